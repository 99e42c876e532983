"""``kvstrata bench e2e``: the workload runner's report (:mod:`kvstrata.workload`, what
``kvstrata demo`` runs) with LMCache beside it on the same prompts, turn by turn.

LMCache runs in a venv of its own (:class:`kvstrata.bench.lmcache_side.SideSession`), for the
tiers both have (host, disk), with LMCache's chunk = our block. Its turns are interleaved with
ours: each of our turns is followed (or, every other turn, preceded) by LMCache's turn on the
same prompt through the same tier, and plain transformers' cold TTFT on that prompt is timed
next to ours. Every ratio is then paired (ours over the baseline timed next to it, per turn),
and reported as the median over turns with the spread, so noise that moves both sides of a turn
together cancels: on a shared machine a run of ours and a later run of LMCache differ by more
than the systems do.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.bench import lmcache_e2e
from kvstrata.bench.lmcache_side import SideSession, SideSessionError
from kvstrata.rounds import Skipped, Spread
from kvstrata.media import Medium
from kvstrata.report import FLATTEN
from kvstrata.workload import WorkloadReport
from kvstrata.workload.spec import Workload

LMCACHE_TIERS = (Medium.HOST, Medium.DISK)


def paired(ours: Sequence[float], theirs: Sequence[float]) -> Spread | None:
    """Ours over a baseline timed next to it, per turn: the median over turns, the lowest and
    highest turn's ratio, the turns paired (``rounds``). None when no turn pairs (a baseline
    that is not positive is left out)."""
    ratios = [a / b for a, b in zip(ours, theirs, strict=True) if b > 0]
    return Spread.of(ratios) if ratios else None


@dataclass(frozen=True)
class TierVersus:
    """One tier's paired TTFT ratios.

    Attributes:
        cold_over_plain: ours cold over plain transformers cold, every turn.
        warm_over_lmcache: ours warm over LMCache warm, over the turns where both hit (None:
            LMCache has no such tier or did not run).
        warm_over_host_and_pool: the remote tier only: its warm TTFT over the host tier's on
            the same turn plus the turn's restored bytes at the pool's measured get rate (what
            a pool restore cannot beat); per turn that hit, the two tiers run one after the
            other (None: not the remote tier, or no host run or pool rate to compare with).
        lmcache: LMCache's summary of the tier (:func:`kvstrata.bench.lmcache_e2e.summary`).
    """

    tier: Medium
    cold_over_plain: Spread | None
    warm_over_lmcache: Spread | None = None
    lmcache: dict[str, Any] | None = None
    warm_over_host_and_pool: Spread | None = None


@dataclass(frozen=True)
class E2EBenchReport:
    """Ours per tier (``model_dir``, ``workload``, ``tiers`` at the top), and per tier the paired
    ratios against plain transformers and LMCache (``lmcache``: what ran on LMCache's side, or
    why it did not; None: not asked for)."""

    run: WorkloadReport = field(metadata=FLATTEN)
    versus: dict[Medium, TierVersus]
    lmcache: dict[str, Any] | Skipped | None
    note: str | None = None


class LMCacheBeside:
    """LMCache's turns, interleaved with ours: the ``beside`` of
    :func:`kvstrata.workload.runner.run_tier`. A side that fails mid-run is noted and left out
    of the rest of the run; ours goes on."""

    def __init__(self, python_exe: str | os.PathLike[str], model_dir: Path, workload: Workload,
                 tiers: Sequence[Medium]) -> None:
        self.tiers = [t for t in LMCACHE_TIERS if t in tiers]
        self.answer_tokens = workload.answer_tokens
        self.turns: dict[Medium, list[dict[str, Any]]] = {t: [] for t in self.tiers}
        self.failed: str | None = None
        self._side: SideSession | None = None
        self._about: dict[str, Any] = {}
        if not self.tiers:
            self.failed = "no tier LMCache has (host, disk) was asked for"
            return
        try:
            self._side = SideSession(
                python_exe, model_dir, [t.label for t in self.tiers],
                capacity_tokens=workload.capacity_blocks() * workload.block_tokens,
                chunk_tokens=workload.block_tokens,
                drop_page_cache=False,  # ours reads just-written files from the page cache too
            )
        except SideSessionError as exc:
            self.failed = str(exc)

    def __call__(self, tier: Medium, index: int, prompt: list[int]) -> None:
        if self._side is None or tier not in self.turns:
            return
        try:
            turn = self._side.turn(index, prompt, self.answer_tokens, [tier.label])[tier.label]
        except SideSessionError as exc:
            self.failed = f"stopped at {tier.label} turn {index}: {exc}"
            self.close()
            return
        self.turns[tier].append(turn)

    def document(self) -> dict[str, Any] | Skipped:
        """LMCache's side as its JSON documents have it: versions, and per tier its summary."""
        ran = {t: turns for t, turns in self.turns.items() if turns}
        if not ran:
            return Skipped(self.failed or "no turn ran")
        about = self._side.about if self._side is not None else self._about
        tiers = {t.label: lmcache_e2e.summary(t.label, turns, drop_pages=False) for t, turns in ran.items()}
        return {**about, "tiers": tiers, **({"failed": self.failed} if self.failed else {})}

    def close(self) -> None:
        if self._side is not None:
            self._about = self._side.about
            self._side.close()
            self._side = None

    def __enter__(self) -> LMCacheBeside:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def versus(run: WorkloadReport, lmcache: dict[str, Any] | Skipped | None) -> dict[Medium, TierVersus]:
    """Per tier that ran: ours cold over plain transformers, ours warm over LMCache (per turn)."""
    out = {}
    for tier, report in run.tiers.items():
        if report.skipped:
            continue
        plain = [t for t in report.per_turn if t.ttft_plain_s is not None]
        cold = paired([t.ttft_cold_s for t in plain], [t.ttft_plain_s for t in plain])
        theirs = lmcache["tiers"].get(tier.label) if isinstance(lmcache, dict) else None
        warm = None
        if theirs is not None:
            pairs = [(ours, t) for ours, t in zip(report.per_turn, theirs["per_turn"], strict=False)
                     if ours.hit_tokens and t["hit_tokens"]]
            warm = paired([o.ttft_warm_s for o, _ in pairs], [t["ttft_warm_s"] for _, t in pairs])
        out[tier] = TierVersus(tier, cold, warm, theirs, _over_host_and_pool(run, tier))
    return out


