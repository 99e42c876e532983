"""A tier's block table: which keys it holds, in which slot, in what state (pure, not locked).

Two-step writes with explicit states: ``prepare_store`` reserves a slot (state WRITING, never
readable, never evicted); ``complete_store(ok)`` makes it READY or frees it. A READY block can
be pinned by readers (a reference count); only READY, unpinned blocks are ever chosen to leave,
and leaving is two-step too: ``choose_victims`` (or ``take`` for one named block) marks them
EVICTING (the bytes still there, so a demotion can copy them down, a disk file be deleted),
``release`` forgets them.

    (absent) --prepare_store--> WRITING --complete_store(ok)--> READY --choose_victims/take--> EVICTING
                                   |                              ^                             |
                                   +--complete_store(fail)--> (absent) <-----release------------+
                                                                  (EVICTING --restore--> READY)

Slots have one owner each. A victim's slot may be handed over (``hand_over``) to a new key while
the victim is still EVICTING: the new key is WRITING in that slot, and whoever moves the bytes
must finish with the victim's bytes (its demotion) before writing the new ones. Releasing the
victim then frees nothing; failing the new key's store before the victim is released gives the
slot back to the victim. So a slot is free only once nobody has a use for its bytes.

A table can hold more blocks than its capacity: a disk tier reopened smaller than what it holds
adopts every block it finds (``adopt(past_capacity=True)``), in slots past the capacity where
needed, rather than deleting the excess before its first hit. It is then full (no free slot)
and ``excess_blocks`` says by how much; the excess leaves as the block manager makes room (the
eviction policy's order). A slot at or past the capacity never goes back on the free list (a
victim's handed straight to a new block is that block's, as any victim's is): only a tier whose
slots are bookkeeping (disk) is ever adopted past its capacity.

The table takes no lock: the block manager that owns it serializes every call.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvstrata.index.keys import BlockKey
from kvstrata.policies.eviction import EvictionPolicy


class BlockState(enum.Enum):
    WRITING = "writing"
    READY = "ready"
    EVICTING = "evicting"

    # Hashed by identity, in C, as Medium is: Enum's own __hash__ (of the name, in Python) cost
    # ~0.5 us a call, two a state change (_ALLOWED), 100K state changes adopting a disk tier.
    __hash__ = object.__hash__


_ALLOWED = {
    (None, BlockState.WRITING),
    (BlockState.WRITING, BlockState.READY),
    (BlockState.WRITING, None),
    (BlockState.READY, BlockState.EVICTING),
    (BlockState.EVICTING, None),
    (BlockState.EVICTING, BlockState.READY),  # a demotion that failed gives the block back
}


class TierFull(Exception):
    """No free slot and nothing evictable (every block is pinned or in flight)."""


class InvalidTransition(RuntimeError):
    pass


@dataclass(slots=True)
class Entry:
    key: BlockKey
    slot: int
    state: BlockState
    pins: int = 0
    hits: int = 0
    handed_from: BlockKey | None = None  # WRITING in the slot of this victim, still EVICTING
    handed_to: BlockKey | None = None  # EVICTING, its slot handed over to this block


@dataclass(frozen=True)
class Reservation:
    key: BlockKey
    slot: int


@dataclass(frozen=True)
class Adopted:
    """What :meth:`BlockTable.adopt` did: ``known`` of the keys, from the first, are in the
    table now (a leading run: it stopped where the table was full); ``new`` were not before."""

    known: int
    new: list[BlockKey]


@dataclass(frozen=True)
class TableCounts:
    """A table's fill and evictions, read at once (:meth:`BlockTable.counts`).

    Attributes:
        used_slots: slots not free: owned by a block (in any state) or retired.
        capacity_blocks: slots it may fill now (it shrinks where its medium ran out of space).
        evicted_blocks: blocks chosen to leave for room since the table was made (a victim
            that stayed after all not counted).
    """

    used_slots: int
    capacity_blocks: int
    evicted_blocks: int


class BlockTable:
    """Slots 0..capacity-1 of one tier (and past it, blocks adopted past the capacity, until they leave)."""

    def __init__(self, capacity_blocks: int, policy: EvictionPolicy, name: str = "tier") -> None:
        if capacity_blocks < 0:
            raise ValueError(f"{name}: capacity_blocks must be >= 0, got {capacity_blocks}")
        self.name = name
        self.capacity_blocks = capacity_blocks  # may shrink below the slots there are (shrink_to_used)
        self._policy = policy
        self._entries: dict[BlockKey, Entry] = {}
        self._owned = 0  # slots owned by an entry (one that has not handed its slot over)
        # Free slots: those released (reused first), then the never-used ones from _fresh up:
        # memory in use grows with the blocks held, not with the capacity (a 100 GB disk tier of
        # 4 KiB blocks would otherwise list 24 million free slots, ~0.9 GB, before holding any).
        self._free: list[int] = []
        self._fresh = 0
        self._quarantined: set[int] = set()  # slots retired by abandoned transfers
        self._evicted = 0  # victims chosen, less those restored

    # --- state changes ---------------------------------------------------------------------

    def _move(self, entry: Entry | None, key: BlockKey, to: BlockState | None) -> None:
        frm = entry.state if entry else None
        if (frm, to) not in _ALLOWED:
            raise InvalidTransition(f"{self.name}: block {key.hex()[:12]} cannot go {frm} -> {to}")

    def prepare_store(self, key: BlockKey) -> Reservation | None:
        """A slot for ``key`` in state WRITING; None if the key is already here (any state).

        Raises:
            TierFull: no free slot (make room first: ``choose_victims`` then ``hand_over``).
        """
        if key in self._entries:
            return None
        if not self.free_blocks:
            raise TierFull(f"{self.name}: all {self.capacity_blocks} slots in use")
        self._move(None, key, BlockState.WRITING)
        if self._free:
            slot = self._free.pop()
        else:
            slot, self._fresh = self._fresh, self._fresh + 1
        self._entries[key] = Entry(key, slot, BlockState.WRITING)
        self._owned += 1
        return Reservation(key, slot)

    def adopt(self, keys: Sequence[BlockKey], past_capacity: bool = False) -> Adopted:
        """Record blocks found whole in the tier without a write of ours (recovered at a start,
        put in a shared pool by others): those not here yet go absent -> READY in one step, as
        ``prepare_store`` then ``complete_store(ok=True)`` would take them, in order, until the
        table is full. One call for a tier's worth of blocks (100K at a start), with no
        reservation or transition check made per block.

        ``past_capacity``: take every key, even beyond the capacity (a disk tier reopened
        smaller than the blocks it holds, whose slots are bookkeeping only): the table is then
        over capacity (``excess_blocks``) until enough of them have left."""
        entries, inserted, new = self._entries, self._policy.inserted, []
        room = len(keys) if past_capacity else self.free_blocks
        for n, key in enumerate(keys):
            if key in entries:
                continue
            if not room:
                return Adopted(n, new)
            room -= 1
            if self._free:
                slot = self._free.pop()
            else:
                slot, self._fresh = self._fresh, self._fresh + 1
            entries[key] = Entry(key, slot, BlockState.READY)
            self._owned += 1
            inserted(key)
            new.append(key)
        return Adopted(len(keys), new)

    def hand_over(self, victim: Reservation, key: BlockKey) -> Reservation:
        """Reserve ``key`` (WRITING) in the slot of ``victim``, a block still EVICTING here."""
        entry = self._entries.get(victim.key)
        if entry is None or entry.state is not BlockState.EVICTING or entry.handed_to is not None:
            raise InvalidTransition(f"{self.name}: hand_over from a block that is not evicting in its own slot")
        if key in self._entries:
            raise InvalidTransition(f"{self.name}: hand_over to block {key.hex()[:12]}, which is here already")
        self._entries[key] = Entry(key, entry.slot, BlockState.WRITING, handed_from=victim.key)
        entry.handed_to = key
        return Reservation(key, entry.slot)

    def complete_store(self, key: BlockKey, ok: bool, pin: bool = False) -> None:
        """WRITING -> READY (``ok``; pinned at once if ``pin``, so no eviction can slip in
        between) or -> absent."""
        entry = self._entries.get(key)
        if entry is None or entry.state is not BlockState.WRITING:
            raise InvalidTransition(f"{self.name}: complete_store of a block that is not being written")
        to = BlockState.READY if ok else None
        self._move(entry, key, to)
        if ok:
            entry.state = BlockState.READY
            self._policy.inserted(key)
            if pin:
                entry.pins += 1
        else:
            self._drop(entry)

    def choose_victims(self, count: int) -> list[Reservation]:
        """Mark up to ``count`` READY unpinned blocks EVICTING, in policy order."""
        if count < 0:
            raise ValueError(f"{self.name}: victim count must be >= 0, got {count}")
        victims = []
        for key in self._policy.order():
            if len(victims) >= count:
                break
            entry = self._entries.get(key)
            if entry is not None and entry.state is BlockState.READY and entry.pins == 0:
                self._move(entry, key, BlockState.EVICTING)
                entry.state = BlockState.EVICTING
                victims.append(Reservation(key, entry.slot))
        self._evicted += len(victims)
        return victims

    def take(self, key: BlockKey) -> Reservation | None:
        """Mark one READY, unpinned block EVICTING (e.g. it failed verification); None if it
        cannot go now (absent, in flight, or another reader holds it)."""
        entry = self._entries.get(key)
        if entry is None or entry.state is not BlockState.READY or entry.pins:
            return None
        self._move(entry, key, BlockState.EVICTING)
        entry.state = BlockState.EVICTING
        return Reservation(key, entry.slot)

    def release(self, key: BlockKey) -> None:
        """Forget an EVICTING block; its slot is free unless it was handed over."""
        entry = self._entries.get(key)
        self._move(entry, key, None)
        if entry.state is not BlockState.EVICTING:
            raise InvalidTransition(f"{self.name}: release of a {entry.state} block")
        self._drop(entry)

    def restore(self, key: BlockKey) -> None:
        """An EVICTING block, a victim of ``choose_victims``, stays after all (its slot was not handed over)."""
        entry = self._entries.get(key)
        if entry is None or entry.state is not BlockState.EVICTING or entry.handed_to is not None:
            raise InvalidTransition(f"{self.name}: restore of a block that is not being evicted from its own slot")
        self._move(entry, key, BlockState.READY)
        entry.state = BlockState.READY
        self._evicted -= 1  # restore follows only choose_victims: the victim stays

    def quarantine(self, key: BlockKey) -> None:
        """Retire a WRITING block's slot for good (a transfer into it was abandoned and may
        still land): the key is free to be stored again elsewhere, the slot never reused."""
        entry = self._entries.get(key)
        if entry is None or entry.state is not BlockState.WRITING:
            raise InvalidTransition(f"{self.name}: quarantine of a block that is not being written")
        del self._entries[key]
        self._owned -= 1
        self._quarantined.add(entry.slot)

    def _drop(self, entry: Entry) -> None:
        del self._entries[entry.key]
        self._policy.removed(entry.key)
        if entry.handed_to is not None:
            # Released after handing its slot over: the slot is the new block's now.
            successor = self._entries.get(entry.handed_to)
            if successor is not None and successor.handed_from == entry.key:
                successor.handed_from = None
            return
        victim = self._entries.get(entry.handed_from) if entry.handed_from else None
        if victim is not None and victim.state is BlockState.EVICTING and victim.handed_to == entry.key:
            victim.handed_to = None  # the victim's bytes are still in use: its slot goes back to it
            return
        self._owned -= 1
        self._free_slot(entry.slot)

    def _free_slot(self, slot: int) -> None:
        """Put ``slot`` on the free list, unless it lies at or past the capacity (a block adopted
        past it, or a tier that shrank): while a block may be reserved, some slot below the
        capacity is free (its slots in use number fewer), so none past it is needed."""
        if slot < self.capacity_blocks:
            self._free.append(slot)

    # --- readers ----------------------------------------------------------------------------

    def pin(self, key: BlockKey, hit: bool = True) -> int | None:
        """Pin a READY block for reading; its slot, or None (absent, being written or evicted).

        ``hit``: a request is reading it (counts a hit and an access for the eviction policy);
        False for the cache's own copying (write-down, prefetch), which must not look hot.
        """
        entry = self._entries.get(key)
        if entry is None or entry.state is not BlockState.READY:
            return None
        entry.pins += 1
        if hit:
            entry.hits += 1
            self._policy.accessed(key)
        return entry.slot

    def unpin(self, key: BlockKey) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.pins == 0:
            raise InvalidTransition(f"{self.name}: unpin of a block that is not pinned")
        entry.pins -= 1

    def state(self, key: BlockKey) -> BlockState | None:
        entry = self._entries.get(key)
        return entry.state if entry else None

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._entries

    def slot(self, key: BlockKey) -> int | None:
        entry = self._entries.get(key)
        return entry.slot if entry and entry.state is not BlockState.WRITING else None

    def pins(self, key: BlockKey) -> int:
        entry = self._entries.get(key)
        return entry.pins if entry else 0

    def hits(self, key: BlockKey) -> int:
        entry = self._entries.get(key)
        return entry.hits if entry else 0

    def ready_keys(self) -> list[BlockKey]:
        return list(self.iter_ready())

    def iter_ready(self) -> Iterator[BlockKey]:
        """The READY keys, lazily (no list of a large tier's every key); not while it changes."""
        return (k for k, e in self._entries.items() if e.state is BlockState.READY)

    def pinned(self) -> dict[BlockKey, int]:
        """Pins per pinned block."""
        return {k: e.pins for k, e in self._entries.items() if e.pins}

    @property
    def used_blocks(self) -> int:
        """Blocks in the table, in any state (a victim and the block its slot went to: both)."""
        return len(self._entries)

    @property
    def free_blocks(self) -> int:
        return max(0, self.capacity_blocks - self._owned - len(self._quarantined))

    @property
    def excess_blocks(self) -> int:
        """Slots in use beyond the capacity (blocks adopted past it, or a tier that shrank)."""
        return max(0, self._owned + len(self._quarantined) - self.capacity_blocks)

    def counts(self) -> TableCounts:
        return TableCounts(self._owned + len(self._quarantined), self.capacity_blocks, self._evicted)

    def shrink_to_used(self) -> None:
        """Hold no more blocks than now (the medium ran out of space below its configured
        capacity): a later reservation must make room first."""
        self.capacity_blocks = min(self.capacity_blocks, self._owned + len(self._quarantined))

    def unretire(self, slot: int) -> None:
        """A retired slot is safe again (the transfer that could still land in it has ended)."""
        if slot not in self._quarantined:
            raise InvalidTransition(f"{self.name}: slot {slot} is not retired")
        self._quarantined.remove(slot)
        self._free_slot(slot)

    @property
    def quarantined_slots(self) -> int:
        return len(self._quarantined)

    def owners(self) -> dict[int, BlockKey]:
        """Slot -> the key that owns it (for invariant checks; walks every entry)."""
        return {e.slot: e.key for e in self._entries.values() if e.handed_to is None}
