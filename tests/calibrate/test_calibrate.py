"""calibrate and validate end to end on tiny sizes: files load, rows are there (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from kvstrata.calibrate import load_calibration, profile_text
from kvstrata.calibrate.measure import CalibrateConfig, calibrate
from kvstrata.calibrate.validate import ValidateConfig, validate
from kvstrata.cli import main
from kvstrata.hardware.profile import builtin_text, load_profile
from kvstrata.plan import host as h

MIB = 1 << 20


def test_profile_with_calibration_loads_as_hardware_profile(tmp_path):
    cal = h.HostCalibration("box", "cpu", 2, {h.MEMCPY_1T: h.PathFit(0.0, 10.0)})
    path = tmp_path / "p.toml"
    path.write_text(profile_text(cal, builtin_text("workstation")))
    assert load_profile(path).name == "workstation"
    assert load_calibration(path) == cal


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
    assert report["skipped"][h.POOL_GET]  # no pool configured here: skipped, with the reason
    cal = load_calibration(out)
    assert {h.MEMCPY_1T, h.MEMCPY_NT, h.DISK_READ_WARM, h.DISK_READ_COLD, h.CHECKSUM} <= set(cal.paths)
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
    rows = json.loads(capsys.readouterr().out)["paths"]
    assert {r["path"] for r in rows} == {"host -> device", "disk (page cache) -> device", "disk (cold) -> device"}
    for r in rows:
        assert r["predicted_s"] > 0 and r["measured_s"] > 0 and r["bytes"] > 0
        assert set(r) >= {"path", "bytes", "predicted_s", "measured_s", "error"}


def test_calibrate_and_validate_the_pool(pool, tmp_path):
    run = calibrate(CalibrateConfig(sizes=(MIB, 2 * MIB), repeats=1, directory=str(tmp_path), pool=pool,
                                    object_bytes=MIB, cold=False))
    assert h.POOL_GET in run.calibration.paths, run.skipped
    rows = validate(run.calibration, ValidateConfig(sizes=(2 * MIB,), repeats=1, block_tokens=16,
                                                   directory=str(tmp_path), pool=pool, cold=False))
    remote = [r for r in rows if r.path == "remote -> device"]
    assert remote and remote[0].predicted_s > 0 and remote[0].measured_s > 0
