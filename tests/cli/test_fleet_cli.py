"""``--fleet-tp`` of ``kvstrata plan`` and ``kvstrata simulate`` through the real entry point."""

from __future__ import annotations

import json

import pytest

from kvstrata.cli import main
from kvstrata.sim.synthetic import Mix, SyntheticConfig, generate
from kvstrata.sim.traceio import write_trace


def plan_json(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_fleet_counts_one_copy_per_tp_size_matched_and_one_sliced(capsys):
    doc = plan_json(capsys, "--model", "llama-3-8b", "--context", "32768", "--fleet-tp", "8,4,2,1")
    fleet = doc["fleet"]
    assert [s["tp"] for s in fleet["sizes"]] == [8, 4, 2, 1]
    assert fleet["copies"] == {"tp-matched": 4, "head-sliced": 1}
    sliced = fleet["prefix_bytes"]["head-sliced"]
    assert sliced == 32768 * doc["bytes_per_token"] and fleet["prefix_bytes"]["tp-matched"] == 4 * sliced
    held = fleet["prefixes_in_pool"]
    assert held["head-sliced"] == fleet["pool_capacity_bytes"] // sliced
    assert held["tp-matched"] == fleet["pool_capacity_bytes"] // (4 * sliced)
    assert doc["capacity"]["pool_tokens"] // 32768 == held["head-sliced"]  # the planner's own pool capacity


def test_plan_fleet_counts_replicated_heads_and_the_mla_latent(capsys):
    tiny = plan_json(capsys, "--model", "tiny-llama", "--fleet-tp", "2x8,2")["fleet"]
    assert [(s["tp"], s["instances"], s["replication"]) for s in tiny["sizes"]] == [(8, 2, 4), (2, 1, 1)]
    assert tiny["copies"]["tp-matched"] == 5  # two TP=8 instances share one namespace
    ds = plan_json(capsys, "--model", "deepseek-v3", "--fleet-tp", "8")["fleet"]
    assert ds["copies"] == {"tp-matched": 8, "head-sliced": 1}


def test_plan_fleet_table_and_no_fleet_key_without_it(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--fleet-tp", "8,4,2,1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "a prefix every TP size has seen: 4 copies" in out and "head-sliced" in out
    assert "fleet" not in plan_json(capsys, "--model", "llama-3-8b")


@pytest.mark.parametrize(
    ("fleet", "says"),
    [
        ("0", "--fleet-tp '0': '0': a TP size and a count must be at least 1"),
        ("abc", "--fleet-tp 'abc': 'abc' is not a TP size"),
        ("8,3", "--fleet-tp '8,3': TP 3: llama-3-8b's 8 KV heads do not split over 3 GPUs"),
        ("16", "--fleet-tp '16': TP 16: 16 GPUs per instance, but the node has only 8"),
        ("2x", "'2x' is not a TP size"),
    ],
)
def test_plan_bad_fleet_is_one_line_naming_it(capsys, fleet, says):
    assert main(["plan", "--model", "llama-3-8b", "--fleet-tp", fleet]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert says in " ".join(err.split())


def simulate(tmp_path, capsys, *argv, code=0):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, generate(SyntheticConfig(requests=80, rate=2.0, seed=2, mix=Mix(chat=0, system=1, agent=0))))
    rc = main(["simulate", "--trace", str(trace), "--hardware", "h200-cx7-gen5", "--model", "llama-3-8b",
               "--arch", "remote-gdr", *argv])
    assert rc == code
    return capsys.readouterr()


def test_simulate_fleet_runs_both_modes_and_sliced_hits_at_least_as_much(tmp_path, capsys):
    out = simulate(tmp_path, capsys, "--fleet-tp", "8,4,2,1", "--route", "round-robin", "--pool-tokens", "16384",
                   "--json").out
    doc = json.loads(out)
    assert doc["fleet_tp"] == [8, 4, 2, 1] and doc["kv_sharing"] == ["tp-matched", "head-sliced"] and doc["gpus_basis"] == "fleet"
    pools = {a["kv_sharing"]: a["pool"] for a in doc["architectures"]}
    assert {a["arch"] for a in doc["architectures"]} == {"remote-gdr (tp-matched)", "remote-gdr (head-sliced)"}
    assert pools["head-sliced"]["hit_ratio_tokens"] > pools["tp-matched"]["hit_ratio_tokens"]
    assert pools["head-sliced"]["copies_mean_time_avg"] == 1 < pools["tp-matched"]["copies_mean_time_avg"]
    assert all(a["gpus"] == 15 for a in doc["architectures"])
    text = " ".join(simulate(tmp_path, capsys, "--fleet-tp", "8,4,2,1", "--kv-sharing", "head-sliced").out.split())
    assert "a fleet of TP 8,4,2,1 (15 GPUs on 2 server(s)" in text and "The shared pool" in text


def test_simulate_without_a_fleet_reports_no_pool(tmp_path, capsys):
    doc = json.loads(simulate(tmp_path, capsys, "--json").out)
    assert "fleet_tp" not in doc and "pool" not in doc["architectures"][0]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--fleet-tp", "4,abc"], "--fleet-tp '4,abc': 'abc' is not a TP size"),
        (["--fleet-tp", "4,0"], "--fleet-tp '4,0': '0': a TP size and a count must be at least 1"),
        (["--fleet-tp", "4,3"], "--fleet-tp '4,3': TP 3: llama-3-8b's 8 KV heads do not split over 3 GPUs"),
        (["--fleet-tp", "4,2", "--instances", "2"], "--fleet-tp sets every instance's GPUs: drop --instances"),
        (["--pool-tokens", "-1"], "--pool-tokens must be at least 0, got -1"),
    ],
)
def test_simulate_bad_fleet_settings_are_one_line(tmp_path, capsys, argv, says):
    err = simulate(tmp_path, capsys, *argv, code=2).err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert says in " ".join(err.split())


def test_the_html_page_has_the_shared_pool_table_only_where_modes_were_compared(tmp_path, capsys):
    fleet, plain = tmp_path / "fleet.html", tmp_path / "plain.html"
    simulate(tmp_path, capsys, "--fleet-tp", "4,1", "--html", str(fleet))
    simulate(tmp_path, capsys, "--html", str(plain))
    assert "The shared pool" in fleet.read_text() and "The shared pool" not in plain.read_text()
