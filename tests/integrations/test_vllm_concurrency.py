"""One load per block under concurrency: requests sharing a prefix that only kvstrata holds.

A vLLM engine (CPU, tiny random-weight Llama, prefix caching on, vLLM's own KV a few prompts'
worth) with kvstrata's host tier stores a prompt, then forgets it itself (other prompts evict
it from vLLM's KV). Sixteen requests then arrive at once, each the shared prefix and a suffix of
its own. The prefix's blocks come from kvstrata once: the first request granted them loads them,
and vLLM caches the blocks it allocated for that load at once, so the requests scheduled after
it find the prefix in vLLM's own cache (a request waiting for a later step finds it there too).
The same with the prefix on disk only, its load running off the step: the requests sharing it
wait for that one load. Every completion is the one a cold engine computes.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvstrata.kv.presets import load_geometry  # noqa: E402
from tests.integrations.test_vllm import BLOCK, MiB, run_children, spec  # noqa: E402

_rng = random.Random(5)
PREFIX = [_rng.randrange(10, 4000) for _ in range(8 * BLOCK)]
SHARING = [PREFIX + [_rng.randrange(10, 4000) for _ in range(20 + i)] for i in range(16)]
FILLERS = [[_rng.randrange(10, 4000) for _ in range(300)] for _ in range(12)]
OTHER = [_rng.randrange(10, 4000) for _ in range(100)]  # sharing nothing
VLLM_BLOCKS = 48  # vLLM's own KV: max_model_len (1024) and a little more; the fillers evict the prefix


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("concurrency")
    model = Path(tiny_model_dir)
    block_bytes = load_geometry(str(model), "bfloat16").bytes_per_token * BLOCK  # the child's dtype
    specs = {
        "ours": spec(model, tmp, "ours", passes=[[SHARING[0]], FILLERS, SHARING], max_tokens=3, host_bytes=64 * MiB),
        # the prefix on disk only, never loaded from before, a request of its own running (OTHER): its
        # load runs off the step
        "disk": spec(model, tmp, "disk", passes=[[SHARING[0]], FILLERS, [OTHER, *SHARING]], max_tokens=3,
                     host_bytes=0, disk_dir=str(tmp / "disk"), disk_bytes=64 * MiB),
        "cold": spec(model, tmp, "cold", passes=[SHARING], max_tokens=3, host_bytes=64 * MiB, role="kv_producer"),
    }
    for s in specs.values():
        s.update(prefix_caching=True, max_num_seqs=16, kv_cache_bytes=VLLM_BLOCKS * block_bytes)
    return run_children(specs, tmp)


def test_sixteen_requests_sharing_a_prefix_load_it_once(runs):
    first, fillers, sharing = runs["ours"]["passes"]
    loaded = sharing["stats"]["loaded_tokens"] - fillers["stats"]["loaded_tokens"]
    # the prefix came back: from kvstrata, once; the other fifteen found it in vLLM's own cache
    assert loaded == len(PREFIX), (loaded, sharing["cached"])
    assert sharing["stats"]["load_requests"] - fillers["stats"]["load_requests"] == 1
    assert all(c >= len(PREFIX) for c in sharing["cached"]), sharing["cached"]
    assert sharing["stats"]["failed_blocks"] == 0
    assert sharing["tokens"] == runs["cold"]["passes"][0]["tokens"]
    assert first["tokens"][0] == sharing["tokens"][0]


def test_sixteen_requests_wait_for_one_load_off_the_step_of_their_prefix(runs):
    """With another request running, the disk's first load runs off the step. vLLM caches an
    asynchronous load's blocks only once it has arrived: the fifteen requests that share the
    prefix are asked again until then (the scheduler knows which blocks are in flight), and then
    find it in vLLM's own cache rather than loading it fifteen more times."""
    _, fillers, sharing = runs["disk"]["passes"]
    stats, before = sharing["stats"], fillers["stats"]
    cached, tokens = sharing["cached"][1:], sharing["tokens"][1:]  # OTHER's first
    assert stats["async_loads"] - before["async_loads"] == 1  # the disk unmeasured: off the step
    assert stats["load_requests"] - before["load_requests"] == 1
    assert stats["loaded_tokens"] - before["loaded_tokens"] == len(PREFIX)
    assert all(c >= len(PREFIX) for c in cached), cached
    assert stats["failed_blocks"] == 0
    assert tokens == runs["cold"]["passes"][0]["tokens"]
