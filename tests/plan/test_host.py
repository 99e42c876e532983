"""Fits and the calibration's TOML round trip (pure arithmetic: no timing asserted)."""

from __future__ import annotations

import tomllib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.plan import host as h


@given(
    latency=st.floats(0, 1e-2),
    gbps=st.floats(0.1, 500),
    sizes=st.lists(st.integers(4096, 1 << 30), min_size=2, max_size=6, unique=True),
)
def test_fit_of_exact_data_recovers_latency_and_bandwidth(latency, gbps, sizes):
    times = [latency + s / (gbps * 1e9) for s in sizes]
    fit = h.fit_path(sizes, times)
    assert fit.gbps == pytest.approx(gbps, rel=1e-6)
    assert fit.latency_s == pytest.approx(latency, rel=1e-6, abs=1e-9)
    assert fit.seconds(sizes[0]) == pytest.approx(times[0], rel=1e-6)


def test_fit_of_one_size_goes_through_the_origin():
    fit = h.fit_path([1_000_000], [0.001])
    assert (fit.latency_s, fit.gbps) == (0.0, pytest.approx(1.0))


def test_fixed_fit_is_latency_only():
    fit = h.fit_path([2048], [3e-4], 0.1, fixed=True)
    assert (fit.latency_s, fit.gbps, fit.spread, fit.sizes) == (3e-4, float("inf"), 0.1, (2048,))
    assert fit.seconds(10**12) == 3e-4  # the bytes cost nothing


@pytest.mark.parametrize(
    ("sizes", "seconds", "match"),
    [([], [], "at least one"), ([1, 2], [1.0], "as many"), ([0], [1.0], "positive"), ([10], [0.0], "positive")],
)
def test_fit_rejects_bad_input_by_name(sizes, seconds, match):
    with pytest.raises(ValueError, match=match):
        h.fit_path(sizes, seconds)


def _calibration(**extra) -> h.HostCalibration:
    paths = {
        h.MEMCPY_1T: h.PathFit(1e-5, 10.0, 0.05, (1, 2)),
        h.MEMCPY_NT: h.PathFit(2e-5, 16.0),
        h.DISK_READ_WARM: h.PathFit(3e-5, 12.0),
        h.DISK_READ_WARM_NT: h.PathFit(3e-5, 20.0),
        h.DISK_READ_COLD: h.PathFit(1e-4, 3.0),
        h.CHECKSUM: h.PathFit(0.0, 30.0),
        h.POOL_GET: h.PathFit(1e-3, 5.0),
    }
    return h.HostCalibration('host "a"', "cpu", 2, paths, {"m": h.PrefillFit(0.01, 5000.0, 1e-9)}, **extra)


def test_toml_round_trip():
    cal = _calibration(efficiency={"pcie": 0.8})
    cal.paths[h.RESTORE_DISPATCH] = h.fit_path([2048], [2e-4], fixed=True)  # gbps = inf: TOML's inf
    assert h.HostCalibration.from_mapping(tomllib.loads(cal.to_toml())) == cal


def test_restore_composition_adds_up_per_tier():
    cal = _calibration()
    n = 64 * 10**6
    assert cal.restore_s("host", n, 8, workers=2) == pytest.approx(2e-5 + n / 16e9)
    # disk: per file the one-thread latency, per byte the N-thread read, then the checksum
    # (no N-thread checksum measured: the one-thread rate times the workers)
    assert cal.restore_s("disk", n, 8, workers=2) == pytest.approx(4 * 3e-5 + n / 20e9 + n / 60e9)
    assert cal.restore_s("remote", n, 8) == pytest.approx(1e-3 + n / 5e9)
    assert cal.restore_s("disk", 0, 0) == 0.0
    with pytest.raises(ValueError, match="unknown tier"):
        cal.restore_s("tape", n, 1)
    with pytest.raises(KeyError, match="not calibrated"):
        h.HostCalibration("x", "cpu", 1).restore_s("host", n, 1)
