"""Hybrid geometries for the planner and simulator tests, built from their published configs'
shapes (not read through the config reader, which the kv package owns):

* gemma-3-27b-like: 62 layers, five of every six sliding (window 1024), every sixth full;
  16 KV heads x 128, 32 query heads, bf16.
* gpt-oss-120b-like: 36 layers alternating sliding (window 128) and full; 8 KV heads x 64.
* qwen3-next-80b-a3b-like: 48 layers, every fourth full attention (2 KV heads x 256), the rest
  gated-delta-net linear attention, a fixed state per sequence: a 32 x 128 x 128 recurrent
  state and a 3-wide convolution state over 8192 channels, bf16, per layer.
* ``dense_twin``: the same model with every layer full attention.
"""

from __future__ import annotations

import dataclasses

from kvstrata.kv.dtypes import DType
from kvstrata.kv.geometry import Attention, KVGeometry
from kvstrata.kv.groups import GroupKind, KVGroup

BF16 = DType.BF16
QWEN3_NEXT_STATE_BYTES = (32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128)) * 2  # per layer


def gemma3_27b() -> KVGeometry:
    layers = 62
    full = tuple(i for i in range(layers) if i % 6 == 5)
    sliding = tuple(i for i in range(layers) if i % 6 != 5)
    return KVGeometry(
        "gemma-3-27b-like", Attention.GQA, layers, 16, 128, BF16, 27_400_000_000, 27_400_000_000, 32,
        groups=(KVGroup(GroupKind.SLIDING, sliding, BF16, 16, 128, span=1024, label="sliding_attention"),
                KVGroup(GroupKind.FULL, full, BF16, 16, 128, label="full_attention")),
    )


def gpt_oss_120b() -> KVGeometry:
    layers = 36
    return KVGeometry(
        "gpt-oss-120b-like", Attention.GQA, layers, 8, 64, BF16, 116_800_000_000, 5_100_000_000, 64,
        weight_dtype=DType.FP8,
        groups=(KVGroup(GroupKind.SLIDING, tuple(range(0, layers, 2)), BF16, 8, 64, span=128),
                KVGroup(GroupKind.FULL, tuple(range(1, layers, 2)), BF16, 8, 64)),
    )


def qwen3_next_80b() -> KVGeometry:
    layers = 48
    full = tuple(i for i in range(layers) if i % 4 == 3)
    linear = tuple(i for i in range(layers) if i % 4 != 3)
    return KVGeometry(
        "qwen3-next-80b-a3b-like", Attention.GQA, layers, 2, 256, BF16, 80_000_000_000, 3_000_000_000, 16,
        groups=(KVGroup(GroupKind.STATE, linear, BF16, state_bytes=QWEN3_NEXT_STATE_BYTES, state_heads=16,
                        label="linear_attention"),
                KVGroup(GroupKind.FULL, full, BF16, 2, 256, label="full_attention")),
    )


def dense_twin(geometry: KVGeometry) -> KVGeometry:
    """``geometry`` with one FULL group over every layer: what it would hold without windows or states."""
    return dataclasses.replace(geometry, name=f"{geometry.name} (all full)", groups=())
