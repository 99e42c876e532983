"""A hybrid transformers model's KV groups, read from its config, and how its recurrent state is packed.

transformers names each decoder layer's kind in ``config.layer_types``: ``"full_attention"``,
``"sliding_attention"`` (K and V of the last ``sliding_window`` tokens; transformers'
``DynamicSlidingWindowLayer`` keeps ``sliding_window - 1`` of them between forwards, all a
next token attends to besides itself) and ``"linear_attention"`` (Qwen3-Next's gated delta
net: a causal-conv state of the last ``linear_conv_kernel_dim`` inputs in the model's dtype, and
a recurrent state per value head in fp32, as its torch path computes it). :func:`hybrid_groups`
is the core reading of the config (:func:`kvstrata.kv.readconfig.geometry_from_config`, one
group per kind) checked against the tensors this integration packs.

A STATE group's snapshot packs each layer's state into one row of bytes, the conv state then
the recurrent state (:class:`LinearState`).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any

import torch

from kvstrata.kv.dtypes import DType
from kvstrata.kv.readconfig import geometry_from_config
from kvstrata.kv.groups import GroupKind, KVGroup
from kvstrata.tensors import kv_dtype, torch_dtype

_KINDS = {"full_attention": GroupKind.FULL, "sliding_attention": GroupKind.SLIDING,
          "linear_attention": GroupKind.STATE}
_MODEL_DTYPES = (DType.BF16, DType.FP16, DType.FP32)
_GATED_DELTA_FIELDS = ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads",
                       "linear_value_head_dim", "linear_conv_kernel_dim")


@dataclass(frozen=True)
class LinearState:
    """One linear-attention layer's state (batch 1): ``conv`` ``[1, conv_dim, kernel]`` of ``dtype``
    and ``recurrent`` ``[1, value_heads, key_head_dim, value_head_dim]`` of ``recurrent_dtype``
    (transformers' torch gated delta rule casts its inputs, and so its state, to fp32)."""

    conv: tuple[int, ...]
    recurrent: tuple[int, ...]
    dtype: DType
    recurrent_dtype: DType = DType.FP32

    @property
    def kernel(self) -> int:
        return self.conv[-1]

    @property
    def layer_bytes(self) -> int:
        return prod(self.conv) * self.dtype.size_bytes + prod(self.recurrent) * self.recurrent_dtype.size_bytes

    def pack(self, conv: torch.Tensor, recurrent: torch.Tensor) -> torch.Tensor:
        """The two states as one uint8 row (a copy: the model updates its states in place).

        Raises:
            ValueError: a state of another shape or dtype than the config says.
        """
        for name, tensor, shape, dtype in (("conv", conv, self.conv, self.dtype),
                                           ("recurrent", recurrent, self.recurrent, self.recurrent_dtype)):
            want = torch_dtype(dtype)
            if tuple(tensor.shape) != shape or tensor.dtype != want:
                raise ValueError(f"linear-attention {name} state is {tuple(tensor.shape)} {tensor.dtype}, the config "
                                 f"says {shape} {want}")
        return torch.cat([conv.reshape(-1).view(torch.uint8), recurrent.reshape(-1).view(torch.uint8)])

    def unpack(self, row: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A packed row's (conv, recurrent) states on ``device``."""
        split = prod(self.conv) * self.dtype.size_bytes
        conv = row[:split].to(device).view(torch_dtype(self.dtype)).reshape(self.conv)
        recurrent = row[split:].to(device).view(torch_dtype(self.recurrent_dtype)).reshape(self.recurrent)
        return conv, recurrent


def layer_kinds(config: Any) -> list[str]:
    """The config's ``layer_types``, each one this integration knows.

    Raises:
        ValueError: no ``layer_types``, or a kind not known (named).
    """
    kinds = getattr(config, "layer_types", None)
    if not kinds:
        raise ValueError(f"config of model type {getattr(config, 'model_type', '?')!r} has no 'layer_types': not a "
                         "hybrid model (use KVStrataLM)")
    unknown = sorted(set(kinds) - set(_KINDS))
    if unknown:
        raise ValueError(f"config field 'layer_types' has kinds {unknown} the transformers integration does not "
                         f"cache; it knows {sorted(_KINDS)}")
    return list(kinds)


def linear_state(config: Any, dtype: torch.dtype) -> LinearState:
    """The state of one of the config's linear-attention layers (Qwen3-Next's fields).

    Raises:
        ValueError: the config's linear-attention layers are not a gated delta net (Mamba in
            Jamba, Bamba, Falcon-H1, ...): the core sizes their state, this integration does not pack it.
    """
    missing = [name for name in _GATED_DELTA_FIELDS if getattr(config, name, None) is None]
    if missing:
        raise ValueError(f"config of model type {getattr(config, 'model_type', '?')!r} has linear_attention layers "
                         f"without {missing[0]!r}: the transformers integration packs Qwen3-Next's gated-delta-net "
                         "state only, not a Mamba mixer's")
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_heads = config.linear_num_value_heads
    conv_dim = 2 * key_dim + value_heads * config.linear_value_head_dim
    return LinearState((1, conv_dim, config.linear_conv_kernel_dim),
                       (1, value_heads, config.linear_key_head_dim, config.linear_value_head_dim),
                       kv_dtype(dtype, _MODEL_DTYPES))


def hybrid_groups(config: Any, dtype: torch.dtype) -> tuple[KVGroup, ...]:
    """The model's KV groups as the core reads its config, for a model run in ``dtype``.

    Raises:
        ValueError: not a hybrid config, one with a kind this integration does not cache, or a
            state the core sizes otherwise than the tensors :class:`LinearState` packs.
    """
    kinds = layer_kinds(config)
    groups = geometry_from_config(config.to_dict(), dtype=kv_dtype(dtype, _MODEL_DTYPES)).groups
    for group in groups:
        if group.kind is GroupKind.STATE and group.state_bytes != linear_state(config, dtype).layer_bytes:
            raise ValueError(f"the {group.label} state of {group.state_bytes} bytes a layer is not the "
                             f"{linear_state(config, dtype).layer_bytes} bytes of the conv + recurrent "
                             "state this integration packs")
    if sorted(layer for group in groups for layer in group.layers) != list(range(len(kinds))):
        raise ValueError("the config's layer kinds do not give each layer one KV group")
    return groups
