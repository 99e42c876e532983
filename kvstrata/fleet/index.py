"""Which tiers hold each block, per server of a fleet, from their KV events (pure).

Each server's events (vLLM's own and kvstrata's, :mod:`kvstrata.fleet.events`) say which of
its blocks it holds where: a map ``block hash -> tiers`` per server, a bitmask of
:class:`~kvstrata.media.Medium` per block. Blocks in the shared pool (``REMOTE``) sit in one map
for the fleet, not the publisher's: every server reaches them, whichever stored them, and
whichever sees one go says so for all.

What a request can use on a server is a prefix: vLLM's own hit and kvstrata's are both the
longest run of a prompt's blocks held from its first, so :meth:`FleetIndex.reach` stops at the
first block the server cannot reach, and gives each block before it the fastest tier holding it.

Events are taken as they come, without checking that a removal follows a store: events of one
server arrive in order, but a subscriber may miss some (a PUB socket drops past its high-water
mark), so a removal of a block not held is nothing, and a store of one already held is nothing
more. ``AllBlocksCleared`` is vLLM's: its prefix cache was reset, so the server's device tier
is emptied, its other tiers kept. A server that restarted is :meth:`~FleetIndex.reset`.

Servers are named when the index is made or added later; an event or a question about a server
it does not know raises :class:`UnknownServer`, which names the servers it knows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvstrata.fleet.events import Batch, BlockHash, Cleared, Removed, Stored
from kvstrata.media import Medium


class UnknownServer(ValueError):
    """A server id the index was not told of."""

    def __init__(self, server: str, known: Iterable[str]) -> None:
        names = ", ".join(sorted(known)) or "none"
        super().__init__(f"unknown server {server!r} (known: {names})")
        self.server = server


@dataclass(frozen=True)
class Applied:
    """What one batch changed (counts of blocks, per the events' own lists).

    Attributes:
        stored: blocks newly held on a tier (already held there: not counted).
        removed: blocks no longer held on a tier (not held there: not counted).
        cleared: device blocks dropped by ``AllBlocksCleared``.
    """

    stored: int = 0
    removed: int = 0
    cleared: int = 0


class FleetIndex:
    """Per server, block hash -> the tiers holding it; the pool's blocks, one map for all.

    Not thread-safe: one owner applies events and asks (a router's event loop).

    Args:
        servers: the fleet's server ids (more may be added with :meth:`add_server`).
    """

    def __init__(self, servers: Iterable[str] = ()) -> None:
        self._local: dict[str, dict[BlockHash, int]] = {}  # server -> hash -> mask of local media
        self._pool: set[BlockHash] = set()  # hashes held in the shared pool (every server reaches them)
        for server in servers:
            self.add_server(server)

    @property
    def servers(self) -> tuple[str, ...]:
        """The servers known, in the order they were added."""
        return tuple(self._local)

    def add_server(self, server: str) -> None:
        """Know ``server`` (holding nothing yet). Raises ValueError for an empty or known name."""
        if not isinstance(server, str) or not server:
            raise ValueError(f"a server id must be a non-empty string, got {server!r}")
        if server in self._local:
            raise ValueError(f"server {server!r} is already in the fleet index")
        self._local[server] = {}

    def remove_server(self, server: str) -> None:
        """Forget ``server`` and what it held (the pool's blocks stay: the pool outlives it)."""
        self._blocks(server)
        del self._local[server]

    def reset(self, server: str) -> None:
        """``server`` restarted: it holds nothing of its own until its events say so again."""
        self._blocks(server).clear()

    def apply(self, server: str, batch: Batch) -> Applied:
        """Take one batch of ``server``'s events, in order.

        Raises:
            UnknownServer: ``server`` is not in the index (nothing is applied).
        """
        held = self._blocks(server)
        stored = removed = cleared = 0
        for event in batch.events:
            if isinstance(event, Stored):
                stored += self._store(held, event.hashes, event.medium)
            elif isinstance(event, Removed):
                removed += self._remove(held, event.hashes, event.medium)
            elif isinstance(event, Cleared):
                cleared += self._remove(held, tuple(held), Medium.DEVICE)
        return Applied(stored, removed, cleared)

    def held(self, server: str, block_hash: BlockHash) -> tuple[Medium, ...]:
        """The tiers ``server`` reaches ``block_hash`` on, fastest first (the pool included)."""
        return Medium.from_mask(self._mask(self._blocks(server), block_hash))

    def reach(self, server: str, hashes: Sequence[BlockHash]) -> tuple[Medium, ...]:
        """The fastest tier of each block of the longest prefix of ``hashes`` that ``server``
        reaches (its own tiers and the pool), in prompt order: ``len`` is the prefix's blocks."""
        held = self._blocks(server)
        out: list[Medium] = []
        for block_hash in hashes:
            mask = self._mask(held, block_hash)
            if not mask:
                break
            out.append(Medium.fastest(mask))
        return tuple(out)

    def count(self, server: str, medium: Medium) -> int:
        """Blocks ``server`` holds on ``medium`` (``REMOTE``: the pool's, the same for all)."""
        held = self._blocks(server)
        if medium is Medium.REMOTE:
            return len(self._pool)
        return sum(1 for mask in held.values() if mask & medium.bit)

    def _blocks(self, server: str) -> dict[BlockHash, int]:
        try:
            return self._local[server]
        except (KeyError, TypeError):
            raise UnknownServer(server, self._local) from None

    def _mask(self, held: dict[BlockHash, int], block_hash: BlockHash) -> int:
        return held.get(block_hash, 0) | (Medium.REMOTE.bit if block_hash in self._pool else 0)

    def _store(self, held: dict[BlockHash, int], hashes: tuple[BlockHash, ...], medium: Medium) -> int:
        if medium is Medium.REMOTE:
            before = len(self._pool)
            self._pool.update(hashes)
            return len(self._pool) - before
        added = 0
        for block_hash in hashes:
            mask = held.get(block_hash, 0)
            if not mask & medium.bit:
                held[block_hash] = mask | medium.bit
                added += 1
        return added

    def _remove(self, held: dict[BlockHash, int], hashes: tuple[BlockHash, ...], medium: Medium) -> int:
        if medium is Medium.REMOTE:
            before = len(self._pool)
            self._pool.difference_update(hashes)
            return before - len(self._pool)
        removed = 0
        for block_hash in hashes:
            mask = held.get(block_hash, 0)
            if mask & medium.bit:
                removed += 1
                if mask == medium.bit:
                    del held[block_hash]
                else:
                    held[block_hash] = mask & ~medium.bit
        return removed
