"""One cached prefix for every TP size: transformers' own tensor parallelism over gloo, two real ranks.

The tiny Llama (2 KV heads) in fp32, as one process (TP=1) and as two (TP=2: transformers'
``DistributedConfig(tp_size=2)`` over a gloo process group, each rank's attention and
DynamicCache holding one KV head). Both store head-sliced blocks in the same namespace (no TP in
it) through the shared pool, the tier every process reads:

(a) TP=1 stores a prompt's KV; each TP=2 rank finds its head's slices of every block, restores
    exactly the bytes stored for its head, and generates the tokens of a cold TP=2 run and of TP=1.
(b) TP=2 stores another prompt's KV; TP=1 restores both heads' slices from the pool (the bytes
    each rank stored) and generates the tokens of its cold run and of TP=2.
(c) A prefix of whose blocks head 0's slices are all there and head 1's of the first two only:
    both ranks restore two blocks (the ranks' all-reduce of the least) and compute the rest.

The two ranks are spawned once for both directions.
"""

from __future__ import annotations

import importlib.util
import socket
import uuid

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tp_child import BLOCK, DTYPE, NEW_TOKENS, make_cache, rank_main, read_back  # noqa: E402

from kvstrata.cache.sliced import SlicedRank  # noqa: E402
from kvstrata.integrations.hf import KVStrataLM  # noqa: E402
from kvstrata.media import Medium  # noqa: E402

WORLD = 2
RANK_TIMEOUT_S = 240


