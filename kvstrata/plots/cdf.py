"""TTFT and TPOT distributions per architecture, for ``kvstrata simulate --plot`` and ``--html``.

Each figure is an empirical CDF, one curve per architecture, in the unit ``simulate``'s table
prints (TTFT in seconds, TPOT in milliseconds), with the SLO the ranking applies drawn on it.
Architectures often produce the very same distribution (when the working set fits in HBM, no
lower tier is ever read), so each curve has its own line style and markers, its markers set off
from those of an identical curve, and its legend entry says which curve it coincides with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from kvstrata.plots import coincident
from kvstrata.sim.outcome import SimOutcome
from kvstrata.sim.results import TPOT_P99_SLO_S, TTFT_P90_SLO_S

LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
MARKS = 8  # markers per curve
PERCENTILE_MARKS = (50, 90, 99)  # drawn when no SLO is given
LOG_SPREAD = 20  # a log axis when the largest value shown is this many times the smallest


@dataclass(frozen=True)
class Latency:
    """A per-request latency the simulator records, and the unit it is shown in.

    Attributes:
        name: its short name (``TTFT``).
        long_name: what it measures.
        unit: the unit of the axis, the one ``simulate``'s table uses.
        per_second: units per second (1e3 for ms).
        record_attr: the :class:`~kvstrata.sim.outcome.RequestRecord` property holding it, in seconds.
    """

    name: str
    long_name: str
    unit: str
    per_second: float
    record_attr: str


TTFT = Latency("TTFT", "time to first token", "s", 1.0, "ttft_s")
TPOT = Latency("TPOT", "time per output token", "ms", 1e3, "tpot_s")


@dataclass(frozen=True)
class Slo:
    """The latency target: the ``percentile``-th percentile at most ``limit_s``."""

    percentile: float
    limit_s: float


SIM_SLOS = {TTFT: Slo(90, TTFT_P90_SLO_S), TPOT: Slo(99, TPOT_P99_SLO_S)}  # what the ranking applies


def cdf_figure(samples_s: Mapping[str, Sequence[float]], latency: Latency, subject: str, slo: Slo | None) -> Figure:
    """The CDF of each named sample of ``latency`` (seconds), titled with ``subject``.

    With an ``slo``, a vertical line at its limit and a horizontal one at its percentile (a curve
    meets it when it crosses the horizontal line left of the vertical one); without, guides at
    the p50, p90 and p99 levels.
    """
    data = {name: np.sort(np.asarray(v, dtype=float)) * latency.per_second for name, v in samples_s.items()}
    same = coincident(data)
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for i, (name, xs) in enumerate(data.items()):
        if not len(xs):
            ax.plot([], [], LINE_STYLES[i % len(LINE_STYLES)], color=f"C{i % 10}", label=f"{name} (no samples)")
            continue
        ys = np.arange(1, len(xs) + 1) / len(xs)
        step = max(1, len(xs) // MARKS)
        label = name + (f" (same curve as {same[name]})" if name in same else "")
        ax.plot(xs, ys, LINE_STYLES[i % len(LINE_STYLES)], color=f"C{i % 10}", marker=MARKERS[i % len(MARKERS)],
                markevery=(i * step // len(data) % step, step), markersize=5, drawstyle="steps-post", label=label)
    values = np.concatenate([xs for xs in data.values() if len(xs)] or [np.zeros(0)])
    span = [*values, slo.limit_s * latency.per_second] if slo is not None and len(values) else values
    if len(values) and values.min() > 0 and max(span) / values.min() >= LOG_SPREAD:
        ax.set_xscale("log")  # latencies over orders of magnitude (queueing), or far below the SLO
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 0.1, 1, 10 rather than 10^-1
    if slo is not None:
        limit = slo.limit_s * latency.per_second
        ax.axvline(limit, color="red", linestyle="--", linewidth=1,
                   label=f"SLO: {latency.name} p{slo.percentile:g} <= {limit:g} {latency.unit}")
        ax.axhline(slo.percentile / 100, color="red", linestyle=":", linewidth=1)
    else:
        for q in PERCENTILE_MARKS:
            ax.axhline(q / 100, color="grey", linestyle=":", linewidth=0.8)
            ax.annotate(f"p{q}", (1, q / 100), xycoords=("axes fraction", "data"), fontsize=7, color="grey",
                        ha="right", va="bottom")
    if not len(values):
        ax.text(0.5, 0.5, "no samples", transform=ax.transAxes, ha="center", va="center", color="grey")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(f"{latency.name}, {latency.long_name} ({latency.unit})")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{latency.name} CDF per architecture\n{subject}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def simulation_figures(outcomes: Sequence[SimOutcome], subject: str) -> dict[str, Figure]:
    """``{"ttft_cdf": ..., "tpot_cdf": ...}`` for a simulation's outcomes, with the SLOs it ranks by."""
    figures = {}
    for latency in (TTFT, TPOT):
        samples = {
            o.label: [v for r in o.records if (v := getattr(r, latency.record_attr)) is not None]
            for o in outcomes
        }
        figures[f"{latency.name.lower()}_cdf"] = cdf_figure(samples, latency, subject, SIM_SLOS[latency])
    return figures
