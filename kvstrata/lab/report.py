"""What ``kvstrata lab`` measured beside what the planner predicted: typed rows, serialized by
``kvstrata.report.to_json`` and drawn as tables by ``kvstrata.cli.lab``.

Every measured figure is the median over the timed rounds; every row keeps its rounds.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstrata.lab.model import Bound, LabPaths
from kvstrata.lab.spec import tcp_efficiency
from kvstrata.media import FetchPath

if TYPE_CHECKING:
    from kvstrata.lab.run import LabConfig

GOAL = 0.10  # |predicted - measured| / measured, where the link bounds a restore of GOAL_MIN_BYTES or more
GOAL_MIN_BYTES = 64 << 20


def _median(runs: tuple[float, ...]) -> float:
    return statistics.median(runs) if runs else float("nan")


@dataclass(frozen=True)
class LinkRow:
    """One restore through one shaped link (``rate_gbit`` None: unshaped, the host's own paths)."""

    rate_gbit: float | None
    path: FetchPath
    nbytes: int
    predicted_s: float
    runs_s: tuple[float, ...]
    predicted_bound: Bound
    observed_bound: Bound  # from the shaper's counters: held packets back, or not
    bottleneck: str  # the planner's bottleneck resource
    held_per_mib: float  # packets the shaper held back per MiB moved (median over rounds)
    measured_s: float = field(init=False)
    error: float = field(init=False)  # (predicted - measured) / measured

    def __post_init__(self) -> None:
        object.__setattr__(self, "measured_s", _median(self.runs_s))
        object.__setattr__(self, "error", (self.predicted_s - self.measured_s) / self.measured_s)

    @property
    def in_goal(self) -> bool:
        """Whether this row is one the goal judges: the link bounds it, and it is large enough."""
        return self.rate_gbit is not None and self.predicted_bound is Bound.LINK and self.nbytes >= GOAL_MIN_BYTES

    @property
    def measured_gbps(self) -> float:
        return self.nbytes / self.measured_s / 1e9


@dataclass(frozen=True)
class PortsRow:
    """One restore over two ports (blocks spread over a daemon behind each) against one port."""

    rate_gbit: float
    nbytes: int
    one_port_runs_s: tuple[float, ...]
    two_ports_runs_s: tuple[float, ...]
    one_port_predicted_s: float
    two_ports_predicted_s: float
    bottleneck: str
    speedup: float = field(init=False)  # median over rounds of one port's time / two ports'
    predicted_speedup: float = field(init=False)

    def __post_init__(self) -> None:
        ratios = tuple(a / b for a, b in zip(self.one_port_runs_s, self.two_ports_runs_s))
        object.__setattr__(self, "speedup", _median(ratios))
        object.__setattr__(self, "predicted_speedup", self.one_port_predicted_s / self.two_ports_predicted_s)


@dataclass(frozen=True)
class UplinkRow:
    """One inference host behind the shared uplink: its restore alone and while the other restores."""

    host: str
    rate_gbit: float
    nbytes: int
    alone_runs_s: tuple[float, ...]
    together_runs_s: tuple[float, ...]
    alone_predicted_s: float
    together_predicted_s: float
    bottleneck: str
    share: float = field(init=False)  # its rate at once over the uplink's payload rate (median)
    predicted_share: float = field(init=False)

    def __post_init__(self) -> None:
        link = self.rate_gbit * 1e9 / 8 * tcp_efficiency()
        object.__setattr__(self, "share", self.nbytes / _median(self.together_runs_s) / link)
        object.__setattr__(self, "predicted_share", self.nbytes / self.together_predicted_s / link)


@dataclass(frozen=True)
class Goal:
    what: str
    met: bool
    detail: str


@dataclass(frozen=True)
class LabReport:
    config: LabConfig
    paths: LabPaths
    link: tuple[LinkRow, ...]
    ports: tuple[PortsRow, ...]
    uplink: tuple[UplinkRow, ...]
    goals: tuple[Goal, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "goals", lab_goals(self))


def lab_goals(report: LabReport) -> tuple[Goal, ...]:
    goals = []
    judged = [r for r in report.link if r.in_goal]
    if judged:
        worst = max(judged, key=lambda r: abs(r.error))
        goals.append(Goal(
            f"predicted within {GOAL:.0%} where the link bounds a restore of {GOAL_MIN_BYTES >> 20} MiB or more",
            abs(worst.error) <= GOAL,
            f"{len(judged)} rows; worst {worst.error:+.1%} ({worst.rate_gbit:g} Gbit/s, {worst.path.value}, "
            f"{worst.nbytes >> 20} MiB)",
        ))
    if report.link:
        wrong = [r for r in report.link if r.rate_gbit is not None and r.predicted_bound is not r.observed_bound]
        goals.append(Goal(
            "the bound the planner names is the one the shaper saw",
            not wrong,
            "every row" if not wrong else "; ".join(
                f"{r.rate_gbit:g} Gbit/s {r.path.value} {r.nbytes >> 20} MiB: predicted {r.predicted_bound.value}, "
                f"saw {r.observed_bound.value}" for r in wrong),
        ))
    return tuple(goals)
