"""The worker's probe reads: one block of a tier the scheduler stopped loading from, now and then.

A tier whose loads the scheduler declines (slow, or failing) is judged again by a probe
(:class:`~kvstrata.policies.payoff.LoadOrRecompute`): the step's metadata names the tiers due
(``probes``), and each worker reads one block only that tier holds
(``BlockManager.held_only_in``) into memory of its own, verified as a load would, on a thread
of its own, never on the step. The time goes back to the scheduler with a later step's metadata
(:class:`~kvstrata.integrations.vllm.feedback.ProbeTiming`); nothing in the caches changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from kvstrata.integrations.vllm.feedback import ProbeTiming, StepClock
from kvstrata.integrations.vllm.reporting import WorkerReport
from kvstrata.media import Medium
from kvstrata.transfer.placement import io_thread_started

if TYPE_CHECKING:
    from kvstrata.cache import TieredCache


class Probes:
    """A worker's probe reads, one at a time on the probe thread.

    Args:
        caches: the worker's caches, every group's (none until vLLM's KV caches are registered).
        report: the worker's counters (a probe that read counts its time).
        clock: the step's measurements (each probe's timing goes back to the scheduler).
    """

    def __init__(self, caches: Callable[[], tuple[TieredCache, ...]], report: WorkerReport, clock: StepClock) -> None:
        self._caches = caches
        self._report = report
        self._clock = clock
        self._prober = ThreadPoolExecutor(1, thread_name_prefix="kvstrata-probe", initializer=io_thread_started)
        self._probing: set[Medium] = set()  # tiers whose probe read is in flight

    def probe(self, media: tuple[Medium, ...]) -> None:
        """Read one block of each tier in ``media`` (the scheduler's due probes) off the step, on
        the probe thread; the time goes back with a later step's metadata. A tier whose last
        probe is still reading is not read again."""
        for medium in media:
            if medium not in self._probing and any(medium in c.media for c in self._caches()):
                self._probing.add(medium)
                self._prober.submit(self._probe_read, medium)

    def _probe_read(self, medium: Medium) -> None:
        """Read a block only ``medium`` holds (so the read is from it) into memory of its own,
        verified, as a load would; nothing else changes. No such block: nothing read."""
        start = time.perf_counter()
        timing = ProbeTiming(medium, 0.0, False, False)
        try:
            for cache in self._caches():
                key = cache.manager.held_only_in(medium) if medium in cache.media else None
                if key is not None:
                    start = time.perf_counter()
                    read = cache.get_into([key], [[torch.empty(cache.layout.block_bytes, dtype=torch.uint8)]])
                    timing = ProbeTiming(medium, time.perf_counter() - start, read == 1)
                    break
        except Exception:  # noqa: BLE001 - a failed read is the probe's answer: the tier still fails
            timing = ProbeTiming(medium, time.perf_counter() - start, False)
        finally:
            self._probing.discard(medium)
        self._clock.probed(timing)
        if timing.read:
            self._report.stats.probed(medium, timing.seconds)
            self._report.changed()
            self._report.write()

    def close(self) -> None:
        """Wait for a probe read in flight (it reads from the caches) and stop the thread."""
        self._prober.shutdown(wait=True)
