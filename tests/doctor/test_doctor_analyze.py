"""The doctor's analysis on scripted observations: each cause named from its numbers, with the
right one change, and the verdict that follows."""

from __future__ import annotations

import json
import math

import pytest

from kvstrata.doctor.analyze import diagnose
from kvstrata.doctor.expect import Expectations, PrefillSource
from kvstrata.doctor.findings import Cause, Change, Severity, Verdict
from kvstrata.doctor.observation import (
    ConnectorCounters,
    Histogram,
    Leg,
    Observation,
    TierCounters,
    VllmCounters,
)
from kvstrata.hardware.profile import load_profile
from kvstrata.media import Medium
from kvstrata.plan.calpaths import CalPath
from kvstrata.plan.host import RESTORE_FIXED, HostCalibration, PathFit, PrefillFit

BLOCK = 64 * 1024  # the tiny model's 32-token block
MB = 10**6
CALIBRATION = HostCalibration("vm", "cpu", 2, {
    CalPath.MEMCPY_ONE: PathFit(0.0, 1.2), CalPath.DISK_BLOCKS_WARM: PathFit(0.0, 5.4),
    CalPath.DISK_BLOCKS_COLD: PathFit(0.0, 1.1),
    RESTORE_FIXED[Medium.HOST]: PathFit(1.6e-4, math.inf), RESTORE_FIXED[Medium.DISK]: PathFit(3.0e-4, math.inf),
})


def hist(total: float, count: float) -> Histogram:
    return Histogram(((math.inf, count),), count, total)


def vllm(requests=12, prompt=300, local_hits=0.0, external_hits=0.0, computed=None, prefill_s=0.3) -> VllmCounters:
    """vLLM's counters for ``requests`` prompts of ``prompt`` tokens; the computed tokens are what
    neither cache held, computed in ``prefill_s`` (kvstrata's loads included)."""
    tokens = requests * prompt
    computed = tokens - local_hits - external_hits if computed is None else computed
    return VllmCounters(requests, tokens, tokens, local_hits, tokens - local_hits, external_hits, 32, 1280,
                        hist(tokens, requests), hist(computed, requests), hist(prefill_s, requests), hist(0.4, requests))


def tier(medium, hits=0.0, loaded=0.0, used=0.0, capacity=64 * MB, evicted=0.0) -> TierCounters:
    return TierCounters(medium, hits, loaded, loaded * BLOCK, evicted, used, capacity)


def observe(v: VllmCounters | None, c: ConnectorCounters | None) -> Observation:
    return Observation("test", "/models/tiny", v, c)


def test_no_connector_series_is_a_finding_not_a_crash():
    d = diagnose(observe(vllm(), None), Expectations())
    assert d.verdict is Verdict.UNKNOWN
    f = d.finding(Cause.NO_CONNECTOR)
    assert f.severity is Severity.PROBLEM and f.suggestion.change is Change.LOAD_CONNECTOR
    assert "not loaded" in f.explanation
    # a connector that served vLLM but reports nothing: said so, with the tokens it served
    silent = diagnose(observe(vllm(external_hits=1728.0), None), Expectations()).finding(Cause.NO_CONNECTOR)
    assert "served vLLM 1,728 prompt tokens" in silent.explanation


def test_no_reuse_is_reuse_limited_and_a_bigger_tier_is_not_the_change():
    conn = ConnectorCounters(tiers=(tier(Medium.DEVICE, used=8 * MB), tier(Medium.HOST, used=20 * MB)),
                             miss_blocks=108, stored_blocks=108, store_seconds=0.05)
    d = diagnose(observe(vllm(), conn), Expectations())
    f = d.finding(Cause.REUSE_LIMITED)
    assert f.severity is Severity.PROBLEM
    assert f.suggestion.change is Change.DISABLE_CONNECTOR and f.suggestion.change is not Change.BIGGER_TIER
    assert Cause.CAPACITY_LIMITED not in d.causes() and Cause.HELPS not in d.causes()
    assert d.verdict is Verdict.NO_GAIN
    assert d.findings[0] is f  # most severe first


def test_a_full_evicting_last_tier_is_capacity_limited():
    conn = ConnectorCounters(tiers=(tier(Medium.DEVICE, used=64 * MB, evicted=500),
                                    tier(Medium.HOST, hits=40, loaded=40, used=63.5 * MB, evicted=300)),
                             miss_blocks=160, loads=10, load_seconds=0.01)
    d = diagnose(observe(vllm(external_hits=1280.0), conn), Expectations())
    f = d.finding(Cause.CAPACITY_LIMITED)
    assert f.tier is Medium.HOST and f.suggestion.change is Change.BIGGER_TIER and f.suggestion.tier is Medium.HOST
    assert Cause.REUSE_LIMITED not in d.causes()
    # the same misses with room to spare: reuse, and it says a bigger tier would not help
    roomy = ConnectorCounters(tiers=(tier(Medium.HOST, hits=40, loaded=40, used=10 * MB),),
                              miss_blocks=160, loads=10, load_seconds=0.01)
    r = diagnose(observe(vllm(external_hits=1280.0), roomy), Expectations()).finding(Cause.REUSE_LIMITED)
    assert r.severity is Severity.INFO and r.suggestion.change is Change.NONE
    assert "bigger tier would not" in r.explanation


