"""``kvstrata bench cache`` through the real command-line entry point, on 16 MiB of KV.

No timing is asserted (this machine's speed is not the code's); the report's shape is, and
that every restore was verified bit-exact: a benchmark that moves wrong bytes fast is worthless.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from kvstrata.bench.cache import CacheBenchConfig, bench_layout
from kvstrata.cli import main

MIB = 1 << 20
# The benchmark itself (module-scoped, once): 5 s on an idle 2-core host, 30 s on a loaded one.
bench_run = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("bench")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["bench", "cache", "--size-mib", "16", "--json", "--dir", str(scratch)])
    assert code == 0
    return json.loads(out.getvalue()), scratch


@bench_run
def test_json_has_every_tier_and_figure(report):
    data, _ = report
    host, disk, device = (data["tiers"][t] for t in ("host", "disk", "device"))
    for key in ("store_gbps", "restore_gbps", "baseline_gbps", "ratio", "store_ratio", "restore_ratio"):
        assert host[key] > 0, key
    for key in ("restore_gbps", "baseline_gbps", "ratio", "store_gbps", "store_baseline_gbps"):
        assert disk[key] > 0, key
    for temp in ("cold", "warm"):
        for key in ("restore_gbps", "baseline_gbps", "ratio", "tier_read_gbps", "tier_read_ratio"):
            assert disk[temp][key] > 0, (temp, key)
    assert disk["restore_gbps"] == disk["cold"]["restore_gbps"]
    for key in ("store_gbps", "baseline_gbps", "ratio", "hit_ms"):
        assert device[key] > 0, key
    assert set(data["lookup_128k_ms"]) == {"256", "16"}
    assert all(ms > 0 for ms in data["lookup_128k_ms"].values())
    for times in data["lookup_128k"].values():  # judged as a paired ratio to the bare xxh3 loop
        assert 0 < times["ours_of_xxh3"]["min"] <= times["ours_of_xxh3"]["median"] <= times["ours_of_xxh3"]["max"]
    assert len(host["runs_gbps"]["ours.host.restore"]) == 5  # 5 repeats; the warm-up round is not kept
    assert "tp_readers" not in data and "tp_readers" not in data["config"]  # only --tp-readers adds its rows


@bench_run
def test_the_geometry_is_llama_3_8b_split_into_16_blocks(report):
    data, _ = report
    config = data["config"]
    layout = bench_layout(CacheBenchConfig(size_bytes=16 * MIB))
    assert config["size_bytes"] == 16 * MIB and config["blocks"] == 16
    assert config["block_bytes"] == MIB == layout.block_bytes
    assert config["layout"] == layout.describe()
    assert (layout.num_layers, layout.kv_heads, layout.head_dim, layout.dtype.name) == (32, 8, 128, "BF16")


@bench_run
def test_every_restore_was_verified_bit_exact(report):
    data, _ = report
    verified = data["verified"]
    assert verified["bit_exact"] is True
    # In each of 6 rounds (5 timed, 1 warm-up): the device hit, the host restore, the cold and
    # warm disk restores and the disk tier's cold and warm reads, each of all 16 MiB.
    assert verified["ours_bytes"] == 6 * 6 * 16 * MIB


@bench_run
def test_goals_are_judged_and_lmcache_is_reported_either_way(report):
    data, _ = report
    figures = {g["figure"] for g in data["goals"]}
    assert {"host store", "host restore", "disk restore, cold", "disk restore, warm"} <= figures
    assert all(isinstance(g["passed"], bool) for g in data["goals"])
    lmcache = data["lmcache"]
    if lmcache["available"]:
        assert lmcache["host"]["retrieve"]["gbps"] > 0
    else:
        assert lmcache["reason"]


@bench_run
def test_scratch_files_are_removed(report):
    _, scratch = report
    assert list(scratch.iterdir()) == []


def test_a_size_that_is_not_whole_tokens_per_block_is_a_clear_error(capsys):
    assert main(["bench", "cache", "--size-mib", "1", "--blocks", "3", "--json"]) == 2
    assert "whole number" in capsys.readouterr().err


def test_fewer_than_three_repeats_are_refused(capsys):
    assert main(["bench", "cache", "--size-mib", "16", "--repeats", "2", "--json"]) == 2
    assert "repeats" in capsys.readouterr().err
