"""The transformers ``Cache`` adapter: a model's KV, restored from kvstrata layer by layer.

The model's cache is a :class:`KVStrataCache`, a transformers ``Cache`` of
:class:`RestoringLayer` s: layer *i*'s first ``update`` waits for layer *i* of the restored
blocks only, so layer *i* computes while later layers are still arriving. In a split (see
:mod:`kvstrata.integrations.hf.generate`), the restored span is appended after the KV the model
computed for the prompt's beginning. :meth:`KVStrataCache.kv` gives everything cached back as
the ``[layers, 2, tokens, kv_heads, head_dim]`` tensor ``TieredCache.store`` takes.

:func:`model_layout` is the block layout of a transformers model (a rank's whole blocks: TP=1,
or TP-matched): its config read by :func:`kvstrata.kv.readconfig.kv_shape_from_config` (the one
reading of a config's heads and widths), its dtype mapped by :mod:`kvstrata.tensors`.
:func:`model_slice_layout` is the layout of one head slice of its blocks, which ranks of any
tensor-parallel size share (:mod:`kvstrata.kv.heads`).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvstrata.kv.fields import GeometryError
from kvstrata.kv.geometry import Attention, DType
from kvstrata.kv.readconfig import kv_shape_from_config
from kvstrata.kv.groups import GroupKind, KVGroup
from kvstrata.kv.heads import HeadSlicing
from kvstrata.kv.layout import KVLayout
from kvstrata.tensors import kv_dtype

if TYPE_CHECKING:
    from kvstrata.cache import LoadHandle
    from kvstrata.cache.sliced import SlicedLoad
    from kvstrata.integrations.hf.streaming import StreamedKV

# The model's dtype is the cache's KV dtype (FP8 KV is an engine's choice, not a model's).
_MODEL_DTYPES = (DType.BF16, DType.FP16, DType.FP32)
_SHAPE_FIELDS = ("num_hidden_layers", "num_attention_heads", "hidden_size", "num_key_value_heads", "head_dim",
                 "kv_lora_rank", "qk_rope_head_dim")


def cache_arg(model: Any) -> str:
    """The name of the model's forward argument that takes a ``Cache``.

    transformers renamed ``past_key_values`` to ``cache`` during 5.x: where ``forward`` takes
    ``cache``, the old name still works but warns (a FutureWarning, "removed in version 5.40.0"),
    so it is passed by the new name; older 5.x releases know ``past_key_values`` only.
    """
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def model_layout(config: Any, block_tokens: int, dtype: torch.dtype, tp: int = 1) -> KVLayout:
    """The kvstrata block layout of a Hugging Face decoder (MHA/GQA/MQA; batch 1): one rank's
    whole blocks, the KV heads a rank of a ``tp``-way model holds (TP-matched).

    Args:
        config: the model's transformers config (``model.config``).
        block_tokens: tokens per block.
        dtype: the model's dtype, which is its KV's: bf16, fp16 or fp32.
        tp: the model's tensor-parallel size (its heads split as transformers splits them).

    Raises:
        GeometryError: the config has no uniform per-token KV (a recurrent or hybrid model), a
            field is missing or inconsistent (named), the model uses MLA, or ``tp`` fits its
            KV heads in neither way.
        ValueError: an unsupported dtype.
    """
    group = _model_group(config, dtype)
    heads = HeadSlicing.for_group(group).rank_heads(tp, 0)
    return KVLayout(group.num_layers, block_tokens, len(heads), group.head_dim, group.dtype)


def model_slice_layout(config: Any, block_tokens: int, dtype: torch.dtype, granularity: int = 1) -> KVLayout:
    """The layout of one head slice (``granularity`` KV heads) of the model's blocks: a cache of
    it holds each block as ``kv_heads / granularity`` objects that ranks of every TP size read
    (its namespace names no TP size; :class:`~kvstrata.cache.sliced.SlicedRank`).

    Raises:
        GeometryError: as :func:`model_layout`, or ``granularity`` does not divide the KV heads.
        ValueError: an unsupported dtype.
    """
    return KVLayout.head_slice(_model_group(config, dtype), block_tokens, granularity)


def model_heads(config: Any, dtype: torch.dtype) -> int:
    """The model's KV heads, all ranks together."""
    return _model_group(config, dtype).kv_heads


def _model_group(config: Any, dtype: torch.dtype) -> KVGroup:
    shape = kv_shape_from_config(_config_dict(config))
    if shape.attention is Attention.MLA:
        # transformers' DeepSeek modules cache K and V expanded per head (of different widths),
        # not the latent kvstrata's MLA layout holds: the two do not fit.
        raise GeometryError("config fields 'kv_lora_rank'/'qk_rope_head_dim' make it an MLA model: the "
                            "transformers integration caches K and V per KV head and does not support MLA")
    return KVGroup(GroupKind.FULL, tuple(range(shape.num_layers)), kv_dtype(dtype, _MODEL_DTYPES),
                   kv_heads=shape.num_kv_heads, head_dim=shape.head_dim)


