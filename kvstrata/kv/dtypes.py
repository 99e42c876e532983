"""Element types of cached KV and of weights."""

from __future__ import annotations

from enum import Enum

from kvstrata.kv.fields import GeometryError


class DType(Enum):
    """Element type of cached K/V (or of weights)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"

    @property
    def size_bytes(self) -> int:
        """Bytes per element."""
        return _DTYPE_SIZE_BYTES[self]

    @classmethod
    def parse(cls, text: str) -> DType:
        """Parse a dtype name as written by users, torch or Hugging Face configs.

        Args:
            text: e.g. ``"bf16"``, ``"bfloat16"``, ``"torch.float16"``, ``"float8_e4m3fn"``.

        Returns:
            The matching DType.

        Raises:
            GeometryError: ``text`` names no dtype we know; the message lists the allowed names.
        """
        key = text.strip().lower().removeprefix("torch.") if isinstance(text, str) else None
        if key not in _DTYPE_ALIASES:
            allowed = ", ".join(sorted(_DTYPE_ALIASES))
            raise GeometryError(f"unknown dtype {text!r}; allowed: {allowed}")
        return _DTYPE_ALIASES[key]


_DTYPE_SIZE_BYTES = {DType.FP32: 4, DType.BF16: 2, DType.FP16: 2, DType.FP8: 1}

_DTYPE_ALIASES = {
    **dict.fromkeys(("fp32", "float32", "float", "f32"), DType.FP32),
    **dict.fromkeys(("bf16", "bfloat16"), DType.BF16),
    **dict.fromkeys(("fp16", "float16", "half", "f16"), DType.FP16),
    **dict.fromkeys(
        ("fp8", "float8", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"),
        DType.FP8,
    ),
}
