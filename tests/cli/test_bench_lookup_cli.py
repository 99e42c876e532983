"""``kvstrata bench lookup`` through the real command-line entry point, on a short prompt.

No timing is asserted (this machine's speed is not the code's): the report's shape is, and that
every ratio comes with its spread over the rounds.
"""

from __future__ import annotations

import contextlib
import io
import json

from kvstrata.cli import main


def test_bench_lookup_reports_each_block_size_the_scaling_and_the_goals():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["bench", "lookup", "--tokens", "4096", "--repeats", "3", "--large-blocks", "4000", "--json"])
    assert code == 0
    data = json.loads(out.getvalue())
    assert set(data["lookups"]) == {"256", "16"}
    for times in data["lookups"].values():
        for name in ("ours_of_xxh3", "hash_of_xxh3", "cache_of_xxh3"):
            assert times[name]["rounds"] == 3
            assert 0 < times[name]["min"] <= times[name]["median"] <= times[name]["max"]
    scaling = data["scaling"]
    assert (scaling["small"], scaling["large"], scaling["blocks"]) == (1000, 4000, 16)
    assert data["goals"] == []  # a goal names its case (128K tokens, 1M of 1K blocks indexed): not this one


def test_the_goals_judge_the_cases_they_name(monkeypatch):
    from kvstrata.bench import lookup_report

    monkeypatch.setattr(lookup_report, "GOAL_TOKENS", 4096)
    monkeypatch.setattr(lookup_report, "GOAL_INDEXED", (1000, 4000))
    report = lookup_report.run_lookup_bench(lookup_report.LookupBenchConfig(tokens=4096, repeats=3, large_blocks=4000))
    assert [g.figure.value for g in report.goals] == ["hash+lookup 128K, block 256", "hash+lookup 128K, block 16",
                                                      "lookup, 1M blocks indexed of 1K"]
    assert report.goals[0].value == report.lookups[256].ours_of_xxh3.median
    assert report.goals[2].value == report.scaling.lookup.median


def test_bench_lookup_prints_a_table():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "lookup", "--tokens", "4096", "--repeats", "3", "--large-blocks", "2000"]) == 0
    text = out.getvalue()
    assert "xxh3 loop" in text and "TieredCache.lookup" in text and "goals met" in text


def test_bench_restart_times_the_first_hit_after_each_restart(tmp_path, monkeypatch):
    from kvstrata.tiers import diskmanifest

    monkeypatch.setattr(diskmanifest, "SETTLE_NS", 0)  # its set-up waits that long before its close
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["bench", "restart", "--blocks", "300", "--repeats", "3", "--dir", str(tmp_path), "--json"])
    assert code == 0
    data = json.loads(out.getvalue())
    times = data["times"]
    assert times["blocks"] == times["recovered_blocks"] == 300
    assert len(times["first_hit_s"]) == len(times["open_s"]) == 3
    assert all(0 < o <= h for o, h in zip(times["open_s"], times["first_hit_s"]))
    assert data["goals"] == []  # the goal names 100K blocks
    assert list(tmp_path.iterdir()) == []  # the blocks are removed after


def test_bench_restart_refuses_a_disk_without_room(tmp_path, monkeypatch):
    import shutil

    from kvstrata.bench import restart

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["bench", "restart", "--blocks", "300", "--dir", str(tmp_path)]) == 1
    assert "no room for the blocks" in err.getvalue()
    assert restart.HEADER_BYTES == 4096
