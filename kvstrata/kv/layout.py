"""The layout of one cached block: what bytes a block holds and in which order.

A block covers ``block_tokens`` tokens of every layer on one GPU (one tensor-parallel rank).
Blocks are layer-major, ``[layers, kv, block_tokens, kv_heads, head_dim]``, so a restore can
hand layer 0 to the model while later layers are still on their way. Tiers treat a block as
``block_bytes`` opaque bytes viewed as ``[layers, layer_bytes]``.

A head-sliced layout (:meth:`KVLayout.head_slice`) is the same shape over one slice's heads
(``granularity`` of them, :mod:`kvstrata.kv.heads`): a block of it is one slice, the same bytes
whatever TP size wrote it, and its namespace names no TP size.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.kv.fields import GeometryError, check_int
from kvstrata.kv.geometry import DType, KVGeometry
from kvstrata.kv.groups import KVGroup
from kvstrata.kv.heads import HeadSlicing

LAYOUT_NAME = "layer-major LKTHD"  # [layers, kv(2, or 1 for MLA), tokens, kv_heads, head_dim]
HEAD_SLICED_NAME = "head-sliced LKTHD"  # the same, over one slice's heads: any TP size reads it


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    block_tokens: int
    kv_heads: int  # per GPU
    head_dim: int
    dtype: DType
    kv_tensors: int = 2  # K and V; 1 for MLA's shared latent
    name: str = LAYOUT_NAME

    def __post_init__(self) -> None:
        for field in ("num_layers", "block_tokens", "kv_heads", "head_dim"):
            check_int(f"KVLayout field {field!r}", getattr(self, field))
        if self.kv_tensors not in (1, 2):
            raise GeometryError(f"KVLayout field 'kv_tensors' must be 1 or 2, got {self.kv_tensors!r}")

    @classmethod
    def from_geometry(cls, geometry: KVGeometry, block_tokens: int, tp: int = 1) -> "KVLayout":
        """The layout of a one-group model's blocks.

        Raises:
            GeometryError: the model has several KV groups (each has its own layout:
                :meth:`for_group`).
        """
        if len(geometry.groups) > 1:
            raise GeometryError(f"model {geometry.name!r} has {len(geometry.groups)} KV groups, each with "
                                "its own block layout (KVLayout.for_group)")
        return cls.for_group(geometry.groups[0], block_tokens, tp)

    @classmethod
    def for_group(cls, group: KVGroup, block_tokens: int, tp: int = 1) -> "KVLayout":
        """The layout of one per-token KV group's blocks: its layers, heads per GPU, width and dtype.

        Raises:
            GeometryError: the group caches a state, not per-token KV.
        """
        if not group.kind.per_token:
            raise GeometryError(f"a {group.kind.value} group caches no per-token blocks")
        return cls(group.num_layers, block_tokens, group.heads_per_gpu(tp), group.head_dim, group.dtype,
                   group.kv_tensors)

    @classmethod
    def head_slice(cls, group: KVGroup, block_tokens: int, granularity: int = 1) -> "KVLayout":
        """The layout of one head slice of a per-token group's blocks (MLA: its whole latent).

        Raises:
            GeometryError: the group caches a state, or ``granularity`` does not divide its heads.
        """
        slicing = HeadSlicing.for_group(group, granularity)
        return cls(group.num_layers, block_tokens, slicing.granularity, group.head_dim, group.dtype,
                   group.kv_tensors, HEAD_SLICED_NAME)

    @property
    def head_sliced(self) -> bool:
        """A block of this layout is one head slice, named by no TP size."""
        return self.name == HEAD_SLICED_NAME

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of one layer."""
        return self.kv_tensors * self.kv_heads * self.head_dim * self.dtype.size_bytes

    @property
    def layer_bytes(self) -> int:
        return self.block_tokens * self.token_bytes

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.kv_tensors, self.block_tokens, self.kv_heads, self.head_dim)

    def describe(self) -> str:
        """Canonical text for namespaces: two layouts that differ never share blocks."""
        dims = "x".join(str(d) for d in self.block_shape)
        return f"{self.name}:{dims}:{self.dtype.name.lower()}"
