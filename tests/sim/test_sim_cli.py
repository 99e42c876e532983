from __future__ import annotations

import dataclasses
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


def sim(tmp_path, requests, *argv, model="llama-3-70b"):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, requests)
    return main(["simulate", "--trace", str(trace), "--hardware", "h200-cx7-gen5", "--model", model,
                 "--arch", "hbm", *argv])


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return " ".join(err.split())


def test_the_default_instance_holds_the_weights_and_says_why(tmp_path, capsys):
    reqs = generate(SyntheticConfig(requests=30, rate=2.0, seed=1))
    assert sim(tmp_path, reqs, "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    # 141.1 GB of llama-3-70b: 2 H200s hold 70.55 GB each, over half their usable 126.9 GB; 4 do.
    assert (doc["gpus_per_instance"], doc["instances"], doc["gpus_basis"]) == (4, 2, "kv-margin")
    assert doc["architectures"][0]["gpus"] == 8
    assert sim(tmp_path, reqs) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "2 instance(s); 4 GPU(s) per instance, the fewest leaving at least 50% of usable HBM for KV" in out
    assert "llama-3-70b's 141.1 GB of bf16 weights take 35.3 GB of each H200-SXM's 126.9 GB usable HBM" in out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--gpus-per-instance", "1"],
         "llama-3-70b's 141.1 GB of bf16 weights do not fit on 1 x H200-SXM (141.0 GB HBM each, 90% usable: "
         "126.9 GB); 2 GPUs per instance would hold them"),
        (["--instances", "8"], "--instances 8 leaves 1 GPU(s) each: llama-3-70b's 141.1 GB of bf16 weights do not fit"),
        (["--gpus-per-instance", "3"], "--gpus-per-instance 3: llama-3-70b's 8 KV heads do not split over 3 GPUs"),
        (["--gpus-per-instance", "16"], "--gpus-per-instance 16: 16 GPUs per instance, but the node has only 8"),
        (["--instances", "0"], "--instances must be at least 1, got 0"),
        (["--instances", "3", "--gpus-per-instance", "4"],
         "--instances with --gpus-per-instance: 3 instances of 4 GPUs need 12 GPUs"),
        (["--restore-slots", "0"], "--restore-slots must be at least 1, got 0"),
        (["--requests", "0"], "--requests must be at least 1, got 0"),
    ],
)
def test_impossible_settings_are_refused_in_one_line_naming_the_flag(tmp_path, capsys, argv, says):
    assert sim(tmp_path, generate(SyntheticConfig(requests=5, seed=1)), *argv) == 2
    err = one_line_error(capsys)
    assert says in err
    assert "'tp'" not in err and "restore_slots" not in err


def test_a_model_no_gpu_group_of_the_node_holds_is_refused(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, generate(SyntheticConfig(requests=5, seed=1)))
    argv = ["simulate", "--trace", str(trace), "--hardware", "workstation", "--model", "llama-3.1-405b", "--arch", "hbm"]
    assert main(argv) == 2
    assert "no tensor-parallel group of the node's 1 GPU holds them" in one_line_error(capsys)


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_a_trace_with_no_request_is_refused_naming_the_file(tmp_path, capsys, text):
    trace = tmp_path / "empty.jsonl"
    trace.write_text(text)
    argv = ["simulate", "--trace", str(trace), "--hardware", "h200-cx7-gen5", "--model", "llama-3-8b", "--arch", "hbm"]
    assert main(argv) == 2
    err = one_line_error(capsys)
    assert str(trace) in err and "has no requests" in err
    assert "nan" not in capsys.readouterr().out


def test_requests_arriving_at_once_with_single_tokens_print_no_nan(tmp_path, capsys):
    # One instant (no arrival rate) and one output token each (no time per output token).
    reqs = [dataclasses.replace(r, timestamp_ms=7, output_length=1) for r in generate(SyntheticConfig(requests=6, seed=2))]
    assert sim(tmp_path, reqs, model="llama-3-8b") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "nan" not in out.lower()
    assert "all 6 requests arrive at once: no arrival rate" in out
    assert sim(tmp_path, reqs, "--json", model="llama-3-8b") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["offered_load"] is None
    assert doc["architectures"][0]["tpot_s"] == {"p50": None, "p90": None, "p99": None}
