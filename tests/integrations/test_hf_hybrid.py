"""Hybrid transformers models on a GroupedCache: a prefix resumed from every tier gives the tokens
of a cold run, and each group moves only what it needs (a window's blocks, one state snapshot)."""

from __future__ import annotations

import random
import uuid

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvstrata.cache.grouped import GroupedCache, GroupedConfig, needed_blocks  # noqa: E402
from kvstrata.integrations.hf.groups import hybrid_groups  # noqa: E402
from kvstrata.integrations.hf.hybrid import HybridLM  # noqa: E402
from kvstrata.integrations.tiny import HybridKind  # noqa: E402
from kvstrata.kv.groups import GroupKind  # noqa: E402
from kvstrata.media import Medium  # noqa: E402

BLOCK = 16
NEW_TOKENS = 8
ABOVE = {"device": [], "host": [Medium.DEVICE], "disk": [Medium.DEVICE, Medium.HOST]}
ABOVE["remote"] = ABOVE["disk"] + [Medium.DISK]


@pytest.fixture(scope="module", params=list(HybridKind), ids=lambda k: k.value)
def hybrid(request, tiny_hybrid_dirs):
    directory = tiny_hybrid_dirs[request.param]
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    return request.param, model, transformers.AutoTokenizer.from_pretrained(directory)


def make_cache(model, tmp_path, pool=None, blocks=64):
    groups = hybrid_groups(model.config, model.dtype)
    one = sum(layout.block_bytes for layout in GroupedConfig("m", groups, BLOCK, 1 << 30, 0).layouts().values())
    return GroupedCache(GroupedConfig(
        f"tiny-hybrid-{uuid.uuid4().hex[:8]}", groups, BLOCK,  # the pool outlives tests: a fresh namespace each
        device_bytes=blocks * one, host_bytes=blocks * one, disk_bytes=blocks * one, disk_dir=tmp_path / "disk",
        device="cpu", pool=pool, remote_bytes=blocks * one if pool else 0))


def prompt(tokenizer, words=120, seed=0):
    rng = random.Random(seed)
    vocab = "the cache block restore path prefix hit layer token memory device host disk pool".split()
    return tokenizer(" ".join(rng.choice(vocab) for _ in range(words))).input_ids


def test_groups_are_read_from_the_layer_types(hybrid):
    kind, model, _ = hybrid
    groups = hybrid_groups(model.config, model.dtype)
    assert [g.kind for g in groups] == [GroupKind.SLIDING if kind is HybridKind.SLIDING else GroupKind.STATE,
                                        GroupKind.FULL]
    assert [g.layers for g in groups] == [(0, 2), (1, 3)]
    if kind is HybridKind.SLIDING:
        assert groups[0].span == model.config.sliding_window
    else:  # conv state [1, 2*2*16 + 4*16, 4] and recurrent state [1, 4, 16, 16], fp32
        assert groups[0].state_bytes == (128 * 4 + 4 * 16 * 16) * 4


