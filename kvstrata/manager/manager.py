"""The block manager: which block is where and in what state, and what to move (pure).

It owns the prefix index and one ``BlockTable`` per tier, and answers in small frozen plans
(``kvstrata.manager.plans``): ``prepare_load(match)``, ``prepare_store(keys)``,
``prepare_copies(keys, to)`` (write-downs, promotions) and ``prepare_evict(medium, n)`` pin
sources, reserve destinations (choosing victims, and their demotions, where a tier is full) and
say which legs to move; ``prepare_put(keys, to)`` and ``prepare_get(keys)`` do the same for
bytes with one end in a caller's own memory (placements: a slot reserved, or a source pinned).
The matching ``complete_*`` take what the worker reports per leg (moved, or a ``Failure``) and
settle every slot the same way:

* moved: the destination becomes READY (and indexed), the source is unpinned;
* CORRUPT or MISSING: the destination is freed, and the source copy leaves its tier (if no other
  reader holds it: then the last one to fail drops it), as a victim to carry out;
* ABANDONED: the destination slot is retired until the stray transfer has ended;
* NO_SPACE: the destination is freed and its tier holds no more blocks than now (a full
  file system below the configured capacity): later reservations there make room first;
* UNAVAILABLE or ERROR: the destination is freed.

Invariants (tested without threads, ``tests/manager``): the index lists a medium for a key iff
the key is READY in that tier's table; every slot is free, owned by one entry, or retired; a
plan's pins and reservations are all released by its ``complete_*`` or ``abandon_*``.

No torch, no threads, no I/O: one lock serializes the calls of the cache's threads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvstrata.index.keys import BlockKey
from kvstrata.index.prefix import Match, PrefixIndex
from kvstrata.kv.layout import KVLayout
from kvstrata.manager.plans import (
    CopyPlan,
    Failure,
    GetPlan,
    Leg,
    LoadBlock,
    LoadPlan,
    Placement,
    PutPlan,
    Room,
    Slot,
    Step,
    StopReason,
    StoreBlock,
    StorePlan,
    Victim,
    copy_ranges,
)
from kvstrata.manager.table import BlockTable, TableCounts, TierFull
from kvstrata.media import Medium
from kvstrata.policies.eviction import Eviction
from kvstrata.policies.write import WriteRule

COPY_TASK_BYTES = 32 * 1024 * 1024  # bytes per layer-range copy of a load: large copies, few dispatches
# A load this small is copied in one dispatch: below it, handing layer ranges to the engine's
# workers (or even dispatching them one by one) costs more than the copies (measured on the
# tiny model, ~1 MB restores: 0.48 -> 0.21 ms idle, 0.81 -> 0.52 ms right after a forward pass).
# Its layers then become ready together, about 0.1 ms in.
SMALL_LOAD_BYTES = 4 * 1024 * 1024
MEMORY_MEDIA = frozenset({Medium.DEVICE, Medium.HOST})  # slots readable in place
# A tier holding more blocks than its capacity (a disk tier reopened smaller) sheds this many
# more per reservation that must make room, so it shrinks by one block per new block written:
# back within its capacity once as many new blocks as it held in excess have come in, each
# write paying one more eviction (a file deleted), never a start that deletes them all at once.
EXCESS_PER_RESERVATION = 1


@dataclass(frozen=True)
class ManagerConfig:
    """What the manager plans for.

    Attributes:
        layout: the block layout (sizes for copy ranges).
        capacities: blocks per tier present; the device tier is required.
        eviction: the order blocks leave a full tier.
        write: when blocks go down the tiers.
        direct: media without an in-memory view whose blocks are read straight into device
            slots (the others are staged in the host tier).
        workers: transfer threads (copy ranges are cut so each gets two or more).
        small_load_bytes: loads up to this size are copied as one range.
        layer_ranges: larger loads are copied in layer ranges (else every load is one range).
    """

    layout: KVLayout
    capacities: Mapping[Medium, int]
    eviction: Eviction = Eviction.LRU
    write: WriteRule = field(default_factory=WriteRule)
    direct: frozenset[Medium] = frozenset()
    workers: int = 2
    small_load_bytes: int = SMALL_LOAD_BYTES
    layer_ranges: bool = True

    def __post_init__(self) -> None:
        if Medium.DEVICE not in self.capacities:
            raise ValueError("the block manager needs a device tier")


class BlockManager:
    def __init__(self, config: ManagerConfig) -> None:
        self.config = config
        self.media = tuple(sorted(config.capacities, key=lambda m: m.value))  # fastest first
        self._tables = {m: BlockTable(config.capacities[m], config.eviction.make(), m.label) for m in self.media}
        self._index = PrefixIndex()
        self._lock = threading.Lock()
        self._below = {m: tuple(x for x in self.media if x.value > m.value) for m in self.media}  # slower media
        self._copy_ranges: dict[int, tuple[range, ...]] = {}  # blocks -> layer ranges (a pure function of it)
        self._unwritten: frozenset[Medium] = frozenset()  # tiers nothing is written down to now
        self._skipped: dict[Medium, int] = {}  # per tier, blocks not written down to it (unwritten)

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

    def skip_writes(self, media: Iterable[Medium]) -> None:
        """Write nothing down to ``media`` from now on (a tier whose loads do not pay: its
        blocks would never be read), until called again without them: an evicted block the
        write policy would send there is dropped, a put leaves them out. Loads from them, and
        blocks already there, are untouched."""
        with self._lock:
            self._unwritten = frozenset(media)

    def skipped_writes(self) -> dict[Medium, int]:
        """Per tier, the blocks not written down to it while it was skipped (a running total)."""
        with self._lock:
            return dict(self._skipped)

    def _writes_to(self, medium: Medium, key: BlockKey) -> bool:
        """Whether ``key`` may be written to ``medium``: not to a skipped tier that lacks it (counted)."""
        if medium in self._unwritten and key not in self._tables[medium]:
            self._skipped[medium] = self._skipped.get(medium, 0) + 1
            return False
        return True

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
        each reservation there then evicts one more block than it needs, ``EXCESS_PER_RESERVATION``,
        until the tier is back within its capacity)."""
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

    # --- loads -----------------------------------------------------------------------------------

    def prepare_load(self, match: Match) -> LoadPlan:
        """Pin each matched block where it is and reserve a device slot (and a host slot to
        stage in, where the source has no view and no direct path) for those not on the device,
        in order, until the first block that cannot be had."""
        if not isinstance(match, Match):
            raise ValueError(f"a load takes the Match of a lookup(), got {type(match).__name__}")
        blocks: list[LoadBlock] = []
        victims: list[Victim] = []
        stop: tuple[StopReason, Medium] | None = None
        with self._lock:
            # Every block pinned where it is first: room made for one block of the plan must
            # not evict a later one (it stopped loads at blocks READY on the device a moment before).
            held = [self._hold(key) for key in match.keys]
            for i, (key, medium) in enumerate(zip(match.keys, match.media)):
                block = self._plan_block(key, held[i], victims)
                if isinstance(block, StopReason):
                    stop = block, medium
                    for later, slot in zip(match.keys[i + 1 :], held[i + 1 :]):
                        if slot is not None:
                            self._tables[slot.medium].unpin(later)
                    break
                blocks.append(block)
        reason, at = stop or (None, None)
        copies = sum(1 for b in blocks if b.step is Step.COPY)
        return LoadPlan(tuple(blocks), Room(tuple(victims)), reason, at, self._ranges(copies))

    def _hold(self, key: BlockKey) -> Slot | None:
        """Pin ``key`` on the device, or else in the fastest tier below holding it READY."""
        slot = self._tables[Medium.DEVICE].pin(key)
        if slot is not None:
            return Slot(Medium.DEVICE, slot)
        return self._pin_source(key, below=Medium.DEVICE, hit=True)

    def _plan_block(self, key: BlockKey, source: Slot | None, victims: list[Victim]) -> LoadBlock | StopReason:
        """The block's load from ``source`` (pinned by ``_hold``; unpinned here if it stops)."""
        if source is None:
            return StopReason.GONE
        if source.medium is Medium.DEVICE:
            return LoadBlock(key, source.index, (Medium.DEVICE,), Step.RESIDENT)
        reserved = self._reserve_or_stop(Medium.DEVICE, key, victims, StopReason.DEVICE_FULL,
                                         StopReason.LOADING_ELSEWHERE)
        if isinstance(reserved, StopReason):
            self._tables[source.medium].unpin(key)
            return reserved
        target = Slot(Medium.DEVICE, reserved)
        if source.medium in MEMORY_MEDIA:
            return LoadBlock(key, reserved, (source.medium, Medium.DEVICE), Step.COPY, Leg(key, source, target))
        if source.medium in self.config.direct:
            return LoadBlock(key, reserved, (source.medium, Medium.DEVICE), Step.FETCH, Leg(key, source, target))
        staged = (StopReason.NO_STAGING if Medium.HOST not in self._tables else
                  self._reserve_or_stop(Medium.HOST, key, victims, StopReason.STAGING_FULL,
                                        StopReason.STAGING_ELSEWHERE))
        if isinstance(staged, StopReason):
            self._tables[source.medium].unpin(key)
            self._tables[Medium.DEVICE].complete_store(key, ok=False)
            return staged
        leg = Leg(key, source, Slot(Medium.HOST, staged))
        return LoadBlock(key, reserved, (source.medium, Medium.HOST, Medium.DEVICE), Step.FETCH, leg)

    def complete_fetch(self, plan: LoadPlan, failures: Sequence[Failure | None]) -> tuple[LoadPlan, Room]:
        """Settle the plan's FETCH legs (``failures`` in ``plan.legs(Step.FETCH)`` order): staged
        blocks become READY (and pinned) in the host and go on to COPY from there, blocks read
        straight into the device are LANDED. The plan is cut before the first block that failed
        (the rest abandoned). Returns the cut plan and the blocks to drop (failed verification)."""
        if not failures:
            return plan, Room()  # nothing was fetched: the plan stands as prepared
        drops: list[Victim] = []
        outcomes = iter(failures)
        blocks = list(plan.blocks)
        cut: tuple[int, Failure] | None = None
        with self._lock:
            for i, block in enumerate(blocks):
                if block.step is not Step.FETCH:
                    continue
                failure = next(outcomes)
                if failure is None:
                    blocks[i] = self._fetched(block)
                    continue
                self._settle(block.leg, failure, drops)
                if block.leg.dst.medium is not Medium.DEVICE:
                    self._tables[Medium.DEVICE].complete_store(block.key, ok=False)
                blocks[i] = None
                cut = cut or (i, failure)
            if cut is not None:
                i, failure = cut
                self._abandon_blocks(b for b in blocks[i:] if b is not None)
                blocks = blocks[:i]
        stopped, at = (cut[1].stop, plan.blocks[cut[0]].route[0]) if cut else (plan.stopped, plan.stopped_at)
        copies = sum(1 for b in blocks if b.step is Step.COPY)
        return LoadPlan(tuple(blocks), Room(), stopped, at, self._ranges(copies)), Room(tuple(drops))

    def _fetched(self, block: LoadBlock) -> LoadBlock:
        leg = block.leg
        self._tables[leg.src.medium].unpin(block.key)
        if leg.dst.medium is Medium.DEVICE:
            return block.advanced(Step.LANDED)
        self._tables[Medium.HOST].complete_store(block.key, ok=True, pin=True)  # pinned: the copy's source
        self._index.add(block.key, Medium.HOST)
        return block.advanced(Step.COPY, Leg(block.key, leg.dst, Slot(Medium.DEVICE, block.device_slot)))

    def complete_load(self, plan: LoadPlan) -> tuple[BlockKey, ...]:
        """Every block is in its device slot: READY there, pinned for the caller, sources
        unpinned. Returns the keys the write policy wants written down now (hot blocks)."""
        device = self._tables[Medium.DEVICE]
        with self._lock:
            for block in plan.blocks:
                if block.step is Step.RESIDENT:
                    continue
                device.complete_store(block.key, ok=True, pin=True)
                self._index.add(block.key, Medium.DEVICE)
                if block.step is Step.COPY:
                    self._tables[block.leg.src.medium].unpin(block.key)
            return tuple(b.key for b in plan.blocks if self.config.write.on_hit(device.hits(b.key)))

    def abandon_load(self, plan: LoadPlan) -> None:
        """Undo a plan that will not complete: reservations freed, pins dropped."""
        with self._lock:
            self._abandon_blocks(plan.blocks)

    def _abandon_blocks(self, blocks: Iterable[LoadBlock]) -> None:
        device = self._tables[Medium.DEVICE]
        for block in blocks:
            if block.step is Step.RESIDENT:
                device.unpin(block.key)
                continue
            if block.leg is not None:
                self._tables[block.leg.src.medium].unpin(block.key)
                if block.leg.dst.medium is not Medium.DEVICE:
                    self._tables[block.leg.dst.medium].complete_store(block.key, ok=False)
            device.complete_store(block.key, ok=False)

    def _ranges(self, blocks: int) -> tuple[range, ...]:
        ranges = self._copy_ranges.get(blocks)
        if ranges is None:
            c, layout = self.config, self.config.layout
            small = c.small_load_bytes if c.layer_ranges else blocks * layout.block_bytes
            ranges = copy_ranges(layout.num_layers, blocks, layout.layer_bytes, c.workers, small, COPY_TASK_BYTES)
            self._copy_ranges[blocks] = ranges
        return ranges

    # --- stores and copies -----------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[BlockKey]) -> StorePlan:
        """Device slots for those of ``keys`` not on the device yet, in order, until one cannot
        be had (every device slot pinned or in flight)."""
        blocks: list[StoreBlock] = []
        victims: list[Victim] = []
        with self._lock:
            for i, key in enumerate(keys):
                try:
                    reservation = self._reserve(Medium.DEVICE, key, victims)
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
                source = self._pin_source(key)
                if source is None:
                    continue
                for medium in targets:
                    if medium is source.medium or not self._writes_to(medium, key):
                        continue
                    try:
                        reservation = self._reserve(medium, key, victims)
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
                    self._landed(leg)
                    landed += 1
                else:
                    self._settle(leg, failure, drops)
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
                    if medium is not targets[0] and not self._writes_to(medium, key):
                        continue  # a tier nothing is written down to (the first is the store itself)
                    try:
                        reservation = self._reserve(medium, key, victims)
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
                    self._settle_destination(placement.key, placement.slot, failure)

    def prepare_get(self, keys: Sequence[BlockKey]) -> GetPlan:
        """The leading run of ``keys`` READY somewhere, each pinned (a hit) in the fastest tier
        holding it, to read straight into the caller's memory."""
        sources: list[Placement] = []
        with self._lock:
            for i, key in enumerate(keys):
                slot = self._pin_source(key, hit=True)
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
                    self._drop_if_bad(placement.key, placement.slot, failure, drops)
        return read, Room(tuple(drops))

    # --- eviction ----------------------------------------------------------------------------------

    def prepare_evict(self, medium: Medium, blocks: int) -> Room:
        """Up to ``blocks`` unpinned blocks leaving ``medium`` (least valuable first), each
        demoted a tier down first where the write policy says so. A block the policy sends down
        that finds no room there (the tier below full of blocks on their way in, this room's
        own among them) stays, and so do those after it: the room ends there, and a later one
        moves them once those have landed (a block evicted is demoted, never dropped for that)."""
        victims: list[Victim] = []
        table, lower = self._tables[medium], next(iter(self._below[medium]), None)
        with self._lock:
            chosen = table.choose_victims(blocks)
            for n, victim in enumerate(chosen):
                sent_down = (lower is not None and lower not in self._unwritten
                             and self.config.write.on_evict(table.hits(victim.key)))
                there = sent_down and victim.key in self._tables[lower]
                self._index.discard(victim.key, medium)
                demotion = self._demotion(medium, victim.key, victim.slot, victims)
                if sent_down and not there and demotion is None:  # no room below: it stays
                    for kept in chosen[n:]:
                        table.restore(kept.key)
                        self._index.add(kept.key, medium)
                    break
                victims.append(Victim(victim.key, Slot(medium, victim.slot), demotion))
        return Room(tuple(victims))

    def complete_room(self, room: Room, failures: Sequence[Failure | None]) -> None:
        """The victims are out: demoted copies READY below (or their slots settled), the
        victims forgotten. ``failures``: per victim, its demotion's outcome (None without one)."""
        with self._lock:
            for victim, failure in zip(room.victims, failures, strict=True):
                leg = victim.demotion
                if leg is not None and failure is None:
                    self._tables[leg.dst.medium].complete_store(leg.key, ok=True)
                    self._index.add(leg.key, leg.dst.medium)
                elif leg is not None:
                    self._settle_destination(leg.key, leg.dst, failure)
                self._tables[victim.slot.medium].release(victim.key)

    # --- internals (the lock is held) --------------------------------------------------------------

    def _pin_source(self, key: BlockKey, below: Medium | None = None, hit: bool = False) -> Slot | None:
        """Pin ``key`` in the fastest tier holding it READY (below ``below``, if given)."""
        for medium in self.media if below is None else self._below[below]:
            slot = self._tables[medium].pin(key, hit=hit)
            if slot is not None:
                return Slot(medium, slot)
        return None

    def _reserve_or_stop(self, medium: Medium, key: BlockKey, victims: list[Victim], full: StopReason,
                         present: StopReason) -> int | StopReason:
        try:
            reservation = self._reserve(medium, key, victims)
        except TierFull:
            return full
        return present if reservation is None else reservation.slot

    def _reserve(self, medium: Medium, key: BlockKey, victims: list[Victim]):
        """A WRITING slot for ``key`` in ``medium``, choosing a victim (and its demotion, whose
        own room goes into ``victims`` first) when the tier is full, and one more while it holds
        more than its capacity (``EXCESS_PER_RESERVATION``); None if the key is there in any state.

        Raises:
            TierFull: nothing can leave (every block pinned or in flight).
        """
        table = self._tables[medium]
        try:
            return table.prepare_store(key)
        except TierFull:
            chosen = table.choose_victims(1 + min(EXCESS_PER_RESERVATION, table.excess_blocks))
            if not chosen:
                raise
        for victim in chosen:
            self._index.discard(victim.key, medium)
            demotion = self._demotion(medium, victim.key, victim.slot, victims)
            victims.append(Victim(victim.key, Slot(medium, victim.slot), demotion))
        return table.hand_over(chosen[0], key)  # the others' slots are freed as they leave

    def _demotion(self, medium: Medium, key: BlockKey, slot: int, victims: list[Victim]) -> Leg | None:
        """The leg that copies an evicted block to the next tier down, if the write policy wants
        it there and it is not there yet; its reservation may make room in turn."""
        lower = next(iter(self._below[medium]), None)
        if lower is None or not self.config.write.on_evict(self._tables[medium].hits(key)):
            return None
        if not self._writes_to(lower, key):
            return None  # a tier whose loads do not pay: dropped
        try:
            reservation = self._reserve(lower, key, victims)
        except TierFull:
            return None  # nowhere to go: the block is dropped (it is a cache)
        if reservation is None:
            return None  # there already (or on its way)
        return Leg(key, Slot(medium, slot), Slot(lower, reservation.slot))

    def _landed(self, leg: Leg) -> None:
        self._tables[leg.dst.medium].complete_store(leg.key, ok=True)
        self._index.add(leg.key, leg.dst.medium)
        self._tables[leg.src.medium].unpin(leg.key)

    def _settle(self, leg: Leg, failure: Failure, drops: list[Victim]) -> None:
        """A failed leg: its destination settled, its source unpinned (and dropped, if bad)."""
        self._settle_destination(leg.key, leg.dst, failure)
        self._tables[leg.src.medium].unpin(leg.key)
        self._drop_if_bad(leg.key, leg.src, failure, drops)

    def _drop_if_bad(self, key: BlockKey, source: Slot, failure: Failure, drops: list[Victim]) -> None:
        """A source whose read failed as ``failure`` leaves its tier if its bytes are bad or gone."""
        if failure.drops_source:
            taken = self._tables[source.medium].take(key)  # None: another reader holds it, and will drop it
            if taken is not None:
                self._index.discard(key, source.medium)
                drops.append(Victim(key, source))

    def _settle_destination(self, key: BlockKey, dst: Slot, failure: Failure) -> None:
        table = self._tables[dst.medium]
        if failure is Failure.ABANDONED:
            table.quarantine(key)  # bytes may still land there: never reuse the slot
        else:
            table.complete_store(key, ok=False)
        if failure is Failure.NO_SPACE:
            table.shrink_to_used()
