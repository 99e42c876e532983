"""Fits and the calibration's TOML round trip (pure arithmetic: no timing asserted)."""

from __future__ import annotations

import math
import tomllib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.plan import host as h
from kvstrata.plan.calpaths import CalPath
from kvstrata.media import Medium


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
@given(
    latency=st.floats(0, 1e-2),
    gbps=st.floats(0.1, 500),
    sizes=st.lists(st.integers(4096, 1 << 30), min_size=2, max_size=6, unique=True),
)
def test_fit_of_exact_data_recovers_latency_and_bandwidth(relative, latency, gbps, sizes):
    times = [latency + s / (gbps * 1e9) for s in sizes]
    fit = h.fit_path(sizes, times, relative=relative)
    assert fit.gbps == pytest.approx(gbps, rel=1e-6)
    assert fit.latency_s == pytest.approx(latency, rel=1e-6, abs=1e-9)
    assert fit.seconds(sizes[0]) == pytest.approx(times[0], rel=1e-6)


def test_fit_of_one_size_goes_through_the_origin():
    fit = h.fit_path([1_000_000], [0.001])
    assert (fit.latency_s, fit.gbps) == (0.0, pytest.approx(1.0))


def test_relative_fit_weighs_every_size_alike():
    # 1 GB/s at three small sizes, one slow large point: unweighted, the large point sets the
    # rate and the small sizes come out 2x off; on relative error every point counts alike.
    sizes, times = [10**6, 2 * 10**6, 4 * 10**6, 10**9], [1e-3, 2e-3, 4e-3, 2.0]
    plain, relative = h.fit_path(sizes, times), h.fit_path(sizes, times, relative=True)
    assert plain.seconds(2 * 10**6) == pytest.approx(4e-3)
    assert relative.seconds(2 * 10**6) == pytest.approx(2e-3, rel=0.1)
    assert relative.seconds(10**9) == pytest.approx(2.0, rel=0.5)  # the outlier pays, no point alone decides
    # A negative latency: through the origin, on relative error (between the points' own rates)
    through = h.fit_path([10**6, 2 * 10**6], [1e-3, 3e-3], relative=True)
    assert through.latency_s == 0.0 and 2 / 3 < through.gbps < 1.0


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
        CalPath.MEMCPY_1T: h.PathFit(1e-5, 10.0, 0.05, (1, 2)),
        CalPath.MEMCPY_NT: h.PathFit(2e-5, 16.0),
        CalPath.DISK_READ_WARM: h.PathFit(3e-5, 12.0),
        CalPath.DISK_READ_WARM_NT: h.PathFit(3e-5, 20.0),
        CalPath.DISK_READ_COLD: h.PathFit(1e-4, 3.0),
        CalPath.CHECKSUM: h.PathFit(0.0, 30.0),
        CalPath.POOL_GET: h.PathFit(1e-3, 5.0),
    }
    return h.HostCalibration('host "a"', "cpu", 2, paths, {"m": h.PrefillFit(0.01, 5000.0, 1e-9)}, **extra)


def test_toml_round_trip():
    cal = _calibration(efficiency={"pcie": 0.8})
    cal.paths[CalPath.RESTORE_DISPATCH] = h.fit_path([2048], [2e-4], fixed=True)  # gbps = inf: TOML's inf
    assert h.HostCalibration.from_mapping(tomllib.loads(cal.to_toml())) == cal


def test_restore_composition_adds_up_per_tier():
    cal = _calibration()
    n = 64 * 10**6
    assert cal.restore_s(Medium.HOST, n, 8, workers=2) == pytest.approx(2e-5 + n / 16e9)
    # disk: per file the one-thread latency, per byte the N-thread read, then the checksum
    # (no N-thread checksum measured: the one-thread rate times the workers)
    assert cal.restore_s(Medium.DISK, n, 8, workers=2) == pytest.approx(4 * 3e-5 + n / 20e9 + n / 60e9)
    assert cal.restore_s(Medium.REMOTE, n, 8) == pytest.approx(1e-3 + n / 5e9)
    assert cal.restore_s(Medium.DISK, 0, 0) == 0.0
    with pytest.raises(ValueError, match="no restore from tier 'device'"):
        cal.restore_s(Medium.DEVICE, n, 1)
    with pytest.raises(KeyError, match="not calibrated"):
        h.HostCalibration("x", "cpu", 1).restore_s(Medium.HOST, n, 1)


def test_restore_paths_per_tier():
    # Into a CPU device: one torch copy, however many workers (see CacheConfig.layer_ranges).
    assert h.restore_paths(Medium.HOST, False, cuda=False, workers=2) == (CalPath.MEMCPY_ONE,)
    assert h.restore_paths(Medium.HOST, False, cuda=False, workers=1) == (CalPath.MEMCPY_ONE,)
    assert h.restore_paths(Medium.HOST, False, cuda=True, workers=2) == (CalPath.H2D_PINNED,)
    assert h.restore_paths(Medium.DISK, True, cuda=False, workers=2) == (CalPath.DISK_BLOCKS_COLD,)
    assert h.restore_paths(Medium.DISK, False, cuda=True, workers=2) == (CalPath.DISK_BLOCKS_WARM, CalPath.H2D_PINNED)
    assert h.restore_paths(Medium.REMOTE, False, cuda=True, workers=2) == (CalPath.POOL_GET, CalPath.H2D_PINNED)
    with pytest.raises(ValueError, match="no restore from tier 'device'"):
        h.restore_paths(Medium.DEVICE, False, cuda=False, workers=2)


