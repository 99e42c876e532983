"""A real model serving a multi-turn workload through each tier, cold vs warm: what
``kvstrata demo`` runs, and ``kvstrata bench e2e`` measures (with LMCache beside it).

* :mod:`~kvstrata.workload.spec`: the workload (conversations sharing growing prefixes);
* :mod:`~kvstrata.workload.runner`: running it through one tier, or every tier;
* :mod:`~kvstrata.workload.report`: what a run reports, per tier.
"""

from typing import Any

from kvstrata.workload.report import TierReport, WorkloadReport
from kvstrata.workload.spec import TIERS, Workload

__all__ = ["TIERS", "TierReport", "Workload", "WorkloadReport", "quick_calibration", "run_e2e", "run_tier"]


def __getattr__(name: str) -> Any:
    """The runner's names, imported when first asked for: it loads the cache and torch, which the
    CLI's parser (it registers ``kvstrata demo``) and the report types need not."""
    if name in ("quick_calibration", "run_e2e", "run_tier"):
        from kvstrata.workload import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