def test_a_workload_that_fits_vllms_own_cache_is_served_by_vllm():
    conn = ConnectorCounters(tiers=(tier(Medium.DEVICE, used=2 * MB),), miss_blocks=27, stored_blocks=27)
    d = diagnose(observe(vllm(requests=30, prompt=100, local_hits=2400.0), conn), Expectations())
    f = d.finding(Cause.VLLM_CACHE_SERVES)
    assert f is not None and f.suggestion.change is Change.NONE
    assert "80%" in f.explanation and "1,280 tokens" in f.explanation
    assert Cause.REUSE_LIMITED not in d.causes()  # the repeats went to vLLM, not missing in kvstrata
    assert d.verdict is Verdict.NO_GAIN


def test_a_slow_disk_loses_to_computing_and_is_below_its_prediction():
    # 54 blocks from disk in 2 s over 6 loads (~0.0018 GB/s); the server computes ~4,400 tokens/s
    conn = ConnectorCounters(tiers=(tier(Medium.DEVICE, used=1 * MB), tier(Medium.DISK, hits=54, loaded=54,
                                                                            used=7 * MB, capacity=256 * MB)),
                             legs=(Leg(Medium.DISK, Medium.DEVICE, 54 * BLOCK, 1.9),),
                             miss_blocks=54, loads=6, load_seconds=2.0, stored_blocks=54)
    v = vllm(external_hits=1728.0, computed=1884.0, prefill_s=2.43)
    d = diagnose(observe(v, conn), Expectations(load_profile("workstation"), CALIBRATION))
    assert d.verdict is Verdict.HURTS and Cause.HELPS not in d.causes()
    slow = d.finding(Cause.SLOWER_THAN_RECOMPUTE)
    assert slow.tier is Medium.DISK and slow.suggestion.change is Change.DISABLE_TIER
    ev = {e.key: e.value for e in slow.evidence}
    assert ev["load_only_s"] > ev["recompute_s"] and ev["break_even_gbps"] > ev["achieved_gbps"]
    below = d.finding(Cause.BELOW_PREDICTION)
    assert below.tier is Medium.DISK and below.suggestion.change is Change.FASTER_PATH
    disk = next(t for t in d.tiers if t.medium is Medium.DISK)
    per_restore_s = 3.0e-4 + 9 * BLOCK / 1.1e9  # the disk's fixed cost + a 9-block restore read cold
    assert disk.predicted_basis == "calibrated" and disk.predicted_gbps == pytest.approx(9 * BLOCK / per_restore_s / 1e9)
    assert disk.achieved_gbps == pytest.approx(54 * BLOCK / 2.0 / 1e9)
    assert "nvme0" in disk.bottleneck  # the spec path's bottleneck link names the drive
    assert d.prefill_basis == "server"


def test_fast_host_restores_help_and_report_hit_rate_per_tier():
    conn = ConnectorCounters(tiers=(tier(Medium.DEVICE, used=1 * MB), tier(Medium.HOST, hits=54, loaded=54,
                                                                            used=7 * MB)),
                             legs=(Leg(Medium.HOST, Medium.DEVICE, 54 * BLOCK, 0.004),),
                             miss_blocks=54, loads=6, load_seconds=0.006, stored_blocks=54)
    d = diagnose(observe(vllm(external_hits=1728.0, computed=1884.0, prefill_s=0.43), conn),
                 Expectations(load_profile("workstation"), CALIBRATION))
    assert d.verdict is Verdict.HELPS
    f = d.finding(Cause.HELPS)
    ev = {e.key: e.value for e in f.evidence}
    assert ev["host_hit_rate"] == pytest.approx(0.5) and ev["saved_s"] > 0
    assert f.suggestion.change is Change.NONE
    assert Cause.SLOWER_THAN_RECOMPUTE not in d.causes() and Cause.BELOW_PREDICTION not in d.causes()
    host = next(t for t in d.tiers if t.medium is Medium.HOST)
    assert host.seconds_per_block < host.recompute_s_per_block


def test_the_profile_prefill_can_be_asked_for_and_changes_the_judgement():
    conn = ConnectorCounters(tiers=(tier(Medium.DISK, hits=54, loaded=54, used=7 * MB),),
                             miss_blocks=54, loads=6, load_seconds=2.0)
    obs = observe(vllm(external_hits=1728.0, computed=1884.0, prefill_s=2.43), conn)
    slow_prefill = PrefillFit(0.5, 100.0)  # a profile whose model computes 100 tokens/s: loading wins
    d = diagnose(obs, Expectations(prefill=slow_prefill, prefill_source=PrefillSource.PROFILE))
    assert d.prefill_basis == "profile" and Cause.SLOWER_THAN_RECOMPUTE not in d.causes()
    assert diagnose(obs, Expectations(prefill=slow_prefill)).prefill_basis == "server"  # auto: the server's


