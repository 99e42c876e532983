"""What every measurement in rounds shares (the benchmarks, ``kvstrata lab``, the serving
simulator's replay of ``bench serve``): rounds of timed steps and their summaries.

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


from kvstrata.report import OMIT, key

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
class Summary:
    """A step's figure over the timed rounds, in ``unit``: the median, the extremes, every round.

    ``unit`` is ``"gbps"`` (a rate, decimal GB/s) or ``"ms"`` (a time); the JSON keys carry it
    (``gbps``, ``min_gbps``, ``max_gbps``, ``runs_gbps``).
    """

    median: float = field(metadata=key("{unit}"))
    min: float = field(metadata=key("min_{unit}"))
    max: float = field(metadata=key("max_{unit}"))
    runs: tuple[float, ...] = field(metadata=key("runs_{unit}"))
    unit: str = field(metadata=OMIT)

    @staticmethod
    def of(values: tuple[float, ...], unit: str) -> Summary:
        return Summary(statistics.median(values), min(values), max(values), values, unit)


@dataclass(frozen=True)
class Compared:
    """Ours beside a baseline timed in the same rounds, in ``unit``: both medians and the
    paired ratio (median over rounds of ours / baseline in that unit; for times < 1 is faster),
    with the lowest and highest round's ratio beside it (the spread the noise left).

    JSON keys ``gbps``, ``baseline_gbps``, ``ratio``, ``ratio_min``, ``ratio_max`` (``ms``,
    ``baseline_ms`` for times), which a report flattens under its own names
    (:func:`kvstrata.report.flatten`).
    """

    ours: float = field(metadata=key("{unit}"))
    baseline: float = field(metadata=key("baseline_{unit}"))
    ratio: float
    unit: str = field(metadata=OMIT)
    ratio_min: float = float("nan")
    ratio_max: float = float("nan")


@dataclass(frozen=True)
class Spread:
    """A paired ratio with its spread: the median over rounds of the ratio within each round,
    the lowest and highest round's, and how many rounds."""

    median: float
    min: float
    max: float
    rounds: int

    @staticmethod
    def of(values: Sequence[float]) -> Spread:
        return Spread(statistics.median(values), min(values), max(values), len(values))


@dataclass(frozen=True)
class Skipped:
    """A part of a benchmark's report that did not run, and why (JSON: ``{"skipped": why}``)."""

    skipped: str


@dataclass(frozen=True)
class Environment:
    """What the figures were measured on."""

    torch: str
    torch_threads: int
    cpus: int | None
    machine: str

    @staticmethod
    def here() -> Environment:
        import torch  # here, not at the top: the serving simulator reads rounds and imports no torch

        return Environment(torch.__version__, torch.get_num_threads(), os.cpu_count(), platform.machine())


@dataclass
class Rounds:
    """Seconds per named step, one sample per timed round (warm-up rounds are not kept)."""

    seconds: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.seconds.setdefault(name, []).append(seconds)

    def __contains__(self, name: str) -> bool:
        return name in self.seconds

    def rate(self, name: str, size_bytes: int) -> Summary:
        """One step's rate, ``size_bytes`` moved per round."""
        return Summary.of(tuple(size_bytes / s / GB for s in self.seconds[name]), "gbps")

    def gbps(self, name: str, size_bytes: int) -> float:
        """The median of :meth:`rate`."""
        return self.rate(name, size_bytes).median

    def latency(self, name: str) -> Summary:
        return Summary.of(tuple(s * 1e3 for s in self.seconds[name]), "ms")

    def ratios(self, ours: str, base: str) -> tuple[float, ...]:
        """Per round, ours' rate / base's rate (same bytes: base seconds / ours)."""
        pairs = zip(self.seconds[ours], self.seconds[base], strict=True)
        return tuple(b / o for o, b in pairs)

    def time_ratios(self, ours: str, base: str) -> tuple[float, ...]:
        """Per round, ours' time / base's time."""
        pairs = zip(self.seconds[ours], self.seconds[base], strict=True)
        return tuple(o / b for o, b in pairs)

    def ratio(self, ours: str, base: str) -> float:
        """Median over rounds of ours' rate / base's rate."""
        return statistics.median(self.ratios(ours, base))

    def time_ratio(self, ours: str, base: str) -> float:
        """Median over rounds of ours' time / base's time (for latencies: < 1 is faster)."""
        return statistics.median(self.time_ratios(ours, base))

    def time_ratio_spread(self, ours: str, base: str) -> Spread:
        """:meth:`time_ratio` with the lowest and highest round's ratio beside it."""
        pairs = zip(self.seconds[ours], self.seconds[base], strict=True)
        return Spread.of([o / b for o, b in pairs])

    def rate_vs(self, ours: str, base: str, size_bytes: int) -> Compared:
        """Ours' rate beside base's, ``size_bytes`` moved per round by each."""
        r = self.ratios(ours, base)
        return Compared(self.gbps(ours, size_bytes), self.gbps(base, size_bytes), statistics.median(r), "gbps",
                        min(r), max(r))

    def time_vs(self, ours: str, base: str) -> Compared:
        """Ours' time beside base's, milliseconds."""
        r = self.time_ratios(ours, base)
        return Compared(self.latency(ours).median, self.latency(base).median, statistics.median(r), "ms",
                        min(r), max(r))
