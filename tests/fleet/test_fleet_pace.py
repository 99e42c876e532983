"""A server's pace (kvstrata.fleet.pace): the decayed mean gap between its decoding requests'
tokens, old gaps fading with the window, a gap still open counted once it is longer than the mean."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.fleet.pace import TokenPace


def test_no_gap_seen_is_no_pace_and_a_steady_decode_is_its_step():
    pace = TokenPace(window_s=10.0)
    assert pace.seconds_per_token(0.0) is None
    pace.start(0.0)
    for step in range(1, 11):
        pace.add(step * 0.02, 0.02, count=4)  # a batch of 4, a step each 20 ms
    assert pace.seconds_per_token(0.2) == pytest.approx(0.02)


def test_a_slow_minute_ago_fades_and_what_the_server_does_now_counts():
    pace = TokenPace(window_s=10.0)
    pace.add(0.0, 0.5, count=100)  # a crowded server: half a second a token
    assert pace.seconds_per_token(0.0) == pytest.approx(0.5)
    for i in range(1, 101):  # then steady 20 ms steps, a minute later, 20 tokens each
        pace.add(60.0 + i * 0.02, 0.02, count=20)
    # the old gaps weigh e^-6.2 of their 100 tokens now: under 0.3% of the pace
    assert 0.02 < pace.seconds_per_token(62.0) < 0.02 * 1.003


def test_a_long_prefill_under_way_counts_before_its_tokens_come():
    pace = TokenPace(window_s=10.0)
    pace.start(0.0)
    for step in range(1, 6):
        pace.add(step * 0.02, 0.02)  # 5 tokens, 20 ms each; the last at 0.1 s
    assert pace.seconds_per_token(0.11) == pytest.approx(0.02)  # a gap shorter than the mean: not yet
    stalled = pace.seconds_per_token(2.1)  # 2 s with no token: another request's prefill
    weights = [math.exp(-(2.1 - step * 0.02) / 10.0) for step in range(1, 6)]  # each token's, at 2.1 s
    assert stalled == pytest.approx((0.02 * sum(weights) + 2.0) / (sum(weights) + 1), rel=1e-9)
    assert stalled > 0.3


@given(st.lists(st.tuples(st.floats(0.0, 5.0), st.integers(1, 64)), min_size=1, max_size=40))
def test_the_pace_lies_between_the_shortest_and_longest_gap(gaps):
    pace = TokenPace(window_s=3.0)
    now = 0.0
    for gap, count in gaps:
        now += gap
        pace.add(now, gap, count)
    value = pace.seconds_per_token(now)
    assert min(g for g, _ in gaps) - 1e-9 <= value <= max(g for g, _ in gaps) + 1e-9


@pytest.mark.parametrize("bad", [lambda p: p.add(1.0, -0.1), lambda p: p.add(1.0, 0.1, count=0),
                                 lambda p: p.add(1.0, math.nan), lambda p: TokenPace(window_s=0.0)])
def test_what_cannot_be_a_pace_is_refused(bad):
    with pytest.raises(ValueError, match="pace"):
        bad(TokenPace())
