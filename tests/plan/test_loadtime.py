"""Load times from a host calibration: per source tier, the device's blocks free, the CPU's
contention only where the model runs on the CPU."""

from __future__ import annotations


import pytest

from kvstrata.media import Medium
from kvstrata.plan.calpaths import CalPath
from kvstrata.plan.host import HostCalibration, PathFit
from kvstrata.plan.loadtime import calibrated_contention, calibrated_load_time

BLOCK_BYTES = 1_000_000
# Fits with no latency: seconds are bytes over rate, so every figure below is exact.
CALIBRATION = HostCalibration(
    "test", "cpu", 2,
    {CalPath.MEMCPY_1T: PathFit(0.0, 10.0), CalPath.DISK_READ_COLD: PathFit(0.0, 1.0),
     CalPath.DISK_READ_WARM: PathFit(0.0, 4.0)},
)
MEDIA = (Medium.DEVICE, Medium.HOST, Medium.DISK, Medium.DISK)  # the hit's blocks, in prompt order


def test_the_last_blocks_load_per_tier_and_device_blocks_cost_nothing():
    load = calibrated_load_time(CALIBRATION, MEDIA, BLOCK_BYTES, workers=1)
    assert load(0) == 0.0
    assert load(1) == pytest.approx(1e-3)  # one disk block, cold: 1 MB at 1 GB/s
    assert load(3) == pytest.approx(1e-4 + 2e-3)  # a host block at 10 GB/s, two cold disk blocks
    assert load(4) == load(3)  # the device block moves nothing


def test_contention_is_the_warm_path_on_a_cpu_and_none_on_a_gpu():
    load = calibrated_load_time(CALIBRATION, MEDIA, BLOCK_BYTES, workers=1)
    assert calibrated_contention(CALIBRATION, MEDIA, BLOCK_BYTES, load, on_cpu=False) is None
    contention = calibrated_contention(CALIBRATION, MEDIA, BLOCK_BYTES, load, on_cpu=True)
    assert contention(2) == pytest.approx(2 * 2.5e-4)  # page-cache reads at 4 GB/s, not the storage's


def test_contention_falls_back_to_the_whole_load_where_a_path_is_missing():
    cold_only = HostCalibration("test", "cpu", 2, {CalPath.DISK_READ_COLD: PathFit(0.0, 1.0)})
    load = calibrated_load_time(cold_only, (Medium.DISK,) * 2, BLOCK_BYTES, workers=1)
    contention = calibrated_contention(cold_only, (Medium.DISK,) * 2, BLOCK_BYTES, load, on_cpu=True)
    assert contention(2) == load(2) == pytest.approx(2e-3)
