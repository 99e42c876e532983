"""What every benchmark shares: rounds of timed steps, their summaries, page-cache control.

Method. A benchmark runs one warm-up round, then ``repeats`` rounds; each round runs every
step once, and the steps that compete (ours, a baseline, another system) run back to back in
an order that rotates from round to round, so they share the machine's noise and none always
goes first. A figure is the median over rounds, with the slowest and fastest round beside it;
a ratio is the median over rounds of the ratio within each round (paired), which cancels noise
that moves both sides of a round together.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

T = TypeVar("T")

GB = 1e9  # decimal, as everywhere in kvstrata


class Progress(Protocol):
    """Where a benchmark reports how far it is (the CLI draws a bar; tests pass nothing)."""

    def start(self, total_steps: int) -> None: ...

    def step(self, label: str) -> None: ...


class NoProgress:
    def start(self, total_steps: int) -> None:
        pass

    def step(self, label: str) -> None:
        pass


class VerificationError(RuntimeError):
    """Bytes read back differ from the bytes written: the run's figures are worthless."""


def elapsed_s(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` takes on the wall clock."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rotated(items: Sequence[T], by: int) -> list[T]:
    """``items`` rotated left by ``by`` (mod its length): round ``r`` starts with item ``r``."""
    if not items:
        return []
    k = by % len(items)
    return [*items[k:], *items[:k]]


@dataclass
class Rounds:
    """Seconds per named step, one sample per timed round (warm-up rounds are not kept)."""

    seconds: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.seconds.setdefault(name, []).append(seconds)

    def __contains__(self, name: str) -> bool:
        return name in self.seconds

    def gbps(self, name: str, size_bytes: int) -> dict:
        """``{"gbps": median, "min_gbps", "max_gbps", "runs_gbps": [...]}`` for one step."""
        rates = [size_bytes / s / GB for s in self.seconds[name]]
        return {
            "gbps": statistics.median(rates),
            "min_gbps": min(rates),
            "max_gbps": max(rates),
            "runs_gbps": rates,
        }

    def ms(self, name: str) -> dict:
        values = [s * 1e3 for s in self.seconds[name]]
        return {"ms": statistics.median(values), "min_ms": min(values), "max_ms": max(values), "runs_ms": values}

    def ratio(self, ours: str, base: str) -> float:
        """Median over rounds of ours' rate / base's rate (same bytes: base seconds / ours)."""
        pairs = zip(self.seconds[ours], self.seconds[base], strict=True)
        return statistics.median(b / o for o, b in pairs)

    def time_ratio(self, ours: str, base: str) -> float:
        """Median over rounds of ours' time / base's time (for latencies: < 1 is faster)."""
        pairs = zip(self.seconds[ours], self.seconds[base], strict=True)
        return statistics.median(o / b for o, b in pairs)


def drop_page_cache(paths: Iterable[str | os.PathLike[str]]) -> int:
    """Write back and evict ``paths`` from the page cache, so the next read comes from the disk.

    ``POSIX_FADV_DONTNEED`` evicts clean pages only, hence the ``fsync`` first. Returns the
    number of files dropped.
    """
    count = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        count += 1
    return count
