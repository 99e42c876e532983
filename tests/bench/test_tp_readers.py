"""``kvstrata bench cache --tp-readers``: head-sliced restores beside TP-matched ones at each reader
TP size, on 16 MiB of KV (3 rounds, 3 lookup rounds), its JSON and its table as the command
line prints them.

No timing is asserted (this machine's speed is not the code's); the report's shape is, and that
every restore of both layouts was verified bit-exact.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from kvstrata.bench.cache import CacheBenchConfig, run_cache_bench
from kvstrata.cli import main
from kvstrata.bench.cli.tiers import _print_cache
from kvstrata.report import dumps

MIB = 1 << 20
READERS = (1, 2, 8)
pytestmark = pytest.mark.slow  # the benchmark itself runs ~50 s on 2 cores: the fast loop leaves it out
REPEATS = 3


def bench(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["bench", "cache", "--size-mib", "16", "--repeats", str(REPEATS), "--no-lmcache", *args])
    return code, out.getvalue()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("bench-tp")
    config = CacheBenchConfig(size_bytes=16 * MIB, repeats=REPEATS, directory=str(scratch), lmcache=False,
                              lookup_repeats=3, tp_readers=READERS)
    return run_cache_bench(config), scratch


@pytest.fixture(scope="module")
def report(measured):
    result, scratch = measured
    return json.loads(dumps(result)), scratch


def test_the_table_has_a_row_per_tier_and_tp_and_the_lookups(measured, capsys):
    _print_cache(measured[0])
    out = " ".join(capsys.readouterr().out.split())  # the console's line breaks undone
    assert "head-sliced vs TP-matched restores" in out and "hash+lookup of 128K tokens by an instance" in out
    for label in ("host, TP=1", "disk, cold, TP=2", "disk, warm, TP=8", "block 256, TP=8", "block 16, TP=8"):
        assert label in out, label
    assert "[layers, kv, tokens, its heads, head_dim]" in out  # the note, not eaten as markup


def test_a_row_per_tier_and_reader_tp_with_both_layouts_and_the_ratio(report):
    data, _ = report
    tp = data["tp_readers"]
    assert tp["readers"] == list(READERS) and tp["kv_heads"] == 8 and tp["slices"] == 8
    rows = {(r["source"], r["tp"]): r for r in tp["restores"]}
    assert set(rows) == {(s, t) for s in ("host", "disk, cold", "disk, warm") for t in READERS}
    for (source, t), row in rows.items():
        assert row["restored_bytes"] == 16 * MIB  # the same bytes at every TP: 8 heads split, none replicated
        for key in ("sliced_gbps", "matched_gbps", "ratio", "load_sliced_gbps", "load_matched_gbps", "load_ratio",
                    "slices_gbps", "slices_ratio"):
            assert row[key] > 0, (source, t, key)
        assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
        assert [len(row["runs_gbps"][k]) for k in ("matched", "sliced", "slices")] == [REPEATS] * 3
        # Per rank: a TP-matched rank holds each block as one object of its heads, and so does a
        # head-sliced rank in its own tiers (a pack of its slices); the shared tiers hold one
        # object per head. The same bytes every way.
        assert (row["matched_objects"], row["sliced_objects"], row["slices_objects"]) == (16, 16, 16 * 8 // t)
        assert row["matched_objects"] * row["matched_object_bytes"] == row["sliced_objects"] * row["sliced_object_bytes"]
        assert row["slices_objects"] * row["slices_object_bytes"] == row["sliced_objects"] * row["sliced_object_bytes"]


def test_every_restore_of_both_layouts_was_verified(report):
    data, _ = report
    # Each (tier, TP): a warm-up round and the timed ones, each restoring all 16 MiB three times
    # (TP-matched, packs, slices).
    assert data["tp_readers"]["verified_bytes"] == 3 * len(READERS) * (REPEATS + 1) * 3 * 16 * MIB
    assert data["verified"]["bit_exact"] is True


def test_the_lookup_compares_tp_1_with_the_largest_reader(report):
    data, _ = report
    lookups = data["tp_readers"]["lookups"]
    assert set(lookups) == {"256", "16"}
    for lk in lookups.values():
        assert (lk["tokens"], lk["tp"]) == (131072, 8)
        for key in ("matched_tp1_ms", "sliced_tp1_ms", "sliced_tp_ms", "sliced_tp_ranks_ms", "hash_ms",
                    "slice_keys_tp1_ms", "slice_keys_tp_ms"):
            assert lk[key] > 0, key
        # the instance's time is its slowest rank's (ranks look up at once); its CPU, all of theirs
        assert lk["sliced_tp_ms"] < lk["sliced_tp_ranks_ms"]
        for spread in (lk["tp_of_tp1"], lk["sliced_of_matched"]):
            assert 0 < spread["min"] <= spread["median"] <= spread["max"]


def test_goals_are_judged_beside_the_others(report):
    data, scratch = report
    figures = [g["figure"] for g in data["tp_readers"]["goals"]]
    assert "head-sliced restore, disk, cold, TP=8" in figures
    assert "head-sliced hash+lookup 128K, block 256, TP=8 of TP=1" in figures
    assert len(figures) == 3 * len(READERS) + 2
    assert set(figures) <= {g["figure"] for g in data["goals"]}
    assert {"host restore", "disk restore, cold"} <= {g["figure"] for g in data["goals"]}  # the rest is there too
    assert list(scratch.iterdir()) == []


def test_a_tp_size_the_heads_do_not_split_over_is_refused_before_anything_runs(capsys):
    code, _ = bench("--tp-readers", "1,3", "--json")
    assert code == 2
    assert "TP=3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench("--tp-readers", "1,1")
    assert "distinct TP sizes" in capsys.readouterr().err
