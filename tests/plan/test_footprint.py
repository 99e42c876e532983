"""The one sizing rule of the planner and the simulator, on windowed and hybrid models."""

from __future__ import annotations

import dataclasses

import pytest
from hybrid_support import QWEN3_NEXT_STATE_BYTES, dense_twin, gemma3_27b, gpt_oss_120b, qwen3_next_80b

from kvstrata.kv.groups import GroupKind, KVGroup
from kvstrata.kv.presets import load_geometry
from kvstrata.plan.footprint import (
    attended_tokens,
    first_layer_bytes,
    held_bytes,
    request_bytes,
    restore_bytes,
    stored_bytes,
)

GEMMA, OSS, QWEN = gemma3_27b(), gpt_oss_120b(), qwen3_next_80b()
GEMMA_TOKEN = 2 * 16 * 128 * 2  # K and V of one layer, one token


def share(groups, kind):
    return next(s for s in groups.shares if s.group.kind is kind)


@pytest.mark.parametrize("prefix", [1, 512, 1024, 1025, 4096, 131_072])
def test_a_sliding_group_restores_only_the_window_before_the_prefix_end(prefix):
    out = restore_bytes(GEMMA, prefix)
    sliding, full = share(out, GroupKind.SLIDING), share(out, GroupKind.FULL)
    assert sliding.tokens == min(prefix, 1024)
    assert sliding.size_bytes == min(prefix, 1024) * 52 * GEMMA_TOKEN
    assert full.tokens == prefix and full.size_bytes == prefix * 10 * GEMMA_TOKEN
    assert out.size_bytes == GEMMA.kv_bytes(prefix)


def test_restore_bytes_grow_only_by_the_full_layers_past_the_window():
    past = [restore_bytes(GEMMA, p).size_bytes for p in (1024, 2048, 65_536)]
    assert past[1] - past[0] == 1024 * GEMMA.bytes_per_token
    assert past[2] - past[1] == (65_536 - 2048) * GEMMA.bytes_per_token
    # an all-sliding model stops growing at all
    mistral = dataclasses.replace(GEMMA, groups=(KVGroup(GroupKind.SLIDING, tuple(range(62)), GEMMA.dtype, 16, 128,
                                                         span=4096),))
    assert restore_bytes(mistral, 4096).size_bytes == restore_bytes(mistral, 100_000).size_bytes
    assert restore_bytes(mistral, 4095).size_bytes < restore_bytes(mistral, 4096).size_bytes


@pytest.mark.parametrize("prefix", [1, 4096, 262_144])
def test_a_state_group_restores_one_snapshot_whatever_the_prefix(prefix):
    state = share(restore_bytes(QWEN, prefix), GroupKind.STATE)
    assert state.size_bytes == 36 * QWEN3_NEXT_STATE_BYTES
    assert restore_bytes(QWEN, prefix).size_bytes == 36 * QWEN3_NEXT_STATE_BYTES + prefix * 12 * 2 * 2 * 256 * 2
    assert restore_bytes(QWEN, 0).size_bytes == 0  # nothing cached: no state either


def test_the_state_splits_over_tensor_parallel_ranks_by_its_heads():
    assert share(restore_bytes(QWEN, 100, tp=2), GroupKind.STATE).size_bytes == 18 * QWEN3_NEXT_STATE_BYTES


@pytest.mark.parametrize("geometry", [GEMMA, OSS, QWEN, load_geometry("llama-3-8b")], ids=lambda g: g.name)
@pytest.mark.parametrize("cuts", [(0, 0), (512, 3000), (1000, 1100), (4000, 4096), (0, 4096)])
def test_tier_segments_add_up_to_the_whole_restore(geometry, cuts):
    """Three tiers serving [0, a), [a, b), [b, P) move together exactly what one would."""
    prefix, (a, b) = 4096, cuts
    parts = [restore_bytes(geometry, prefix, segment=seg) for seg in ((0, a), (a, b), (b, prefix))]
    whole = restore_bytes(geometry, prefix)
    assert sum(p.size_bytes for p in parts) == whole.size_bytes
    for i, s in enumerate(whole.shares):
        assert sum(p.shares[i].size_bytes for p in parts) == s.size_bytes


