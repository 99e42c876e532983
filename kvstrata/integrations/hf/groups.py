"""A hybrid transformers model's KV groups, read from its config, and how its recurrent state is packed.

transformers names each decoder layer's kind in ``config.layer_types``: ``"full_attention"``,
``"sliding_attention"`` (K and V of the last ``sliding_window`` tokens; transformers'
``DynamicSlidingWindowLayer`` keeps ``sliding_window - 1`` of them between forwards, all a
next token attends to besides itself) and ``"linear_attention"`` (Qwen3-Next's gated delta
net: a causal-conv state of the last ``linear_conv_kernel_dim`` inputs and a recurrent state
per value head, both in the model's dtype). :func:`hybrid_groups` makes one
:class:`~kvstrata.kv.groups.KVGroup` per kind, in order of first appearance.

A STATE group's snapshot packs each layer's state into one row of bytes, the conv state then
the recurrent state (:class:`LinearState`). Until :mod:`kvstrata.kv.geometry` reads hybrid
configs, this is the integration's own reading of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any

import torch

from kvstrata.kv.dtypes import DType
from kvstrata.kv.groups import GroupKind, KVGroup
from kvstrata.tensors import kv_dtype, torch_dtype

_KINDS = {"full_attention": GroupKind.FULL, "sliding_attention": GroupKind.SLIDING,
          "linear_attention": GroupKind.STATE}
_MODEL_DTYPES = (DType.BF16, DType.FP16, DType.FP32)


@dataclass(frozen=True)
class LinearState:
    """One linear-attention layer's state (batch 1): ``conv`` ``[1, conv_dim, kernel]`` and
    ``recurrent`` ``[1, value_heads, key_head_dim, value_head_dim]``, both of ``dtype``."""

    conv: tuple[int, ...]
    recurrent: tuple[int, ...]
    dtype: DType

    @property
    def kernel(self) -> int:
        return self.conv[-1]

    @property
    def layer_bytes(self) -> int:
        return (prod(self.conv) + prod(self.recurrent)) * self.dtype.size_bytes

    def pack(self, conv: torch.Tensor, recurrent: torch.Tensor) -> torch.Tensor:
        """The two states as one uint8 row (a copy: the model updates its states in place).

        Raises:
            ValueError: a state of another shape or dtype than the config says.
        """
        want = torch_dtype(self.dtype)
        for name, tensor, shape in (("conv", conv, self.conv), ("recurrent", recurrent, self.recurrent)):
            if tuple(tensor.shape) != shape or tensor.dtype != want:
                raise ValueError(f"linear-attention {name} state is {tuple(tensor.shape)} {tensor.dtype}, the config "
                                 f"says {shape} {want}")
        return torch.cat([conv.reshape(-1).view(torch.uint8), recurrent.reshape(-1).view(torch.uint8)])

    def unpack(self, row: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A packed row's (conv, recurrent) states on ``device``."""
        split = prod(self.conv) * self.dtype.size_bytes
        dtype = torch_dtype(self.dtype)
        conv = row[:split].to(device).view(dtype).reshape(self.conv)
        recurrent = row[split:].to(device).view(dtype).reshape(self.recurrent)
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
    """The state of one of the config's linear-attention layers (Qwen3-Next's fields)."""
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_heads = config.linear_num_value_heads
    conv_dim = 2 * key_dim + value_heads * config.linear_value_head_dim
    return LinearState((1, conv_dim, config.linear_conv_kernel_dim),
                       (1, value_heads, config.linear_key_head_dim, config.linear_value_head_dim),
                       kv_dtype(dtype, _MODEL_DTYPES))


def hybrid_groups(config: Any, dtype: torch.dtype) -> tuple[KVGroup, ...]:
    """One KV group per layer kind of ``config.layer_types``, in order of first appearance.

    Raises:
        ValueError: not a hybrid config, or one with a kind this integration does not cache.
    """
    kinds = layer_kinds(config)
    element = kv_dtype(dtype, _MODEL_DTYPES)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    groups = []
    for label in dict.fromkeys(kinds):
        layers = tuple(i for i, k in enumerate(kinds) if k == label)
        kind = _KINDS[label]
        if kind is GroupKind.STATE:
            state = linear_state(config, dtype)
            groups.append(KVGroup(kind, layers, element, state_bytes=state.layer_bytes,
                                  state_heads=config.linear_num_value_heads, label=label))
        else:
            span = config.sliding_window if kind is GroupKind.SLIDING else None
            groups.append(KVGroup(kind, layers, element, kv_heads=config.num_key_value_heads, head_dim=head_dim,
                                  span=span, label=label))
    return tuple(groups)
