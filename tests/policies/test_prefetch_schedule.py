"""The deadline schedule of a prefetch: pure arithmetic."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.policies.prefetch import PrefetchRule, schedule

times = st.floats(min_value=0, max_value=1e4, allow_nan=False)


@given(now=times, ahead=times, predicted=times, margin=st.floats(min_value=0, max_value=2))
def test_starts_in_time_when_it_can_and_never_before_now(now, ahead, predicted, margin):
    deadline = now + ahead
    t = schedule(now, deadline, predicted, margin)
    assert t.start_s >= now
    if now + predicted * (1 + margin) <= deadline:  # feasible with the margin: exactly that early
        assert t.start_s == pytest.approx(deadline - predicted * (1 + margin))
        assert t.late_s == 0
    assert t.late_s == pytest.approx(max(0.0, now + predicted - deadline))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="predicted_s"):
        schedule(0, 1, -1)
    with pytest.raises(ValueError, match="margin"):
        PrefetchRule(margin=-0.1)
