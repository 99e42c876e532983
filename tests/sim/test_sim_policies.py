"""A simulated fleet routed by the router's policies (kvstrata.sim.fleet): where a trace reuses long
prefixes and each instance's HBM holds only some of them, the policies that see the caches keep
each prefix on an instance and beat round robin on TTFT; the run is deterministic, and the fleet's
index ends holding exactly what the instances' caches hold."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from kvstrata.fleet.scorer import Policy
from kvstrata.hardware.profile import load_profile
from kvstrata.kv.presets import load_geometry
from kvstrata.cli.simulate import versus_round_robin
from kvstrata.media import Medium
from kvstrata.policies.write import WritePolicy
from kvstrata.sim.config import SimConfig
from kvstrata.sim.engine import Simulation
from kvstrata.sim.run import simulate
from kvstrata.sim.tiers import parse_arch
from kvstrata.sim.trace import BLOCK_TOKENS, Request
from kvstrata.slo import Slo

PREFIX_BLOCKS = 16


def prefix_reuse(requests=400, prefixes=8, gap_ms=60, seed=1) -> list[Request]:
    """Each request: one of ``prefixes`` shared prefixes of 16 blocks, then one block of its own."""
    rng = random.Random(seed)
    out = []
    for i in range(requests):
        p = rng.randrange(prefixes)
        ids = tuple(p * 1000 + b for b in range(PREFIX_BLOCKS)) + (10**6 + i,)
        out.append(Request(i * gap_ms, (PREFIX_BLOCKS + 1) * BLOCK_TOKENS, 8, ids))
    return out


@pytest.fixture(scope="module")
def config():
    # 4 instances of one H200, each HBM cache holding 3 of the 8 prefixes: round robin sends every
    # prefix everywhere and they evict each other; a policy that sees the caches spreads them.
    return SimConfig(load_geometry("llama-3-8b"), load_profile("h200-cx7-gen5"), 1, 4,
                     tier_tokens=((Medium.DEVICE, 3 * (PREFIX_BLOCKS + 1) * BLOCK_TOKENS),))


def test_policies_that_see_the_caches_beat_round_robin_on_ttft(config):
    summaries, _ = simulate(prefix_reuse(), config, ["hbm"], policies=list(Policy))
    by = {s.arch: s for s in summaries}
    rr = by["hbm / round-robin"]
    for name in ("predicted-ttft", "dynamo", "llm-d"):
        s = by[f"hbm / {name}"]
        assert s.ttft_s["p90"] <= 0.5 * rr.ttft_s["p90"], (name, s.ttft_s, rr.ttft_s)
        assert s.ttft_s["p50"] < rr.ttft_s["p50"]
        assert s.hit_rate[Medium.DEVICE] > rr.hit_rate[Medium.DEVICE] + 0.1


def test_a_policys_run_is_deterministic(config):
    trace = prefix_reuse(requests=150)
    runs = [simulate(trace, config, ["hbm"], policies=[Policy.PREDICTED_TTFT])[1][0] for _ in range(2)]
    assert [(r.instance, r.first_token_s) for r in runs[0].records] == \
        [(r.instance, r.first_token_s) for r in runs[1].records]


def test_the_index_ends_as_the_caches_and_the_queues_empty(config):
    sim = Simulation(prefix_reuse(requests=150), replace(config, policy=Policy.DYNAMO), parse_arch("hbm"))
    sim.run()
    for inst in sim.instances:
        assert inst.queued_tokens == 0
        assert sim._fleet.index.count(f"instance-{inst.index}", Medium.DEVICE) == len(inst.caches[Medium.DEVICE])
    assert len({r.instance for r in sim.records}) == 4  # every instance was used


def test_simulate_policy_all_prints_a_ttft_table_per_policy(tmp_path, capsys):
    from kvstrata.cli import main
    from kvstrata.sim.traceio import write_trace

    trace = tmp_path / "t.jsonl"
    write_trace(trace, prefix_reuse(requests=120))
    argv = ["simulate", "--trace", str(trace), "--hardware", "h200-cx7-gen5", "--model", "llama-3-8b",
            "--arch", "hbm", "--instances", "4", "--gpus-per-instance", "1"]
    assert main([*argv, "--policy", "all", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["policies"] == [p.value for p in Policy]
    assert {a["arch"] for a in doc["architectures"]} == {f"hbm / {p.value}" for p in Policy}
    assert {a["arch"]: a["policy"] for a in doc["architectures"]} == {f"hbm / {p.value}": p.value for p in Policy}
    assert main([*argv, "--policy", "all"]) == 0
    assert "TTFT per routing policy" in capsys.readouterr().out
    # Write-back's label ends "hbm / round-robin (write-back)": round robin's row is still found, by its policy.
    assert main([*argv, "--policy", "all", "--write", "back"]) == 0
    assert "1.00x" in capsys.readouterr().out
    assert main([*argv, "--policy", "fastest"]) == 2
    assert "unknown routing policy 'fastest'" in capsys.readouterr().err


def test_each_run_is_compared_with_round_robin_on_what_ran_not_on_its_label(config):
    summaries, _ = simulate(prefix_reuse(requests=150), config, ["hbm", "hbm+dram"], write=WritePolicy.WRITE_BACK,
                            policies=[Policy.DYNAMO, Policy.ROUND_ROBIN])
    assert "hbm / round-robin (write-back)" in {s.arch for s in summaries}  # the policy inside the label
    rr = {s.spec: s.ttft_s["p90"] for s in summaries if s.policy is Policy.ROUND_ROBIN}
    # Labels that name nothing (an architecture or policy renamed for display): the same comparison.
    relabelled = [replace(s, arch=f"x / y / {i}") for i, s in enumerate(summaries)]
    rows = versus_round_robin(relabelled)
    assert len(rows) == 4 and {(s.spec.name, s.policy) for s, _ in rows} == \
        {(a, p) for a in ("hbm", "hbm+dram") for p in (Policy.DYNAMO, Policy.ROUND_ROBIN)}
    for s, ratio in rows:
        assert ratio == pytest.approx(s.ttft_s["p90"] / rr[s.spec]), s.arch
        if s.policy is Policy.ROUND_ROBIN:
            assert ratio == 1.0
    assert [s.spec.name for s, _ in rows] == ["hbm", "hbm", "hbm+dram", "hbm+dram"]  # grouped by architecture


def one_hot_prefix(requests=1500, gap_ms=40) -> list[Request]:
    """Every request: the same 16-block prefix, one block of its own, 128 tokens out (a minute at 25/s)."""
    return [Request(i * gap_ms, (PREFIX_BLOCKS + 1) * BLOCK_TOKENS, 128, tuple(range(PREFIX_BLOCKS)) + (10**6 + i,))
            for i in range(requests)]


def test_a_tpot_target_keeps_one_hot_prefix_from_piling_every_decode_onto_its_instance():
    # Without a target the instance holding the prefix takes most requests (its TTFT is the
    # least), and its decode batch slows past 10 ms a token; with one, predicted-ttft sends
    # requests elsewhere once that instance's pace passes the headroom.
    slo = Slo(ttft_s=2.0, tpot_s=0.010)
    base = SimConfig(load_geometry("llama-3-8b"), load_profile("h200-cx7-gen5"), 1, 4)
    runs = {}
    for name, target in (("alone", None), ("guarded", slo)):
        summaries, outcomes = simulate(one_hot_prefix(), replace(base, slo=target), ["hbm+dram"],
                                       policies=[Policy.PREDICTED_TTFT], slo=slo)
        runs[name] = (summaries[0], outcomes[0])
    alone, guarded = runs["alone"][0], runs["guarded"][0]
    assert alone.tpot_s["p50"] > slo.tpot_s and alone.goodput.share < 0.5
    assert guarded.tpot_s["p90"] <= slo.tpot_s and guarded.goodput.share > 0.95
    assert guarded.ttft_s["p90"] <= slo.ttft_s
    on_first = {name: sum(r.instance == 0 for r in outcome.records) / len(outcome.records)
                for name, (_, outcome) in runs.items()}
    assert on_first["alone"] > 0.6 and on_first["guarded"] < 0.4, on_first
