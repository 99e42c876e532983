from __future__ import annotations

import json

import pytest

from kvstrata.cli import main
from kvstrata.sim.synthetic import SyntheticConfig, generate
from kvstrata.sim.traceio import write_trace


def test_simulate_json_and_plot(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, generate(SyntheticConfig(requests=40, rate=2.0, seed=1)))
    rc = main([
        "simulate", "--trace", str(trace), "--hardware", "h200-cx7-gen5", "--model", "llama-3-8b",
        "--arch", "hbm,remote-gdr", "--instances", "2", "--json", "--plot", str(tmp_path / "plots"),
    ])
    assert rc == 0
    out = capsys.readouterr()
    doc = json.loads(out.out)  # the plots' paths go to stderr, so stdout stays JSON
    assert {a["arch"] for a in doc["architectures"]} == {"hbm", "remote-gdr"}
    for a in doc["architectures"]:
        assert set(a["ttft_s"]) == {"p50", "p90", "p99"} and isinstance(a["meets_slo"], bool)
    for name in ("ttft_cdf.png", "tpot_cdf.png"):
        path = tmp_path / "plots" / name
        assert path.read_bytes().startswith(b"\x89PNG")
        assert f"plot written to {path}" in out.err


def test_simulate_says_where_its_plots_and_report_went(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, generate(SyntheticConfig(requests=20, rate=2.0, seed=1)))
    plots, page = tmp_path / "new" / "plots", tmp_path / "r.html"
    assert main(["simulate", "--trace", str(trace), "--hardware", "h200-cx7-gen5", "--model", "llama-3-8b",
                 "--arch", "hbm", "--instances", "1", "--plot", str(plots), "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert "rank" in out  # the table, then where each file went
    lines = [line for line in out.splitlines() if " written to " in line]
    assert lines == [f"plot written to {plots / 'ttft_cdf.png'}", f"plot written to {plots / 'tpot_cdf.png'}",
                     f"report written to {page}"]
    assert sorted(p.name for p in plots.iterdir()) == ["tpot_cdf.png", "ttft_cdf.png"]
    assert page.read_text().count("data:image/png;base64,") == 2


def test_simulate_bad_arch_is_an_error(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, generate(SyntheticConfig(requests=3, seed=1)))
    assert main(["simulate", "--trace", str(trace), "--hardware", "h200-cx7-gen5", "--model", "llama-3-8b", "--arch", "tape"]) == 2


def test_simulate_time_scale_write_back_and_load(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, generate(SyntheticConfig(requests=40, rate=2.0, seed=1)))
    base = ["simulate", "--trace", str(trace), "--hardware", "h200-cx7-gen5", "--model", "llama-3-8b",
            "--arch", "hbm+dram+nvme", "--instances", "1", "--json"]
    assert main(base) == 0
    one = json.loads(capsys.readouterr().out)
    tiers = ["hbm", "dram", "nvme"]  # hardware names, in the order searched
    assert list(one["architectures"][0]["hit_rate"]) == tiers == list(one["architectures"][0]["tier_writes_blocks"])
    assert main(base + ["--time-scale", "2", "--write", "back"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["offered_load"] == pytest.approx(one["offered_load"] / 2, rel=1e-2)
    assert two["architectures"][0]["arch"] == "hbm+dram+nvme (write-back)"
    assert main(base + ["--time-scale", "0"]) == 2
    assert "--time-scale" in capsys.readouterr().err
