"""What a run of the workload reports: per tier, TTFT cold and warm, hit rate, bytes and time
restored (beside the calibrated prediction), whether the tokens equal the cold run's, and the
routes the blocks took. Serialized by :func:`kvstrata.report.to_json`.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kvstrata.media import Medium, Route
from kvstrata.report import OMIT
from kvstrata.workload.spec import Workload


@dataclass(frozen=True)
class TurnFigures:
    """One turn: its prompt and hit tokens, TTFT cold and warm, and with a benchmark beside the
    run the cold TTFT of plain transformers on the same prompt (a fresh DynamicCache, no
    kvstrata), timed next to ours (None otherwise)."""

    prompt_tokens: int
    hit_tokens: int
    ttft_cold_s: float
    ttft_warm_s: float
    ttft_plain_s: float | None = None


@dataclass(frozen=True)
class TierReport:
    """The workload through one tier.

    Attributes:
        tier: the tier every warm restore came from.
        skipped: why the tier did not run (None: it ran).
        turns: turns run.
        ttft_cold_s, ttft_warm_s: medians over turns (None: no turn ran).
        per_turn: every turn's figures, in order.
        hit_rate: reused over prompt tokens.
        hit_tokens: prompt tokens reused from the cache.
        restored_bytes: bytes the warm runs' loads brought to the device.
        restore_s: the loads' own seconds, summed, while the model computed beside them.
        restore_alone_s: the same restores again with nothing else running (per turn the
            median of three after a warm-up), summed (what the prediction describes).
        restore_gbps: restored bytes over ``restore_s``, decimal GB/s.
        predicted_restore_s: the calibrated model's, summed over the loads (None: a path
            not calibrated, or not predicted).
        tokens_identical: every warm run's tokens equal the cold run's.
        paths: blocks restored per route.
        stream_bytes_per_step: host tier only, the last turn again in per-step DRAM
            streaming decode: bytes crossing host -> device per decode step.
        stream_tokens_identical: whether that streamed run's tokens equal the resident run's.
        prompt_tokens: prompt tokens over all turns.
        loads: warm runs that loaded blocks.
        load_sizes: per load, (bytes restored, blocks) (not in JSON).
        prompts: every turn's prompt, in order (not in JSON).
    """

    tier: Medium
    skipped: str | None = None
    turns: int = 0
    ttft_cold_s: float | None = None
    ttft_warm_s: float | None = None
    hit_rate: float = field(init=False)  # of hit_tokens and prompt_tokens
    hit_tokens: int = 0
    restored_bytes: int = 0
    restore_s: float = 0.0
    restore_alone_s: float = 0.0
    restore_gbps: float = field(init=False)  # of restored_bytes and restore_s
    predicted_restore_s: float | None = None
    tokens_identical: bool = True
    paths: dict[Route, int] = field(default_factory=dict)
    stream_bytes_per_step: float | None = None
    stream_tokens_identical: bool | None = None
    prompt_tokens: int = 0
    loads: int = 0
    load_sizes: tuple[tuple[int, int], ...] = field(default=(), metadata=OMIT)
    prompts: tuple[tuple[int, ...], ...] = field(default=(), metadata=OMIT, repr=False)
    per_turn: tuple[TurnFigures, ...] = ()

    def __post_init__(self) -> None:
        hit_rate = self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        object.__setattr__(self, "hit_rate", hit_rate)
        gbps = self.restored_bytes / self.restore_s / 1e9 if self.restore_s > 0 else 0.0
        object.__setattr__(self, "restore_gbps", gbps)


@dataclass(frozen=True)
class WorkloadReport:
    """Every tier's run of one workload on one model.

    Attributes:
        load_average: the host's 1-minute load average as the run began (None: unknown), and
            ``cpus`` its CPU count: restores this small swing with what else runs.
        pool_gbps: the pool's measured get rate, decimal GB/s (the calibration's raw Mooncake
            gets; None: not calibrated).
    """

    model_dir: Path
    workload: Workload
    tiers: dict[Medium, TierReport]
    load_average: float | None = None
    cpus: int | None = None
    pool_gbps: float | None = None

    @property
    def prompts(self) -> tuple[tuple[int, ...], ...]:
        """The prompts the tiers ran (the same on every tier: the answers are greedy)."""
        return next((r.prompts for r in self.tiers.values() if r.prompts), ())

    @property
    def tokens_identical(self) -> bool:
        return all(r.tokens_identical for r in self.tiers.values())


@dataclass
class Tally:
    """A tier's figures while its turns run (:meth:`report` freezes them)."""

    tier: Medium
    prompt_tokens: int = 0
    hit_tokens: int = 0
    restored_bytes: int = 0
    restore_s: float = 0.0
    restore_alone_s: float = 0.0
    tokens_identical: bool = True
    ttft_cold: list[float] = field(default_factory=list)
    ttft_warm: list[float] = field(default_factory=list)
    per_turn: list[TurnFigures] = field(default_factory=list)
    load_sizes: list[tuple[int, int]] = field(default_factory=list)
    paths: Counter = field(default_factory=Counter)
    prompts: list[list[int]] = field(default_factory=list)
    stream_bytes_per_step: float | None = None
    stream_tokens_identical: bool | None = None

    def report(self) -> TierReport:
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        return TierReport(
            tier=self.tier,
            turns=len(self.prompts),
            ttft_cold_s=med(self.ttft_cold),
            ttft_warm_s=med(self.ttft_warm),
            hit_tokens=self.hit_tokens,
            restored_bytes=self.restored_bytes,
            restore_s=self.restore_s,
            restore_alone_s=self.restore_alone_s,
            tokens_identical=self.tokens_identical,
            paths=dict(self.paths),
            stream_bytes_per_step=self.stream_bytes_per_step,
            stream_tokens_identical=self.stream_tokens_identical,
            prompt_tokens=self.prompt_tokens,
            loads=len(self.load_sizes),
            load_sizes=tuple(self.load_sizes),
            prompts=tuple(tuple(p) for p in self.prompts),
            per_turn=tuple(self.per_turn),
        )
