"""``kvstrata bench e2e``: the workload runner's report (:mod:`kvstrata.workload`, what
``kvstrata demo`` runs) with LMCache beside it on the same prompts, where it runs.

LMCache runs in a venv of its own (:mod:`kvstrata.bench.lmcache_e2e`), on the prompts the
kvstrata side ran, for the tiers both have (host, disk), with LMCache's chunk = our block.
Its result comes back as that module's JSON document, kept as it came.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from kvstrata.bench import lmcache_e2e
from kvstrata.media import Medium
from kvstrata.report import FLATTEN
from kvstrata.workload import WorkloadReport


@dataclass(frozen=True)
class LMCacheSkipped:
    skipped: str


@dataclass(frozen=True)
class E2EBenchReport:
    """Ours per tier (``model_dir``, ``workload``, ``tiers`` at the top), LMCache's beside it
    (None: not asked for)."""

    run: WorkloadReport = field(metadata=FLATTEN)
    lmcache: dict[str, Any] | LMCacheSkipped | None


def lmcache_beside(report: WorkloadReport, python_exe: str | os.PathLike[str]) -> dict[str, Any] | LMCacheSkipped:
    """LMCache on ``report``'s prompts in the interpreter ``python_exe`` (a venv with lmcache)."""
    prompts = report.prompts
    if not prompts:
        return LMCacheSkipped("no prompts ran")
    tiers = [t.label for t in (Medium.HOST, Medium.DISK) if t in report.tiers]
    workload = report.workload
    result, reason = lmcache_e2e.run_in_side_venv(
        python_exe, str(report.model_dir), prompts, tiers, max_new_tokens=workload.answer_tokens,
        chunk_tokens=workload.block_tokens,
        drop_page_cache=False,  # ours reads just-written files from the page cache too
    )
    return result if result is not None else LMCacheSkipped(reason)
