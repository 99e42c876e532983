"""bench route's plan (passes, the SLO and goodput, the prefill fit) and its report from passes'
records and counters (pure: no server, no network)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvstrata.bench.route_plan import POLICIES, Pass, RouteBenchConfig, per_token_s, plan_passes
from kvstrata.bench.route_report import PassRun, build_report, ttft_figure
from kvstrata.calibrate.serving.counters import Counters
from kvstrata.calibrate.serving.measured import RequestRecord
from kvstrata.calibrate.serving.servers import Instance, ServeBenchConfig
from kvstrata.calibrate.serving.workload import ServeWorkload
from kvstrata.fleet.scorer import Policy
from kvstrata.media import Medium
from kvstrata.report import dumps
from kvstrata.rounds import Skipped
from kvstrata.slo import Slo, goodput

RR, DYN, PRED = Policy.ROUND_ROBIN, Policy.DYNAMO, Policy.PREDICTED_TTFT


def record(ttft_s: float, tpot_s: float | None = 0.01, prompt: tuple[int, ...] = (1, 2, 3), answer=(7, 8),
           sent_s: float = 0.0) -> RequestRecord:
    return RequestRecord(0, 0, Instance.OURS, len(prompt), tuple(answer), ttft_s, tpot_s, ttft_s + 0.02, sent_s,
                         prompt=prompt)


def config(policies=(RR, DYN, PRED), rounds=2, slo=Slo(0.1, 0.05)) -> RouteBenchConfig:
    serve = ServeBenchConfig(ServeWorkload(), Path("/models/tiny"), 4096, 4096, rounds=rounds)
    return RouteBenchConfig(serve, 2, policies, slo)


def test_each_round_runs_every_policy_once_in_a_rotated_order_on_tokens_of_its_own():
    passes = plan_passes((RR, DYN, PRED), 3)
    assert [[p.policy for p in r] for r in passes] == [[RR, DYN, PRED], [DYN, PRED, RR], [PRED, RR, DYN]]
    variants = [p.variant for r in passes for p in r]
    assert len(set(variants)) == len(variants) == 9  # no pass shares another's token ids
    assert all(p.round == n and p.position == i for n, r in enumerate(passes) for i, p in enumerate(r))
    with pytest.raises(ValueError):
        plan_passes((RR,), 0)


def test_round_robin_is_always_compared_and_the_config_refuses_what_it_cannot_run():
    assert config(policies=(PRED,)).policies == (RR, PRED)  # the ratios' base is added
    assert RouteBenchConfig(config().serve).policies == POLICIES
    with pytest.raises(ValueError, match="servers"):
        RouteBenchConfig(config().serve, servers=4)
    with pytest.raises(ValueError, match="twice"):
        RouteBenchConfig(config().serve, policies=(RR, RR))
    with pytest.raises(ValueError, match="ttft_s"):
        Slo(0.0, 0.05)


def test_goodput_counts_requests_meeting_both_targets_and_a_one_token_answer_by_ttft_alone():
    slo = Slo(0.1, 0.05)
    records = [record(0.05), record(0.2), record(0.05, tpot_s=0.06), record(0.1, tpot_s=None)]
    g = goodput(records, slo, span_s=2.0)
    assert (g.met, g.requests, g.share, g.per_s) == (2, 4, 0.5, 1.0)
    assert math.isnan(goodput([], slo, 1.0).share)


def test_the_prefill_rate_is_the_slope_between_two_lengths_or_an_upper_bound_under_noise():
    assert per_token_s([(100, 0.02)] * 3, [(500, 0.06)] * 3) == pytest.approx(1e-4)
    # the long prompts no slower than the short (noise): their TTFT over their tokens
    assert per_token_s([(100, 0.05)], [(500, 0.04)]) == pytest.approx(0.04 / 500)
    with pytest.raises(ValueError):
        per_token_s([], [(500, 0.04)])
    with pytest.raises(ValueError):
        per_token_s([(500, 0.04)], [(100, 0.05)])


def pass_run(plan: Pass, ttfts: list[float], answered: dict[str, int], hits: int = 0) -> PassRun:
    records = tuple(record(t, prompt=(plan.variant, i), sent_s=i * 0.5) for i, t in enumerate(ttfts))
    counters = {"server-1": Counters({Medium.HOST: hits}, connector=True, prefix_queries_tokens=100,
                                     prefix_hits_tokens=40),
                "server-2": Counters({Medium.REMOTE: hits}, connector=True, prefix_queries_tokens=100)}
    return PassRun(plan, records, counters, answered, wall_s=2.0)


def test_the_report_gives_each_policy_its_figures_and_per_round_ratios_to_round_robin():
    cfg = config(policies=(RR, PRED))
    plans = [p for r in plan_passes(cfg.policies, 2) for p in r]
    ttft = {(RR, 0): [0.10, 0.20], (PRED, 0): [0.05, 0.10], (RR, 1): [0.10, 0.10], (PRED, 1): [0.08, 0.08]}
    answered = {RR: {"server-1": 1, "server-2": 1}, PRED: {"server-1": 2}}
    runs = [pass_run(p, ttft[p.policy, p.round], answered[p.policy], hits=3 if p.policy is PRED else 1) for p in plans]
    reference = {r.prompt: r for run in runs for r in run.records}  # every answer as the cold server gave it
    report = build_report(cfg, "generated", ["server-1", "server-2"], runs, reference, Skipped("not installed"),
                          "restores from a test", None, {"server-1": 20.0, "server-2": 21.0}, 99.0)
    assert report.orders == ((RR, PRED), (PRED, RR))
    pred, rr = report.result(PRED), report.result(RR)
    assert len(pred.measured.requests) == 4 and pred.requests_per_server == {"server-1": 4, "server-2": 0}
    assert rr.requests_per_server == {"server-1": 2, "server-2": 2}
    # per round: p50 0.075/0.15 = 0.5 and 0.08/0.10 = 0.8; the median of the two, and its spread
    v = pred.versus_round_robin
    assert (v.ttft_p50.median, v.ttft_p50.min, v.ttft_p50.max, v.ttft_p50.rounds) == pytest.approx((0.65, 0.5, 0.8, 2))
    assert rr.versus_round_robin.ttft_p50.median == 1.0
    # hits per tier: both servers' counters summed over the policy's passes
    assert pred.measured.hits[Medium.HOST].blocks == 6 and pred.measured.hits[Medium.REMOTE].blocks == 6
    assert pred.measured.vllm_prefix_hit_rate == pytest.approx(80 / 400)
    # goodput at TTFT <= 100 ms: every predicted-ttft request, 3 of round robin's 4
    assert (pred.goodput.share, rr.goodput.share) == (1.0, 0.75)
    assert v.goodput_share.median == 1.5  # per round 1/0.5 and 1/1
    assert report.identical and report.reference_prompts == 8
    doc = json.loads(dumps(report))
    assert [r["policy"] for r in doc["results"]] == ["round-robin", "predicted-ttft"]
    assert doc["sglang"] == {"skipped": "not installed"} and doc["config"]["slo"] == {"ttft_s": 0.1, "tpot_s": 0.05}
    assert doc["results"][1]["versus_round_robin"]["ttft_p50"]["median"] == pytest.approx(0.65)
    assert ttft_figure(report).axes[0].get_title().startswith("TTFT CDF per routing policy")


def test_a_completion_unlike_the_cold_servers_is_reported():
    cfg = config(policies=(RR,), rounds=1)
    run = pass_run(plan_passes(cfg.policies, 1)[0][0], [0.05], {"server-1": 1})
    wrong = {run.records[0].prompt: record(0.05, prompt=run.records[0].prompt, answer=(9, 9))}
    report = build_report(cfg, "t", ["server-1", "server-2"], [run], wrong, Skipped("x"), "", None, {}, 1.0)
    assert not report.identical and report.result(RR).measured.differing == 1


def test_the_table_renders_every_policy_and_says_why_sglang_did_not_run(capsys, monkeypatch):
    from kvstrata.bench.cli.route import _print_route

    cfg = config(policies=(RR, PRED), rounds=1)
    runs = [pass_run(p, [0.05, 0.2], {"server-1": 2}) for p in plan_passes(cfg.policies, 1)[0]]
    reference = {r.prompt: r for run in runs for r in run.records}
    report = build_report(cfg, "generated", ["server-1", "server-2"], runs, reference,
                          Skipped("sglang-router is not installed here"), "a test", None, {"server-1": 20.0}, 5.0)
    monkeypatch.setenv("COLUMNS", "250")  # no line wraps inside a phrase asserted
    _print_route(report)
    out = capsys.readouterr().out
    assert "round-robin" in out and "predicted-ttft" in out and "sglang-router is not installed here" in out
    assert "TTFT <= 100 ms and TPOT <= 50 ms" in out and "every one equals the reference's" in out
