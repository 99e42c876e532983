"""A serving engine's decode step, fitted: recovered from exact points, costs never negative, and
kept in a calibration's TOML."""

from __future__ import annotations

import sys

import pytest

from kvstrata.plan.host import HostCalibration, PrefillFit
from kvstrata.plan.steps import STALL_MIN_S, DecodeFit, Stalls, fit_decode, fit_stalls

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def test_the_fit_recovers_a_step_that_grows_with_requests_and_tokens():
    truth = DecodeFit(0.003, 1e-4, 6e-7)
    points = [(b, b * ctx, truth.step_s(b, b * ctx)) for b in (1, 2, 4, 8) for ctx in (64, 256)]
    fit = fit_decode(points)
    assert fit.latency_s == pytest.approx(truth.latency_s, rel=1e-6)
    assert fit.per_request_s == pytest.approx(truth.per_request_s, rel=1e-6)
    assert fit.per_token_s == pytest.approx(truth.per_token_s, rel=1e-6)


def test_a_term_fitted_negative_is_dropped_and_the_rest_refitted():
    # Step time that falls a little with tokens held (noise): no negative cost survives.
    points = [(1, 100, 0.0040), (2, 200, 0.0045), (4, 400, 0.0055), (8, 4000, 0.0070), (8, 800, 0.0075)]
    fit = fit_decode(points)
    assert fit.per_token_s == 0.0 and fit.per_request_s > 0 and fit.latency_s > 0


@pytest.mark.parametrize("points, message", [
    ([(1, 10, 0.01), (2, 20, 0.01)], "at least 3 points"),
    ([(0, 10, 0.01), (2, 20, 0.01), (4, 40, 0.02)], "positive batch sizes"),
    ([(1, 10, 0.03), (2, 20, 0.02), (4, 40, 0.01)], "does not grow"),
])
def test_points_that_cannot_be_fitted_are_refused_saying_why(points, message):
    with pytest.raises(ValueError, match=message):
        fit_decode(points)


def test_a_step_of_no_requests_takes_no_time():
    assert DecodeFit(0.003, 1e-4).step_s(0, 0) == 0.0


def test_a_calibration_keeps_each_models_decode_fit_in_its_toml():
    cal = HostCalibration("h", "cpu", 2, prefill={"tiny": PrefillFit(0.006, 2e4, 5e-8)},
                          decode={"tiny": DecodeFit(0.003, 1e-4, 6e-7)})
    back = HostCalibration.from_mapping(tomllib.loads(cal.to_toml()))
    assert back.decode == cal.decode and back.prefill == cal.prefill


# --- stalls ---------------------------------------------------------------------------------------


def test_a_stall_is_a_time_well_past_its_servers_median_by_how_much():
    one = [0.050, 0.052, 0.055, 0.060, 0.300]  # median 55 ms: one 245 ms late, 5 ms is noise
    other = [0.080, 0.081, 0.130, 0.079]  # median 80.5 ms: 130 ms is 49.5 ms late
    share, stalls = fit_stalls([one, other])
    assert share == pytest.approx(2 / 9)
    assert stalls == pytest.approx((0.0495, 0.245))


def test_a_steady_stream_with_no_late_request_has_no_stalls():
    assert fit_stalls([[0.05, 0.06, 0.07, 0.05 + STALL_MIN_S * 0.99]]) == (0.0, ())


def test_stalls_need_times():
    with pytest.raises(ValueError, match="at least one request"):
        fit_stalls([[], []])


@pytest.mark.parametrize("stalls, message", [
    (dict(alone=1.5, alone_s=(0.1,)), "alone must be a share"),
    (dict(beside=0.2), "no stall of that kind was measured"),
    (dict(beside=0.2, beside_s=(0.1, -0.1)), "beside_s must be seconds > 0"),
])
def test_stalls_that_cannot_be_are_refused_naming_the_field(stalls, message):
    with pytest.raises(ValueError, match=message):
        Stalls(**stalls)


def test_a_calibration_keeps_each_models_stalls_in_its_toml():
    cal = HostCalibration("h", "cpu", 2, stalls={"tiny": Stalls(0.05, (0.12,), 0.2, (0.06, 0.31)),
                                                 "other": Stalls()})
    back = HostCalibration.from_mapping(tomllib.loads(cal.to_toml()))
    assert back.stalls == cal.stalls
