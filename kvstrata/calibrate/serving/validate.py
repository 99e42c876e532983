"""``kvstrata validate --serve``: the serving simulator beside what ``bench serve`` measured
(pure: built from the bench's JSON report and a calibrated profile; the CLI reads the files).

For each configuration the bench measured (vLLM alone; vLLM with kvstrata, its hits from host
DRAM and the device tier; two servers on one pool; the restarted server, its hits from disk;
the decode server of P/D, its hits from the pool), the same figures from the simulation of the
same run (:mod:`kvstrata.calibrate.serving.sim`): TTFT p50/p90/p99, TPOT p50/p90, throughput, and
the hit rate of vLLM's own prefix cache and of each kvstrata tier.

Goals (the issue's): hit rates within 2 percentage points; TTFT and TPOT p50 within 15% and p90
within 25%; the configurations ranked by TTFT p90 in the same order. TTFT p99, throughput and
kvstrata's own time per load (where the time model's loads stand) are shown without a goal.

Several runs of one workload (the same arrival rate) also say how far the host lets any
simulation go: a figure whose runs differ among themselves by more than its goal's band
(``max / min > (1 + goal) / (1 - goal)``: 1.35 for a p50, 1.67 for a p90; for a hit rate, more
than twice its points apart) has no single value within the goal of every run
(:func:`run_spreads`). What the simulation misses there, a deterministic model cannot meet.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvstrata.calibrate.serving.workload import ServeWorkload, WorkloadKind, workload_of
from kvstrata.calibrate.serving.measured import Measured, percentile
from kvstrata.media import Medium
from kvstrata.plan.host import HostCalibration
from kvstrata.calibrate.serving.sim import ServeSetup, SimulatedServe
from kvstrata.sim.serving.engine import EngineLimits
from kvstrata.sim.serving.timing import ServingTimes
from kvstrata.sim.trace import Request

HIT_GOAL_POINTS = 0.02
TIME_GOALS = {"ttft_p50": 0.15, "ttft_p90": 0.25, "tpot_p50": 0.15, "tpot_p90": 0.25}
VLLM = "vllm"  # the hit rate of vLLM's own prefix cache, beside kvstrata's tiers
# the configurations compared: (name in the simulation, path in the bench's JSON, label)
CONFIGURATIONS = (
    ("baseline", ("baseline",), "vLLM alone"),
    ("kvstrata", ("kvstrata",), "vLLM + kvstrata"),
    ("shared_pool", ("shared_pool", "together"), "two servers, one pool"),
    ("restart", ("restart", "replay"), "restarted (disk)"),
    ("prefill_decode.decode", ("prefill_decode", "decode"), "P/D: decode"),
)


REQUIRED = ("baseline", "kvstrata")  # every report has them; the pool's parts may not have run


class BadReport(ValueError):
    """A file that is not a ``bench serve --json`` report (the message says what is missing)."""


@dataclass(frozen=True)
class Figures:
    """One configuration's figures (seconds; rates as fractions of prompt tokens)."""

    requests: int
    ttft_s: tuple[float, ...]
    tpot_s: tuple[float, ...]
    requests_per_s: float
    hit_rate: dict[str, float]  # vllm and each kvstrata tier by its label
    load_s: float | None = None  # kvstrata's own time per load (None: no loads)

    def value(self, figure: str) -> float:
        of, q = figure.split("_p")
        xs = self.ttft_s if of == "ttft" else self.tpot_s
        return percentile(list(xs), float(q))


@dataclass(frozen=True)
class Row:
    """One figure of one configuration: measured, simulated, the error and its goal."""

    configuration: str
    figure: str
    measured: float
    simulated: float
    goal: float | None  # relative bound, or hit-rate points; None: shown only
    points: bool = False  # the goal is in percentage points (hit rates), not relative

    @property
    def error(self) -> float:
        if self.points:
            return self.simulated - self.measured
        return self.simulated / self.measured - 1 if self.measured > 0 else math.nan

    @property
    def met(self) -> bool | None:
        if self.goal is None:
            return None
        return abs(self.error) <= self.goal + 1e-12


