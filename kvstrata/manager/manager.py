"""The block manager: which block is where and in what state, and what to move (pure).

It owns the prefix index and one ``BlockTable`` per tier (``kvstrata.manager.residency``), and
answers in small frozen plans (``kvstrata.manager.plans``): ``prepare_load(match)``
(``kvstrata.manager.loads``), ``prepare_store(keys)``, ``prepare_copies(keys, to)`` (write-downs,
promotions) and ``prepare_evict(medium, n)`` pin sources, reserve destinations (choosing victims,
and their demotions, where a tier is full) and say which legs to move; ``prepare_put(keys, to)``
and ``prepare_get(keys)`` do the same for bytes with one end in a caller's own memory
(placements: a slot reserved, or a source pinned). The matching ``complete_*`` take what the
worker reports per leg (moved, or a ``Failure``) and settle every slot the same way (the rules
are in ``kvstrata.manager.residency``).

Invariants (tested without threads, ``tests/manager``): the index lists a medium for a key iff
the key is READY in that tier's table; every slot is free, owned by one entry, or retired; a
plan's pins and reservations are all released by its ``complete_*`` or ``abandon_*``.

No torch, no threads, no I/O: one lock serializes the calls of the cache's threads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from kvstrata.index.keys import BlockKey
from kvstrata.index.prefix import IndexListener, Match
from kvstrata.manager.config import ManagerConfig
from kvstrata.manager.loads import LoadPlanner
from kvstrata.manager.plans import (
    CopyPlan,
    Failure,
    GetPlan,
    Leg,
    LoadPlan,
    Placement,
    PutPlan,
    Room,
    Slot,
    StopReason,
    StoreBlock,
    StorePlan,
    Victim,
)
from kvstrata.manager.residency import Residency
from kvstrata.manager.table import BlockTable, TableCounts, TierFull
from kvstrata.media import Medium


class BlockManager:
    """The cache's pure half: every call takes the one lock, plans or settles, and returns."""

    def __init__(self, config: ManagerConfig) -> None:
        self.config = config
        self._res = Residency(config)
        self.media = self._res.media  # fastest first
        self._tables, self._index = self._res.tables, self._res.index  # the residency's, by short names
        self._loads = LoadPlanner(config, self._res)
        self._lock = threading.Lock()

    # --- looking ---------------------------------------------------------------------------------

    def match(self, keys: list[BlockKey]) -> Match:
        """The longest prefix of ``keys`` READY somewhere, and the fastest medium of each block."""
        return self._index.match(keys, self.config.layout.block_tokens)

    def where(self, key: BlockKey) -> tuple[Medium, ...]:
        """The media holding ``key`` READY, fastest first."""
        return self._index.media(key)

    def table(self, medium: Medium) -> BlockTable:
        """A tier's table, to inspect (tests, reports); change it only through the manager."""
        return self._tables[medium]

    def counts(self) -> dict[Medium, TableCounts]:
        """Each tier's fill and evictions, read together (a moment's view, for metrics)."""
        with self._lock:
            return {m: t.counts() for m, t in self._tables.items()}

    def indexed_blocks(self) -> int:
        return len(self._index)

    def listen(self, listener: IndexListener) -> None:
        """Tell ``listener`` which blocks each tier holds READY now, then each change (a block
        stored, promoted, written down, evicted, dropped, forgotten) as it is made, under this
        manager's lock (see :meth:`PrefixIndex.listen`: it must not call the manager back)."""
        with self._lock:
            self._index.listen(listener)

    def skip_writes(self, media: Iterable[Medium]) -> None:
        """Write nothing down to ``media`` from now on (a tier whose loads do not pay: its
        blocks would never be read), until called again without them: an evicted block the
        write policy would send there is dropped, a put leaves them out. Loads from them, and
        blocks already there, are untouched."""
        with self._lock:
            self._res.unwritten = frozenset(media)

    def skipped_writes(self) -> dict[Medium, int]:
        """Per tier, the blocks not written down to it while it was skipped (a running total)."""
        with self._lock:
            return dict(self._res.skipped)

    def pin(self, medium: Medium, key: BlockKey, hit: bool = False) -> int | None:
        """Pin a READY block where it is (a reader outside any plan); its slot, or None."""
        with self._lock:
            return self._tables[medium].pin(key, hit)

    def unpin(self, medium: Medium, keys: Iterable[BlockKey]) -> None:
        with self._lock:
            for key in keys:
                self._tables[medium].unpin(key)

    def release_retired(self, slot: Slot) -> None:
        """A slot retired by an abandoned transfer is free again: that transfer has ended."""
        with self._lock:
            self._tables[slot.medium].unretire(slot.index)

    def adopt(self, medium: Medium, keys: Sequence[BlockKey], past_capacity: bool = False) -> int:
        """Record blocks found READY in a tier without a plan (recovered from disk, written to
        a shared pool by others): those not known yet, in order, until the table is full.
        Returns how many of ``keys`` are known there now, from the first (a leading run).

        ``past_capacity``: all of them, even past the tier's capacity (a disk tier reopened
        smaller than what it holds keeps its blocks, and serves them, until they are evicted:
        each reservation there then evicts one more block than it needs until the tier is back
        within its capacity: ``residency.EXCESS_PER_RESERVATION``)."""
        with self._lock:
            adopted = self._tables[medium].adopt(keys, past_capacity)
            self._index.add_many(adopted.new, medium)
            return adopted.known

    def held_only_in(self, medium: Medium) -> BlockKey | None:
        """A block READY in ``medium`` and in no faster tier (None: none): a read of it is a read
        from ``medium`` (a probe of that tier's speed)."""
        with self._lock:
            for key in self._tables[medium].iter_ready():
                if self._index.media(key)[:1] == (medium,):
                    return key
        return None

    def ready_keys(self, medium: Medium) -> list[BlockKey]:
        """The keys READY in a tier now (a snapshot, safe while other threads plan)."""
        with self._lock:
            return self._tables[medium].ready_keys()

    def forget(self, medium: Medium, keys: Iterable[BlockKey]) -> int:
        """Drop blocks from this cache's view of a tier without a plan and without touching
        their bytes (a shared pool that lost them, or another pool): each READY, unpinned one
        leaves the table (its slot free) and the index. Blocks in flight or being read stay:
        their plans settle them (a read of a lost object fails as MISSING and drops it).
        Returns how many were forgotten."""
        table = self._tables[medium]
        forgotten = 0
        with self._lock:
            for key in keys:
                if table.take(key) is None:
                    continue
                table.release(key)
                self._index.discard(key, medium)
                forgotten += 1
        return forgotten

    # --- loads (``kvstrata.manager.loads``) -------------------------------------------------------

    def prepare_load(self, match: Match) -> LoadPlan:
        """Pin each matched block where it is and reserve a device slot (and a host slot to
        stage in, where the source has no view and no direct path) for those not on the device,
        in order, until the first block that cannot be had."""
        if not isinstance(match, Match):
            raise ValueError(f"a load takes the Match of a lookup(), got {type(match).__name__}")
        with self._lock:
            return self._loads.prepare(match)

    def complete_fetch(self, plan: LoadPlan, failures: Sequence[Failure | None]) -> tuple[LoadPlan, Room]:
        """Settle the plan's FETCH legs (``failures`` in ``plan.legs(Step.FETCH)`` order): staged
        blocks become READY (and pinned) in the host and go on to COPY from there, blocks read
        straight into the device are LANDED. The plan is cut before the first block that failed
        (the rest abandoned). Returns the cut plan and the blocks to drop (failed verification)."""
        if not failures:
            return plan, Room()  # nothing was fetched: the plan stands as prepared
        with self._lock:
            return self._loads.complete_fetch(plan, failures)

    def complete_load(self, plan: LoadPlan) -> tuple[BlockKey, ...]:
        """Every block is in its device slot: READY there, pinned for the caller, sources
        unpinned. Returns the keys the write policy wants written down now (hot blocks)."""
        with self._lock:
            return self._loads.complete(plan)

    def abandon_load(self, plan: LoadPlan) -> None:
        """Undo a plan that will not complete: reservations freed, pins dropped."""
        with self._lock:
            self._loads.abandon(plan.blocks)

    # --- stores and copies -----------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[BlockKey]) -> StorePlan:
        """Device slots for those of ``keys`` not on the device yet, in order, until one cannot
        be had (every device slot pinned or in flight)."""
        blocks: list[StoreBlock] = []
        victims: list[Victim] = []
        with self._lock:
            for i, key in enumerate(keys):
                try:
                    reservation = self._res.reserve(Medium.DEVICE, key, victims)
                except TierFull:
                    return StorePlan(tuple(blocks), i, Room(tuple(victims)), StopReason.DEVICE_FULL)
                if reservation is not None:
                    blocks.append(StoreBlock(i, key, reservation.slot))
        return StorePlan(tuple(blocks), len(keys), Room(tuple(victims)))

    def complete_store(self, plan: StorePlan, failures: Sequence[Failure | None], pin: bool) -> tuple[BlockKey, ...]:
        """The stored blocks become READY on the device (``pin``: pinned, until written down);
        failed ones are freed. Returns the keys stored."""
        device = self._tables[Medium.DEVICE]
        stored = []
        with self._lock:
            for block, failure in zip(plan.blocks, failures, strict=True):
                device.complete_store(block.key, ok=failure is None, pin=pin and failure is None)
                if failure is None:
                    self._index.add(block.key, Medium.DEVICE)
                    stored.append(block.key)
        return tuple(stored)

    def prepare_copies(self, keys: Iterable[BlockKey], to: Sequence[Medium]) -> CopyPlan:
        """Copy each of ``keys`` from the fastest tier holding it READY into every tier of ``to``
        (present, lacking the key) that has or can make room. A block nowhere READY is skipped."""
        legs: list[Leg] = []
        victims: list[Victim] = []
        targets = [m for m in to if m in self._tables]
        with self._lock:
            for key in keys:
                source = self._res.pin_source(key)
                if source is None:
                    continue
                for medium in targets:
                    if medium is source.medium or not self._res.writes_to(medium, key):
                        continue
                    try:
                        reservation = self._res.reserve(medium, key, victims)
                    except TierFull:
                        continue  # best effort: a full tier is skipped
                    if reservation is not None:
                        self._tables[source.medium].pin(key, hit=False)  # one pin per leg
                        legs.append(Leg(key, source, Slot(medium, reservation.slot)))
                self._tables[source.medium].unpin(key)  # the lookup's own pin
        return CopyPlan(tuple(legs), Room(tuple(victims)))

    def complete_copies(self, plan: CopyPlan, failures: Sequence[Failure | None]) -> tuple[int, Room]:
        """Settle each leg; returns how many copies landed and the blocks to drop."""
        drops: list[Victim] = []
        landed = 0
        with self._lock:
            for leg, failure in zip(plan.legs, failures, strict=True):
                if failure is None:
                    self._res.landed(leg)
                    landed += 1
                else:
                    self._res.settle(leg, failure, drops)
        return landed, Room(tuple(drops))

    # --- a caller's memory (no device slot): puts and gets ----------------------------------------

    def prepare_put(self, keys: Sequence[BlockKey], to: Sequence[Medium]) -> PutPlan:
        """A slot in every tier of ``to`` (present) for each of ``keys`` not there yet in any
        state, to write straight from the caller's memory; a tier that cannot make room (every
        block pinned or in flight, this plan's own among them) is skipped for that block."""
        placements: list[Placement] = []
        victims: list[Victim] = []
        present: set[int] = set()
        full: set[int] = set()
        targets = [m for m in to if m in self._tables]
        with self._lock:
            for i, key in enumerate(keys):
                for medium in targets:
                    if medium is not targets[0] and not self._res.writes_to(medium, key):
                        continue  # a tier nothing is written down to (the first is the store itself)
                    try:
                        reservation = self._res.reserve(medium, key, victims)
                    except TierFull:
                        full.add(i)
                        continue
                    if reservation is None:
                        present.add(i)
                    else:
                        placements.append(Placement(i, key, Slot(medium, reservation.slot)))
        return PutPlan(tuple(placements), Room(tuple(victims)), frozenset(present), frozenset(full))

    def complete_put(self, plan: PutPlan, failures: Sequence[Failure | None]) -> None:
        """Settle each placement: written ones READY (and indexed), failed ones as a failed leg's
        destination is (freed; retired if abandoned; the tier shrunk if out of space)."""
        with self._lock:
            for placement, failure in zip(plan.placements, failures, strict=True):
                if failure is None:
                    self._tables[placement.slot.medium].complete_store(placement.key, ok=True)
                    self._index.add(placement.key, placement.slot.medium)
                else:
                    self._res.settle_destination(placement.key, placement.slot, failure)

    def prepare_get(self, keys: Sequence[BlockKey]) -> GetPlan:
        """The leading run of ``keys`` READY somewhere, each pinned (a hit) in the fastest tier
        holding it, to read straight into the caller's memory."""
        sources: list[Placement] = []
        with self._lock:
            for i, key in enumerate(keys):
                slot = self._res.pin_source(key, hit=True)
                if slot is None:
                    break
                sources.append(Placement(i, key, slot))
        return GetPlan(tuple(sources))

    def complete_get(self, plan: GetPlan, failures: Sequence[Failure | None]) -> tuple[int, Room]:
        """Unpin the sources; one that failed verification or went missing leaves its tier.
        Returns how many blocks, from the first, were read, and the blocks to drop."""
        drops: list[Victim] = []
        read = len(plan.sources)
        with self._lock:
            for placement, failure in zip(plan.sources, failures, strict=True):
                self._tables[placement.slot.medium].unpin(placement.key)
                if failure is not None:
                    read = min(read, placement.position)
                    self._res.drop_if_bad(placement.key, placement.slot, failure, drops)
        return read, Room(tuple(drops))

    # --- eviction (``kvstrata.manager.residency``) ---------------------------------------------------

    def prepare_evict(self, medium: Medium, blocks: int) -> Room:
        """Up to ``blocks`` unpinned blocks leaving ``medium`` (least valuable first), each
        demoted a tier down first where the write policy says so. A block the policy sends down
        that finds no room there (the tier below full of blocks on their way in, this room's
        own among them) stays, and so do those after it: the room ends there, and a later one
        moves them once those have landed (a block evicted is demoted, never dropped for that)."""
        with self._lock:
            return self._res.prepare_evict(medium, blocks)

    def complete_room(self, room: Room, failures: Sequence[Failure | None]) -> None:
        """The victims are out: demoted copies READY below (or their slots settled), the
        victims forgotten. ``failures``: per victim, its demotion's outcome (None without one)."""
        with self._lock:
            self._res.complete_room(room, failures)
