"""Where bytes become tensors: the one map between kvstrata's KV dtypes and torch's, and KV of a layout."""

from __future__ import annotations

import torch

from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout

TORCH_DTYPES: dict[DType, torch.dtype] = {
    DType.FP32: torch.float32,
    DType.BF16: torch.bfloat16,
    DType.FP16: torch.float16,
    DType.FP8: torch.float8_e4m3fn,
}
_KV_DTYPES = {dtype: kv for kv, dtype in TORCH_DTYPES.items()}


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype a block of ``dtype`` KV is viewed as."""
    return TORCH_DTYPES[dtype]


def kv_dtype(dtype: torch.dtype, supported: tuple[DType, ...] = tuple(TORCH_DTYPES)) -> DType:
    """kvstrata's DType for a model's or an engine's torch ``dtype``.

    Raises:
        ValueError: ``dtype`` is not one of ``supported``, named with the ones that are.
    """
    kv = _KV_DTYPES.get(dtype)
    if kv is None or kv not in supported:
        names = ", ".join(str(TORCH_DTYPES[d]).removeprefix("torch.") for d in supported)
        raise ValueError(f"KV dtype {dtype} is not supported: use {names}")
    return kv


def block_tensor(raw: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """A block's bytes (uint8 ``[layers, layer_bytes]``) as KV, ``layout.block_shape``, in place."""
    return raw.view(torch_dtype(layout.dtype)).view(layout.block_shape)


def check_kv(kv: object, layout: KVLayout, min_tokens: int = 0) -> None:
    """Refuse KV that is not ``[layers, kv, tokens, kv_heads, head_dim]`` of ``layout``'s dtype,
    with at least ``min_tokens`` tokens.

    Raises:
        ValueError: naming what differs.
    """
    if not isinstance(kv, torch.Tensor):
        raise ValueError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dtype != torch_dtype(layout.dtype):
        raise ValueError(f"kv dtype {kv.dtype} does not match the cache layout's {torch_dtype(layout.dtype)}")
    expected = (layout.num_layers, layout.kv_tensors, "tokens", layout.kv_heads, layout.head_dim)
    if kv.dim() != 5 or tuple(kv.shape[i] for i in (0, 1, 3, 4)) != tuple(expected[i] for i in (0, 1, 3, 4)):
        raise ValueError(f"kv shape {tuple(kv.shape)} does not match [layers, kv, tokens, kv_heads, head_dim] = {expected}")
    if kv.shape[2] < min_tokens:
        raise ValueError(f"kv holds {kv.shape[2]} tokens, fewer than the {min_tokens} of the blocks to store")
