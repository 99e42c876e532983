"""``kvstrata bench remote`` through the real command-line entry point, on 8 MiB of KV.

The pool is real: the session's (``$KVSTRATA_POOL``, as ``.ci/run`` sets it) when configured,
else the embedded one the command starts and stops itself. No timing is asserted (this
machine's speed is not the code's); the report's shape is, and that every restore was
verified bit-exact: a benchmark that moves wrong bytes fast is worthless.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest

from kvstrata.tiers import poolvalue

from kvstrata.cli import main
from kvstrata.pool.config import pool_from_env

MIB = 1 << 20
SIZE_MIB = 8
BLOCKS = 8
REPEATS = 5
SAMPLES = 5  # one-block restores per round and side (RemoteBenchConfig.latency_samples)

pytestmark = [pytest.mark.pool, pytest.mark.skipif(  # the command starts an embedded pool
    importlib.util.find_spec("mooncake") is None,
    reason="the pool engine is not installed (pip install mooncake-transfer-engine-non-cuda)",
)]


@pytest.fixture(scope="module")
def report():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["bench", "remote", "--size-mib", str(SIZE_MIB), "--json"])
    assert code == 0
    return json.loads(out.getvalue())


def measured(report) -> dict[str, dict]:
    return {mode: m for mode, m in report["modes"].items() if "skipped" not in m}


def test_both_modes_are_reported_and_tcp_is_measured(report):
    assert set(report["modes"]) == {"tcp", "shm"}
    assert "tcp" in measured(report)
    configured = pool_from_env()
    if configured is None or configured.daemon:  # SHM needs a pool daemon on this host
        assert "shm" in measured(report)
    else:
        assert "daemon" in report["modes"]["shm"]["skipped"]


def test_every_mode_has_ours_raw_and_their_ratios(report):
    for mode, m in measured(report).items():
        for key in ("restore_gbps", "raw_gbps", "ratio", "store_gbps", "raw_store_gbps", "store_ratio",
                    "ttfb_ms", "raw_ttfb_ms", "ttfb_time_ratio", "lookup_ms", "raw_exists_ms", "lookup_time_ratio"):
            assert m[key] > 0, (mode, key)
        assert m["ttfb_block_bytes"] == SIZE_MIB * MIB // BLOCKS
        for step in ("ours.store", "raw.store", "ours.restore", "raw.restore", "cache.direct", "cache.staged"):
            assert len(m["gbps"][step]["runs_gbps"]) == REPEATS, (mode, step)  # the warm-up round is not kept
        assert len(m["latency_ms"]["ours.ttfb"]["runs_ms"]) == REPEATS * SAMPLES


def test_the_cache_restores_blocks_from_the_pool_by_both_paths(report):
    for mode, m in measured(report).items():
        cache = m["cache"]
        assert cache["direct"]["route"] == "remote -> device"
        assert cache["staged"]["route"] == "remote -> host -> device"
        for path in ("direct", "staged"):
            assert cache[path]["restore_gbps"] > 0 and cache[path]["ratio"] > 0, (mode, path)


def test_every_restore_was_verified_bit_exact(report):
    verified = report["verified"]
    assert verified["bit_exact"] is True
    size = SIZE_MIB * MIB
    block = size // BLOCKS
    for mode, m in measured(report).items():
        # Per round (warm-up included): ours, ours unsealed and encrypted (the seal's price),
        # the cache's two paths and raw restore every block (raw's objects carry a value header
        # each), and ours and raw restore one block SAMPLES times.
        rounds = REPEATS + 1
        head = poolvalue.HEADER_BYTES
        per_round = 5 * size + (size + BLOCKS * head) + SAMPLES * (block + (block + head))
        assert m["verified_bytes"] == rounds * per_round, mode
    assert verified["bytes"] == sum(m["verified_bytes"] for m in measured(report).values())


def test_tcp_mode_moves_every_byte_across_a_socket(report):
    if not report["config"]["pool"]["master"].startswith("127.0.0.1:"):
        pytest.skip("the pool is not on loopback here")
    crossed = report["modes"]["tcp"]["loopback_bytes"]
    for step in ("ours.store", "ours.restore", "raw.store", "raw.restore"):
        assert crossed[step] >= SIZE_MIB * MIB, step  # other traffic may add to it, never take away


def test_goals_ask_for_ninety_percent_of_raw(report):
    goals = {g["figure"]: g for g in report["goals"]}
    for mode in measured(report):
        for what in ("restore", "store"):
            goal = goals[f"{mode} {what}"]
            assert goal["target"] == 0.9 and isinstance(goal["passed"], bool)
        lookup = goals[f"{mode} lookup"]  # a time ratio: at most 1.5x the raw existence query
        assert (lookup["target"], lookup["at_most"]) == (1.5, True)
        assert lookup["passed"] == (lookup["value"] <= 1.5)


def test_every_ratio_carries_its_spread_over_rounds(report):
    for mode, m in measured(report).items():
        for prefix, ratio in (("restore_", "ratio"), ("store_", "store_ratio"), ("ttfb_", "ttfb_time_ratio"),
                              ("lookup_", "lookup_time_ratio")):
            assert 0 < m[f"{prefix}ratio_min"] <= m[ratio] <= m[f"{prefix}ratio_max"], (mode, prefix)
        per_round = [o / r for o, r in zip(m["gbps"]["ours.restore"]["runs_gbps"], m["gbps"]["raw.restore"]["runs_gbps"])]
        assert (m["restore_ratio_min"], m["restore_ratio_max"]) == pytest.approx((min(per_round), max(per_round)))
        for path in ("direct", "staged"):
            cache = m["cache"][path]
            assert cache["ratio_min"] <= cache["ratio"] <= cache["ratio_max"], (mode, path)


def test_the_run_reports_where_the_pool_was(report):
    pool = report["config"]["pool"]
    assert pool["source"] == ("configured" if pool_from_env() is not None else "embedded")
    assert pool["master"]
    config = report["config"]
    assert (config["size_bytes"], config["blocks"], config["block_bytes"]) == (SIZE_MIB * MIB, BLOCKS, MIB)


def test_an_embedded_pool_is_stopped_at_the_end(report):
    pool = report["config"]["pool"]
    if pool["source"] != "embedded":
        pytest.skip("the configured pool is not the benchmark's to stop")
    for pid in (pool["master_pid"], pool["daemon_pid"]):
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_a_size_that_is_not_whole_tokens_per_block_fails_before_any_pool_starts(capsys):
    assert main(["bench", "remote", "--size-mib", "1", "--blocks", "3", "--json"]) == 2
    assert "whole number" in capsys.readouterr().err
