"""How a fleet of mixed tensor-parallel sizes shares one pool: TP-matched vs head-sliced blocks.

A fleet runs one model at several TP sizes on one shared DRAM pool. Two ways to store a block:

* **TP-matched** (:attr:`KVSharing.MATCHED`): blocks are namespaced by the writer's TP size and
  rank, so a TP=4 block is useless to a TP=2 instance and the pool keeps one copy of a prefix per
  TP size that has seen it. Each rank stores what it holds, so a head replicated over ranks (fewer
  KV heads than ranks; MLA's latent on every rank) is stored once per rank holding it:
  :meth:`kvstrata.kv.heads.HeadSlicing.copies` copies of every per-token group.
* **head-sliced** (:attr:`KVSharing.SLICED`): one copy of each block, as slices of KV heads
  addressed by (prefix, slice) whatever the writer's TP (:mod:`kvstrata.kv.heads`); any instance
  of any TP size loads them. This is what the simulator's pool modelled before fleets existed:
  one logical copy per block id, which every instance hits.

A recurrent state splits over its heads and no TP here replicates it: one copy either way.

Pure arithmetic: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstrata.kv.geometry import KVGeometry
from kvstrata.kv.heads import HeadSlicing, KVSharing
from kvstrata.plan.footprint import stored_groups


def pool_bytes(geometry: KVGeometry, tokens: int, tp: int, sharing: KVSharing, ends: int = 1) -> int:
    """Bytes the pool keeps for a prefix of ``tokens`` tokens a ``tp``-way instance stored
    (:func:`kvstrata.plan.footprint.stored_bytes` per group, times the group's copies when
    TP-matched).

    Raises:
        GeometryError: ``tp`` does not fit the model's heads.
    """
    geometry.kv_heads_per_gpu(tp)  # refuses a TP that does not fit, in either mode
    total = 0
    for share in stored_groups(geometry, tokens, ends).shares:
        copies = 1
        if sharing is KVSharing.MATCHED and share.group.kind.per_token:
            copies = HeadSlicing.for_group(share.group).copies(tp)
        total += copies * share.size_bytes
    return total


@dataclass(frozen=True)
class FleetSize:
    """One TP size of a fleet: what one stored prefix costs the pool in each mode.

    Attributes:
        tp: the tensor-parallel size.
        instances: instances of this size in the fleet.
        matched_bytes: the prefix TP-matched (every rank's copy of a replicated head).
        sliced_bytes: the prefix head-sliced (one copy).
    """

    tp: int
    instances: int
    matched_bytes: int
    sliced_bytes: int

    @property
    def replication(self) -> float:
        """Copies TP-matched stores of the prefix (1 where no head is replicated)."""
        return self.matched_bytes / self.sliced_bytes if self.sliced_bytes else 1.0


@dataclass(frozen=True)
class FleetSharing:
    """A prefix every TP size of the fleet has seen, in the pool, TP-matched vs head-sliced.

    Attributes:
        context_tokens: the prefix's tokens.
        sizes: each distinct TP size, in the order first listed.
        pool_capacity_bytes: the pool's KV capacity; None where the hardware has no pool.
    """

    context_tokens: int
    sizes: tuple[FleetSize, ...]
    pool_capacity_bytes: int | None

    @property
    def matched_bytes(self) -> int:
        """One copy per TP size (instances of one size share theirs), each with its replication."""
        return sum(s.matched_bytes for s in self.sizes)

    @property
    def sliced_bytes(self) -> int:
        return self.sizes[0].sliced_bytes

    @property
    def matched_copies(self) -> float:
        return self.matched_bytes / self.sliced_bytes if self.sliced_bytes else 1.0

    def prefixes(self, sharing: KVSharing) -> int | None:
        """Such prefixes the pool holds; None without a pool."""
        if self.pool_capacity_bytes is None:
            return None
        each = self.matched_bytes if sharing is KVSharing.MATCHED else self.sliced_bytes
        return self.pool_capacity_bytes // each if each else None

    def to_json(self) -> dict:
        return {
            "context_tokens": self.context_tokens,
            "pool_capacity_bytes": self.pool_capacity_bytes,
            "sizes": [
                {"tp": s.tp, "instances": s.instances, "matched_bytes": s.matched_bytes,
                 "sliced_bytes": s.sliced_bytes, "replication": s.replication}
                for s in self.sizes
            ],
            "prefix_bytes": {KVSharing.MATCHED.value: self.matched_bytes, KVSharing.SLICED.value: self.sliced_bytes},
            "copies": {KVSharing.MATCHED.value: self.matched_copies, KVSharing.SLICED.value: 1},
            "prefixes_in_pool": {m.value: self.prefixes(m) for m in KVSharing},
        }


def fleet_sharing(
    geometry: KVGeometry, fleet_tp: Sequence[int], context_tokens: int, pool_capacity_bytes: int | None
) -> FleetSharing:
    """Per TP size of ``fleet_tp`` (one entry per instance), a ``context_tokens`` prefix's pool
    bytes in each mode.

    Raises:
        ValueError: an empty fleet.
        GeometryError: a TP size the model's heads do not fit.
    """
    if not fleet_tp:
        raise ValueError("a fleet needs at least one instance")
    sizes = []
    for tp in dict.fromkeys(fleet_tp):
        sizes.append(FleetSize(tp, list(fleet_tp).count(tp),
                               pool_bytes(geometry, context_tokens, tp, KVSharing.MATCHED),
                               pool_bytes(geometry, context_tokens, tp, KVSharing.SLICED)))
    return FleetSharing(context_tokens, tuple(sizes), pool_capacity_bytes)