@dataclass(frozen=True)
class ServeValidation:
    """The comparison: rows, and the TTFT p90 ranking measured and simulated."""

    rows: tuple[Row, ...]
    labels: dict[str, str]
    ranking_measured: tuple[str, ...]
    ranking_simulated: tuple[str, ...]
    measured: dict[str, Figures]
    simulated: dict[str, Figures]

    @property
    def ranking_same(self) -> bool:
        return self.ranking_measured == self.ranking_simulated

    @property
    def misses(self) -> tuple[Row, ...]:
        return tuple(r for r in self.rows if r.met is False)


def _at(doc: Mapping[str, Any], path: Sequence[str]) -> Mapping[str, Any] | None:
    node: Any = doc
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node if isinstance(node, Mapping) and "requests" in node else None


def measured_figures(doc: Mapping[str, Any]) -> dict[str, Figures]:
    """Each configuration's figures from a ``bench serve --json`` report (those that ran)."""
    if not isinstance(doc, Mapping) or "baseline" not in doc or "config" not in doc:
        raise BadReport("not a bench serve --json report: no 'config' or 'baseline'")
    out = {}
    for name, path, _ in CONFIGURATIONS:
        m = _at(doc, path)
        if m is None:
            if name in REQUIRED:
                raise BadReport(f"bench serve report: {'.'.join(path)} has no requests")
            continue  # a part that did not run (no pool)
        try:
            hits = {VLLM: m["vllm_prefix_hit_rate"] or 0.0} | {tier: h["rate"] for tier, h in m["hits"].items()}
            records = m["requests"]
            out[name] = Figures(len(records), tuple(r["ttft_s"] for r in records),
                                tuple(r["tpot_s"] for r in records if r["tpot_s"] is not None),
                                m["requests_per_s"], hits, m.get("load_seconds_per_load"))
        except (KeyError, TypeError) as exc:
            raise BadReport(f"bench serve report: {'.'.join(path)} lacks {exc}") from None
    return out


def simulated_figures(sim: SimulatedServe) -> dict[str, Figures]:
    return {name: _figures(sim.configurations[name]) for name, _, _ in CONFIGURATIONS if name in sim.configurations}


def _figures(m: Measured) -> Figures:
    hits = {VLLM: m.vllm_prefix_hit_rate or 0.0} | {tier.label: h.rate for tier, h in m.hits.items()}
    return Figures(len(m.requests), m.ttft_s, tuple(r.tpot_s for r in m.requests if r.tpot_s is not None),
                   m.requests_per_s, hits, m.load_seconds_per_load)


def setup_of(doc: Mapping[str, Any], trace: Sequence[Request], calibration: HostCalibration, model: str,
             workers: int) -> ServeSetup:
    """What the report's run was, for the simulator, timed by ``calibration``'s fits for ``model``.

    Raises:
        BadReport: the report's config lacks a field.
        ValueError: the profile has no vLLM step fits for the model.
    """
    try:
        c = doc["config"]
        workload = report_workload(c["workload"])
        if workload.kind is not WorkloadKind.CONVERSATIONS:
            raise BadReport(f"bench serve report: a --workload {workload.kind.value} run; the simulation replays "
                            "the conversations workload only")
        limits = EngineLimits(c["kv_blocks"], workload.block_tokens, c["max_num_seqs"])
        block_bytes = c["block_bytes"]
        pool = _at(doc, ("shared_pool", "together")) is not None
        tiers = (Medium.HOST, Medium.DISK, Medium.REMOTE) if pool else (Medium.HOST, Medium.DISK)
        return ServeSetup(workload, tuple(trace), c["vocab"], c["rounds"], limits, block_bytes,
                          c["kv_blocks"] * block_bytes, c["host_bytes"], c["disk_bytes"], c["remote_bytes"], pool,
                          ServingTimes.of(calibration, model, block_bytes, workers, tiers))
    except (KeyError, TypeError) as exc:
        raise BadReport(f"bench serve report: config lacks {exc}") from None


def report_workload(doc: Mapping[str, Any]) -> ServeWorkload:
    """A report's ``config.workload``; a kind or field the workload refuses is a bad report (one line)."""
    try:
        return workload_of(doc)
    except ValueError as exc:
        raise BadReport(f"bench serve report: {exc}") from None


