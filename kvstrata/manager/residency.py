"""Where each block resides: the tiers' tables and the prefix index kept in step, and making room.

``Residency`` holds one ``BlockTable`` per tier and the ``PrefixIndex``, and changes them only
together: the index lists a medium for a key iff the key is READY in that tier's table. It makes
room (``reserve``: a WRITING slot, choosing victims where a tier is full, each demoted a tier
down first where the write policy says so; ``prepare_evict``), and settles the slots a plan held
once the worker reports each leg (moved, or a ``Failure``), the same way for every plan:

* moved: the destination becomes READY (and indexed), the source is unpinned;
* CORRUPT or MISSING: the destination is freed, and the source copy leaves its tier (if no other
  reader holds it: then the last one to fail drops it), as a victim to carry out;
* ABANDONED: the destination slot is retired until the stray transfer has ended;
* NO_SPACE: the destination is freed and its tier holds no more blocks than now (a full
  file system below the configured capacity): later reservations there make room first;
* UNAVAILABLE or ERROR: the destination is freed.

Not thread-safe: ``BlockManager`` calls it under its one lock. No torch, no threads, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.index.keys import BlockKey
from kvstrata.index.prefix import PrefixIndex
from kvstrata.manager.config import ManagerConfig
from kvstrata.manager.plans import Failure, Leg, Room, Slot, Victim
from kvstrata.manager.table import BlockTable, Reservation, TierFull
from kvstrata.media import Medium

# A tier holding more blocks than its capacity (a disk tier reopened smaller) sheds this many
# more per reservation that must make room, so it shrinks by one block per new block written:
# back within its capacity once as many new blocks as it held in excess have come in, each
# write paying one more eviction (a file deleted), never a start that deletes them all at once.
EXCESS_PER_RESERVATION = 1


class Residency:
    """The tables of every tier and the index over them, for one ``BlockManager`` (under its lock).

    Attributes:
        media: the tiers present, fastest first.
        tables: one ``BlockTable`` per tier.
        index: which media hold each key READY.
        below: per tier, the slower media present.
        unwritten: tiers nothing is written down to now (``BlockManager.skip_writes``).
        skipped: per tier, blocks not written down to it while it was unwritten (a running total).
    """

    def __init__(self, config: ManagerConfig) -> None:
        self.write = config.write
        self.media = tuple(sorted(config.capacities, key=lambda m: m.value))  # fastest first
        self.tables = {m: BlockTable(config.capacities[m], config.eviction.make(), m.label) for m in self.media}
        self.index = PrefixIndex()
        self.below = {m: tuple(x for x in self.media if x.value > m.value) for m in self.media}  # slower media
        self.unwritten: frozenset[Medium] = frozenset()
        self.skipped: dict[Medium, int] = {}

    def writes_to(self, medium: Medium, key: BlockKey) -> bool:
        """Whether ``key`` may be written to ``medium``: not to a skipped tier that lacks it (counted)."""
        if medium in self.unwritten and key not in self.tables[medium]:
            self.skipped[medium] = self.skipped.get(medium, 0) + 1
            return False
        return True

    def pin_source(self, key: BlockKey, below: Medium | None = None, hit: bool = False) -> Slot | None:
        """Pin ``key`` in the fastest tier holding it READY (below ``below``, if given)."""
        for medium in self.media if below is None else self.below[below]:
            slot = self.tables[medium].pin(key, hit=hit)
            if slot is not None:
                return Slot(medium, slot)
        return None

    # --- making room -------------------------------------------------------------------------------

    def reserve(self, medium: Medium, key: BlockKey, victims: list[Victim]) -> Reservation | None:
        """A WRITING slot for ``key`` in ``medium``, choosing a victim (and its demotion, whose
        own room goes into ``victims`` first) when the tier is full, and one more while it holds
        more than its capacity (``EXCESS_PER_RESERVATION``); None if the key is there in any state.

        Raises:
            TierFull: nothing can leave (every block pinned or in flight).
        """
        table = self.tables[medium]
        try:
            return table.prepare_store(key)
        except TierFull:
            chosen = table.choose_victims(1 + min(EXCESS_PER_RESERVATION, table.excess_blocks))
            if not chosen:
                raise
        for victim in chosen:
            self.index.discard(victim.key, medium)
            demotion = self._demotion(medium, victim.key, victim.slot, victims)
            victims.append(Victim(victim.key, Slot(medium, victim.slot), demotion))
        return table.hand_over(chosen[0], key)  # the others' slots are freed as they leave

    def _demotion(self, medium: Medium, key: BlockKey, slot: int, victims: list[Victim]) -> Leg | None:
        """The leg that copies an evicted block to the next tier down, if the write policy wants
        it there and it is not there yet; its reservation may make room in turn."""
        lower = next(iter(self.below[medium]), None)
        if lower is None or not self.write.on_evict(self.tables[medium].hits(key)):
            return None
        if not self.writes_to(lower, key):
            return None  # a tier whose loads do not pay: dropped
        try:
            reservation = self.reserve(lower, key, victims)
        except TierFull:
            return None  # nowhere to go: the block is dropped (it is a cache)
        if reservation is None:
            return None  # there already (or on its way)
        return Leg(key, Slot(medium, slot), Slot(lower, reservation.slot))

    def prepare_evict(self, medium: Medium, blocks: int) -> Room:
        """``BlockManager.prepare_evict``: a block sent down that finds no room below stays, and
        so do those after it (a block evicted is demoted, never dropped for that)."""
        victims: list[Victim] = []
        table, lower = self.tables[medium], next(iter(self.below[medium]), None)
        chosen = table.choose_victims(blocks)
        for n, victim in enumerate(chosen):
            sent_down = (lower is not None and lower not in self.unwritten
                         and self.write.on_evict(table.hits(victim.key)))
            there = sent_down and victim.key in self.tables[lower]
            self.index.discard(victim.key, medium)
            demotion = self._demotion(medium, victim.key, victim.slot, victims)
            if sent_down and not there and demotion is None:  # no room below: it stays
                for kept in chosen[n:]:
                    table.restore(kept.key)
                    self.index.add(kept.key, medium)
                break
            victims.append(Victim(victim.key, Slot(medium, victim.slot), demotion))
        return Room(tuple(victims))

    def complete_room(self, room: Room, failures: Sequence[Failure | None]) -> None:
        """``BlockManager.complete_room``: per victim, its demotion settled, then the victim released."""
        for victim, failure in zip(room.victims, failures, strict=True):
            leg = victim.demotion
            if leg is not None and failure is None:
                self.tables[leg.dst.medium].complete_store(leg.key, ok=True)
                self.index.add(leg.key, leg.dst.medium)
            elif leg is not None:
                self.settle_destination(leg.key, leg.dst, failure)
            self.tables[victim.slot.medium].release(victim.key)

    # --- settling legs -----------------------------------------------------------------------------

    def landed(self, leg: Leg) -> None:
        self.tables[leg.dst.medium].complete_store(leg.key, ok=True)
        self.index.add(leg.key, leg.dst.medium)
        self.tables[leg.src.medium].unpin(leg.key)

    def settle(self, leg: Leg, failure: Failure, drops: list[Victim]) -> None:
        """A failed leg: its destination settled, its source unpinned (and dropped, if bad)."""
        self.settle_destination(leg.key, leg.dst, failure)
        self.tables[leg.src.medium].unpin(leg.key)
        self.drop_if_bad(leg.key, leg.src, failure, drops)

    def drop_if_bad(self, key: BlockKey, source: Slot, failure: Failure, drops: list[Victim]) -> None:
        """A source whose read failed as ``failure`` leaves its tier if its bytes are bad or gone."""
        if failure.drops_source:
            taken = self.tables[source.medium].take(key)  # None: another reader holds it, and will drop it
            if taken is not None:
                self.index.discard(key, source.medium)
                drops.append(Victim(key, source))

    def settle_destination(self, key: BlockKey, dst: Slot, failure: Failure) -> None:
        table = self.tables[dst.medium]
        if failure is Failure.ABANDONED:
            table.quarantine(key)  # bytes may still land there: never reuse the slot
        else:
            table.complete_store(key, ok=False)
        if failure is Failure.NO_SPACE:
            table.shrink_to_used()
