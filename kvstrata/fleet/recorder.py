"""What one server's kvstrata stores and drops, per tier, gathered into KV event batches (pure).

kvstrata names its blocks by its own keys (:mod:`kvstrata.index.keys`); a router matches vLLM's
block hashes (:mod:`kvstrata.fleet.events`). The two meet in the worker that stores a block: the
scheduler sends vLLM's hashes of the blocks it saves beside their tokens, and the worker keys
those tokens (:meth:`~EventRecorder.learn`). What the tiers then hold is the block manager's to
know: the recorder listens to its index (:meth:`kvstrata.manager.manager.BlockManager.listen`,
:meth:`~EventRecorder.changed`), which tells it of every block that comes to be READY on a tier
or stops being, whatever moved it (a store, a write-down, an eviction, a dropped corrupt copy).

So the recorder keeps, for every key some tier holds, the media holding it (the index's view)
and its vLLM hash where learnt. A key learnt that no tier holds (its store on its way, or a
block evicted whose demotion is on its way: the index drops a victim before the tier below
has it) keeps its hash among at most ``pending_limit`` such aliases, oldest forgotten first (a
store dropped never comes). A change to a key whose hash was never learnt (a block recovered from disk at a
start, one another server put in the pool) has no hash to publish: it is counted
(``unknown``) and skipped, and published once a save names it (:meth:`~EventRecorder.learn`
of a held key publishes where it is held). No event names a hash the recorder was not given.

Events gather until :meth:`~EventRecorder.take`, one batch per publish (vLLM publishes once per
engine step); consecutive events of one kind and tier are merged into one, as vLLM merges a
step's stores. Thread-safe (one lock): the caches' threads tell it of changes as they make them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstrata.fleet.events import Batch, BlockHash, KVEvent, Removed, Stored
from kvstrata.index.keys import BlockKey
from kvstrata.media import Medium

PENDING_ALIASES = 1 << 16  # keys learnt but not yet held, at most (stores on their way: a few steps' saves)


@dataclass
class _Held:
    block_hash: BlockHash | None  # None: never learnt (its changes are not published)
    mask: int = 0  # the tiers holding it (Medium.bit)


@dataclass
class EventRecorder:
    """Gathers one server's stores and drops as events, keyed by vLLM's block hashes.

    Attributes:
        pending_limit: keys learnt and not yet held, kept at most.
        unknown: changes skipped because their key's hash was never learnt.
        conflicts: keys learnt again with another hash (the first is kept: the tokens are the
            same, vLLM's hash differs by a LoRA or a cache salt kvstrata's key does not carry).
    """

    pending_limit: int = PENDING_ALIASES
    unknown: int = 0
    conflicts: int = 0
    _held: dict[BlockKey, _Held] = field(default_factory=dict)
    _pending: OrderedDict[BlockKey, BlockHash] = field(default_factory=OrderedDict)
    _events: list[KVEvent] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.pending_limit < 0:
            raise ValueError(f"pending_limit must be >= 0, got {self.pending_limit}")

    def learn(self, keys: Sequence[BlockKey], hashes: Sequence[BlockHash]) -> None:
        """``keys`` are the blocks vLLM hashes as ``hashes`` (pairwise); a key held already is
        published now on every tier holding it."""
        if len(keys) != len(hashes):
            raise ValueError(f"{len(keys)} keys for {len(hashes)} block hashes")
        with self._lock:
            for key, block_hash in zip(keys, hashes):
                held = self._held.get(key)
                if held is None:
                    if self._pending.setdefault(key, block_hash) != block_hash:
                        self.conflicts += 1
                    self._pending.move_to_end(key)
                elif held.block_hash is None:
                    held.block_hash = block_hash
                    for medium in Medium.from_mask(held.mask):
                        self._append(Stored((block_hash,), medium))
                elif held.block_hash != block_hash:
                    self.conflicts += 1
            while len(self._pending) > self.pending_limit:
                self._pending.popitem(last=False)

    def changed(self, medium: Medium, keys: Sequence[BlockKey], held: bool) -> None:
        """The index's change (:class:`~kvstrata.index.prefix.IndexListener`)."""
        if held:
            self.stored(medium, keys)
        else:
            self.removed(medium, keys)

    def stored(self, medium: Medium, keys: Sequence[BlockKey], hashes: Sequence[BlockHash] | None = None) -> None:
        """``keys`` are now held on ``medium`` (``hashes``: learn them first)."""
        if hashes is not None:
            self.learn(keys, hashes)
        new = []
        with self._lock:
            for key in keys:
                held = self._held.get(key)
                if held is None:
                    held = self._held[key] = _Held(self._pending.pop(key, None))
                if held.mask & medium.bit:
                    continue
                held.mask |= medium.bit
                if held.block_hash is None:
                    self.unknown += 1
                else:
                    new.append(held.block_hash)
            if new:
                self._append(Stored(tuple(new), medium))

    def removed(self, medium: Medium, keys: Sequence[BlockKey]) -> None:
        """``keys`` are no longer held on ``medium``."""
        gone = []
        with self._lock:
            for key in keys:
                held = self._held.get(key)
                if held is None or not held.mask & medium.bit:
                    continue
                held.mask &= ~medium.bit
                if held.block_hash is None:
                    self.unknown += 1
                else:
                    gone.append(held.block_hash)
                if not held.mask:  # its demotion may be on its way (an evicted block leaves first)
                    del self._held[key]
                    if held.block_hash is not None:
                        self._pending[key] = held.block_hash
            while len(self._pending) > self.pending_limit:
                self._pending.popitem(last=False)
            if gone:
                self._append(Removed(tuple(gone), medium))

    def held(self) -> int:
        """Keys some tier holds (learnt or not)."""
        with self._lock:
            return len(self._held)

    def pending(self) -> int:
        """Keys learnt that no tier holds yet."""
        with self._lock:
            return len(self._pending)

    def take(self, ts: float) -> Batch | None:
        """The events gathered since the last take, as one batch made at ``ts`` (None: none)."""
        with self._lock:
            if not self._events:
                return None
            events, self._events = tuple(self._events), []
        return Batch(ts, events)

    def _append(self, event: Stored | Removed) -> None:
        last = self._events[-1] if self._events else None
        if type(last) is type(event) and last.medium is event.medium:
            self._events[-1] = type(event)(last.hashes + event.hashes, event.medium)
        else:
            self._events.append(event)
