"""The one map between kvstrata's KV dtypes and torch's (the edge where bytes become tensors)."""

from __future__ import annotations

import torch

from kvstrata.kv.geometry import DType

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
