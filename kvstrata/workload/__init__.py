"""A real model serving a multi-turn workload through each tier, cold vs warm: what
``kvstrata demo`` runs, and ``kvstrata bench e2e`` measures (with LMCache beside it).

* :mod:`~kvstrata.workload.spec`: the workload (conversations sharing growing prefixes);
* :mod:`~kvstrata.workload.runner`: running it through one tier, or every tier;
* :mod:`~kvstrata.workload.report`: what a run reports, per tier.
"""

from kvstrata.workload.report import TierReport, WorkloadReport
from kvstrata.workload.spec import TIERS, Workload

__all__ = ["TIERS", "TierReport", "Workload", "WorkloadReport"]  # the runner (torch, the cache): workload.runner