@pytest.mark.parametrize("tier", ["device", "host", "disk", "remote"])
def test_prefix_from_each_tier_gives_the_cold_tokens(tier, hybrid, tmp_path, request):
    kind, model, tokenizer = hybrid
    pool = request.getfixturevalue("pool") if tier == "remote" else None
    ids = prompt(tokenizer)
    plain = HybridLM(model, None).generate(ids, NEW_TOKENS)  # transformers alone: one prefill, no cache
    assert len(set(plain.tokens)) > 2  # the check below compares real choices, not one repeated token
    with make_cache(model, tmp_path, pool) as cache:
        lm = HybridLM(model, cache)
        cold = lm.generate(ids, NEW_TOKENS, reuse=False)
        assert cold.tokens == plain.tokens
        for name in cache.caches:
            for medium in ABOVE[tier]:
                cache.cache(name).evict(medium, 10_000)
        warm = lm.generate(ids, NEW_TOKENS, store=False)
        assert warm.tokens == plain.tokens
        torch.testing.assert_close(warm.first_logits, plain.first_logits, atol=1e-4, rtol=1e-4)
        hit = (len(ids) - 1) // BLOCK * BLOCK
        assert warm.hit_tokens == hit
        # Bytes per group: the full group all of the prefix's blocks, the sliding group the
        # window's blocks only, the state group one snapshot.
        expected = {}
        for name, group in cache.groups.items():
            blocks = len(needed_blocks(group, hit, BLOCK))
            if group.kind is GroupKind.SLIDING:  # [hit - span, hit) overlaps ceil(span / block) blocks
                assert blocks == -(-group.span // BLOCK) < hit // BLOCK
            else:
                assert blocks == (1 if group.kind is GroupKind.STATE else hit // BLOCK)
            expected[name] = blocks * cache.layouts[name].block_bytes
        assert warm.load.loaded_bytes == expected
        assert warm.load.restored_bytes == ({n: 0 for n in expected} if tier == "device" else expected)
        assert {route[0] for load in warm.load.loads.values() for route in load.paths} == {Medium[tier.upper()]}


def test_the_next_turn_resumes_after_the_answer(hybrid, tmp_path):
    kind, model, tokenizer = hybrid
    with make_cache(model, tmp_path) as cache:
        lm = HybridLM(model, cache)
        turn1 = prompt(tokenizer, 90, seed=1)
        first = lm.generate(turn1, NEW_TOKENS)
        turn2 = turn1 + first.tokens + prompt(tokenizer, 30, seed=2)
        warm = lm.generate(turn2, NEW_TOKENS)
        cold = HybridLM(model, None).generate(turn2, NEW_TOKENS)
        assert warm.tokens == cold.tokens
        # Everything computed in turn 1 (prompt and answer) was stored, windows and state included.
        assert warm.hit_tokens == (len(turn1) + NEW_TOKENS - 1) // BLOCK * BLOCK


def test_windows_and_snapshots_written_per_tier(hybrid, tmp_path):
    kind, model, tokenizer = hybrid
    with make_cache(model, tmp_path) as cache:
        ids = prompt(tokenizer, seed=3)
        cold = HybridLM(model, cache).generate(ids, NEW_TOKENS, reuse=False)
        computed = len(ids) + NEW_TOKENS - 1
        ends = sorted({(len(ids) - 1) // BLOCK * BLOCK, computed // BLOCK * BLOCK})
        for name, group in cache.groups.items():
            wanted = set().union(*(needed_blocks(group, end, BLOCK) for end in ends))
            if group.kind is GroupKind.SLIDING:
                assert len(wanted) < computed // BLOCK  # some blocks fell out of every window
            assert cold.stored.blocks[name] == len(wanted)
            for medium in (Medium.DEVICE, Medium.HOST, Medium.DISK):
                assert len(cache.cache(name).manager.table(medium).ready_keys()) == len(wanted)
        if kind is HybridKind.LINEAR:
            assert cold.snapshots == tuple(ends)


def test_a_cache_of_other_groups_is_refused(hybrid, tiny_hybrid_dirs, tmp_path):
    kind, model, _ = hybrid
    other = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_hybrid_dirs[next(k for k in HybridKind if k is not kind)])
    with make_cache(other, tmp_path) as cache:
        with pytest.raises(ValueError, match="do not fit the model"):
            HybridLM(model, cache)


def test_make_tiny_cli_builds_a_hybrid(tmp_path, capsys):
    from kvstrata.cli import main

    out = tmp_path / "h"
    assert main(["model", "make-tiny", str(out), "--hybrid", "sliding", "--layers", "2", "--hidden", "64",
                 "--vocab", "600", "--dtype", "float32"]) == 0
    assert "sliding hybrid" in capsys.readouterr().out
    config = transformers.AutoConfig.from_pretrained(out)
    assert config.layer_types == ["sliding_attention", "full_attention"] and config.sliding_window == 40
    assert main(["model", "make-tiny", str(out), "--hybrid", "linear"]) == 2  # another spec: refused
    assert main(["model", "make-tiny", str(tmp_path / "odd"), "--hybrid", "linear", "--layers", "3"]) == 2


def test_a_bf16_linear_hybrid_keeps_its_recurrent_state_in_fp32(tiny_hybrid_dirs, tmp_path):
    """transformers' torch gated delta rule computes, and so keeps, the recurrent state in fp32
    whatever the model's dtype: the core's state size and the packed snapshot say the same."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_hybrid_dirs[HybridKind.LINEAR], dtype=torch.bfloat16).eval()
    state = next(g for g in hybrid_groups(model.config, model.dtype) if g.kind is GroupKind.STATE)
    assert state.state_bytes == 128 * 4 * 2 + 4 * 16 * 16 * 4  # conv bf16, recurrent fp32
    ids = list(range(5, 80))
    cold = HybridLM(model, None).generate(ids, 6)
    with make_cache(model, tmp_path) as cache:
        lm = HybridLM(model, cache)
        lm.generate(ids, 6)
        warm = lm.generate(ids, 6)
    assert warm.hit_tokens == 64 and warm.tokens == cold.tokens
    assert warm.load.loaded_bytes[cache.config.names[0]] == state.num_layers * state.state_bytes


def test_a_mamba_hybrid_is_refused_in_one_line_naming_what_is_not_packed():
    config = transformers.JambaConfig(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1)
    with pytest.raises(ValueError, match=r"'jamba' has linear_attention layers without 'linear_num_key_heads'.*"
                                         r"gated-delta-net state only"):
        hybrid_groups(config, torch.float32)


def test_another_instance_resumes_from_the_pool_snapshot_and_window_included(hybrid, tmp_path, pool):
    """Instance A stores a prompt and pushes it down to the shared pool; instance B, empty, finds
    every group's part there (the state snapshot and the window too) and gives the cold tokens."""
    kind, model, tokenizer = hybrid
    ids = prompt(tokenizer, seed=5)
    plain = HybridLM(model, None).generate(ids, NEW_TOKENS)
    groups = hybrid_groups(model.config, model.dtype)
    one = sum(layout.block_bytes for layout in GroupedConfig("m", groups, BLOCK, 1 << 30, 0).layouts().values())
    shared = f"tiny-hybrid-shared-{uuid.uuid4().hex[:8]}"

    def instance(name):
        return GroupedCache(GroupedConfig(shared, groups, BLOCK, device_bytes=64 * one, host_bytes=0, device="cpu",
                                          pool=pool, remote_bytes=64 * one, disk_dir=tmp_path / name))

    with instance("a") as a:
        HybridLM(model, a).generate(ids, NEW_TOKENS)
        for name in a.caches:
            a.cache(name).evict(Medium.DEVICE, 10_000)  # written down to the pool
        with instance("b") as b:
            warm = HybridLM(model, b).generate(ids, NEW_TOKENS, store=False)
    assert warm.hit_tokens == (len(ids) - 1) // BLOCK * BLOCK
    assert warm.tokens == plain.tokens
    assert {route[0] for load in warm.load.loads.values() for route in load.paths} == {Medium.REMOTE}
