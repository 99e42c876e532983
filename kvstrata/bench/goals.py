"""The benchmarks' goals, checked against their reports (``run_cache_bench``, ``run_remote_bench``;
``run_sim_bench`` judges its own rows against :data:`SIM_WALL_S`).

Ratio goals use the paired ratios of the report (ours over the baseline of the same round);
"at least LMCache" goals use ours over LMCache's figure of the same round, and are left out
when LMCache did not run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Goal:
    figure: str  # the row of the table it belongs to
    goal: str  # what it asks, in words
    value: float
    target: float
    at_most: bool = False  # a time: value <= target passes; else value >= target

    @property
    def passed(self) -> bool:
        return self.value <= self.target if self.at_most else self.value >= self.target


HOST_STORE_OF_COPY = 0.95
HOST_RESTORE_OF_COPY = 0.98
DISK_WARM_OF_COPY = 0.80
DISK_COLD_OF_RAW_READ = 0.90
LOOKUP_MS = {"256": 0.2, "16": 2.0}
REMOTE_OF_RAW = 0.90  # the remote tier's restore and store, of raw Mooncake calls on the same bytes
SIM_WALL_S = 5.0  # one simulation of a trace, one architecture, on one core (kvstrata bench sim)


def cache_goals(report: dict[str, Any]) -> list[Goal]:
    """The cache benchmark's: each tier against its baseline, LMCache when it ran, lookup time."""
    host, disk = report["tiers"]["host"], report["tiers"]["disk"]
    out = [
        Goal("host store", f">={HOST_STORE_OF_COPY}x copy", host["store_ratio"], HOST_STORE_OF_COPY),
        Goal("host restore", f">={HOST_RESTORE_OF_COPY}x copy", host["restore_ratio"], HOST_RESTORE_OF_COPY),
        Goal(
            "disk restore, cold", f">={DISK_COLD_OF_RAW_READ}x cold read", disk["cold"]["ratio"], DISK_COLD_OF_RAW_READ
        ),
        Goal("disk restore, warm", f">={DISK_WARM_OF_COPY}x copy", disk["warm"]["ratio"], DISK_WARM_OF_COPY),
    ]
    lmc = report["lmcache"]
    if lmc.get("available"):
        for figure, (group, name) in {
            "host store": ("host", "store"),
            "host restore": ("host", "retrieve"),
            "disk store": ("disk", "store"),
            "disk restore, cold": ("disk", "retrieve_cold"),
            "disk restore, warm": ("disk", "retrieve_warm"),
        }.items():
            out.append(Goal(figure, ">=LMCache", lmc[group][name]["ours_over_lmcache"], 1.0))
    for block_size, limit_ms in LOOKUP_MS.items():
        value = report["lookup_128k_ms"][block_size]
        out.append(Goal(f"hash+lookup 128K, block {block_size}", f"<={limit_ms} ms", value, limit_ms, at_most=True))
    return out


def remote_goals(report: dict[str, Any]) -> list[Goal]:
    """Per measured pool mode: restore and store through the tier at >= 0.9x the raw calls."""
    out = []
    for mode, figures in report["modes"].items():
        if "skipped" in figures:
            continue
        out.append(Goal(f"{mode} restore", f">={REMOTE_OF_RAW}x raw", figures["ratio"], REMOTE_OF_RAW))
        out.append(Goal(f"{mode} store", f">={REMOTE_OF_RAW}x raw", figures["store_ratio"], REMOTE_OF_RAW))
    return out


def as_json(judged: list[Goal]) -> list[dict[str, Any]]:
    """Goals as JSON-ready dicts, each with ``passed``."""
    return [{**asdict(g), "passed": g.passed} for g in judged]
