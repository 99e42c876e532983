"""This cache's view of a shared pool, kept true at each lookup: what others put there joins it,
what the pool dropped leaves it.

The pool is shared: other instances put blocks in it, and it evicts (a full segment) or loses
(a daemon gone) blocks this cache put there, telling no one. So a lookup that reaches the pool
asks it, in one call (bounded by the pool's call budget, on the pool client's worker: a hung
pool never holds the caller longer), about the matched blocks only it holds and the blocks after
the match:

* a matched block the pool no longer has leaves the view, counted (``pool_dropped``), so the
  lookup misses it rather than promise it to a load that would miss; a pool that is down says
  nothing about its blocks, so none leave then;
* the leading run of the blocks after the match that the pool holds (put by other instances)
  joins the view (READY, indexed); a full view forgets its coldest blocks for them (this
  cache's view of them only: the pool keeps them).
"""

from __future__ import annotations

from collections.abc import Callable

from kvstrata.index.keys import BlockKey
from kvstrata.index.prefix import Match
from kvstrata.manager.manager import BlockManager
from kvstrata.manager.plans import Room
from kvstrata.media import Medium
from kvstrata.metrics import CacheMetrics
from kvstrata.transfer.worker import TransferWorker


class PoolView:
    """Keeps a cache's view of its shared pool true at each lookup (see the module docstring)."""

    def __init__(self, manager: BlockManager, worker: TransferWorker, metrics: CacheMetrics,
                 carry_out: Callable[[Room], None], pool_error: Callable[[], str | None]) -> None:
        self._manager = manager
        self._worker = worker
        self._metrics = metrics
        self._carry_out = carry_out
        self._pool_error = pool_error

    def follow(self, keys: list[BlockKey], match: Match) -> bool:
        """Ask the pool about ``match``'s blocks only it holds and ``keys`` past the match;
        whether the view changed (the caller matches again)."""
        held = [key for key, medium in zip(match.keys, match.media) if medium is Medium.REMOTE]
        after = keys[match.blocks :]
        if not held and not after:
            return False
        found = self._worker.find(Medium.REMOTE, held + after)
        gone = [key for key, here in zip(held, found) if not here]
        dropped = 0
        if gone and self._pool_error() is None:
            dropped = self._manager.forget(Medium.REMOTE, gone)
            self._metrics.pool_dropped(dropped)
        return bool(dropped) | bool(after and self._discover(after, found[len(held) :]))

    def _discover(self, keys: list[BlockKey], found: list[bool]) -> int:
        """The leading run of ``keys`` the pool holds (``found``) joins the view; how many of
        them are in it now."""
        run = next((i for i, hit in enumerate(found) if not hit), len(found))
        known = self._manager.adopt(Medium.REMOTE, keys[:run])
        if known < run:  # our view of the pool is full: forget its coldest, not the pool's
            self._carry_out(self._manager.prepare_evict(Medium.REMOTE, run - known))
            known = self._manager.adopt(Medium.REMOTE, keys[:run])
        return known
