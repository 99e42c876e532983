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
def test_a_request_whose_kv_is_more_than_its_tokens_has_keys_of_its_own(other):
    """A LoRA adapter's or a salted tenant's KV is not the plain prompt's: its blocks are keyed
    apart (the extras folded into its first block's ids), so it never finds a plain prompt's
    blocks, nor another adapter's or tenant's, and finds what the same adapter or tenant stored."""
    from vllm.lora.request import LoRARequest

    asked: list[list[int]] = []
    plain = list(range(1, HIT_BLOCKS * BLOCK + 2))

    def answer(tokens: list[int]) -> tuple[Medium, ...]:  # the workers' caches hold the plain prompt only
        asked.append(list(tokens))
        return (Medium.HOST,) * (len(tokens) // BLOCK) if tokens == plain[: len(tokens)] else ()

    engine_id = f"extras-{uuid.uuid4().hex[:8]}"
    server = LookupServer(engine_id, answer)
    try:
        scheduler = KVStrataConnectorScheduler(BLOCK, engine_id, loads_enabled=True, saves_enabled=True)
        given = {"lora": lambda n: dict(lora_request=LoRARequest(f"adapter-{n}", n, f"/adapters/{n}")),
                 "cache_salt": lambda n: dict(cache_salt=f"tenant-{n}")}[other]
        a1, a2, b = (Request(f"r{i}", plain, SamplingParams(max_tokens=1), None, **given(n))
                     for i, n in ((1, 1), (2, 1), (3, 2)))
        assert scheduler.get_num_new_matched_tokens(a1, 0) == (0, False)  # the plain prompt's blocks: not its own
        assert scheduler.get_num_new_matched_tokens(Request("p", plain, SamplingParams(max_tokens=1), None),
                                                    0)[0] == HIT_BLOCKS * BLOCK  # ... as a plain request finds
        for request in (a2, b):
            scheduler.get_num_new_matched_tokens(request, 0)
        keyed_a1, _, keyed_a2, keyed_b = asked
        assert keyed_a1 == keyed_a2 != keyed_b  # the same adapter or tenant keys alike, another apart
        assert keyed_a1[BLOCK:] == plain[BLOCK: len(keyed_a1)] and keyed_a1[:BLOCK] != plain[:BLOCK]
        assert scheduler._stores(a1.request_id, a1, len(plain))  # offered to store, under its own keys
    finally:
        server.close()


def test_a_request_of_prompt_embeddings_is_neither_loaded_nor_stored(scheduler):
    """Prompt embeddings have no token ids to key the KV by."""
    import torch

    tokens = list(range(1, HIT_BLOCKS * BLOCK + 2))
    request = Request("embeds", tokens, SamplingParams(max_tokens=1), None,
                      prompt_embeds=torch.zeros(len(tokens), 8))
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    assert not scheduler._stores(request.request_id, request, len(tokens))
