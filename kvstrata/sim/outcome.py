"""What a simulation produced: a record per request and the run's raw totals;
:mod:`kvstrata.sim.results` summarises them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvstrata.fleet.scorer import Policy
from kvstrata.media import Medium
from kvstrata.plan.sharing import KVSharing
from kvstrata.sim.pool import PoolStats
from kvstrata.sim.tiers import ArchSpec
from kvstrata.sim.trace import Request


@dataclass
class RequestRecord:
    """What happened to one request (times in seconds from the trace start)."""

    request: Request
    instance: int
    arrival_s: float
    hit_tokens: dict[Medium, int]
    restore_s: float = 0.0  # arrival to restored, queueing for a restore slot included
    restore_started_s: float | None = None  # when its restore took a slot; None: nothing to restore
    first_token_s: float | None = None
    finish_s: float | None = None
    completions: int = 0  # must end at exactly 1

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None for one token or fewer."""
        n = self.request.output_length
        return (self.finish_s - self.first_token_s) / (n - 1) if n > 1 else None


def run_label(arch: ArchSpec, policy: Policy | None) -> str:
    """How reports and plots name a run: the architecture's label, with the fleet policy that
    routed it after `` / `` (``hbm / dynamo``, ``hbm / dynamo (write-back)``). For display only:
    code that groups runs compares their :class:`ArchSpec` and :class:`Policy`."""
    return arch.label if policy is None else replace(arch, name=f"{arch.name} / {policy.value}").label


@dataclass
class SimOutcome:
    """Raw results of one run; :mod:`kvstrata.sim.results` summarises them."""

    arch: ArchSpec
    records: list[RequestRecord]
    makespan_s: float
    link_bytes: dict[str, float]  # resource key -> bytes moved
    link_sent_bytes: dict[str, float]
    link_gbps: dict[str, float]
    link_labels: dict[str, str]
    gpus: int = 0
    tier_writes: dict[Medium, int] = field(default_factory=dict)  # blocks written into each tier
    event_times: list[float] = field(default_factory=list)
    pool: PoolStats | None = None  # what the shared pool held and served; None: no pool tier
    sharing: KVSharing = KVSharing.SLICED
    policy: Policy | None = None  # the fleet policy that routed the run; None: the config's ``routing``

    @property
    def label(self) -> str:
        """The run's display label (:func:`run_label`)."""
        return run_label(self.arch, self.policy)