def compare(measured: Mapping[str, Figures], simulated: Mapping[str, Figures]) -> ServeValidation:
    """Rows for every configuration both have (see the module text)."""
    rows = []
    names = [n for n, _, _ in CONFIGURATIONS if n in measured and n in simulated]
    for name in names:
        m, s = measured[name], simulated[name]
        for figure in ("ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90"):
            if figure.startswith("tpot") and not (m.tpot_s and s.tpot_s):
                continue  # one-token answers: no time between tokens on either side
            rows.append(Row(name, figure, m.value(figure), s.value(figure), TIME_GOALS.get(figure)))
        rows.append(Row(name, "requests/s", m.requests_per_s, s.requests_per_s, None))
        if m.load_s is not None and s.load_s is not None:  # where the time model's loads stand
            rows.append(Row(name, "load (kvstrata)", m.load_s, s.load_s, None))
        for tier in dict.fromkeys([*m.hit_rate, *s.hit_rate]):
            rows.append(Row(name, f"hit {tier}", m.hit_rate.get(tier, 0.0), s.hit_rate.get(tier, 0.0),
                            HIT_GOAL_POINTS, points=True))
    rank = lambda figs: tuple(sorted(names, key=lambda n: figs[n].value("ttft_p90")))  # noqa: E731
    return ServeValidation(tuple(rows), {n: label for n, _, label in CONFIGURATIONS}, rank(measured), rank(simulated),
                           dict(measured), dict(simulated))


def summary(validations: Sequence[ServeValidation]) -> dict[str, Any]:
    """Several reports' comparisons together: per row, the worst error; the rankings each."""
    worst: dict[tuple[str, str], Row] = {}
    for v in validations:
        for r in v.rows:
            k = (r.configuration, r.figure)
            if k not in worst or abs(r.error) > abs(worst[k].error):
                worst[k] = r
    timed = [abs(r.error) for r in worst.values() if not r.points and r.goal is not None and math.isfinite(r.error)]
    return {"reports": len(validations), "rankings_same": sum(v.ranking_same for v in validations),
            "misses": [f"{r.configuration} {r.figure}" for r in worst.values() if r.met is False],
            "median_abs_time_error": statistics.median(timed) if timed else None}



@dataclass(frozen=True)
class RunSpread:
    """One figure of one configuration over several runs of one workload, measured.

    Attributes:
        workload: what the runs share (their arrival rate, as the caller labels it).
        configuration, figure: as the rows name them.
        measured: the figure in each run.
        goal: the figure's goal (relative; hit rates in points).
        points: the goal is in percentage points.
    """

    workload: str
    configuration: str
    figure: str
    measured: tuple[float, ...]
    goal: float
    points: bool = False

    @property
    def ratio(self) -> float:
        """The largest run's figure over the smallest's (inf where the smallest is 0)."""
        low = min(self.measured)
        return max(self.measured) / low if low > 0 else math.inf

    @property
    def attainable(self) -> bool:
        """Whether one value lies within the goal of every run's figure."""
        low, high = min(self.measured), max(self.measured)
        if self.points:
            return high - low <= 2 * self.goal + 1e-12
        return high * (1 - self.goal) <= low * (1 + self.goal) + 1e-12


def run_spreads(runs: Sequence[tuple[str, ServeValidation]]) -> tuple[RunSpread, ...]:
    """For each workload with two runs or more (``runs``: each validation with its workload's
    label), each goal's figure over those runs (see the module text)."""
    by: dict[str, list[ServeValidation]] = {}
    for workload, v in runs:
        by.setdefault(workload, []).append(v)
    out = []
    for workload, group in by.items():
        if len(group) < 2:
            continue
        values: dict[tuple[str, str], list[Row]] = {}
        for v in group:
            for r in v.rows:
                if r.goal is not None:
                    values.setdefault((r.configuration, r.figure), []).append(r)
        for (configuration, figure), rows in values.items():
            if len(rows) == len(group):  # every run has it
                out.append(RunSpread(workload, configuration, figure, tuple(r.measured for r in rows), rows[0].goal,
                                     rows[0].points))
    return tuple(out)
