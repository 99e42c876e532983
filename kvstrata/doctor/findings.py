"""The doctor's answer, typed: findings (a cause, its evidence, the one change most likely to
help), per-tier numbers, and a verdict, serialized to JSON in one place (:meth:`Diagnosis.to_json`).

Keys are enums and identifiers; the words a person reads are the explanation and the change's
text, and the labels of evidence are made by the CLI.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from kvstrata.media import Medium


class Severity(Enum):
    """How much a finding matters, least first (``rank`` orders them)."""

    INFO = "info"  # worth knowing, costs nothing
    OK = "ok"  # kvstrata does its job here (the answer, above the details)
    WARN = "warn"  # costs time, or leaves a gain on the table
    PROBLEM = "problem"  # kvstrata does not help, or makes it slower

    @property
    def rank(self) -> int:
        return list(Severity).index(self)


class Cause(Enum):
    """What a finding is about."""

    NO_CONNECTOR = "no_connector"  # no kvstrata_connector_ series: not loaded, or stats off
    NO_TRAFFIC = "no_traffic"  # no prompts yet: nothing to judge
    VLLM_CACHE_SERVES = "vllm_cache_serves"  # vLLM's own prefix cache finds the repeats first
    REUSE_LIMITED = "reuse_limited"  # misses with room to spare: the prompts do not repeat
    CAPACITY_LIMITED = "capacity_limited"  # misses while the last tier is full and evicting
    BELOW_PREDICTION = "below_prediction"  # a tier restores slower than the hardware model says
    SLOWER_THAN_RECOMPUTE = "slower_than_recompute"  # loading from a tier loses to computing
    LOAD_FAILURES = "load_failures"  # loads failed and vLLM computed those blocks again
    DECLINED = "declined"  # hits in a tier the scheduler did not load: measured slower than computing
    HELPS = "helps"  # kvstrata served prompt tokens faster than computing them


class Change(Enum):
    """The kind of the one change a finding suggests."""

    NONE = "none"  # nothing in kvstrata's configuration would help
    LOAD_CONNECTOR = "load_connector"  # start vLLM with the connector (or its stats on)
    DISABLE_CONNECTOR = "disable_connector"  # it stores every block and serves none
    BIGGER_TIER = "bigger_tier"
    FASTER_PATH = "faster_path"
    LONGER_BLOCK = "longer_block"
    DISABLE_TIER = "disable_tier"


class Verdict(Enum):
    """The short answer to "does kvstrata speed this workload up?"."""

    HELPS = "helps"
    NO_GAIN = "no_gain"  # it is not asked, or finds nothing
    HURTS = "hurts"  # its loads cost more than computing
    UNKNOWN = "unknown"  # not running here, or no traffic yet


@dataclass(frozen=True)
class Evidence:
    """One number behind a finding.

    Attributes:
        key: what it is (an identifier; the CLI makes its label).
        value: the number; ``unit`` says of what.
        unit: "ratio", "blocks", "tokens", "bytes", "s", "GB/s" or "count".
    """

    key: str
    value: float
    unit: str


@dataclass(frozen=True)
class Suggestion:
    """The one change most likely to help, and what it is in words."""

    change: Change
    text: str
    tier: Medium | None = None


@dataclass(frozen=True)
class Finding:
    """One cause, with its numbers and the change to make.

    Attributes:
        cause: what it is about.
        severity: how much it matters.
        title: one line.
        evidence: the numbers it rests on.
        explanation: why, in plain words.
        suggestion: the one change.
        tier: the tier it is about, if one.
    """

    cause: Cause
    severity: Severity
    title: str
    evidence: tuple[Evidence, ...]
    explanation: str
    suggestion: Suggestion
    tier: Medium | None = None


@dataclass(frozen=True)
class TierReport:
    """One tier's numbers, as the doctor derived them.

    Attributes:
        medium: the tier.
        hit_rate: its hits over the blocks lookups asked about.
        loaded_blocks, loaded_bytes: what loads moved from it.
        fill: used over capacity now; None: not reported.
        evicted_blocks: None: not reported.
        achieved_gbps: its restores' rate (loaded bytes over their seconds); None: nothing loaded
            or no time reported.
        predicted_gbps: the hardware model's rate for the same restores; None: no prediction.
        predicted_basis: "calibrated" or "spec"; None with no prediction.
        spec_path: the seed's path a restore from this tier takes (its name); None: none.
        spec_gbps: the spec path's rate into one GPU; None: no profile or no such path.
        bottleneck: the spec path's bottleneck link.
        seconds_per_block: achieved seconds per loaded block.
        recompute_s_per_block: what computing one block's tokens costs, at the typical prompt.
    """

    medium: Medium
    hit_rate: float
    loaded_blocks: float
    loaded_bytes: float
    fill: float | None = None
    evicted_blocks: float | None = None
    achieved_gbps: float | None = None
    predicted_gbps: float | None = None
    predicted_basis: str | None = None
    spec_path: str | None = None
    spec_gbps: float | None = None
    bottleneck: str | None = None
    seconds_per_block: float | None = None
    recompute_s_per_block: float | None = None


@dataclass(frozen=True)
class Diagnosis:
    """The doctor's answer for one observation.

    Attributes:
        source: where the observation came from.
        verdict: the short answer.
        findings: most severe first.
        tiers: per tier its numbers, fastest first.
        summary: headline numbers (hit rates, prompt lengths, TTFT), as evidence.
        prefill_basis: where the prefill rate the load-or-recompute checks used came from.
    """

    source: str
    verdict: Verdict
    findings: tuple[Finding, ...]
    tiers: tuple[TierReport, ...]
    summary: tuple[Evidence, ...]
    prefill_basis: str | None = None

    def causes(self) -> set[Cause]:
        return {f.cause for f in self.findings}

    def finding(self, cause: Cause) -> Finding | None:
        return next((f for f in self.findings if f.cause is cause), None)

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "verdict": self.verdict.value,
            "prefill_basis": self.prefill_basis,
            "summary": {e.key: _number(e.value) for e in self.summary},
            "tiers": [_tier_json(t) for t in self.tiers],
            "findings": [
                {
                    "cause": f.cause.value,
                    "severity": f.severity.value,
                    "tier": f.tier.label if f.tier is not None else None,
                    "title": f.title,
                    "evidence": {e.key: {"value": _number(e.value), "unit": e.unit} for e in f.evidence},
                    "explanation": f.explanation,
                    "change": {
                        "kind": f.suggestion.change.value,
                        "tier": f.suggestion.tier.label if f.suggestion.tier is not None else None,
                        "text": f.suggestion.text,
                    },
                }
                for f in self.findings
            ],
        }


def _tier_json(t: TierReport) -> dict:
    return {
        "tier": t.medium.label, "hit_rate": t.hit_rate, "loaded_blocks": t.loaded_blocks,
        "loaded_bytes": t.loaded_bytes, "fill": t.fill, "evicted_blocks": t.evicted_blocks,
        "achieved_gbps": _number(t.achieved_gbps), "predicted_gbps": _number(t.predicted_gbps),
        "predicted_basis": t.predicted_basis, "spec_path": t.spec_path, "spec_gbps": _number(t.spec_gbps), "bottleneck": t.bottleneck,
        "seconds_per_block": t.seconds_per_block, "recompute_s_per_block": t.recompute_s_per_block,
    }


def _number(value: float | None) -> float | None:
    """JSON has no infinity: an unbounded rate is null."""
    return None if value is None or not math.isfinite(value) else value
