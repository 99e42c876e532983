"""calibrate and validate end to end on tiny sizes: files load, rows are there, validate's rounds
interleave probes with restores and fit every tier (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from kvstrata.calibrate import load_calibration, profile_text
from kvstrata.calibrate.measure import CalibrateConfig, calibrate
from kvstrata.calibrate.validate import RowKind, ValidateConfig, row_kinds, validate
from kvstrata.cli import main
from kvstrata.hardware.profile import builtin_text, load_profile
from kvstrata.plan import host as h
from kvstrata.plan.calpaths import CalPath
from kvstrata.pool.config import PoolConfig
from kvstrata.media import Medium

MIB = 1 << 20


def test_profile_with_calibration_loads_as_hardware_profile(tmp_path):
    cal = h.HostCalibration("box", "cpu", 2, {CalPath.MEMCPY_1T: h.PathFit(0.0, 10.0)})
    path = tmp_path / "p.toml"
    path.write_text(profile_text(cal, builtin_text("workstation")))
    assert load_profile(path).name == "workstation"
    assert load_calibration(path) == cal


def test_a_base_with_an_efficiency_table_keeps_every_serving_fit(tmp_path):
    from kvstrata.plan.steps import ConnectorFit, DecodeFit, Stalls

    cal = h.HostCalibration("box", "cuda:0", 2, {CalPath.MEMCPY_1T: h.PathFit(0.0, 10.0)},
                            {"tiny": h.PrefillFit(0.01, 2e4)}, {"pcie": 0.8}, {"tiny": DecodeFit(0.003, 1e-4)},
                            {"tiny": ConnectorFit(0.01)}, {"tiny": Stalls(0.1, (0.2,))})
    base = builtin_text("workstation").rstrip("\n") + '\n\n[efficiency]\n"dram" = 0.7\n'
    path = tmp_path / "p.toml"
    path.write_text(profile_text(cal, base))
    back = load_calibration(path)
    assert (back.decode, back.connector, back.stalls, back.prefill) == (cal.decode, cal.connector, cal.stalls, cal.prefill)
    assert load_profile(path).name == "workstation"


def test_load_calibration_names_what_is_missing(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(builtin_text("workstation"))
    with pytest.raises(ValueError, match=r"no \[calibration\]"):
        load_calibration(path)


def test_calibrate_cli_quick_writes_a_loadable_profile(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVSTRATA_POOL", raising=False)  # CI sets one: here, no pool is configured
    out = tmp_path / "host.toml"
    code = main(["calibrate", "--quick", "--sizes-mib", "0.25", "0.5", "--repeats", "1",
                 "--dir", str(tmp_path), "--out", str(out), "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["skipped"][CalPath.POOL_GET.value]  # no pool configured here: skipped, with the reason (stable key)
    cal = load_calibration(out)
    assert {CalPath.MEMCPY_1T, CalPath.MEMCPY_NT, CalPath.MEMCPY_ONE, CalPath.DISK_READ_WARM, CalPath.DISK_READ_COLD,
            CalPath.CHECKSUM} <= set(cal.paths)
    assert {h.RESTORE_FIXED[Medium.HOST], h.RESTORE_FIXED[Medium.DISK]} <= set(cal.paths)  # a fixed cost per local tier
    assert load_profile(out).name == "workstation"
    assert main(["plan", "--hardware", str(out)]) == 0


def test_validate_cli_json_rows_for_host_and_disk(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVSTRATA_POOL", raising=False)  # the remote row has its own test
    out = tmp_path / "host.toml"
    assert main(["calibrate", "--sizes-mib", "0.5", "1", "--repeats", "1", "--dir", str(tmp_path), "--out", str(out)]) == 0
    capsys.readouterr()
    code = main(["validate", "--quick", "--json", "--profile", str(out), "--sizes-mib", "2", "4",
                 "--block-tokens", "16", "--repeats", "1", "--dir", str(tmp_path)])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["paths"]
    assert [(r["path"], r["bytes"]) for r in rows] == [
        (path, mib * MIB) for mib in (2, 4) for path in ("host -> device", "disk (page cache) -> device", "disk (cold) -> device")]
    for r in rows:
        assert r["predicted_s"] > 0 and r["measured_s"] > 0 and r["profile_s"] > 0
        assert set(r) >= {"error", "spread", "paired_error", "paired_spread", "probe_spread", "profile_error",
                          "runs_s", "probe_runs_s", "fixed_runs_s", "meets_goal"}
        assert len(r["runs_s"]) == len(r["probe_runs_s"]) == len(r["fixed_runs_s"]) == 1
    assert {p.value for p in (CalPath.MEMCPY_ONE, CalPath.DISK_BLOCKS_WARM, CalPath.DISK_BLOCKS_COLD,
                              h.RESTORE_FIXED[Medium.HOST], h.RESTORE_FIXED[Medium.DISK])} <= set(report["fits"])
    assert main(["validate", "--quick", "--sizes-mib", "2", "--block-tokens", "16", "--repeats", "1",
                 "--dir", str(tmp_path)]) == 0  # the table, without a profile
    assert "paired error" in capsys.readouterr().out


class _Steps:
    """A Progress that records its step labels."""

    def __init__(self) -> None:
        self.labels: list[str] = []

    def start(self, total_steps: int) -> None:
        self.total = total_steps

    def step(self, label: str) -> None:
        self.labels.append(label)


def test_validate_interleaves_probe_restore_and_fixed_cost_per_size_per_round(tmp_path):
    steps = _Steps()  # llama-3-8b blocks of 16 tokens: 2 MiB
    config = ValidateConfig(sizes=(2 * MIB, 4 * MIB), repeats=2, block_tokens=16, directory=str(tmp_path), cold=False)
    run = validate(config, steps)
    assert len(steps.labels) == steps.total
    host = [label for label in steps.labels if "host" in label or "memcpy" in label]
    one_turn = ["probe {probe}, {mib} MiB", "restore host -> device, {mib} MiB", "fixed cost host"]
    turns = [line.format(probe=CalPath.MEMCPY_ONE, mib=mib) for mib in (2, 4) for line in one_turn]
    assert host == turns * 3  # a warm-up round and two timed ones; the sizes take turns within each
    disk = [label for label in steps.labels if label not in host]
    assert disk[:3] == [f"probe {CalPath.DISK_BLOCKS_WARM}, 2 MiB", "restore disk (page cache) -> device, 2 MiB",
                        "fixed cost disk"]
    assert steps.labels.index(disk[0]) > steps.labels.index(host[-1])  # the host rows first: blocks sink once
    assert [(r.tier, r.cold, r.bytes) for r in run.rows] == [(Medium.HOST, False, 2 * MIB), (Medium.DISK, False, 2 * MIB),
                                                            (Medium.HOST, False, 4 * MIB), (Medium.DISK, False, 4 * MIB)]
    for row in run.rows:
        assert len(row.runs_s) == len(row.probe_runs_s) == len(row.fixed_runs_s) == 2  # warm-up dropped
        assert len(row.paired_errors) == 2 and row.profile_s is None and row.meets_goal is None
    fits = run.calibration.paths
    assert fits[CalPath.MEMCPY_ONE].sizes == fits[CalPath.DISK_BLOCKS_WARM].sizes == (2 * MIB, 4 * MIB)
    for tier in (Medium.HOST, Medium.DISK):  # a fixed cost per tier, the bytes free
        assert fits[h.RESTORE_FIXED[tier]].gbps == float("inf")
    # Each row's prediction is the sitting's calibration's
    for row in run.rows:
        assert row.predicted_s == run.calibration.restore_s(row.tier, row.bytes, row.blocks, config.workers, row.cold)
    assert run.within_goal is None  # no row of 64 MiB or more


def test_row_kinds_follow_the_config():
    pool = PoolConfig(master="127.0.0.1:50051")  # never reached: the rows only ask whether there is one
    assert row_kinds(ValidateConfig()) == (RowKind(Medium.HOST), RowKind(Medium.DISK), RowKind(Medium.DISK, cold=True))
    assert row_kinds(ValidateConfig(cold=False, pool=pool)) == (RowKind(Medium.HOST), RowKind(Medium.DISK), RowKind(Medium.REMOTE))
    assert [k.label for k in row_kinds(ValidateConfig(pool=pool))] == [
        "host -> device", "disk (page cache) -> device", "disk (cold) -> device", "remote -> device"]


def test_calibrate_and_validate_the_pool(pool, tmp_path):
    run = calibrate(CalibrateConfig(sizes=(MIB, 2 * MIB), repeats=1, directory=str(tmp_path), pool=pool,
                                    object_bytes=MIB, cold=False))
    assert CalPath.POOL_GET in run.calibration.paths, run.skipped
    assert h.RESTORE_FIXED[Medium.REMOTE] in run.calibration.paths
    result = validate(ValidateConfig(sizes=(2 * MIB,), repeats=1, block_tokens=16, directory=str(tmp_path), pool=pool,
                                     cold=False), profile=run.calibration)
    remote = [r for r in result.rows if r.path == "remote -> device"]
    assert remote and remote[0].predicted_s > 0 and remote[0].measured_s > 0 and remote[0].profile_s > 0
    assert {CalPath.POOL_GET, h.RESTORE_FIXED[Medium.REMOTE]} <= set(result.calibration.paths)


def test_calibrate_combine_writes_the_median_profile_and_refuses_other_hosts_in_one_line(tmp_path, capsys):
    from kvstrata.plan.sittings import combine
    from kvstrata.plan.steps import DecodeFit, Stalls

    files = []
    for i, (host, together) in enumerate((("box", 1.5), ("box", 2.1), ("box", 1.7), ("elsewhere", 1.0))):
        cal = h.HostCalibration(host, "cpu", 2, {CalPath.MEMCPY_1T: h.PathFit(0.0, 10.0 + i)},
                                decode={"tiny": DecodeFit(0.004, 1e-4, 0.0, together)}, stalls={"tiny": Stalls(0.1, (0.2 + i,))})
        files.append(tmp_path / f"p{i}.toml")
        files[-1].write_text(profile_text(cal, builtin_text("workstation")))
    out = tmp_path / "combined.toml"
    assert main(["calibrate", "--combine", *map(str, files[:3]), "--out", str(out)]) == 0
    assert "the median of 3 calibrations" in " ".join(capsys.readouterr().out.split())
    assert load_calibration(out) == combine([load_calibration(f) for f in files[:3]])
    assert load_calibration(out).decode["tiny"].together == 1.7
    assert main(["calibrate", "--combine", *map(str, files), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "different hosts" in err and "elsewhere" in err and len(err.splitlines()) == 1
