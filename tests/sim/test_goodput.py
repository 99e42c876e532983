"""Goodput in the simulator's summaries (kvstrata.slo, kvstrata.sim.results): the share of requests
whose own TTFT and TPOT meet the SLO, and those per simulated second; a one-token answer is judged
by its TTFT alone; the CLI takes the SLO as flags and reports goodput in its tables and JSON."""

from __future__ import annotations

import json

import pytest

from kvstrata.cli import main
from kvstrata.hardware.profile import load_profile
from kvstrata.kv.presets import load_geometry
from kvstrata.sim.config import SimConfig
from kvstrata.sim.run import simulate
from kvstrata.sim.trace import BLOCK_TOKENS, Request
from kvstrata.sim.traceio import write_trace
from kvstrata.slo import Slo


def trace() -> list[Request]:
    """Four requests at once on one instance: three cold prompts of 1, 4 and 16 blocks, each with
    a 64-token answer, and a one-token answer (no TPOT) on a prompt of its own."""
    prompts = [(1, 64), (4, 64), (16, 64), (2, 1)]
    return [Request(0, blocks * BLOCK_TOKENS, out, tuple(range(i * 100, i * 100 + blocks)))
            for i, (blocks, out) in enumerate(prompts)]


@pytest.fixture(scope="module")
def config():
    return SimConfig(load_geometry("llama-3-8b"), load_profile("h200-cx7-gen5"), 1, 1)


def run(config, slo: Slo):
    summaries, outcomes = simulate(trace(), config, ["hbm"], slo=slo)
    return summaries[0], outcomes[0]


def test_goodput_counts_each_request_by_its_own_ttft_and_tpot(config):
    loose, outcome = run(config, Slo(60.0, 1.0))
    assert (loose.goodput.met, loose.goodput.requests, loose.goodput.share) == (4, 4, 1.0)
    assert loose.goodput.per_s == pytest.approx(4 / outcome.makespan_s)
    recs = outcome.records
    ttfts = sorted(r.ttft_s for r in recs)
    assert ttfts[0] < ttfts[-1]  # prefills queue: TTFTs differ
    # A TTFT target between the second-fastest and the rest admits exactly two requests.
    cut = (ttfts[1] + ttfts[2]) / 2
    assert run(config, Slo(cut, 1.0))[0].goodput.met == 2
    # A TPOT no decode meets: only the one-token answer (no TPOT) is counted.
    tight = run(config, Slo(60.0, min(r.tpot_s for r in recs if r.tpot_s is not None) / 2))[0]
    assert tight.goodput.met == 1 and tight.goodput.share == 0.25


def test_the_cli_takes_the_slo_and_reports_goodput(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_trace(path, trace())
    argv = ["simulate", "--trace", str(path), "--hardware", "h200-cx7-gen5", "--model", "llama-3-8b",
            "--arch", "hbm", "--instances", "1", "--gpus-per-instance", "1"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["goodput_slo"] == {"ttft_s": 2.0, "tpot_s": 0.1}  # the defaults: the ranking's thresholds
    assert doc["architectures"][0]["goodput"]["requests"] == 4
    assert main([*argv, "--json", "--slo-tpot-ms", "0.001"]) == 0
    assert json.loads(capsys.readouterr().out)["architectures"][0]["goodput"]["met"] == 1
    assert main([*argv, "--slo-ttft-ms", "500"]) == 0
    out = capsys.readouterr().out
    assert "goodput" in out and "TTFT <= 500 ms" in out
    assert main([*argv, "--slo-ttft-ms", "0"]) == 2
    assert "--slo-ttft-ms and --slo-tpot-ms must be > 0" in capsys.readouterr().err
