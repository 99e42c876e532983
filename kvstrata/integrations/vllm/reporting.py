"""What the worker reports, and when: its counters and the connector's CPU in this process.

The counters (:class:`~kvstrata.integrations.vllm.stats.WorkerStats`) go two ways: to the stats
file (``stats_path``; each TP rank its own, rank 0's is ``stats_path``), rewritten off the step
once something changed, and to vLLM's connector stats
(:class:`~kvstrata.integrations.vllm.prom.WorkerReporter`), read only after a step that loaded,
saved or saw a store end. The CPU is the connector's hooks' on vLLM's step thread
(:meth:`WorkerReport.hook`) plus its own threads' (read from ``/proc``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvstrata.integrations.vllm.feedback import StepClock
from kvstrata.integrations.vllm.hooktimer import HookTimer
from kvstrata.integrations.vllm.prom import KVStrataStats, WorkerReporter
from kvstrata.integrations.vllm.stats import GroupStats, StatsFile, WorkerStats
from kvstrata.transfer.placement import io_threads_cpu_s

if TYPE_CHECKING:
    import torch

    from kvstrata.cache import TieredCache
    from kvstrata.integrations.vllm.paged import OpaqueGroup, SlicedGroup


class WorkerReport:
    """The worker's counters, where they are written, and the CPU it used.

    Args:
        stats_path: the stats file (None: none); a TP rank above 0 writes beside it.
        clock: the step's measurements (a hook that saves charges its CPU to the stores).
    """

    def __init__(self, stats_path: Path | None, clock: StepClock) -> None:
        self.stats = WorkerStats()
        self._stats_path = stats_path
        self._stats_file: StatsFile | None = None
        self._reporter = WorkerReporter(0)  # its TP rank, once the caches are registered
        self._clock = clock
        self._changed = True  # anything to report since the last report (a load, a save, a store done)
        self._hooks_cpu_s = 0.0  # CPU the connector's hooks used on vLLM's step thread
        self._threads_cpu = (0.0, -1.0)  # the connector's own threads' CPU seconds, and when read
        self._hook = HookTimer(lambda cpu_s, wall_s: self.hooked(cpu_s, wall_s, saving=False))
        self._saving_hook = HookTimer(lambda cpu_s, wall_s: self.hooked(cpu_s, wall_s, saving=True))

    def describe(self, groups: list[OpaqueGroup | SlicedGroup], caches: tuple[TieredCache, ...],
                 paged: torch.Tensor, tp_rank: int, tp_size: int) -> None:
        """The stats' account of the caches just opened (``paged``: one layer of vLLM's KV)."""
        errors = [c.remote_error for c in caches if c.remote_error is not None]
        self.stats.remote_error = errors[0] if errors else None
        self.stats.block_bytes = sum(g.layout.block_bytes for g in groups)  # this rank's share of a block
        self.stats.vllm_block_shape = list(paged.shape[1:])
        self.stats.groups = [GroupStats(g.spec.namespace, g.spec.kind.value, g.spec.group.span, g.spec.group.num_layers,
                                        g.layout.block_bytes) for g in groups]
        self.stats.tp = [tp_rank, tp_size]
        self._reporter, self.stats.writes = WorkerReporter(tp_rank), all(g.writes for g in groups)

    def open(self, tp_rank: int, caches: Callable[[], tuple[TieredCache, ...]]) -> None:
        """Start the stats file (if any) and write it once: the caches are open."""
        if tp_rank > 0 and self._stats_path is not None:  # each rank its own file: rank 0's is stats_path
            path = self._stats_path
            self._stats_path = path.with_name(f"{path.stem}.rank{tp_rank}{path.suffix}")
        if self._stats_path is not None:
            self._stats_file = StatsFile(self._stats_path, self.stats, caches)
            self._stats_file.write_now()

    def changed(self) -> None:
        """Something to report: the next ``connector_stats`` reads the counters and caches."""
        self._changed = True

    def write(self, now: bool = False) -> None:
        """Rewrite the stats file: ``now`` on this thread, else soon on the file's own."""
        if self._stats_file is not None:
            if now:
                self._stats_file.write_now()
            else:
                self._stats_file.poke()

    def connector_stats(self, caches: Callable[[], tuple[TieredCache, ...]]) -> KVStrataStats | None:
        """What the counters and caches say changed since the last call (every step; None:
        nothing). Only a step after a load, a save or a store's end looks at them (``caches``
        asked for then): the rest (a decode step) change nothing but the CPU counter, which the
        next report carries."""
        if not self._changed:
            return None
        self._changed = False  # before reading: a store ending meanwhile marks it again
        return self._reporter.report(self.stats, caches(), self.cpu_s())

    def hook(self, saving: bool = False) -> HookTimer:
        """Around a hook on vLLM's step thread: its CPU is the connector's (``saving``: a store's
        cost too), its time not the forward's."""
        return self._saving_hook if saving else self._hook

    def hooked(self, cpu_s: float, wall_s: float, saving: bool) -> None:
        """A hook ended, having used ``cpu_s`` of its thread's CPU over ``wall_s``."""
        self._hooks_cpu_s += cpu_s
        if saving:
            self._clock.save_cpu(cpu_s)
        self._clock.hooked(wall_s)

    def cpu_s(self) -> float:
        """CPU seconds the connector used in this worker: its hooks, and its threads (read from
        ``/proc`` at most twice a second)."""
        threads, at = self._threads_cpu
        now = time.monotonic()
        if now - at >= 0.5:
            threads = io_threads_cpu_s()
            self._threads_cpu = (threads, now)
        return self._hooks_cpu_s + threads

    def close(self) -> None:
        """Stop the stats file's thread and write it a last time, on this thread."""
        if self._stats_file is not None:
            self._stats_file.close()
        self.write(now=True)

