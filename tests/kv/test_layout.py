"""The layout of one cached block, derived from a model's KV geometry."""

from __future__ import annotations

import pytest

from kvstrata.kv import DType, GeometryError
from kvstrata.kv.layout import KVLayout
from kvstrata.kv.presets import load_geometry


def test_gqa_layout_splits_kv_heads_over_tp():
    geometry = load_geometry("llama-3-70b")  # 80 layers, 8 KV heads of 128, bf16
    layout = KVLayout.from_geometry(geometry, block_tokens=16, tp=4)
    assert layout.block_shape == (80, 2, 16, 2, 128)
    assert layout.block_bytes == 80 * 2 * 16 * 2 * 128 * 2
    assert layout.block_bytes == geometry.bytes_per_block(16, tp=4)


def test_tp_beyond_kv_heads_keeps_one_head_per_rank():
    layout = KVLayout.from_geometry(load_geometry("llama-3-70b"), block_tokens=16, tp=16)
    assert layout.kv_heads == 1


def test_mla_layout_is_one_latent_stored_once():
    geometry = load_geometry("deepseek-v3")  # 61 layers, latent 512 + 64 rope
    layout = KVLayout.from_geometry(geometry, block_tokens=8, tp=8)
    assert layout.block_shape == (61, 1, 8, 1, 576)
    assert layout.block_bytes == geometry.bytes_per_block(8, tp=8)


@pytest.mark.parametrize("field", ["num_layers", "block_tokens", "kv_heads", "head_dim"])
def test_layout_fields_must_be_positive_integers(field):
    values = {"num_layers": 2, "block_tokens": 4, "kv_heads": 1, "head_dim": 8}
    with pytest.raises(GeometryError, match=f"KVLayout field '{field}' must be a positive integer"):
        KVLayout(**(values | {field: 0}), dtype=DType.BF16)
