"""Several calibrations of one host combined: each figure the median of its sittings, the stalls
pooled, calibrations of other hosts refused."""

from __future__ import annotations

import pytest

from kvstrata.plan.calpaths import CalPath
from kvstrata.plan.host import HostCalibration, PathFit, PrefillFit
from kvstrata.plan.sittings import combine
from kvstrata.plan.steps import ConnectorFit, DecodeFit, Stalls


def _sitting(together: float, request_s: float, stalls: Stalls, gbps: float = 10.0, pool: bool = False) -> HostCalibration:
    paths = {CalPath.MEMCPY_1T: PathFit(1e-5 * together, gbps, together / 10, (1 << 20,))}
    if pool:
        paths[CalPath.POOL_GET] = PathFit(2e-4, 3.0, 0.1, (4 << 20,))
    return HostCalibration("box", "cpu", 2, paths, {"tiny": PrefillFit(0.01 * together, 2e4)}, {},
                           {"tiny": DecodeFit(0.004, 1e-4, 0.0, together, 0.9, 1.2)},
                           {"tiny": ConnectorFit(request_s, 0.002)}, {"tiny": stalls})


def test_each_figure_is_the_median_of_its_sittings_and_the_stalls_are_pooled():
    sittings = [_sitting(2.2, 0.023, Stalls(0.0, (), 0.25, (0.1, 0.3))),
                _sitting(1.6, 0.014, Stalls(0.05, (0.08,), 0.0, ())),
                _sitting(1.5, 0.018, Stalls(0.0, (), 0.05, (0.2,)), gbps=12.0, pool=True)]
    c = combine(sittings)
    assert c.decode["tiny"] == DecodeFit(0.004, 1e-4, 0.0, 1.6, 0.9, 1.2)
    assert c.connector["tiny"] == ConnectorFit(0.018, 0.002)
    assert c.prefill["tiny"].latency_s == pytest.approx(0.016)
    assert c.paths[CalPath.MEMCPY_1T].gbps == 10.0 and c.paths[CalPath.MEMCPY_1T].spread == pytest.approx(0.22)
    assert c.paths[CalPath.POOL_GET] == sittings[2].paths[CalPath.POOL_GET]  # one sitting had it: its own
    stalls = c.stalls["tiny"]
    assert (stalls.alone, stalls.beside) == pytest.approx((0.05 / 3, 0.1))
    assert (stalls.alone_s, stalls.beside_s) == ((0.08,), (0.1, 0.2, 0.3))


def test_one_calibration_combined_is_itself():
    one = _sitting(1.7, 0.02, Stalls(0.1, (0.15,), 0.2, (0.05, 0.4)))
    assert combine([one]) == one


def test_calibrations_of_different_hosts_or_none_are_refused():
    other = HostCalibration("elsewhere", "cpu", 2)
    with pytest.raises(ValueError, match="different hosts"):
        combine([_sitting(1.5, 0.01, Stalls()), other])
    with pytest.raises(ValueError, match="at least one"):
        combine([])
