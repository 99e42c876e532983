"""What the cache does with the worker's reports, beside completing plans: counting what moved
and what failed, freeing slots again once a stray transfer has ended, saying what went wrong."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvstrata.manager.manager import BlockManager
from kvstrata.manager.plans import Failure, Leg, Slot
from kvstrata.media import Medium
from kvstrata.metrics import CacheMetrics
from kvstrata.transfer.worker import Moved, TransferResult

log = logging.getLogger("kvstrata.cache")


class Outcomes:
    def __init__(self, manager: BlockManager, metrics: CacheMetrics) -> None:
        self._manager = manager
        self._metrics = metrics

    def moved(self, moved: Moved, into: list[TransferResult] | None = None) -> Moved:
        """Count the bytes ``moved`` moved (and keep its transfers ``into`` a list)."""
        for result in moved.transfers:
            self._metrics.transfer(result)
        if into is not None:
            into.extend(moved.transfers)
        return moved

    def settled(self, legs: Sequence[Leg | None], moved: Moved) -> None:
        """After the plan that ``legs`` belong to is completed (its slots settled): count each
        failed leg, warn where a medium ran out of space, and free the destinations an
        abandoned transfer retired once that transfer has ended."""
        self.settled_into([None if leg is None else leg.dst for leg in legs], moved)

    def failed_reads(self, moved: Moved) -> None:
        """Count the failed reads of a get into a caller's memory (which counts as the device)."""
        for failure in moved.failures:
            if failure is not None:
                self._metrics.failed(Medium.DEVICE, failure)

    def settled_into(self, destinations: Sequence[Slot | None], moved: Moved) -> None:
        """``settled`` for transfers named by their destination slots (None: no transfer)."""
        for dst, failure, error in zip(destinations, moved.failures, moved.errors, strict=True):
            if dst is None or failure is None:
                continue
            self._metrics.failed(dst.medium, failure)
            if failure is Failure.NO_SPACE:
                held = self._manager.table(dst.medium).capacity_blocks
                log.warning("the %s tier ran out of space (%s): it holds %d blocks now, making room as it goes",
                            dst.medium.label, error, held)
            settled = getattr(error, "settled", None)
            if failure is Failure.ABANDONED and settled is not None:
                settled.add_done_callback(lambda _, slot=dst: self._manager.release_retired(slot))
