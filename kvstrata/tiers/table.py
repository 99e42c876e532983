"""A tier's block table: which keys it holds, in which slot, in which state (pure).

Two-step writes with explicit states: ``prepare_store`` reserves a slot (state WRITING,
never readable, never evicted); ``complete_store(ok)`` makes it READY or frees it. A READY
block can be pinned by readers (a reference count); only READY, unpinned blocks are ever
chosen for eviction, and an eviction is two-step too: ``choose_victims`` marks them EVICTING
(still readable, so a demotion can copy them down), ``release`` frees their slots.

    (absent) --prepare_store--> WRITING --complete_store(ok)--> READY --choose_victims--> EVICTING
                                   |                              ^  |                       |
                                   +--complete_store(fail)--> (absent) <--remove (unpinned)--+--release--> (absent)
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

from kvstrata.index.keys import BlockKey
from kvstrata.policies.eviction import EvictionPolicy


class BlockState(enum.Enum):
    WRITING = "writing"
    READY = "ready"
    EVICTING = "evicting"


_ALLOWED = {
    (None, BlockState.WRITING),
    (BlockState.WRITING, BlockState.READY),
    (BlockState.WRITING, None),
    (BlockState.READY, BlockState.EVICTING),
    (BlockState.READY, None),
    (BlockState.EVICTING, None),
    (BlockState.EVICTING, BlockState.READY),  # a demotion that failed gives the block back
}


class TierFull(Exception):
    """No free slot and nothing evictable (every block is pinned or in flight)."""


class InvalidTransition(RuntimeError):
    pass


@dataclass
class Entry:
    key: BlockKey
    slot: int
    state: BlockState
    pins: int = 0
    hits: int = 0


@dataclass(frozen=True)
class Reservation:
    key: BlockKey
    slot: int


class BlockTable:
    """Slots 0..capacity-1 of one tier. One lock; every method takes it."""

    def __init__(self, capacity_blocks: int, policy: EvictionPolicy, name: str = "tier") -> None:
        if capacity_blocks < 0:
            raise ValueError(f"{name}: capacity_blocks must be >= 0, got {capacity_blocks}")
        self.name = name
        self.capacity_blocks = capacity_blocks
        self._policy = policy
        self._lock = threading.Lock()
        self._entries: dict[BlockKey, Entry] = {}
        self._free = list(range(capacity_blocks - 1, -1, -1))
        self._quarantined: set[int] = set()  # slots retired by abandoned transfers

    # --- state changes ---------------------------------------------------------------------

    def _move(self, entry: Entry | None, key: BlockKey, to: BlockState | None) -> None:
        frm = entry.state if entry else None
        if (frm, to) not in _ALLOWED:
            raise InvalidTransition(f"{self.name}: block {key.hex()[:12]} cannot go {frm} -> {to}")

    def prepare_store(self, key: BlockKey) -> Reservation | None:
        """A slot for ``key`` in state WRITING; None if the key is already here (any state).

        Raises:
            TierFull: no free slot (evict first: ``choose_victims`` then ``release``).
        """
        with self._lock:
            if key in self._entries:
                return None
            if not self._free:
                raise TierFull(f"{self.name}: all {self.capacity_blocks} slots in use")
            self._move(None, key, BlockState.WRITING)
            slot = self._free.pop()
            self._entries[key] = Entry(key, slot, BlockState.WRITING)
            return Reservation(key, slot)

    def complete_store(self, key: BlockKey, ok: bool, pin: bool = False) -> None:
        """WRITING -> READY (``ok``; pinned at once if ``pin``, so no eviction can slip in
        between) or -> absent."""
        with self._lock:
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
        with self._lock:
            victims = []
            for key in self._policy.order():
                if len(victims) >= count:
                    break
                entry = self._entries.get(key)
                if entry is not None and entry.state is BlockState.READY and entry.pins == 0:
                    self._move(entry, key, BlockState.EVICTING)
                    entry.state = BlockState.EVICTING
                    victims.append(Reservation(key, entry.slot))
            return victims

    def release(self, key: BlockKey) -> None:
        """Free an EVICTING block's slot."""
        with self._lock:
            entry = self._entries.get(key)
            self._move(entry, key, None)
            if entry.state is not BlockState.EVICTING:
                raise InvalidTransition(f"{self.name}: release of a {entry.state} block")
            self._drop(entry)

    def restore(self, key: BlockKey) -> None:
        """An EVICTING block stays after all (its demotion failed)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.state is not BlockState.EVICTING:
                raise InvalidTransition(f"{self.name}: restore of a block that is not being evicted")
            self._move(entry, key, BlockState.READY)
            entry.state = BlockState.READY

    def quarantine(self, key: BlockKey) -> None:
        """Retire a WRITING block's slot for good (a transfer into it was abandoned and may
        still land): the key is free to be stored again elsewhere, the slot never reused."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.state is not BlockState.WRITING:
                raise InvalidTransition(f"{self.name}: quarantine of a block that is not being written")
            del self._entries[key]
            self._quarantined.add(entry.slot)

    @property
    def quarantined_slots(self) -> int:
        with self._lock:
            return len(self._quarantined)

    def remove(self, key: BlockKey) -> bool:
        """Drop a READY, unpinned block (e.g. it failed verification). False if it can't go now."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.state is not BlockState.READY or entry.pins:
                return False
            self._drop(entry)
            return True

    def _drop(self, entry: Entry) -> None:
        del self._entries[entry.key]
        self._policy.removed(entry.key)
        self._free.append(entry.slot)

    # --- readers ----------------------------------------------------------------------------

    def pin(self, key: BlockKey, hit: bool = True) -> int | None:
        """Pin a READY block for reading; its slot, or None (absent, being written or evicted).

        ``hit``: a request is reading it (counts a hit and an access for the eviction policy);
        False for the cache's own copying (write-down, prefetch), which must not look hot.
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.state is not BlockState.READY:
                return None
            entry.pins += 1
            if hit:
                entry.hits += 1
                self._policy.accessed(key)
            return entry.slot

    def unpin(self, key: BlockKey) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.pins == 0:
                raise InvalidTransition(f"{self.name}: unpin of a block that is not pinned")
            entry.pins -= 1

    def state(self, key: BlockKey) -> BlockState | None:
        with self._lock:
            entry = self._entries.get(key)
            return entry.state if entry else None

    def slot(self, key: BlockKey) -> int | None:
        with self._lock:
            entry = self._entries.get(key)
            return entry.slot if entry and entry.state is not BlockState.WRITING else None

    def pins(self, key: BlockKey) -> int:
        with self._lock:
            entry = self._entries.get(key)
            return entry.pins if entry else 0

    def hits(self, key: BlockKey) -> int:
        with self._lock:
            entry = self._entries.get(key)
            return entry.hits if entry else 0

    def ready_keys(self) -> list[BlockKey]:
        with self._lock:
            return [k for k, e in self._entries.items() if e.state is BlockState.READY]

    @property
    def used_blocks(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def free_blocks(self) -> int:
        with self._lock:
            return len(self._free)
