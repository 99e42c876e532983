"""``kvstrata trace analyze`` and ``kvstrata trace generate`` through the real entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.cli import main
from kvstrata.sim.traceio import read_trace

REAL_TRACE = (
    Path(__file__).resolve().parents[2].parent
    / "shared/data/traces/mooncake_synthetic_trace.jsonl"
)


def generate(path: Path, *argv: str) -> None:
    assert main(["trace", "generate", "--out", str(path), *argv]) == 0


@pytest.fixture
def small_trace(tmp_path) -> Path:
    path = tmp_path / "small.jsonl"
    generate(path, "--requests", "200", "--seed", "3")
    return path


def analyze_json(capsys, *argv: str) -> dict:
    capsys.readouterr()
    assert main(["trace", "analyze", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_shape_with_default_capacities(small_trace, capsys):
    doc = analyze_json(capsys, "--trace", str(small_trace))
    assert list(doc) == [
        "requests",
        "mean_input",
        "mean_output",
        "unique_blocks",
        "capacities",
    ]
    assert doc["requests"] == 200 and doc["unique_blocks"] > 0
    assert [c["cache_tokens"] for c in doc["capacities"]] == [
        65536,
        262144,
        1048576,
        "inf",
    ]
    assert all(list(c) == ["cache_tokens", "hit_ratio"] for c in doc["capacities"])
    ratios = [c["hit_ratio"] for c in doc["capacities"]]
    assert ratios == sorted(ratios) and 0 <= ratios[0] and ratios[-1] <= 1


def test_capacities_take_suffixes_and_inf(small_trace, capsys):
    doc = analyze_json(
        capsys,
        "--trace",
        str(small_trace),
        "--cache-tokens",
        "0",
        "8k",
        "2M",
        "4096",
        "inf",
    )
    assert [c["cache_tokens"] for c in doc["capacities"]] == [
        0,
        8192,
        2097152,
        4096,
        "inf",
    ]
    assert doc["capacities"][0]["hit_ratio"] == 0.0


def test_generate_is_deterministic_and_readable(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for path in (a, b):
        generate(path, "--requests", "50", "--seed", "9", "--kind", "agent")
    assert a.read_bytes() == b.read_bytes()
    assert len(read_trace(a)) == 50


def test_human_output_is_a_table(small_trace, capsys):
    assert (
        main(
            [
                "trace",
                "analyze",
                "--trace",
                str(small_trace),
                "--cache-tokens",
                "64K",
                "inf",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "200 requests" in out
        and "hit ratio" in out
        and "65,536" in out
        and "inf" in out
    )


@pytest.mark.skipif(
    not REAL_TRACE.is_file(), reason=f"the Mooncake trace is not at {REAL_TRACE}"
)
def test_the_real_trace(capsys):
    doc = analyze_json(capsys, "--trace", str(REAL_TRACE))
    assert doc["requests"] == 3993
    assert doc["capacities"][-1]["cache_tokens"] == "inf"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--trace", "/no/such/trace.jsonl"], "no such file"),
        (["--cache-tokens", "-5"], "--cache-tokens '-5'"),
        (["--cache-tokens", "lots"], "--cache-tokens 'lots'"),
        (["--cache-tokens", "1.5M"], "--cache-tokens '1.5M'"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(small_trace, capsys, argv, message):
    if "--trace" not in argv:
        argv = ["--trace", str(small_trace), *argv]
    capsys.readouterr()
    assert main(["trace", "analyze", *argv]) == 2
    assert message in " ".join(capsys.readouterr().err.split())  # rich wraps long lines


def test_a_bad_line_exits_2_naming_line_and_field(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": []}\n{"timestamp": 1}\n'
    )
    assert main(["trace", "analyze", "--trace", str(path)]) == 2
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "line 2" in err and "'input_length'" in err and "missing" in err


@pytest.mark.parametrize(
    ("argv", "says"),
    [(["--rate", "0"], "--rate must be a positive number of arrivals per second, got 0.0"),
     (["--requests", "-1"], "--requests must be at least 1, got -1"),
     (["--requests", "0"], "--requests must be at least 1, got 0")],
)
def test_generate_rejects_bad_parameters_naming_the_flag(tmp_path, capsys, argv, says):
    out = tmp_path / "x.jsonl"
    assert main(["trace", "generate", "--out", str(out), *argv]) == 2
    assert says in " ".join(capsys.readouterr().err.split())
    assert not out.exists()  # no empty trace left behind


@pytest.mark.parametrize("text", ["", "\n \n"])
def test_analyze_refuses_a_trace_with_no_request_naming_it(tmp_path, capsys, text):
    path = tmp_path / "empty.jsonl"
    path.write_text(text)
    assert main(["trace", "analyze", "--trace", str(path)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert str(path) in err and "has no requests" in err
