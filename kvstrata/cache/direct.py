"""Puts and gets between the cache's tiers and a caller's own memory, with no device slot between.

A caller that keeps KV in memory of its own (SGLang's host KV pool, say) stores a block from
there and reads it back there: ``put`` writes each block, given as its bytes in pieces (a page
of the caller's buffer is often a few separate runs of bytes, K then V), straight into the tiers
below the device (every one, write-through; the first, write-back); ``get`` reads the leading
run of keys from the fastest tier holding each straight into the caller's pieces, verified. A
tier moves the pieces as they lie (:meth:`kvstrata.tiers.base.Tier.write_pieces`: vectored file
I/O on disk; on the pool, one copy through the remote tier's own staging, never registering the
caller's memory). The same three steps as the cache's other operations: the manager plans (``prepare_put``,
``prepare_get``), the worker moves, the manager settles.

The bytes are the caller's, in the caller's order; the cache's layout (its ``name``) must say
which order that is, so that blocks of another order never share a namespace. A block put here
is not on the device tier, and a get brings nothing there: the caller's memory plays its part.

Caller memory cannot be quarantined. A get whose transfer was abandoned (a tier stopped answering
with the caller's memory handed to it; the pool tier never hands it over) waits until that
transfer has ended before it returns, so nothing lands in memory the caller has reused; a warning
says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from kvstrata.cache.outcomes import Outcomes
from kvstrata.cache.results import PutResult
from kvstrata.index.keys import BlockKey
from kvstrata.manager.manager import BlockManager
from kvstrata.manager.plans import Room
from kvstrata.tiers.base import Pieces
from kvstrata.transfer.worker import TransferWorker

_log = logging.getLogger("kvstrata.cache")


class Direct:
    """A cache's puts and gets of a caller's memory (see the module docstring)."""

    def __init__(self, manager: BlockManager, worker: TransferWorker, outcomes: Outcomes,
                 carry_out: Callable[[Room], None]) -> None:
        self._manager = manager
        self._worker = worker
        self._outcomes = outcomes
        self._carry_out = carry_out
        below = manager.media[1:]
        self._to = below if manager.config.write.on_store() else below[:1]

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[Pieces]) -> PutResult:
        """Store block i of ``keys`` from ``blocks[i]`` in every tier it goes to that lacks it,
        in rounds: blocks that found no room in a round (a tier smaller than the batch, full of
        this put's own blocks on their way in) go in the next, which can make room from those.
        Per block, whether it is stored: written into a tier, or there already (False: every
        write of it failed, or no tier had room for it); and how many it wrote."""
        if len(blocks) != len(keys):
            raise ValueError(f"a put takes one block of pieces per key: {len(keys)} keys, {len(blocks)} blocks")
        if not self._to:
            raise ValueError("this cache has no tier below the device to put blocks into")
        start = time.perf_counter()
        stored, written, held = [False] * len(keys), [False] * len(keys), set()
        pending = list(range(len(keys)))
        while pending:
            plan = self._manager.prepare_put([keys[i] for i in pending], self._to)
            self._carry_out(plan.room)
            moved = self._outcomes.moved(self._worker.put(plan.placements, [blocks[i] for i in pending]))
            self._manager.complete_put(plan, moved.failures)
            self._outcomes.settled_into([p.slot for p in plan.placements], moved)
            if moved.error is not None:
                raise moved.error
            placed = {p.position for p in plan.placements}
            for placement, failure in zip(plan.placements, moved.failures):
                written[pending[placement.position]] |= failure is None
            for n in plan.present:
                stored[pending[n]] = True
                held.add(pending[n])
            pending = [pending[n] for n in sorted(plan.full - placed - plan.present)] if placed else []
        stored = [s or w for s, w in zip(stored, written)]
        new = sum(1 for i, w in enumerate(written) if w and i not in held)
        return PutResult(tuple(stored), sum(written), time.perf_counter() - start, new)

    def get(self, keys: Sequence[BlockKey], blocks: Sequence[Pieces]) -> int:
        """Read the leading run of ``keys`` held READY into ``blocks`` (block i into
        ``blocks[i]``): how many blocks, from the first, are in place and verified. A block that
        fails verification or went missing leaves its tier and ends the run (the pieces from
        there on may hold any bytes).

        Raises:
            Exception: a tier's unexpected error (after every block is settled).
        """
        if len(blocks) != len(keys):
            raise ValueError(f"a get takes one block of pieces per key: {len(keys)} keys, {len(blocks)} blocks")
        plan = self._manager.prepare_get(keys)
        moved = self._outcomes.moved(self._worker.get(plan.sources, blocks))
        for error in moved.errors:
            settled = getattr(error, "settled", None)
            if settled is not None:  # the caller's memory may still be written: wait until it cannot
                _log.warning("a get into caller memory was abandoned (%s); waiting for its transfer to end", error)
                settled.exception()
        read, drops = self._manager.complete_get(plan, moved.failures)
        self._outcomes.failed_reads(moved)
        self._carry_out(drops)
        if moved.error is not None:
            raise moved.error
        return read

