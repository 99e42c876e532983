"""bench serve's figures from records and counters, the reference's check, the paired ratios,
the report assembled from the runs, and the servers' specs (pure: no server, no network)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pytest

from kvstrata.calibrate.serving.client import lead
from kvstrata.calibrate.serving.servers import Instance, ServeBenchConfig, cpu_halves, server_specs
from kvstrata.calibrate.serving.counters import Counters, counters_of
from kvstrata.calibrate.serving.workload import ServeWorkload, WorkloadKind, plan_conversations, round_plans
from kvstrata.bench.serve_report import (
    PhaseRun,
    RestartRun,
    RoundRun,
    RunLog,
    ServeRound,
    build_report,
    checked,
    versus,
)
from kvstrata.calibrate.serving.measured import RequestRecord, measure, percentile
from kvstrata.media import Medium
from kvstrata.report import dumps
from kvstrata.sim.trace import Request

VOCAB = 4096
METRICS = 'vllm:prefix_cache_queries_total{engine="0"} 1000.0\nvllm:prefix_cache_hits_total{engine="0"} 250.0\n' \
          'kvstrata_connector_lookup_hit_blocks_total{engine="0",tier="host"} 12.0\n'
STATS = {"load_paths": {"host -> device": 12}, "load_requests": 4, "load_seconds": 0.2, "restored_bytes": 1000}


def test_percentiles_interpolate_between_ranks():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert (percentile(values, 0), percentile(values, 50), percentile(values, 100)) == (1.0, 3.0, 5.0)
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile([2.0], 99) == 2.0 and math.isnan(percentile([], 50))


def record(conversation: int, sent_s: float, ttft_s: float, ids=(1, 2, 3), prompt=(7,) * 64,
           tpot_s: float | None = 0.01) -> RequestRecord:
    return RequestRecord(conversation, 0, Instance.OURS, len(prompt), tuple(ids), ttft_s, tpot_s, ttft_s + 0.02,
                         sent_s, prompt=tuple(prompt))


def test_figures_of_a_configuration():
    records = [record(0, 0.0, 0.10), record(1, 0.5, 0.30), record(2, 1.0, 0.20)]
    counters = counters_of(METRICS, STATS)
    m = measure(records, counters, block_tokens=32)
    assert m.ttft_s == (0.10, 0.30, 0.20) and m.ttft_p50_s == 0.20
    assert m.wall_s == pytest.approx(1.22) and m.requests_per_s == pytest.approx(3 / 1.22)
    assert m.output_tokens_per_s == pytest.approx(9 / 1.22)
    assert m.hits[Medium.HOST].tokens == 12 * 32 and m.hits[Medium.HOST].rate == pytest.approx(384 / 192)
    assert m.identical is None and m.load_seconds_per_load == pytest.approx(0.05)


def test_the_connectors_cpu_per_request_is_the_phases_seconds_over_its_requests():
    cpu = 'kvstrata_connector_cpu_seconds_total{engine="0",model_name="m",side="scheduler"} %s\n' \
          'kvstrata_connector_cpu_seconds_total{engine="0",model_name="m",side="worker"} %s\n'
    phase = counters_of(cpu % (0.104, 1.02), STATS).minus(counters_of(cpu % (0.1, 1.0), STATS))
    records = [record(i, 0.1 * i, 0.1) for i in range(4)]
    m = measure(records, phase, 32)
    assert m.connector_cpu_per_request.scheduler_s == pytest.approx(0.001)
    assert m.connector_cpu_per_request.worker_s == pytest.approx(0.005)
    doc = json.loads(dumps(m))
    assert doc["connector_cpu_per_request"] == pytest.approx({"scheduler_s": 0.001, "worker_s": 0.005,
                                                              "copied_bytes": 0.0, "checksummed_bytes": 0.0})
    older = measure(records, counters_of(METRICS, STATS), 32)  # a connector without the counter
    assert older.connector_cpu_per_request is None and "connector_cpu_per_request" not in json.loads(dumps(older))
    assert measure([], phase, 32).connector_cpu_per_request is None


def answers(by_prompt: dict, leads=()) -> dict:
    """The reference's records for ``{prompt: answer ids}`` (its choices' leads: ``leads``)."""
    return {p: replace(record(0, 0.0, 0.1, ids=ids, prompt=p), leads=tuple(leads)) for p, ids in by_prompt.items()}


def test_completions_are_checked_against_the_reference_by_prompt():
    good, bad = record(0, 0.0, 0.1, ids=(1, 2, 3), prompt=(5,) * 40), record(1, 0.1, 0.1, ids=(1, 2, 9), prompt=(6,) * 40)
    prefill = record(1, 0.2, 0.1, ids=(1,), prompt=(6,) * 40)  # one token: the reference's first
    reference = answers({(5,) * 40: (1, 2, 3), (6,) * 40: (1, 2, 3)})
    a, b, c = checked([good, bad, prefill], reference)
    assert (a.identical, b.identical, c.identical) == (True, False, True)
    m = measure([a, b], Counters(), 32)
    assert m.identical is False and m.differing == 1


def test_an_answer_that_leaves_the_reference_at_a_near_tie_is_counted_apart_not_as_differing():
    tie, far, late = ((5,) * 40, (6,) * 40, (7,) * 40)
    reference = {**answers({tie: (1, 2, 3), far: (1, 2, 3)}, leads=(3.0, 0.1, 4.0)),
                 **answers({late: (1, 2, 3)}, leads=(3.0, 2.0, 0.01))}
    got = [record(0, 0.0, 0.1, ids=(1, 8, 9), prompt=tie),  # left it where the lead was 0.1: rounding
           record(1, 0.0, 0.1, ids=(7, 2, 3), prompt=far),  # left it where the lead was 3: not rounding
           record(2, 0.0, 0.1, ids=(1, 2, 3), prompt=late)]
    a, b, c = checked(got, reference, tie_nats=0.25)
    assert (a.identical, a.near_tie, b.identical, b.near_tie, c.identical, c.near_tie) == (
        False, True, False, False, True, False)
    m = measure([a, b, c], Counters(), 32)
    assert (m.identical, m.differing, m.near_ties) == (False, 1, 1)
    assert measure([a, c], Counters(), 32).identical is True  # a near-tie alone does not fail the check
    x, = checked(got[:1], reference, tie_nats=0.0)  # float32: only identical answers pass
    assert (x.near_tie, measure([x], Counters(), 32).differing) == (False, 1)
    assert lead({"token_id:4": -0.1, "token_id:9": -2.6}) == pytest.approx(2.5) and lead({"token_id:4": 0.0}) == math.inf


def test_ratios_are_per_round_then_the_median_with_its_spread():
    def figures(ttft: float) -> object:
        return measure([record(0, 0.0, ttft, tpot_s=ttft / 10), record(1, 1.0, ttft, tpot_s=ttft / 10)], Counters(), 32)

    rounds = [ServeRound(r, (Instance.OURS, Instance.BASELINE), figures(base), figures(ours))
              for r, (base, ours) in enumerate([(0.2, 0.1), (0.4, 0.1), (0.1, 0.1)])]
    v = versus(rounds)
    assert (v.ttft_p50.median, v.ttft_p50.min, v.ttft_p50.max, v.ttft_p50.rounds) == (0.5, 0.25, 1.0, 3)
    assert (v.tpot_p50.median, v.tpot_p50.min, v.tpot_p50.max) == pytest.approx((0.5, 0.25, 1.0))


def test_the_servers_sizes_roles_and_prefix_caching(tmp_path):
    w = ServeWorkload(max_model_len=256, block_tokens=32)
    config = ServeBenchConfig(w, Path("/m"), VOCAB, 65536, kv_blocks=9, host_bytes=1 << 24, disk_bytes=1 << 25,
                              remote_bytes=1 << 24)
    specs = server_specs(config, tmp_path, tmp_path / "pool.json", "ns", {})
    assert set(specs) == set(Instance)
    assert specs[Instance.BASELINE].connector is None and specs[Instance.BASELINE].prefix_caching
    assert specs[Instance.REFERENCE].connector is None and not specs[Instance.REFERENCE].prefix_caching
    ours, second = specs[Instance.OURS].connector, specs[Instance.SECOND].connector
    assert ours["device_bytes"] == 9 * 65536 and ours["disk_dir"] != second["disk_dir"]
    assert ours["pool"] == second["pool"] and ours["model_id"] == second["model_id"] == "ns"
    assert (specs[Instance.PREFILL].kv_role, specs[Instance.DECODE].kv_role) == ("kv_producer", "kv_consumer")
    assert "disk_dir" not in specs[Instance.DECODE].connector  # its KV can only come from the pool
    assert all(s.kv_blocks == 9 and s.block_size == 32 for s in specs.values())
    bound = {i: s.env.get("VLLM_CPU_OMP_THREADS_BIND") for i, s in
             server_specs(config, tmp_path, tmp_path / "pool.json", "ns", {"X": "1"}, ("0", "1")).items()}
    assert bound[Instance.BASELINE] == bound[Instance.OURS] != bound[Instance.SECOND]  # the rounds: like with like
    assert bound[Instance.PREFILL] != bound[Instance.DECODE] and bound[Instance.REFERENCE] is None
    alone = server_specs(config, tmp_path, None, "ns", {})
    assert set(alone) == {Instance.BASELINE, Instance.OURS, Instance.REFERENCE} and "pool" not in alone[Instance.OURS].connector
    with pytest.raises(ValueError, match="--kv-blocks >= 9"):
        ServeBenchConfig(w, Path("/m"), VOCAB, 65536, kv_blocks=8)


def test_the_report_checks_every_run_and_splits_the_two_servers_turns():
    w = ServeWorkload(conversations=2, turns=1, max_model_len=256)
    config = ServeBenchConfig(w, Path("/m"), VOCAB, 65536, rounds=2, kv_blocks=9, host_bytes=1 << 24,
                              disk_bytes=1 << 25, remote_bytes=1 << 24)
    plans = plan_conversations([Request(0, 600, 5, (1, 2)), Request(1, 900, 5, (3, 4))], w, VOCAB)

    def run(instance: Instance, *prompts: tuple[int, ...], counters: Counters = Counters()) -> PhaseRun:
        records = tuple(RequestRecord(i, 0, instance if instance is not Instance.SECOND or i % 2 else Instance.OURS,
                                      len(p), (1, 2), 0.1, 0.01, 0.2, float(i), prompt=p) for i, p in enumerate(prompts))
        return PhaseRun(records, {Instance.OURS: counters, Instance.SECOND: counters, Instance.BASELINE: Counters(),
                                  instance: counters})

    a, b = (5,) * 40, (6,) * 40
    ours = counters_of(METRICS, STATS)
    rounds = tuple(RoundRun((Instance.OURS, Instance.BASELINE), {Instance.BASELINE: run(Instance.BASELINE, a, b),
                                                                  Instance.OURS: run(Instance.OURS, a, b, counters=ours)})
                   for _ in range(2))
    ran = RunLog(rounds, run(Instance.SECOND, a, b, counters=ours), RestartRun(Instance.SECOND, run(Instance.SECOND, b), 19.0, ""),
                 None)
    reference = answers({a: (1, 2), b: (1, 3)})  # b's answer differs from the reference's
    report = build_report(config, "t", plans, ran, reference, None, (None, "none", 2), "--no-pool", {}, {}, 9.0)
    assert len(report.kvstrata.requests) == 4 and report.kvstrata.wall_s == pytest.approx(2 * 1.2)
    assert report.kvstrata.hits[Medium.HOST].blocks == 24  # both rounds' counters
    assert report.kvstrata.identical is False and report.kvstrata.differing == 2 and report.identical is False
    assert [r.server for r in report.shared_pool.servers[Instance.SECOND].requests] == [Instance.SECOND]
    assert report.restart.server is Instance.SECOND and report.restart.replay.identical is False
    assert report.prefill_decode.skipped == "--no-pool" and report.reference_prompts == 2
    assert report.versus.ttft_p50.rounds == 2 and report.opener_tokens == tuple(len(p.opener) for p in plans)


def test_concurrent_servers_get_halves_of_the_cpus():
    assert cpu_halves([0]) is None
    assert cpu_halves([3, 0, 1, 2]) == ("0,1", "2,3")
    # --server-cpus: the rounds' servers on the CPUs named, the servers beside them keep their half
    assert cpu_halves([3, 0, 1, 2], "0-3") == ("0-3", "2,3") and cpu_halves([0], "0") == ("0", "0")
    mine = str(min(os.sched_getaffinity(0)))  # a CPU this process may use (the config checks)
    config = ServeBenchConfig(ServeWorkload(), Path("/m"), VOCAB, 65536, server_cpus=mine)
    specs = server_specs(config, Path("/w"), None, "ns", {}, cpu_halves([0, 1, 2, 3], config.server_cpus))
    assert specs[Instance.BASELINE].env["VLLM_CPU_OMP_THREADS_BIND"] == specs[Instance.OURS].env[
        "VLLM_CPU_OMP_THREADS_BIND"] == mine
    with pytest.raises(ValueError, match="CPU 4095 is not among this host's CPUs"):
        ServeBenchConfig(ServeWorkload(), Path("/m"), VOCAB, 65536, server_cpus="4095")
    with pytest.raises(ValueError, match="server_cpus must be a CPU list such as '0-3'"):
        ServeBenchConfig(ServeWorkload(), Path("/m"), VOCAB, 65536, server_cpus="3-1")


def test_a_no_reuse_report_has_the_rounds_alone_and_says_why_the_rest_was_skipped():
    w = ServeWorkload(conversations=2, turns=1, max_model_len=256, kind=WorkloadKind.NO_REUSE)
    config = ServeBenchConfig(w, Path("/m"), VOCAB, 65536, rounds=1, kv_blocks=9, host_bytes=1 << 24,
                              disk_bytes=1 << 25, remote_bytes=1 << 24)
    (sent,) = round_plans([Request(0, 600, 5, (1, 2)), Request(1, 900, 5, (1, 2))], w, VOCAB, rounds=1)

    def run(instance: Instance, plans) -> PhaseRun:
        records = tuple(RequestRecord(p.index, 0, instance, len(p.opener), (1, 2), 0.1, 0.01, 0.2, float(p.index),
                                      prompt=p.opener) for p in plans)
        return PhaseRun(records, {instance: Counters()})

    ran = RunLog((RoundRun((Instance.OURS, Instance.BASELINE), {Instance.BASELINE: run(Instance.BASELINE, sent[0]),
                                                                 Instance.OURS: run(Instance.OURS, sent[1])}),),
                 None, None, None)
    assert len(ran.runs()) == 2
    reference = answers({r.prompt: (1, 2) for run in ran.runs() for r in run.records})
    assert len(reference) == 4  # each server of the round was sent prompts of its own
    report = build_report(config, "t", sent[0], ran, reference, None, (None, "none", 2), None, {}, {}, 9.0)
    why = "--workload no-reuse"
    assert report.shared_pool.skipped == report.restart.skipped == report.prefill_decode.skipped == why
    assert report.identical and report.kvstrata.identical and report.reference_prompts == 4


def test_prefill_against_restore_is_the_quickest_first_turn_over_a_copy_and_checksum_of_its_kv():
    from kvstrata.bench.serve_report import prefill_vs_restore
    from kvstrata.calibrate.serving.counters import ByteRates

    first = [replace(record(i, 0.0, ttft, prompt=(7,) * 1000), turn=0) for i, ttft in enumerate((4.0, 2.0))]
    later = [replace(record(2, 0.0, 0.1, prompt=(7,) * 10), turn=1)]  # a later turn's TTFT is no prefill of its prompt
    baseline = measure(first + later, Counters(), 128)
    pr = prefill_vs_restore(baseline, ByteRates(copy_gbps=4.0, checksum_gbps=12.0), bytes_per_token=12000)
    assert pr.prefill_s_per_token == pytest.approx(2.0 / 1000)
    assert pr.restore_s_per_token == pytest.approx(12000 / 4e9 + 12000 / 12e9)
    assert pr.ratio == pytest.approx(0.002 / 4e-6)
    assert prefill_vs_restore(baseline, None, 12000) is None  # no rates measured: no ratio
