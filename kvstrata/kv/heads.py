"""Head slicing: one stored copy of a block's KV for every tensor-parallel size.

A rank of a TP=t instance holds a contiguous range of a group's KV heads (vLLM's and
transformers' split: rank r of t holds heads ``[r*H/t, (r+1)*H/t)``). Where blocks are stored
per rank, KV written at TP=4 is useless at TP=2. Head-sliced blocks are stored per *slice*
instead: ``granularity`` consecutive heads of one block, one object each, addressed by (prefix
key, slice), whatever the writer's TP. A rank stores and loads exactly the slices of its heads.

Heads are replicated when a group has fewer KV heads than ranks (rank r of t > H holds head
``r*H // t``; MLA's one latent is on every rank): the ranks holding a head share one copy, which
the first of them writes. A TP=t instance hits a prefix only if every slice of every block is
there: the union of its ranks' slices is all ``H/granularity`` slices, at every t.

Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvstrata.kv.fields import GeometryError, check_int
from kvstrata.kv.groups import GroupKind, KVGroup


class KVSharing(Enum):
    """How a group's blocks are stored across tensor-parallel ranks."""

    MATCHED = "tp-matched"  # each rank's whole block, namespaced by its TP rank and size
    SLICED = "head-sliced"  # one object per head slice of a block, in a namespace without a TP size


@dataclass(frozen=True)
class HeadSlicing:
    """How one per-token group's KV heads are cut into stored slices.

    Attributes:
        kv_heads: The group's KV heads (1 for MLA's latent, which every rank holds).
        granularity: Heads per slice; a rank must hold whole slices (1: any TP that fits the heads).
    """

    kv_heads: int
    granularity: int = 1

    def __post_init__(self) -> None:
        check_int("head slicing 'kv_heads'", self.kv_heads)
        check_int("head slicing 'granularity'", self.granularity)
        if self.kv_heads % self.granularity:
            raise GeometryError(f"head slicing 'granularity' ({self.granularity}) must divide the "
                                f"{self.kv_heads} KV heads")

    @classmethod
    def for_group(cls, group: KVGroup, granularity: int = 1) -> "HeadSlicing":
        """The slicing of ``group``'s heads (MLA: its one latent).

        Raises:
            GeometryError: the group caches a state, or ``granularity`` does not divide its heads.
        """
        if not group.kind.per_token:
            raise GeometryError(f"a {group.kind.value} group has no KV heads to slice")
        return cls(1 if group.kind is GroupKind.MLA else group.kv_heads, granularity)

    @property
    def slices(self) -> int:
        """Stored slices per block: what a TP=t instance needs, all of them, at every t."""
        return self.kv_heads // self.granularity

    def rank_heads(self, tp_size: int, tp_rank: int) -> range:
        """The KV heads rank ``tp_rank`` of a ``tp_size``-way instance holds.

        Raises:
            GeometryError: the rank is out of range, or ``tp_size`` fits the heads in neither
                way (it must divide them, or be a multiple of them).
        """
        check_int("'tp_size'", tp_size)
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
            raise GeometryError(f"'tp_rank' must be in [0, {tp_size}), got {tp_rank!r}")
        heads = self.kv_heads
        if tp_size <= heads:
            if heads % tp_size:
                raise GeometryError(f"'tp_size' ({tp_size}) must divide the {heads} KV heads")
            per = heads // tp_size
            return range(tp_rank * per, (tp_rank + 1) * per)
        if tp_size % heads:
            raise GeometryError(f"'tp_size' ({tp_size}) exceeds the {heads} KV heads and is not a multiple of them")
        head = tp_rank * heads // tp_size
        return range(head, head + 1)

    def rank_slices(self, tp_size: int, tp_rank: int) -> range:
        """The slices rank ``tp_rank`` of a ``tp_size``-way instance stores and loads.

        Raises:
            GeometryError: as :meth:`rank_heads`, or the rank's heads are not whole slices.
        """
        heads = self.rank_heads(tp_size, tp_rank)
        g = self.granularity
        if heads.start % g or len(heads) % g:
            raise GeometryError(f"at TP={tp_size} rank {tp_rank} holds KV heads {heads.start}-{heads.stop - 1}, "
                                f"not whole slices of {g} heads: store with a granularity that divides "
                                f"{len(heads)}")
        return range(heads.start // g, heads.stop // g)

    def writes(self, tp_size: int, tp_rank: int) -> bool:
        """Rank ``tp_rank`` is the first rank of its instance holding its heads: it writes them
        (the others holding the same replicated heads share its copy)."""
        return tp_rank == 0 or self.rank_heads(tp_size, tp_rank - 1) != self.rank_heads(tp_size, tp_rank)

    def copies(self, tp_size: int) -> int:
        """Copies a ``tp_size``-way instance would store of each head were blocks kept per rank
        (TP-matched): the replication factor; head-sliced blocks keep one."""
        self.rank_heads(tp_size, 0)
        return max(1, tp_size // self.kv_heads)