def _config_dict(config: Any) -> dict[str, Any]:
    """``config`` as its ``config.json`` reads, with the fields the shape is read from as the
    config object reports them: transformers resolves a model's own names there (GPT-2's
    ``n_head`` is ``num_attention_heads``) and raises for a field that varies per layer (a
    heterogeneous model has no one KV shape)."""
    data = config.to_dict()
    for name in _SHAPE_FIELDS:
        value = getattr(config, name, None)
        if value is not None:
            data[name] = value
    return data


class RestoredPrefix:
    """``tokens`` tokens' KV (the prompt's first, or in a split those after the computed
    beginning), arriving layer by layer from a load: a :class:`LoadHandle` of whole blocks, or a
    :class:`~kvstrata.cache.sliced.SlicedLoad` of a rank's head slices (both give ``pieces()``)."""

    def __init__(self, handle: LoadHandle | SlicedLoad, tokens: int, timeout_s: float = 120.0) -> None:
        self.handle = handle
        self.tokens = tokens
        self.timeout_s = timeout_s

    def layer(self, i: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s K and V as ``[1, kv_heads, tokens, head_dim]`` on ``device`` (waits for it)."""
        self.handle.wait_layer(i, self.timeout_s)
        pieces = self.handle.pieces()
        heads = max(h + piece.shape[3] for _, h, piece in pieces)
        first = pieces[0][2]
        keys = torch.empty(1, heads, self.tokens, first.shape[-1], dtype=first.dtype, device=device)
        values = torch.empty_like(keys)
        self._write(pieces, i, keys, values)
        return keys, values

    def write_layer(self, i: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy layer ``i``'s K and V into ``keys`` and ``values`` (``[1, kv_heads, tokens,
        head_dim]``, any device and dtype; waits for the layer): one copy a piece, no staging."""
        self.handle.wait_layer(i, self.timeout_s)
        self._write(self.handle.pieces(), i, keys, values)

    def _write(self, pieces: list[tuple[int, int, torch.Tensor]], i: int, keys: torch.Tensor,
               values: torch.Tensor) -> None:
        for b, h, piece in pieces:
            kv = piece[i]  # [2, block tokens, piece heads, D]
            start = b * kv.shape[1]
            n = min(kv.shape[1], self.tokens - start)
            if n <= 0:
                continue  # past the tokens the ranks agreed on
            heads = slice(h, h + kv.shape[2])
            keys[0, heads, start:start + n].copy_(kv[0, :n].transpose(0, 1), non_blocking=True)
            values[0, heads, start:start + n].copy_(kv[1, :n].transpose(0, 1), non_blocking=True)


class RestoringLayer(DynamicLayer):
    """A DynamicLayer whose next update first appends this layer of a restored span: the
    prompt's cached prefix (before anything was computed), or, in a split, the loaded blocks
    after the computed beginning. ``prefix`` is the span still to append (None once appended).

    That update lays the layer's KV out once: what it held, the restored span copied straight
    from the loaded blocks, then the new tokens, in one tensor (a plain DynamicLayer would take
    the span as a tensor of its own and copy it again to append the new tokens)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.prefix: RestoredPrefix | None = None

    def get_seq_length(self) -> int:
        return super().get_seq_length() + (self.prefix.tokens if self.prefix is not None else 0)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        prefix = self.prefix
        if prefix is None:
            return super().update(key_states, value_states, *args, **kwargs)
        before = self.keys.shape[-2] if self.is_initialized else 0
        batch, heads, new, _ = key_states.shape
        total = before + prefix.tokens + new
        keys = key_states.new_empty(batch, heads, total, key_states.shape[-1])
        values = value_states.new_empty(batch, heads, total, value_states.shape[-1])
        if before:
            keys[..., :before, :].copy_(self.keys)
            values[..., :before, :].copy_(self.values)
        else:
            self.lazy_initialization(key_states, value_states)
        prefix.write_layer(self.index, keys[..., before:before + prefix.tokens, :],
                           values[..., before:before + prefix.tokens, :])
        keys[..., before + prefix.tokens:, :].copy_(key_states)
        values[..., before + prefix.tokens:, :].copy_(value_states)
        self.keys, self.values = keys, values
        self.prefix = None
        return self.keys, self.values


class KVStrataCache(Cache):
    """A transformers Cache of :class:`RestoringLayer` per layer, or with ``stream`` the
    stream's :class:`~kvstrata.integrations.hf.streaming.StreamingLayer` s (KV in host memory)."""

    def __init__(self, num_layers: int, stream: StreamedKV | None = None):
        if stream is None:
            layers = [RestoringLayer(i) for i in range(num_layers)]
        else:
            layers = [stream.layer(i) for i in range(num_layers)]
        super().__init__(layers=layers)
        self.stream = stream

    def append_restored(self, prefix: RestoredPrefix) -> None:
        """Append ``prefix`` after what each layer holds, at that layer's next update."""
        for layer in self.layers:
            layer.prefix = prefix

    def kv(self) -> torch.Tensor:
        """All cached KV as ``[layers, 2, tokens, kv_heads, head_dim]`` (batch 1), for storing."""
        if self.stream is not None:
            per_layer = self.stream.host_kv()  # [2, H, n, D] each
        else:
            per_layer = [torch.stack([layer.keys[0], layer.values[0]]) for layer in self.layers]
        return torch.stack(per_layer).permute(0, 1, 3, 2, 4).contiguous()
