"""The transformers integration: KV restored from every tier gives the tokens of a cold run."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvstrata.cache import CacheConfig, TieredCache  # noqa: E402
from kvstrata.integrations.hf import KVStrataLM, model_layout  # noqa: E402
from kvstrata.media import Medium  # noqa: E402

BLOCK = 32
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


def make_cache(model, tmp_path, pool=None, blocks=64, device_blocks=64):
    layout = model_layout(model.config, BLOCK, model.dtype)
    b = layout.block_bytes
    return TieredCache(
        CacheConfig(
            layout,
            f"tiny-{uuid.uuid4().hex[:8]}",  # the pool outlives tests: a fresh namespace each
            device_bytes=device_blocks * b,
            host_bytes=blocks * b,
            disk_bytes=blocks * b,
            disk_dir=tmp_path / "disk",
            device="cpu",
            pool=pool,
            remote_bytes=blocks * b if pool else 0,
        )
    )


def prompt(tokenizer, words=300, seed=0):
    import random

    rng = random.Random(seed)
    vocab = "the cache block restore path prefix hit layer token memory device host disk pool".split()
    return tokenizer(" ".join(rng.choice(vocab) for _ in range(words))).input_ids


ROUTES = {
    "device": (Medium.DEVICE,),
    "host": (Medium.HOST, Medium.DEVICE),
    "disk": (Medium.DISK, Medium.DEVICE),
    "remote": (Medium.REMOTE, Medium.DEVICE),
}
ABOVE = {"device": [], "host": [Medium.DEVICE], "disk": [Medium.DEVICE, Medium.HOST]}
ABOVE["remote"] = ABOVE["disk"] + [Medium.DISK]


@pytest.mark.parametrize("tier", ["device", "host", "disk", "remote"])
def test_prefix_from_each_tier_gives_the_cold_tokens(tier, model, tokenizer, tmp_path, request):
    pool = request.getfixturevalue("pool") if tier == "remote" else None
    with make_cache(model, tmp_path, pool) as cache:
        lm = KVStrataLM(model, cache)
        ids = prompt(tokenizer)
        cold = lm.generate(ids, NEW_TOKENS, reuse=False)
        assert cold.hit_tokens == 0 and cold.stored_blocks == (len(ids) + NEW_TOKENS - 1) // BLOCK
        for medium in ABOVE[tier]:
            cache.evict(medium, 10_000)
        warm = lm.generate(ids, NEW_TOKENS, store=False)
        assert warm.tokens == cold.tokens
        assert warm.hit_tokens == (len(ids) - 1) // BLOCK * BLOCK
        assert warm.load.paths == {ROUTES[tier]: warm.hit_tokens // BLOCK}
        assert warm.load.restored_bytes == (0 if tier == "device" else warm.hit_tokens * cache.layout.layer_bytes // BLOCK * cache.layout.num_layers)
        torch.testing.assert_close(warm.first_logits, cold.first_logits, atol=0.05, rtol=0.02)


def test_multi_turn_history_is_reused(model, tokenizer, tmp_path):
    with make_cache(model, tmp_path) as cache:
        lm = KVStrataLM(model, cache)
        turn1 = prompt(tokenizer, 200, seed=1)
        first = lm.generate(turn1, NEW_TOKENS)
        turn2 = turn1 + first.tokens + prompt(tokenizer, 80, seed=2)
        warm = lm.generate(turn2, NEW_TOKENS)
        cold = lm.generate(turn2, NEW_TOKENS, reuse=False, store=False)
        assert warm.tokens == cold.tokens
        # The answer's KV was stored too, so the hit reaches past the first prompt.
        assert warm.hit_tokens == (len(turn1) + NEW_TOKENS - 1) // BLOCK * BLOCK


def test_streaming_decode_matches_resident_and_reports_bytes(model, tokenizer, tmp_path):
    with make_cache(model, tmp_path) as cache:
        lm = KVStrataLM(model, cache)
        ids = prompt(tokenizer, 250, seed=3)
        resident = lm.generate(ids, NEW_TOKENS, reuse=False, store=True)
        for reuse in (False, True):
            streamed = lm.generate(ids, NEW_TOKENS, reuse=reuse, store=False, streaming=True)
            assert streamed.tokens == resident.tokens
            assert streamed.hit_tokens == (reuse and (len(ids) - 1) // BLOCK * BLOCK)
            # Decode step j reads every layer's KV of len(ids) + j - 1 tokens across the host link.
            layout = cache.layout
            per_token = layout.num_layers * layout.token_bytes
            mean_tokens = len(ids) + (NEW_TOKENS - 2) / 2
            assert streamed.stream_bytes_per_step == pytest.approx(mean_tokens * per_token)


def test_streaming_decodes_a_context_larger_than_the_device_tier(model, tokenizer, tmp_path):
    # The device tier holds 2 blocks; the context is ~10: streaming keeps KV on the host.
    with make_cache(model, tmp_path, device_blocks=2) as cache:
        lm = KVStrataLM(model, cache)
        ids = prompt(tokenizer, 300, seed=4)
        assert len(ids) > 4 * BLOCK
        resident = KVStrataLM(model, None).generate(ids, NEW_TOKENS)
        streamed = lm.generate(ids, NEW_TOKENS, reuse=False, store=False, streaming=True)
        assert streamed.tokens == resident.tokens


def test_a_corrupt_block_is_recomputed_not_served(model, tokenizer, tmp_path):
    with make_cache(model, tmp_path) as cache:
        lm = KVStrataLM(model, cache)
        ids = prompt(tokenizer, 300, seed=5)
        cold = lm.generate(ids, NEW_TOKENS, reuse=False)
        cache.evict(Medium.DEVICE, 10_000)
        cache.evict(Medium.HOST, 10_000)
        files = sorted(p for p in (tmp_path / "disk").rglob("*") if p.is_file() and p.stat().st_size > 4096)
        assert files
        for path in files:  # flip a payload byte in every block file
            with open(path, "r+b") as f:
                f.seek(os.path.getsize(path) - 1)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 0xFF]))
        warm = lm.generate(ids, NEW_TOKENS, store=False)
        assert warm.tokens == cold.tokens
        assert warm.hit_tokens < (len(ids) - 1) // BLOCK * BLOCK


def test_a_cache_of_another_layout_is_refused(model, tmp_path):
    from kvstrata.kv.geometry import DType
    from kvstrata.kv.layout import KVLayout

    wrong = KVLayout(3, BLOCK, 2, 64, DType.BF16)
    with TieredCache(CacheConfig(wrong, "x", device_bytes=wrong.block_bytes * 4, host_bytes=0, device="cpu")) as cache:
        with pytest.raises(ValueError, match="does not fit the model"):
            KVStrataLM(model, cache)


def test_bad_arguments_are_named(model):
    lm = KVStrataLM(model, None)
    with pytest.raises(ValueError, match="prompt is empty"):
        lm.generate([], 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        lm.generate([1, 2], 0)


def test_model_layout_reads_the_config_through_the_kv_geometry(model):
    from kvstrata.kv.fields import GeometryError
    from kvstrata.kv.geometry import DType

    layout = model_layout(model.config, BLOCK, model.dtype)  # the tiny model: 4 layers, 2 KV heads of 64
    assert (layout.num_layers, layout.kv_heads, layout.head_dim, layout.dtype) == (4, 2, 64, DType.BF16)
    # A model's own field names are transformers' standard ones (GPT-2's n_head, n_layer, n_embd).
    gpt2 = model_layout(transformers.GPT2Config(n_layer=2, n_head=4, n_embd=128), BLOCK, torch.float32)
    assert (gpt2.num_layers, gpt2.kv_heads, gpt2.head_dim, gpt2.dtype) == (2, 4, 32, DType.FP32)
    mla = transformers.DeepseekV3Config(num_hidden_layers=2, hidden_size=256, num_attention_heads=4)
    with pytest.raises(GeometryError, match="MLA"):
        model_layout(mla, BLOCK, torch.bfloat16)
    with pytest.raises(ValueError, match="not supported"):
        model_layout(model.config, BLOCK, torch.float8_e4m3fn)
