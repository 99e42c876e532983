"""``kvstrata bench sim`` through the real command-line entry point, on a small synthetic trace.

No timing is asserted (this machine's speed is not the code's); the report's shape is, and that
the tiled trace has the requests asked for, with every architecture timed on both traces.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from kvstrata.bench.sim import ARCHS, tile_trace
from kvstrata.cli import main
from kvstrata.sim.synthetic import SyntheticConfig, generate
from kvstrata.sim.traceio import write_trace


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    trace = tmp_path_factory.mktemp("bench_sim") / "trace.jsonl"
    write_trace(trace, generate(SyntheticConfig(requests=100, seed=1, rate=4.0)))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["bench", "sim", "--json", "--trace", str(trace), "--requests-large", "300"])
    assert code == 0
    return json.loads(out.getvalue()), str(trace)


def test_json_has_both_traces_every_arch_and_the_baseline(report):
    data, trace = report
    assert set(data) == {"config", "traces", "goals"}
    assert data["config"]["trace"] == trace and data["config"]["requests_large"] == 300
    assert [t["name"] for t in data["traces"]] == ["trace", "tiled"]
    assert [t["requests"] for t in data["traces"]] == [100, 300]
    assert data["traces"][1]["tiling"]["copies"] == 3
    for t in data["traces"]:
        assert {"wall_s", "runs_s", "requests_per_s", "what"} <= set(t["baseline"])
        assert [row["arch"] for row in t["architectures"]] == list(ARCHS)
        for row in t["architectures"]:
            assert {"wall_s", "cpu_s", "requests_per_s", "overhead_x", "within_goal"} <= set(row)
            assert row["records"] == t["requests"]
    assert len(data["goals"]) == 2 * len(ARCHS)
    assert all({"figure", "goal", "value", "target", "passed"} <= set(g) for g in data["goals"])


def test_a_missing_trace_is_a_clear_error(tmp_path, capsys):
    assert main(["bench", "sim", "--trace", str(tmp_path / "none.jsonl")]) == 2
    assert "not found; pass --trace FILE" in " ".join(capsys.readouterr().err.split())


def test_tiled_copies_are_later_and_use_fresh_ids():
    source = generate(SyntheticConfig(requests=50, seed=2))
    tiled = tile_trace(source, 120)
    assert (tiled.copies, len(tiled.requests)) == (3, 120)
    assert tiled.requests[:50] == source
    ids = [{b for r in tiled.requests[k * 50 : (k + 1) * 50] for b in r.hash_ids} for k in range(3)]
    assert not (ids[0] & ids[1]) and not (ids[0] & ids[2]) and not (ids[1] & ids[2])
    second = tiled.requests[50:100]
    assert [r.timestamp_ms - tiled.span_ms for r in second] == [r.timestamp_ms for r in source]
    assert [len(r.hash_ids) for r in second] == [len(r.hash_ids) for r in source]
    assert tile_trace(source, 120) == tiled
