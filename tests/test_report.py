"""The one JSON serializer: typed results out as the JSON the reports always had."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvstrata.bench.goals import CacheFigure, Goal, RemoteFigure
from kvstrata.bench.remote_report import PathRestore
from kvstrata.rounds import Rounds, Skipped
from kvstrata.media import FetchPath, Medium
from kvstrata.pool.config import PoolConfig, RemoteMode
from kvstrata.pool.scoped import PoolOrigin, PoolSource
from kvstrata.report import FLATTEN, OMIT, dumps, flatten, key, to_json
from kvstrata.workload import TierReport, Workload, WorkloadReport

D, H, K, R = Medium.DEVICE, Medium.HOST, Medium.DISK, Medium.REMOTE


def test_media_are_labels_and_routes_their_text_as_values_and_as_keys():
    assert to_json(H) == "host"
    assert to_json((R, H, D)) == "remote -> host -> device"
    assert to_json({H: 1, (K, D): 2}) == {"host": 1, "disk -> device": 2}
    assert to_json([H, K]) == ["host", "disk"]  # a list of media is no route


def test_other_enums_are_their_values_and_keys_become_strings():
    assert to_json(RemoteMode.TCP) == "tcp"
    assert to_json({RemoteMode.SHM: FetchPath.STAGED, 256: 0.5}) == {"shm": "staged", "256": 0.5}
    with pytest.raises(TypeError):
        to_json({(1, 2): 3})
    with pytest.raises(TypeError):
        to_json(object())


def test_floats_stay_but_json_has_no_infinity():
    assert to_json(0.25) == 0.25
    assert to_json([math.inf, math.nan, -math.inf]) == [None, None, None]
    assert json.loads(dumps({"x": math.inf})) == {"x": None}


def test_nested_frozen_dataclasses_flatten_and_omit():
    class Color(enum.Enum):
        RED = "red"

    @dataclass(frozen=True)
    class Inner:
        a: int
        b: tuple[float, ...]

    @dataclass(frozen=True)
    class Outer:
        inner: Inner = field(metadata=FLATTEN)
        nested: Inner
        color: Color
        where: Path
        bulk: list[int] = field(default_factory=list, metadata=OMIT)

    doc = to_json(Outer(Inner(1, (0.5,)), Inner(2, ()), Color.RED, Path("/tmp/x"), [1, 2, 3]))
    assert doc == {"a": 1, "b": [0.5], "nested": {"a": 2, "b": []}, "color": "red", "where": "/tmp/x"}


def test_goals_keep_their_json_with_the_verdict_computed():
    rows = to_json([Goal(CacheFigure.HOST_STORE, ">=0.95x copy", 0.97, 0.95),
                    Goal(RemoteFigure.of(RemoteMode.SHM, store=False), ">=0.9x raw", 0.8, 0.9),
                    Goal("tiled hbm", "<=5 s", 6.0, 5.0, at_most=True)])
    assert rows == [
        {"figure": "host store", "goal": ">=0.95x copy", "value": 0.97, "target": 0.95, "at_most": False, "passed": True},
        {"figure": "shm restore", "goal": ">=0.9x raw", "value": 0.8, "target": 0.9, "at_most": False, "passed": False},
        {"figure": "tiled hbm", "goal": "<=5 s", "value": 6.0, "target": 5.0, "at_most": True, "passed": False},
    ]
    assert CacheFigure.lookup(16) is CacheFigure.LOOKUP_16


def test_rates_are_median_min_max_and_every_round():
    rounds = Rounds()
    for seconds in (1.0, 0.5, 0.25):
        rounds.add("ours", seconds)
    assert to_json(rounds.rate("ours", 10**9)) == {"gbps": 2.0, "min_gbps": 1.0, "max_gbps": 4.0,
                                                   "runs_gbps": [1.0, 2.0, 4.0]}
    assert to_json(rounds.latency("ours"))["runs_ms"] == [1000.0, 500.0, 250.0]


def test_a_paired_ratio_is_the_median_of_the_rounds_ratios_with_their_spread():
    rounds = Rounds()
    for ours, base in ((1.0, 0.5), (1.0, 2.0), (0.5, 0.5)):  # per round ours/base rate: 0.5, 2.0, 1.0
        rounds.add("ours", ours)
        rounds.add("base", base)
    rates = to_json(rounds.rate_vs("ours", "base", 10**9))
    assert (rates["ratio"], rates["ratio_min"], rates["ratio_max"]) == (1.0, 0.5, 2.0)
    times = to_json(rounds.time_vs("ours", "base"))  # per round ours/base time: 2.0, 0.5, 1.0
    assert (times["ratio"], times["ratio_min"], times["ratio_max"]) == (1.0, 0.5, 2.0)


def test_a_paired_ratio_spread_is_its_lowest_and_highest_round():
    rounds = Rounds()
    for ours, base in ((1.0, 0.5), (0.5, 0.5), (0.25, 1.0)):  # per round: ours 0.5x, 1x, 4x base's rate
        rounds.add("ours", ours)
        rounds.add("base", base)
    rate = rounds.rate_vs("ours", "base", 10**9)
    assert (rate.ratio, rate.ratio_min, rate.ratio_max) == (1.0, 0.5, 4.0)
    time = rounds.time_vs("ours", "base")
    assert (time.ratio, time.ratio_min, time.ratio_max) == (1.0, 0.25, 2.0)
    doc = to_json(rate)
    assert (doc["ratio"], doc["ratio_min"], doc["ratio_max"]) == (1.0, 0.5, 4.0)


def test_remote_modes_paths_and_the_pool_come_out_as_the_old_json():
    pool = PoolSource(PoolOrigin.EMBEDDED, PoolConfig("127.0.0.1:5000", "127.0.0.1:5001"), 1 << 20, 11, 12)
    doc = to_json({
        "pool": pool,
        "modes": {RemoteMode.SHM: Skipped("no daemon")},
        "cache": {FetchPath.DIRECT: PathRestore((R, D), 1.0, 2.0, 0.5, 0.25, 0.75)},
    })
    assert doc["pool"]["source"] == "embedded" and doc["pool"]["master"] == "127.0.0.1:5000"
    assert doc["pool"]["daemon"] == "127.0.0.1:5001" and doc["pool"]["daemon_pid"] == 12
    assert doc["modes"] == {"shm": {"skipped": "no daemon"}}
    assert doc["cache"]["direct"] == {"route": "remote -> device", "restore_gbps": 1.0, "raw_gbps": 2.0, "ratio": 0.5,
                                      "ratio_min": 0.25, "ratio_max": 0.75}  # the old keys, the spread beside them


def test_a_workload_report_is_keyed_by_tier_label_and_keeps_prompts_out():
    host = TierReport(H, turns=2, hit_tokens=10, paths={(H, D): 3}, prompts=((1, 2, 3),), load_sizes=((64, 1),))
    report = WorkloadReport(Path("/models/tiny"), Workload(), {H: host, R: TierReport(R, skipped="--no-pool")})
    doc = json.loads(dumps(report))
    assert doc["model_dir"] == "/models/tiny" and doc["workload"]["block_tokens"] == 256
    assert set(doc["tiers"]) == {"host", "remote"}
    assert doc["tiers"]["host"]["tier"] == "host" and doc["tiers"]["host"]["paths"] == {"host -> device": 3}
    assert "prompts" not in doc["tiers"]["host"] and "load_sizes" not in doc["tiers"]["host"]
    assert doc["tiers"]["remote"]["skipped"] == "--no-pool"
    assert report.prompts == ((1, 2, 3),)


def test_a_flattened_field_may_prefix_or_rename_its_keys_and_a_key_may_name_a_unit():
    @dataclass(frozen=True)
    class Figure:
        value: float = field(metadata=key("{unit}"))
        baseline: float = field(metadata=key("baseline_{unit}"))
        ratio: float = 1.0
        unit: str = field(default="gbps", metadata=OMIT)

    @dataclass(frozen=True)
    class Parent:
        store: Figure = field(metadata=flatten("store_"))
        restore: Figure = field(metadata=flatten("restore_", baseline_gbps="raw_gbps", ratio="ratio"))
        ttfb: Figure = field(metadata=flatten("ttfb_", baseline_ms="raw_ttfb_ms"))

    doc = to_json(Parent(Figure(1.0, 2.0), Figure(3.0, 4.0, 0.75), Figure(5.0, 6.0, unit="ms")))
    assert doc == {"store_gbps": 1.0, "store_baseline_gbps": 2.0, "store_ratio": 1.0,
                   "restore_gbps": 3.0, "raw_gbps": 4.0, "ratio": 0.75,
                   "ttfb_ms": 5.0, "raw_ttfb_ms": 6.0, "ttfb_ratio": 1.0}