def test_a_segment_before_the_window_moves_no_windowed_kv_and_the_last_carries_the_state():
    early = restore_bytes(OSS, 4096, segment=(0, 3968))  # window 128: tokens 3968..4095 only
    assert share(early, GroupKind.SLIDING).size_bytes == 0
    assert share(early, GroupKind.FULL).tokens == 3968
    assert share(restore_bytes(QWEN, 4096, segment=(0, 4000)), GroupKind.STATE).size_bytes == 0
    assert share(restore_bytes(QWEN, 4096, segment=(4000, 4096)), GroupKind.STATE).size_bytes > 0
    with pytest.raises(ValueError, match="segment"):
        restore_bytes(QWEN, 4096, segment=(100, 5000))


def test_a_dense_model_holds_stores_and_restores_tokens_times_bytes_per_token():
    llama = load_geometry("llama-3-70b")
    for tokens in (1, 777, 32_768):
        for tp in (1, 2, 8):
            assert restore_bytes(llama, tokens, tp).size_bytes == tokens * llama.bytes_per_token_per_gpu(tp)
            assert request_bytes(llama, tokens, tp) == tokens * llama.bytes_per_token_per_gpu(tp)
        assert stored_bytes(llama, tokens) == tokens * llama.bytes_per_token
    assert first_layer_bytes(llama, 100) * 80 == 100 * llama.bytes_per_token


def test_a_store_keeps_the_windows_before_its_ends_and_a_snapshot_per_end():
    # One end: what a restore from there moves (the data plane drops blocks out of every window).
    assert stored_bytes(GEMMA, 32_768) == restore_bytes(GEMMA, 32_768).size_bytes
    assert stored_bytes(GEMMA, 32_768) < 32_768 * dense_twin(GEMMA).bytes_per_token
    # Ends 1024 tokens apart: each end's window; a block shorter than the window keeps all of it.
    assert stored_bytes(GEMMA, 32_768, ends=3) == 32_768 * GEMMA.bytes_per_token + 3 * 1024 * 52 * GEMMA_TOKEN
    assert stored_bytes(GEMMA, 512) == 512 * dense_twin(GEMMA).bytes_per_token
    assert stored_bytes(QWEN, 512, ends=3) == 512 * QWEN.bytes_per_token + 3 * QWEN.state_bytes()


def test_held_bytes_of_one_request_is_its_request_bytes():
    for geometry in (GEMMA, OSS, QWEN):
        for tokens in (10, 1024, 5000):
            held = tuple(g.tokens_kept(tokens) if g.kind.per_token else 1 for g in geometry.groups)
            assert held_bytes(geometry, held, 2) == request_bytes(geometry, tokens, 2)


def test_the_first_layer_of_a_sliding_model_holds_only_its_window():
    assert first_layer_bytes(GEMMA, 32_768) == 1024 * GEMMA_TOKEN  # layer 0 is sliding
    assert first_layer_bytes(QWEN, 32_768) == QWEN3_NEXT_STATE_BYTES  # layer 0 is linear attention


@pytest.mark.parametrize(("cached", "new"), [(0, 100), (0, 5000), (500, 1000), (3000, 2000), (10_000, 7)])
def test_attended_tokens_is_the_sum_of_capped_contexts(cached, new):
    span = 1024
    exact = sum(min(j, span) for j in range(cached, cached + new))  # token j attends to ~j earlier ones
    assert attended_tokens(cached, new, span) == pytest.approx(exact, abs=new)
    assert attended_tokens(cached, new, None) == new * (cached + new / 2)
    assert attended_tokens(cached, new, span) <= attended_tokens(cached, new, None)
