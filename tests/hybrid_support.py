"""Hybrid geometries for the planner and simulator tests: the presets, read by the config reader,
and each one's all-full twin.

* gemma-3-27b: 62 layers, five of every six sliding (window 1024), every sixth full;
  16 KV heads x 128, bf16.
* gpt-oss-120b: 36 layers alternating sliding (window 128) and full; 8 KV heads x 64.
* qwen3-next-80b-a3b: 48 layers, every fourth full attention (2 KV heads x 256), the rest
  gated-delta-net linear attention with a fixed state per sequence (QWEN3_NEXT_STATE_BYTES a layer).
* ``dense_twin``: the same model with every layer full attention.
"""

from __future__ import annotations

import dataclasses

from kvstrata.kv.geometry import KVGeometry
from kvstrata.kv.presets import load_geometry

# From the preset's config, per linear layer: a bf16 convolution state over q, k and v
# (2 * 16 key heads * 128 + 32 value heads * 128 = 8192 channels) x linear_conv_kernel_dim 4,
# and an fp32 recurrent state of 32 value heads x 128 x 128 (transformers' torch path keeps it so).
QWEN3_NEXT_STATE_BYTES = (2 * 16 * 128 + 32 * 128) * 4 * 2 + 32 * 128 * 128 * 4


def gemma3_27b() -> KVGeometry:
    return load_geometry("gemma-3-27b")


def gpt_oss_120b() -> KVGeometry:
    return load_geometry("gpt-oss-120b")


def qwen3_next_80b() -> KVGeometry:
    return load_geometry("qwen3-next-80b-a3b")


def dense_twin(geometry: KVGeometry) -> KVGeometry:
    """``geometry`` with one FULL group over every layer: what it would hold without windows or states."""
    return dataclasses.replace(geometry, name=f"{geometry.name} (all full)", groups=(), max_context=None)