def _skip_reason() -> str | None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return "torch.distributed with gloo is not available in this torch build"
    if importlib.util.find_spec("accelerate") is None:
        return "transformers' tensor parallelism needs accelerate (pip install accelerate)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt(seed: int, tokens: int) -> list[int]:
    return torch.randint(5, 4000, (tokens,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_ranks(*args) -> list[dict]:
    """Spawn the TP=2 ranks with ``args``; each one's result, by rank (their errors raised)."""
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, WORLD, port, *args, queue), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        results = sorted((queue.get(timeout=RANK_TIMEOUT_S) for _ in procs), key=lambda r: r["rank"])
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    return results


def test_kv_stored_at_one_tp_size_restores_at_another(tiny_model_dir, pool):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=DTYPE)
    model_id = f"tiny-tp-{uuid.uuid4().hex[:8]}"  # the pool outlives tests: a fresh namespace each
    a, b, c = prompt(1, 7 * BLOCK + 5), prompt(2, 6 * BLOCK + 3), prompt(3, 5 * BLOCK + 2)
    with make_cache(model, model_id, pool) as cache:
        lm = KVStrataLM(model, cache)
        assert (lm.tp.size, lm.kv.heads) == (1, range(0, 2))
        tp1_a = lm.generate(a, NEW_TOKENS, reuse=False)  # stores a's KV, both heads' slices
        assert tp1_a.stored_blocks == (len(a) + NEW_TOKENS - 1) // BLOCK
        a_blocks, a_kv = read_back(lm, a[:-1])  # what TP=1 stored: [layers, 2, tokens, 2 heads, D]
        tp1_b = lm.generate(b, NEW_TOKENS, reuse=False, store=False)
        # The stored bytes are the model's KV: what plain transformers computes for the prompt.
        dyn = transformers.DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=torch.tensor([a[: a_blocks * BLOCK]]), past_key_values=dyn, use_cache=True)
        torch.testing.assert_close(torch.from_numpy(a_kv[0, 0]), dyn.layers[0].keys[0].transpose(0, 1))
        # (c): c's KV as TP=2's rank 0 would store it (all blocks), and as rank 1 (two blocks).
        tp1_c = lm.generate(c, NEW_TOKENS, reuse=False, store=False)
        dyn = transformers.DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=torch.tensor([c]), past_key_values=dyn, use_cache=True)
        c_kv = torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in dyn.layers]).transpose(2, 3)
        for r, blocks in enumerate((len(c) // BLOCK, 2)):
            rank = SlicedRank(cache, lm.kv.slicing, WORLD, r)
            rank.store(c[: blocks * BLOCK], c_kv[:, :, : blocks * BLOCK, r:r + 1].contiguous()).result()

    ranks = run_ranks(str(tiny_model_dir), model_id, pool, a, b, c)

    hit = (len(a) - 1) // BLOCK
    for r, rank in enumerate(ranks):
        assert rank["tp"] == (WORLD, r) and rank["heads"] == (r, r + 1)
        # (a) Each rank has its head's slice of every block TP=1 stored, restores them all, and
        # they are the bytes TP=1 stored for its head.
        assert rank["own_blocks"] == hit == a_blocks
        assert rank["hit_tokens"] == hit * BLOCK
        assert rank["restored_blocks"] == hit
        assert np.array_equal(rank["restored_kv"], a_kv[:, :, :, r:r + 1])
        assert rank["warm"] == rank["cold"] == tp1_a.tokens
        assert rank["store_tokens"] == tp1_b.tokens
        assert rank["stored_blocks"] == (len(b) + NEW_TOKENS - 1) // BLOCK  # each rank wrote its head's slices
        # (c) Rank 0 holds all of c's blocks, rank 1 two: both restore two and compute the rest.
        assert rank["partial_own_blocks"] == ((len(c) - 1) // BLOCK, 2)[r]
        assert rank["partial_hit_tokens"] == 2 * BLOCK
        assert rank["partial_tokens"] == tp1_c.tokens

    # (b) TP=1 restores b's prefix, which the two ranks stored, from the pool: both heads' slices.
    with make_cache(model, model_id, pool) as cache:
        lm = KVStrataLM(model, cache)
        warm = lm.generate(b, NEW_TOKENS, store=False)
        b_hit = (len(b) - 1) // BLOCK
        assert warm.hit_tokens == b_hit * BLOCK
        assert warm.load.paths == {(Medium.REMOTE, Medium.DEVICE): b_hit}  # in blocks (two slices each)
        assert warm.tokens == tp1_b.tokens == ranks[0]["store_tokens"]
        b_blocks, b_kv = read_back(lm, b[:-1])
        assert b_blocks == b_hit
        for r, rank in enumerate(ranks):
            assert rank["stored_read_blocks"] == b_hit
            assert np.array_equal(b_kv[:, :, :, r:r + 1], rank["stored_kv"])


def test_a_head_sliced_cache_serves_every_strategy_in_one_process(tiny_model_dir, tmp_path):
    from kvstrata.cache import CacheConfig, TieredCache
    from kvstrata.integrations.hf import TensorParallel, model_layout

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=DTYPE)
    ids = prompt(4, 6 * BLOCK + 7)
    hit = (len(ids) - 1) // BLOCK * BLOCK
    with make_cache(model, f"tiny-sliced-{uuid.uuid4().hex[:8]}", None) as cache:
        lm = KVStrataLM(model, cache)
        cold = lm.generate(ids, NEW_TOKENS, reuse=False)
        cache.evict(Medium.DEVICE, 10_000)  # from the host tier: slices copied back one by one
        for kwargs, restored in (({}, hit), ({"streaming": True}, hit),
                                 ({"strategy": "split", "split_tokens": 2 * BLOCK}, hit - 2 * BLOCK)):
            warm = lm.generate(ids, NEW_TOKENS, store=False, **kwargs)
            assert (warm.tokens, warm.hit_tokens) == (cold.tokens, restored), kwargs
    # With packs (the rank's own tiers): a restore of what another process stored comes as slices
    # and is packed on release; the next is one object a block. The same tokens each time.
    from kvstrata.cache.sliced import pack_layout

    with make_cache(model, f"tiny-packs-{uuid.uuid4().hex[:8]}", None) as cache:
        cold = KVStrataLM(model, cache).generate(ids, NEW_TOKENS, reuse=False)  # the slices alone
        own = pack_layout(cache.layout, 2)  # the tiny model's 2 KV heads: at TP=1 the rank holds both
        with TieredCache(CacheConfig(own, cache.config.model_id, device_bytes=64 * own.block_bytes,
                                     host_bytes=64 * own.block_bytes, device="cpu")) as packs:
            lm = KVStrataLM(model, cache, packs=packs)
            for packed in (False, True):
                assert [s.packed for s in lm.kv.match(lm.kv.keys(ids)).segments] == [packed]
                warm = lm.generate(ids, NEW_TOKENS, store=False)
                assert (warm.tokens, warm.hit_tokens) == (cold.tokens, hit)
                lm.kv.flush(10)
    # A TP-matched cache is one rank's: a cache naming another rank is refused, in one line.
    layout = model_layout(model.config, BLOCK, DTYPE, tp=2)
    assert layout.kv_heads == 1
    config = CacheConfig(layout, "x", device_bytes=4 * layout.block_bytes, host_bytes=0, device="cpu",
                         tp_rank=0, tp_size=2)
    with TieredCache(config) as cache:
        with pytest.raises(ValueError, match="is not the model's rank 1 of 2"):
            KVStrataLM(model, cache, tp=TensorParallel(2, 1))
        assert KVStrataLM(model, cache, tp=TensorParallel(2, 0)).kv is cache
