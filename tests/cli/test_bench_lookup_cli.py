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