def test_several_tiers_share_the_load_time_by_their_legs():
    conn = ConnectorCounters(tiers=(tier(Medium.HOST, hits=50, loaded=50), tier(Medium.DISK, hits=50, loaded=50)),
                             legs=(Leg(Medium.HOST, Medium.DEVICE, 50 * BLOCK, 0.01),
                                   Leg(Medium.DISK, Medium.HOST, 50 * BLOCK, 0.09)),
                             loads=10, load_seconds=0.2)
    d = diagnose(observe(vllm(external_hits=3200.0), conn), Expectations())
    host, disk = (next(t for t in d.tiers if t.medium is m) for m in (Medium.HOST, Medium.DISK))
    # disk -> host -> device costs 0.09 + 0.01 per its bytes, host -> device 0.01: 10 to 1
    assert disk.seconds_per_block * 50 == pytest.approx(0.2 * 10 / 11)
    assert host.seconds_per_block * 50 == pytest.approx(0.2 * 1 / 11)


def test_failed_loads_say_what_they_cost():
    conn = ConnectorCounters(tiers=(tier(Medium.HOST, hits=100, loaded=90),), loads=10, load_seconds=0.05,
                             load_failed_blocks=10, recomputed_blocks=10)
    d = diagnose(observe(vllm(external_hits=2880.0), conn), Expectations())
    f = d.finding(Cause.LOAD_FAILURES)
    ev = {e.key: e.value for e in f.evidence}
    assert f.severity is Severity.PROBLEM and ev["failed_share"] == pytest.approx(10 / 90)
    assert ev["recompute_lost_s"] > 0 and "computed 10 blocks again" in f.explanation


def test_hits_the_scheduler_declined_are_told_and_ask_for_no_change():
    from dataclasses import replace

    disk = replace(tier(Medium.DISK, hits=100, loaded=0), declined_blocks=96)
    conn = ConnectorCounters(tiers=(tier(Medium.HOST, hits=0, loaded=0), disk), loads=1, load_seconds=0.04,
                             load_failed_blocks=4, recomputed_blocks=4)
    d = diagnose(observe(vllm(), conn), Expectations())
    f = d.finding(Cause.DECLINED)
    assert f.tier is Medium.DISK and f.severity is Severity.INFO and f.suggestion.change is Change.NONE
    assert {e.key: e.value for e in f.evidence} == {"declined_blocks": 96}
    assert d.verdict is not Verdict.HURTS  # kvstrata computed them: it did not wait on the disk
    assert d.finding(Cause.LOAD_FAILURES) is not None  # the load that found it slow is still told


def test_an_uncalibrated_profile_predicts_from_the_spec_path():
    conn = ConnectorCounters(tiers=(tier(Medium.DISK, hits=54, loaded=54),), loads=6, load_seconds=2.0)
    d = diagnose(observe(vllm(external_hits=1728.0), conn), Expectations(load_profile("workstation")))
    disk = d.tiers[0]
    assert disk.predicted_basis == "spec" and disk.predicted_gbps == pytest.approx(disk.spec_gbps, rel=0.05)


def test_no_traffic_and_json_without_infinities():
    empty = diagnose(observe(vllm(requests=0, prompt=0), ConnectorCounters()), Expectations())
    assert empty.verdict is Verdict.UNKNOWN and empty.causes() == {Cause.NO_TRAFFIC}
    conn = ConnectorCounters(tiers=(tier(Medium.HOST, hits=54, loaded=54, used=7 * MB),), miss_blocks=54, loads=6,
                             load_seconds=0.006)
    doc = diagnose(observe(vllm(external_hits=1728.0), conn), Expectations(load_profile("workstation"),
                                                                          CALIBRATION)).to_json()
    text = json.dumps(doc, allow_nan=False)
    assert json.loads(text)["findings"][0]["change"]["kind"] in {c.value for c in Change}


def test_histogram_quantiles_follow_prometheus():
    h = Histogram(((10.0, 2.0), (20.0, 6.0), (math.inf, 8.0)), 8.0, 120.0)
    assert h.quantile(0.25) == pytest.approx(10.0)
    assert h.quantile(0.5) == pytest.approx(15.0)  # 4th of 8: halfway through (10, 20]
    assert h.quantile(0.9) == 20.0  # in the +Inf bucket: the highest finite bound
    assert h.mean == 15.0 and Histogram((), 0, 0).quantile(0.5) is None


def test_the_analysis_is_pure():
    """Imported in a fresh interpreter, the doctor's core leaves torch unloaded and opens no socket."""
    import subprocess
    import sys

    code = ("import sys, kvstrata.doctor.analyze, kvstrata.doctor.derive, kvstrata.doctor.expect; "
            "print(sorted(m for m in ('torch', 'socket', 'urllib.request', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
