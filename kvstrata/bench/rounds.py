"""What every benchmark shares: rounds of timed steps and their summaries.

Method. A benchmark runs one warm-up round, then ``repeats`` rounds; each round runs every
step once, and the steps that compete (ours, a baseline, another system) run back to back in
an order that rotates from round to round, so they share the machine's noise and none always
goes first. A figure is the median over rounds, with the slowest and fastest round beside it;
a ratio is the median over rounds of the ratio within each round (paired), which cancels noise
that moves both sides of a round together.
"""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

T = TypeVar("T")

GB = 1e9  # decimal, as everywhere in kvstrata


def rotated(items: Sequence[T], by: int) -> list[T]:
    """``items`` rotated left by ``by`` (mod its length): round ``r`` starts with item ``r``."""
    if not items:
        return []
    k = by % len(items)
    return [*items[k:], *items[:k]]


def check_rounds(config: object, what: str, positive: Sequence[str]) -> None:
    """A benchmark config's checks: each of ``positive`` >= 1, and ``repeats`` >= 3 (a median
    and a spread). ``what`` names the benchmark in the message.

    Raises:
        ValueError: the first field that is not.
    """
    for name in positive:
        if getattr(config, name) < 1:
            raise ValueError(f"{what}: {name} must be >= 1, got {getattr(config, name)}")
    repeats = getattr(config, "repeats")
    if repeats < 3:
        raise ValueError(f"{what}: repeats must be >= 3 (a median and a spread), got {repeats}")


@dataclass(frozen=True)
class Rate:
    """A step's rate over the timed rounds, decimal GB/s: the median, the extremes, every round."""

    gbps: float
    min_gbps: float
    max_gbps: float
    runs_gbps: tuple[float, ...]


@dataclass(frozen=True)
class Latency:
    """A step's time over the timed rounds, milliseconds: the median, the extremes, every round."""

    ms: float
    min_ms: float
    max_ms: float
    runs_ms: tuple[float, ...]


@dataclass(frozen=True)
class Environment:
    """What the figures were measured on."""

    torch: str
    torch_threads: int
    cpus: int | None
    machine: str

    @staticmethod
    def here() -> Environment:
        return Environment(torch.__version__, torch.get_num_threads(), os.cpu_count(), platform.machine())


@dataclass
class Rounds:
    """Seconds per named step, one sample per timed round (warm-up rounds are not kept)."""

    seconds: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.seconds.setdefault(name, []).append(seconds)

    def __contains__(self, name: str) -> bool:
        return name in self.seconds

    def rate(self, name: str, size_bytes: int) -> Rate:
        """One step's rate, ``size_bytes`` moved per round."""
        rates = tuple(size_bytes / s / GB for s in self.seconds[name])
        return Rate(statistics.median(rates), min(rates), max(rates), rates)

    def gbps(self, name: str, size_bytes: int) -> float:
        """The median of :meth:`rate`."""
        return self.rate(name, size_bytes).gbps

    def latency(self, name: str) -> Latency:
        values = tuple(s * 1e3 for s in self.seconds[name])
        return Latency(statistics.median(values), min(values), max(values), values)

    def ratio(self, ours: str, base: str) -> float:
        """Median over rounds of ours' rate / base's rate (same bytes: base seconds / ours)."""
        pairs = zip(self.seconds[ours], self.seconds[base], strict=True)
        return statistics.median(b / o for o, b in pairs)

    def time_ratio(self, ours: str, base: str) -> float:
        """Median over rounds of ours' time / base's time (for latencies: < 1 is faster)."""
        pairs = zip(self.seconds[ours], self.seconds[base], strict=True)
        return statistics.median(o / b for o, b in pairs)
