"""kvstrata's tiers behind one simulated server (pure): which blocks each holds, from when.

The cache's rules as the connector runs them:

* Stores are write-through: a stored block goes into every tier the server has (device, host,
  disk, and the pool when it has one), each an LRU of its capacity in blocks. A tier can serve
  the block once its copy has landed: the store's time on that tier's path after the step that
  computed it (stores run behind the engine, off its steps). A block the device tier holds is
  not stored again (the cache reserves device slots only for keys the device lacks).
* A lookup is the leading run of a prompt's keys that some tier holds, each block by the
  fastest tier holding it (device, host, disk, pool: the order the cache searches).
* A load lands in the device tier (where loads go before the copy into vLLM's blocks); a load
  from the pool is staged in the host tier first, stays there, and is written through to the
  disk tier as a stored block is. (Seen in ``bench serve``: the decode server of P/D, which never
  stores, hits its host tier; the restarted server finds on its disk the blocks it had loaded from
  the pool. A block loaded from disk is not copied up: the restart hits its host tier hardly at all.)
* The pool is one, shared by every server on it; a server's own tiers are its own. A restarted
  server keeps its disk tier and the pool, and loses device and host.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstrata.media import Medium
from kvstrata.sim.serving.blocks import BlockKey

SEARCH_ORDER = (Medium.DEVICE, Medium.HOST, Medium.DISK, Medium.REMOTE)


@dataclass
class TierLRU:
    """One tier: keys in least-recently-used order, each with when its copy landed."""

    capacity_blocks: int
    _ready: OrderedDict[BlockKey, float] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.capacity_blocks < 0:
            raise ValueError(f"a tier's capacity must be >= 0 blocks, got {self.capacity_blocks}")

    def ready(self, key: BlockKey, now_s: float) -> bool:
        landed = self._ready.get(key)
        return landed is not None and landed <= now_s

    def put(self, key: BlockKey, ready_s: float) -> None:
        if self.capacity_blocks == 0:
            return
        if key in self._ready:
            self._ready[key] = min(self._ready[key], ready_s)
            self._ready.move_to_end(key)
            return
        self._ready[key] = ready_s
        while len(self._ready) > self.capacity_blocks:
            self._ready.popitem(last=False)

    def touch(self, key: BlockKey) -> None:
        if key in self._ready:
            self._ready.move_to_end(key)

    def __len__(self) -> int:
        return len(self._ready)


@dataclass(frozen=True)
class StoreHit:
    """A lookup's usable hit: the tier each block loads from, first block first."""

    tiers: tuple[Medium, ...]

    @property
    def blocks(self) -> int:
        return len(self.tiers)

    def count(self, tier: Medium) -> int:
        return sum(1 for t in self.tiers if t is tier)


@dataclass
class ServerStore:
    """One server's tiers (``tiers`` maps each it has to its LRU; the pool's is shared)."""

    tiers: dict[Medium, TierLRU]

    def lookup(self, keys: Sequence[BlockKey], now_s: float) -> StoreHit:
        """The leading run of ``keys`` held, each by the fastest tier holding it by ``now_s``."""
        out = []
        order = [t for t in SEARCH_ORDER if t in self.tiers]
        for key in keys:
            tier = next((t for t in order if self.tiers[t].ready(key, now_s)), None)
            if tier is None:
                break
            out.append(tier)
        return StoreHit(tuple(out))

    def loaded(self, keys: Sequence[BlockKey], hit: StoreHit, now_s: float) -> None:
        """The hit's blocks were loaded by ``now_s``: refreshed where found and now in the device
        tier; a pool block also in every local tier (staged in host, written through below)."""
        for key, tier in zip(keys, hit.tiers):
            self.tiers[tier].touch(key)
            for into in (Medium.DEVICE, Medium.HOST, Medium.DISK) if tier is Medium.REMOTE else (Medium.DEVICE,):
                if into in self.tiers:
                    self.tiers[into].put(key, now_s)

    def fresh(self, keys: Sequence[BlockKey], now_s: float) -> list[BlockKey]:
        """Those of ``keys`` a store at ``now_s`` would write (the device tier lacks them)."""
        device = self.tiers.get(Medium.DEVICE)
        return [k for k in keys if device is None or not device.ready(k, now_s)]

    def store(self, keys: Sequence[BlockKey], ready_s: dict[Medium, float], now_s: float) -> int:
        """Store ``keys``: those not in the device tier at ``now_s`` go into it and are written
        through every tier below, each readable from its ``ready_s``; those it holds are left
        as they are (the cache stores a key only where the device lacks it). Returns how many
        were stored."""
        fresh = self.fresh(keys, now_s)
        for tier, lru in self.tiers.items():
            for key in fresh:
                lru.put(key, ready_s[tier])
        return len(fresh)