def test_restore_with_a_tier_fixed_cost_adds_the_paths_rates_only():
    cal = _calibration()
    cal.paths.update({
        CalPath.DISK_BLOCKS_WARM: h.PathFit(5e-4, 8.0), CalPath.DISK_BLOCKS_COLD: h.PathFit(1e-3, 2.0),
        CalPath.RESTORE_DISPATCH: h.PathFit(9.0, math.inf),  # an old profile's: not used beside a tier's own
        h.RESTORE_FIXED[Medium.HOST]: h.PathFit(1e-3, math.inf), h.RESTORE_FIXED[Medium.DISK]: h.PathFit(2e-3, math.inf),
    })
    n = 64 * 10**6
    assert cal.restore_s(Medium.HOST, n, 8, workers=2) == pytest.approx(1e-3 + n / 16e9)  # memcpy_nt's latency not added
    assert cal.restore_s(Medium.HOST, n, 8, workers=1) == pytest.approx(1e-3 + n / 10e9)
    cal.paths[CalPath.MEMCPY_ONE] = h.PathFit(3e-5, 12.0)  # a profile that has it: the path a CPU load takes
    assert cal.restore_s(Medium.HOST, n, 8, workers=2) == pytest.approx(1e-3 + n / 12e9)
    assert cal.restore_s(Medium.HOST, n, 8, workers=1) == pytest.approx(1e-3 + n / 12e9)
    assert cal.restore_s(Medium.DISK, n, 8, workers=2) == pytest.approx(2e-3 + n / 8e9)
    assert cal.restore_s(Medium.DISK, n, 8, workers=2, cold=True) == pytest.approx(2e-3 + n / 2e9)
    # remote: no fixed cost of its own measured: the old composition, the old dispatch
    assert cal.restore_s(Medium.REMOTE, n, 8) == pytest.approx(9.0 + 1e-3 + n / 5e9)
    assert h.HostCalibration.from_mapping(tomllib.loads(cal.to_toml())) == cal


def test_a_profile_keys_its_paths_by_stable_keys_and_labels_them_for_people():
    text = _calibration().to_toml()
    assert 'path = "memcpy_1t"\nlabel = "memcpy 1 thread"' in text
    entries = tomllib.loads(text)["calibration"]["path"]
    assert [e["path"] for e in entries] == [p.value for p in _calibration().paths]


# A profile as kvstrata calibrate wrote it before paths had stable keys: each path named by its label.
OLD_PROFILE = """\
# Written by `kvstrata calibrate`: this host's measured paths, seconds = latency_s + bytes / (gbps * 1e9).
[calibration]
host = "old-host"
device = "cpu"
threads = 2

[[calibration.path]]
name = "memcpy (one torch copy)"
latency_s = 3e-05
gbps = 12.0
spread = 0.05
sizes = [2097152, 4194304]

[[calibration.path]]
name = "restore fixed cost (kvstrata, from host)"
latency_s = 0.001
gbps = inf
spread = 0.0
sizes = [2048]

[[calibration.prefill]]
model = "m"
latency_s = 0.01
tokens_per_s = 5000.0
attn_s = 1e-09

[efficiency]
"pcie" = 0.8
"""


def test_a_profile_written_before_stable_keys_still_loads(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text(OLD_PROFILE)
    cal = h.HostCalibration.from_mapping(tomllib.loads(path.read_text()))
    assert cal.paths == {CalPath.MEMCPY_ONE: h.PathFit(3e-5, 12.0, 0.05, (2097152, 4194304)),
                         h.RESTORE_FIXED[Medium.HOST]: h.PathFit(1e-3, math.inf, 0.0, (2048,))}
    assert cal.restore_s(Medium.HOST, 12 * 10**6, 1) == pytest.approx(1e-3 + 1e-3)
    assert (cal.host, cal.prefill["m"].tokens_per_s, cal.efficiency) == ("old-host", 5000.0, {"pcie": 0.8})
    # written again, it is in the new format, and reads back the same
    assert 'path = "memcpy_one"' in cal.to_toml()
    assert h.HostCalibration.from_mapping(tomllib.loads(cal.to_toml())) == cal


@pytest.mark.parametrize(("entry", "match"), [
    ('name = "memcpy (a path no more)"', r"'memcpy \(a path no more\)' \(a profile from an older kvstrata\)"),
    ('path = "teleport"', "'teleport' is not one this kvstrata knows"),
])
def test_a_profile_path_not_known_is_refused_saying_to_calibrate_again(tmp_path, entry, match):
    path = tmp_path / "odd.toml"
    path.write_text(OLD_PROFILE.replace('name = "memcpy (one torch copy)"', entry))
    with pytest.raises(ValueError, match=match) as caught:
        h.HostCalibration.from_mapping(tomllib.loads(path.read_text()))
    assert str(caught.value).endswith("run `kvstrata calibrate` again to write a new profile")
    assert "\n" not in str(caught.value)
