"""``bench route``'s results (pure: built from each pass's records and counters; JSON through
:func:`kvstrata.report.dumps`, the plot through :mod:`kvstrata.plots.cdf`).

Per policy, over its passes of every round: the figures a client saw through the router (TTFT,
TPOT, throughput: :func:`~kvstrata.calibrate.serving.measured.measure`), the servers' own
counters summed (vLLM's prefix hits, kvstrata's hits per tier), the requests each server
answered (the router's count), the goodput at the SLO (:mod:`kvstrata.bench.route_plan`), and
against round robin, per round then the median with its spread: TTFT p50 and p90, TPOT p50
(times: < 1 is faster) and the goodput's share (> 1 is more requests within the SLO).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvstrata.bench.route_plan import BASELINE, Pass, RouteBenchConfig
from kvstrata.bench.serve_report import TIE_NATS, checked
from kvstrata.calibrate.serving.counters import Counters
from kvstrata.calibrate.serving.measured import Measured, RequestRecord, measure, total
from kvstrata.fleet.scorer import Policy
from kvstrata.rounds import Skipped, Spread
from kvstrata.slo import Goodput, goodput

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from kvstrata.pool.scoped import PoolSource


@dataclass(frozen=True)
class PassRun:
    """One pass as it ran: the answers through the router, each server's counters over the pass,
    the requests the router had each server answer, and the pass's wall time."""

    plan: Pass
    records: tuple[RequestRecord, ...]
    counters: Mapping[str, Counters]
    answered: Mapping[str, int]
    wall_s: float


@dataclass(frozen=True)
class VersusRoundRobin:
    """A policy over round robin, per round then the median with its spread."""

    ttft_p50: Spread
    ttft_p90: Spread
    tpot_p50: Spread
    goodput_share: Spread


@dataclass(frozen=True)
class PolicyResult:
    """One policy over its passes (see the module text)."""

    policy: Policy
    measured: Measured
    goodput: Goodput
    requests_per_server: Mapping[str, int]
    versus_round_robin: VersusRoundRobin


@dataclass(frozen=True)
class RouteBenchReport:
    """``bench route``'s report.

    Attributes:
        config: what ran.
        trace: the trace, or how it was generated.
        servers: the servers' names, in the order the router lists them (ties go to the first).
        orders: each round's policies in the order they ran.
        results: per policy, in ``config.policies``' order.
        sglang: SGLang's router, not run here, and why.
        cost: what kvstrata's scorer priced the servers with (restores and prefill).
        pool: the pool the servers shared (None: none).
        reference_prompts: distinct prompts the cold reference answered.
        identical: every completion equals the reference's (near-ties apart).
        start_s: each server's start, seconds to ``/health``.
        wall_s: the whole run.
    """

    config: RouteBenchConfig
    trace: str
    servers: tuple[str, ...]
    orders: tuple[tuple[Policy, ...], ...]
    results: tuple[PolicyResult, ...]
    sglang: Skipped
    cost: str
    pool: PoolSource | None
    reference_prompts: int
    identical: bool
    start_s: Mapping[str, float]
    wall_s: float

    def result(self, policy: Policy) -> PolicyResult:
        return next(r for r in self.results if r.policy is policy)


def build_report(config: RouteBenchConfig, trace: str, servers: Sequence[str], runs: Sequence[PassRun],
                 reference: Mapping[tuple[int, ...], RequestRecord], sglang: Skipped, cost: str,
                 pool: PoolSource | None, start_s: Mapping[str, float], wall_s: float) -> RouteBenchReport:
    """The report of ``runs`` (every pass of every round), each completion checked against
    ``reference`` (its answer per prompt)."""
    bt = config.serve.workload.block_tokens
    tie = TIE_NATS[config.serve.dtype]
    runs = [replace(r, records=checked(r.records, reference, tie)) for r in runs]
    rounds = sorted({r.plan.round for r in runs})

    def of(policy: Policy, round_: int | None = None) -> list[PassRun]:
        return [r for r in runs if r.plan.policy is policy and round_ in (None, r.plan.round)]

    def figures(passes: Sequence[PassRun]) -> tuple[Measured, Goodput]:
        wall = sum(p.wall_s for p in passes)
        records = [rec for p in passes for rec in p.records]
        counters = total(c for p in passes for c in p.counters.values())
        return measure(records, counters, bt, wall_s=wall), goodput(records, config.slo, wall)

    def versus(policy: Policy) -> VersusRoundRobin:
        pairs = [(figures(of(policy, r)), figures(of(BASELINE, r))) for r in rounds]
        return VersusRoundRobin(*(Spread.of([_ratio(get(p), get(b)) for p, b in pairs]) for get in (
            lambda f: f[0].ttft_p50_s, lambda f: f[0].ttft_p90_s, lambda f: f[0].tpot_p50_s,
            lambda f: f[1].share)))

    results = []
    for policy in config.policies:
        passes = of(policy)
        measured, good = figures(passes)
        answered = {s: sum(p.answered.get(s, 0) for p in passes) for s in servers}
        results.append(PolicyResult(policy, measured, good, answered, versus(policy)))
    orders = tuple(tuple(r.plan.policy for r in sorted(runs, key=lambda r: r.plan.position) if r.plan.round == n)
                   for n in rounds)
    identical = all(r.measured.identical is True for r in results)
    return RouteBenchReport(config, trace, tuple(servers), orders, tuple(results), sglang, cost, pool,
                            len(reference), identical, dict(start_s), wall_s)


def _ratio(a: float | None, b: float | None) -> float:
    """``a / b``; NaN where either is missing (one-token answers' TPOT) or ``b`` is not > 0."""
    return a / b if a is not None and b is not None and b > 0 else math.nan


def ttft_figure(report: RouteBenchReport) -> Figure:
    """TTFT CDFs per routing policy (every round's requests), in milliseconds, the SLO's TTFT drawn."""
    from kvstrata.plots.cdf import Latency, cdf_figure

    c, w = report.config, report.config.serve.workload
    subject = (f"{c.serve.model_dir.name}, {c.servers} servers, one pool: {w.conversations} conversations x "
               f"{w.turns} turns at {w.rate_per_s:g} req/s, {c.serve.rounds} round(s); vLLM KV {c.serve.kv_blocks} x "
               f"{w.block_tokens} tokens")
    samples = {r.policy.value: r.measured.ttft_s for r in report.results}
    latency = Latency("TTFT", "time to first token", "ms", 1e3, "ttft_s")
    fig = cdf_figure(samples, latency, subject, None)
    ax = fig.axes[0]
    ax.axvline(c.slo.ttft_s * 1e3, color="red", linestyle="--", linewidth=1, label=f"SLO: TTFT <= {c.slo.ttft_s * 1e3:g} ms")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"TTFT CDF per routing policy\n{subject}", fontsize=10)  # cdf_figure's says per architecture
    return fig
