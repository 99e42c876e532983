"""What one server's kvstrata stores and drops, per tier, gathered into KV event batches (pure).

kvstrata names its blocks by its own keys (:mod:`kvstrata.index.keys`); a router matches vLLM's
block hashes (:mod:`kvstrata.fleet.events`). The scheduler knows both when it sends a block to be
saved (``request.block_hashes`` beside the keys it stores under); a tier that later drops the
block knows only its key. So the recorder keeps, for every block some tier holds, its key's
vLLM hash (an alias), learnt at :meth:`~EventRecorder.stored`, used at
:meth:`~EventRecorder.removed` and forgotten once no tier holds the block: its size follows
what the tiers hold. A drop of a key it never learnt (stored before the recorder started, or by
another server into the pool) has no hash to publish: it is counted (``unknown``) and skipped.

Events gather until :meth:`~EventRecorder.take`, one batch per publish (vLLM publishes once per
engine step); consecutive events of one kind and tier are merged into one, as vLLM merges a
step's stores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.fleet.events import Batch, BlockHash, KVEvent, Removed, Stored
from kvstrata.index.keys import BlockKey
from kvstrata.media import Medium


@dataclass
class _Held:
    block_hash: BlockHash
    mask: int = 0  # the tiers holding it (Medium.bit)


@dataclass
class EventRecorder:
    """Gathers one server's stores and drops as events, keyed by vLLM's block hashes.

    Not thread-safe: one owner (the thread that learns of the tiers' changes).

    Attributes:
        unknown: drops skipped because their key's hash was never learnt.
    """

    unknown: int = 0
    _held: dict[BlockKey, _Held] = field(default_factory=dict)
    _events: list[KVEvent] = field(default_factory=list)

    def stored(self, medium: Medium, keys: list[BlockKey], hashes: list[BlockHash]) -> None:
        """``keys`` (whose vLLM hashes are ``hashes``, pairwise) are now held on ``medium``."""
        if len(keys) != len(hashes):
            raise ValueError(f"{len(keys)} keys for {len(hashes)} block hashes")
        new = []
        for key, block_hash in zip(keys, hashes):
            held = self._held.setdefault(key, _Held(block_hash))
            if held.block_hash != block_hash:
                raise ValueError(f"block key {key.hex()} stored as two vLLM hashes: {held.block_hash!r}, "
                                 f"{block_hash!r}")
            if not held.mask & medium.bit:
                held.mask |= medium.bit
                new.append(block_hash)
        if new:
            self._append(Stored(tuple(new), medium))

    def removed(self, medium: Medium, keys: list[BlockKey]) -> None:
        """``keys`` are no longer held on ``medium``."""
        gone = []
        for key in keys:
            held = self._held.get(key)
            if held is None:
                self.unknown += 1
                continue
            if held.mask & medium.bit:
                held.mask &= ~medium.bit
                gone.append(held.block_hash)
            if not held.mask:
                del self._held[key]
        if gone:
            self._append(Removed(tuple(gone), medium))

    def held(self) -> int:
        """Blocks some tier holds (the aliases kept)."""
        return len(self._held)

    def take(self, ts: float) -> Batch | None:
        """The events gathered since the last take, as one batch made at ``ts`` (None: none)."""
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
