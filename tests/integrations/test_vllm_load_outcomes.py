"""The scheduler side judges a tier by how its loads end (``feedback.LoadOutcome``): a load whose
blocks left kvstrata after the lookup (evicted meanwhile) is recomputed and says nothing of the
tier; a load given up past its budget makes the tier failing, and the next hit there is not granted.

The scheduler runs as vLLM builds it, asked with vLLM's own ``Request``; its lookups go through the
channel to an answer standing in for the workers' caches, every block of a prompt on disk.
"""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvstrata.integrations.vllm.channel import LookupServer  # noqa: E402
from kvstrata.integrations.vllm.feedback import KVStrataWorkerMeta, LoadOutcome, LoadTiming  # noqa: E402
from kvstrata.integrations.vllm.scheduler import KVStrataConnectorScheduler  # noqa: E402
from kvstrata.media import Medium  # noqa: E402

BLOCK = 32
HIT_BLOCKS = 4


@pytest.fixture
def scheduler():
    engine_id = f"outcomes-{uuid.uuid4().hex[:8]}"
    server = LookupServer(engine_id, lambda tokens: (Medium.DISK,) * (len(tokens) // BLOCK))
    try:
        yield KVStrataConnectorScheduler(BLOCK, engine_id, loads_enabled=True, saves_enabled=True)
    finally:
        server.close()


def ask(scheduler: KVStrataConnectorScheduler, req_id: str) -> int:
    """The tokens kvstrata is granted for a prompt of ``HIT_BLOCKS`` full blocks and one token more."""
    request = Request(req_id, list(range(1, HIT_BLOCKS * BLOCK + 2)), SamplingParams(max_tokens=1), None)
    tokens, _ = scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, tokens or 0)
    return tokens or 0


def test_blocks_evicted_since_the_lookup_leave_the_tier_in_use_and_a_load_given_up_cuts_it(scheduler):
    assert ask(scheduler, "r1") == HIT_BLOCKS * BLOCK  # the disk not measured yet: the whole hit
    scheduler.measured(KVStrataWorkerMeta(loads=[LoadTiming("r1", 0.001, LoadOutcome.LEFT)]))
    assert ask(scheduler, "r2") == HIT_BLOCKS * BLOCK  # an eviction race is no verdict on the disk
    scheduler.measured(KVStrataWorkerMeta(loads=[LoadTiming("r2", 0.5, LoadOutcome.FAILED)]))
    assert ask(scheduler, "r3") == 0  # given up: the disk is failing, its blocks computed until a probe pays
    assert scheduler.decision.probes_due(1e12) == (Medium.DISK,)  # ... and its probe falls due


@pytest.mark.parametrize("other", ["lora", "cache_salt"])
def test_a_request_whose_kv_is_more_than_its_tokens_is_neither_loaded_nor_stored(scheduler, other):
    """A LoRA adapter's or a salted tenant's KV is not the plain prompt's: kvstrata's keys name
    tokens only, so such a request gets no hit and offers no block to store (vLLM's own cache,
    whose hashes carry them, still serves it)."""
    from vllm.lora.request import LoRARequest

    given = {"lora": dict(lora_request=LoRARequest("adapter", 1, "/nonexistent/adapter")),
             "cache_salt": dict(cache_salt="tenant-a")}[other]
    tokens = list(range(1, HIT_BLOCKS * BLOCK + 2))
    request = Request("r-" + other, tokens, SamplingParams(max_tokens=1), None, **given)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)  # the plain prompt's blocks are on disk
    assert ask(scheduler, "plain") == HIT_BLOCKS * BLOCK  # ... as a plain request of the same tokens finds
    assert not scheduler._stores(request.request_id, request, len(tokens))  # its blocks are not offered to store
    assert scheduler._stores("plain", Request("plain", tokens, SamplingParams(max_tokens=1), None), len(tokens))
