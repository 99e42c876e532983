"""``kvstrata bench sglang`` on a few tiny pages: its JSON and its table as the command line
prints them, every prefetch of every backend verified. No timing is asserted (this machine's
speed is not the code's); the report's shape is, and that the bytes came back."""

from __future__ import annotations

import contextlib
import io
import json

import sglang_support  # noqa: F401  (skips where SGLang is not installed)

from kvstrata.cli import main

REPEATS = 3


def bench(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["bench", "sglang", "--model", "tiny-llama", "--page-tokens", "4", "--pages", "6",
                     "--repeats", str(REPEATS), *args])
    return code, out.getvalue()


def test_disk_and_pool_rows_beside_their_baselines_every_prefetch_verified(pool_file, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTRATA_POOL", pool_file)
    code, out = bench("--dir", str(tmp_path), "--json")
    assert code == 0
    report = json.loads(out)
    rows = {(r["side"], r["phase"], r["subject"], r["baseline"]): r for r in report["rows"]}
    disk = {("disk", phase, "kvstrata", "HiCacheFile") for phase in ("set", "get, warm", "get, cold")}
    # the session pool has a secret: kvstrata sealed, as deployed, and unsealed, as the raw client;
    # and, sealed, beside SGLang's own Mooncake backend (no goal: for information)
    pool = {("pool", phase, subject, "raw Mooncake") for phase in ("set", "get")
            for subject in ("kvstrata", "kvstrata, unsealed")}
    pool |= {("pool", phase, "kvstrata", "SGLang Mooncake") for phase in ("set", "get")}
    assert set(rows) == disk | pool
    for (side, _, _, baseline), row in rows.items():
        assert row["ours_gbps"] > 0 and row["theirs_gbps"] > 0 and row["ratio"]["rounds"] == REPEATS
        assert row["goal"] == {"HiCacheFile": 1.5, "raw Mooncake": 0.9, "SGLang Mooncake": None}[baseline]
    # per round (warm-up included) each get of each backend: 6 pages compared byte for byte
    gets = 2 * 2 + 1 * 4  # disk: two gets x two backends; pool: one get x four (sealed, unsealed, raw, SGLang's)
    assert report["verified_bytes"] == (REPEATS + 1) * gets * 6 * report["page_bytes"]
    assert list(tmp_path.iterdir()) == []  # the scratch files are gone


def test_the_table_and_a_bad_layout_in_one_line(pool_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVSTRATA_POOL", pool_file)
    code, out = bench("--dir", str(tmp_path), "--layout", "layer_first")
    assert code == 0
    text = " ".join(out.split())
    assert "disk: get, cold" in text and "HiCacheFile" in text and "pool: get" in text and "raw Mooncake" in text
    assert "pool (unsealed): set" in text
    assert "goals met:" in text and "pool: configured" in text
    code, out = bench("--dir", str(tmp_path), "--no-pool")
    assert code == 0 and "pool rows: not asked for" in " ".join(out.split())
    code, _ = bench("--layout", "page_head")
    assert code == 2
    err = capsys.readouterr().err
    assert "layout must be one of" in err and len(err.strip().splitlines()) == 1


def test_on_an_embedded_pool_sglangs_mooncake_backend_runs_beside_for_information(tmp_path, monkeypatch):
    """An embedded pool (no $KVSTRATA_POOL): SGLang's own Mooncake backend runs in the same rounds,
    its rows shown with no goal (the goal is the raw client's) and its prefetches verified too."""
    monkeypatch.delenv("KVSTRATA_POOL", raising=False)
    code, out = bench("--dir", str(tmp_path), "--json")
    assert code == 0
    report = json.loads(out)
    theirs = [r for r in report["rows"] if r["baseline"] == "SGLang Mooncake"]
    assert [(r["phase"], r["subject"], r["goal"]) for r in theirs] == [("set", "kvstrata", None), ("get", "kvstrata", None)]
    assert all(r["ours_gbps"] > 0 and r["theirs_gbps"] > 0 for r in theirs)
    assert report["pool"]["source"] == "embedded"
    gets = 2 * 2 + 1 * 4  # disk: two gets x two backends; pool: one get x four (sealed, unsealed, raw, SGLang's)
    assert report["verified_bytes"] == (REPEATS + 1) * gets * 6 * report["page_bytes"]
