"""Summaries of simulation runs: percentiles, hit rates per tier, link use, SLOs and ranking.

Two SLOs, both judged on the simulated times. The ranking's is on the run's percentiles: TTFT
p90 <= :data:`TTFT_P90_SLO_S` and TPOT p99 <= :data:`TPOT_P99_SLO_S` (``meets_slo``). Goodput is
per request (:mod:`kvstrata.slo`, as ``bench route`` counts it on real servers): the share of
requests with TTFT and TPOT within a :class:`~kvstrata.slo.Slo` (default :data:`GOODPUT_SLO`, the
same thresholds applied to each request), and those requests per simulated second (the makespan).

Per-tier figures are keyed by :class:`kvstrata.media.Medium`; :meth:`Summary.to_json` writes each
tier by its hardware name (:data:`kvstrata.sim.tiers.HARDWARE_NAME`: ``hbm``, ``dram``, ...).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstrata.fleet.scorer import Policy
from kvstrata.media import Medium
from kvstrata.plan.sharing import KVSharing
from kvstrata.sim.outcome import SimOutcome
from kvstrata.sim.pool import PoolStats
from kvstrata.sim.tiers import HARDWARE_NAME, ArchSpec
from kvstrata.slo import Goodput, Slo, goodput

TTFT_P90_SLO_S = 2.0
TPOT_P99_SLO_S = 0.100
GOODPUT_SLO = Slo(TTFT_P90_SLO_S, TPOT_P99_SLO_S)  # per request: the ranking's thresholds


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear between closest ranks; NaN for no values."""
    return float(np.percentile(values, q)) if len(values) else math.nan


@dataclass(frozen=True)
class Summary:
    """One run's figures. ``arch`` is its display label (:func:`kvstrata.sim.outcome.run_label`);
    ``spec``, ``sharing`` and ``policy`` say what ran, for code that groups or compares runs."""

    arch: str
    ttft_s: dict[str, float]
    tpot_s: dict[str, float]
    mean_ttft_s: float
    mean_restore_s: float
    throughput_tok_s: float
    hit_rate: dict[Medium, float]  # tiers in the order searched
    link_bytes: dict[str, float]
    link_utilisation: dict[str, float]
    meets_slo: bool
    goodput: Goodput  # per request, at the SLO the run was summarised at
    spec: ArchSpec
    gpus: int = 0
    tier_writes: dict[Medium, int] = field(default_factory=dict)  # blocks written into each tier
    pool: PoolStats | None = None  # the shared pool's own hits and copies; None: no pool tier
    sharing: KVSharing = KVSharing.SLICED
    policy: Policy | None = None  # the fleet policy that routed the run; None: the config's routing

    @property
    def throughput_per_gpu(self) -> float:
        return self.throughput_tok_s / self.gpus if self.gpus else math.nan

    def to_json(self, pool: bool = False) -> dict:
        """The summary; with ``policy`` where a fleet policy routed it; ``pool``: with the sharing
        mode and the pool's figures (a fleet's report)."""

        def clean(x: float) -> float | None:
            return None if math.isnan(x) else x

        routed = {"policy": self.policy.value} if self.policy is not None else {}
        return {
            "arch": self.arch,
            **routed,
            "ttft_s": {k: clean(v) for k, v in self.ttft_s.items()},
            "tpot_s": {k: clean(v) for k, v in self.tpot_s.items()},
            "throughput_tok_s": self.throughput_tok_s,
            "gpus": self.gpus,
            "throughput_tok_s_per_gpu": clean(self.throughput_per_gpu),
            "tier_writes_blocks": {HARDWARE_NAME[m]: n for m, n in self.tier_writes.items()},
            "hit_rate": {HARDWARE_NAME[m]: rate for m, rate in self.hit_rate.items()},
            "link_bytes": self.link_bytes,
            "link_utilisation": self.link_utilisation,
            "meets_slo": self.meets_slo,
            "goodput": self.goodput.to_json(),
        } | ({"kv_sharing": self.sharing.value, "pool": self.pool.to_json()} if pool and self.pool else {})


def summarise(outcome: SimOutcome, slo: Slo = GOODPUT_SLO) -> Summary:
    """``outcome``'s figures, its goodput at ``slo`` (see the module text)."""
    recs = outcome.records
    ttft = [r.ttft_s for r in recs]
    tpot = [t for r in recs if (t := r.tpot_s) is not None]
    quant = lambda xs: {f"p{q}": percentile(xs, q) for q in (50, 90, 99)}  # noqa: E731
    input_tokens = sum(r.request.input_length for r in recs)
    hit_rate = {
        tier: (sum(r.hit_tokens[tier] for r in recs) / input_tokens if input_tokens else 0.0)
        for tier in outcome.arch.tiers
    }
    span = outcome.makespan_s
    out_tokens = sum(r.request.output_length for r in recs)
    labels = outcome.link_labels
    link_bytes = {labels[k]: b for k, b in sorted(outcome.link_bytes.items()) if b > 0}
    util = {
        labels[k]: (b / (outcome.link_gbps[k] * 1e9 * span) if span > 0 else 0.0)
        for k, b in sorted(outcome.link_bytes.items())
        if b > 0
    }
    ttft_q, tpot_q = quant(ttft), quant(tpot)
    meets = ttft_q["p90"] <= TTFT_P90_SLO_S and (not tpot or tpot_q["p99"] <= TPOT_P99_SLO_S)
    return Summary(
        outcome.label,
        ttft_q,
        tpot_q,
        sum(ttft) / len(ttft) if ttft else math.nan,
        sum(r.restore_s for r in recs) / len(recs) if recs else math.nan,
        out_tokens / span if span > 0 else 0.0,
        hit_rate,
        link_bytes,
        util,
        bool(meets),
        goodput(recs, slo, span),
        outcome.arch,
        outcome.gpus,
        dict(outcome.tier_writes),
        outcome.pool,
        outcome.sharing,
        outcome.policy,
    )


def rank(summaries: Sequence[Summary]) -> list[Summary]:
    """Those meeting the SLOs first, then by throughput (higher first), then TTFT p90."""
    return sorted(summaries, key=lambda s: (not s.meets_slo, -s.throughput_tok_s, s.ttft_s["p90"]))