def _over_host_and_pool(run: WorkloadReport, tier: Medium) -> Spread | None:
    host, remote = run.tiers.get(Medium.HOST), run.tiers.get(tier)
    if tier is not Medium.REMOTE or host is None or host.skipped or not run.pool_gbps or not remote.hit_tokens:
        return None
    token_bytes = remote.restored_bytes / remote.hit_tokens
    pairs = [(r, h) for r, h in zip(remote.per_turn, host.per_turn, strict=False) if r.hit_tokens and h.hit_tokens]
    return paired([r.ttft_warm_s for r, _ in pairs],
                          [h.ttft_warm_s + r.hit_tokens * token_bytes / (run.pool_gbps * 1e9) for r, h in pairs])


def version_note(lmcache: dict[str, Any] | Skipped | None) -> str | None:
    """A line when LMCache's side ran other transformers or torch than ours (their TTFTs then
    compare two libraries' code, not two caches)."""
    if not isinstance(lmcache, dict):
        return None
    import importlib.metadata

    import torch

    ours = {"transformers": importlib.metadata.version("transformers"), "torch": torch.__version__}
    differ = [f"{name} {lmcache.get(name)} (ours {mine})" for name, mine in ours.items() if lmcache.get(name) != mine]
    if not differ:
        return None
    return f"LMCache's venv runs {', '.join(differ)}: install the same versions there for a like-for-like TTFT"
