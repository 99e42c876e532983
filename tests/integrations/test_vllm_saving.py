"""Save or skip in a real engine: where no stored prompt ever comes back, stores stop but for samples.

A vLLM engine (CPU, tiny random-weight Llama, vLLM's own KV a few prompts' worth, its prefix
caching off) with kvstrata's host tier generates a stream of prompts none of which repeats. Once
vLLM computed twice its own capacity of blocks (before that a stored block could not have been
asked for), no prompt block having repeated an earlier prompt's and stores' measured CPU
outweighing what that evidence allows them to save, the scheduler stores only one request in 16 (:class:`~kvstrata.policies.saving.SaveOrSkip`). A second pass
asks every prompt again: the stored ones load from kvstrata, the rest are computed, and every
completion is the one the first pass computed.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvstrata.kv.presets import load_geometry  # noqa: E402
from tests.integrations.test_vllm import BLOCK, MiB, run_children, spec  # noqa: E402

_rng = random.Random(11)
STREAM = [[_rng.randrange(10, 4000) for _ in range(_rng.choice((100, 130, 160)))] for _ in range(320)]
LEARN, LATER = STREAM[:200], STREAM[200:]
VLLM_BLOCKS = 40  # vLLM's own KV: max_model_len (1024) and a little more


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("saving")
    model = Path(tiny_model_dir)
    stream = spec(model, tmp, "stream", passes=[LEARN, LATER, STREAM], max_tokens=2, host_bytes=64 * MiB)
    vllm_block_bytes = load_geometry(str(model), "bfloat16").bytes_per_token * BLOCK  # the child's dtype
    stream["kv_cache_bytes"] = VLLM_BLOCKS * vllm_block_bytes
    return run_children({"stream": stream}, tmp)


def test_a_stream_that_never_repeats_stops_storing_but_for_samples(runs):
    learn, later, again = runs["stream"]["passes"]
    blocks = [(len(p) - 1) // BLOCK for p in LATER]  # full blocks before each prompt's last token
    stored_later = later["stats"]["new_blocks"] - learn["stats"]["new_blocks"]
    assert learn["stats"]["new_blocks"] > 0
    # by the later prompts stores have stopped but for samples (one request in 16: about 1/16 of the blocks)
    assert 0 < stored_later <= sum(blocks) // 4, (stored_later, sum(blocks))
    assert learn["cached"] + later["cached"] == [0] * len(STREAM)
    # asked again: what was stored loads whole, the rest is computed; the tokens are the ones computed
    hits = [c for c in again["cached"] if c]
    assert hits and sum(again["cached"]) <= later["stats"]["new_blocks"] * BLOCK
    assert again["stats"]["failed_blocks"] == 0
    assert again["tokens"] == learn["tokens"] + later["tokens"]  # the first passes computed every prompt
