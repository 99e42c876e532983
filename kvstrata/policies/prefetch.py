"""Prefetch policies: when promotions for a queued request start, and how long it waits for them.

Deadlines: a queued request is expected to start at ``deadline_s``. With the host's measured
paths (:class:`kvstrata.plan.host.HostCalibration`) the cache predicts how long promoting its
blocks takes and :func:`schedule` says when to begin so that they are predicted to be in the
host tier by then, with a safety margin: not earlier (the host tier's room serves other
requests meanwhile), never later than now. A promotion that cannot finish in time starts at
once, and the lateness is reported.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PrefetchPolicy(enum.Enum):
    BEST_EFFORT = "best-effort"  # start promotions, never wait: the load uses what has arrived
    WAIT = "wait"  # wait until every promotion completes
    TIMEOUT = "timeout"  # wait up to a deadline, then go with what has arrived
    DEADLINE = "deadline"  # start in time for the request's start (predicted); never wait


@dataclass(frozen=True)
class PrefetchRule:
    policy: PrefetchPolicy = PrefetchPolicy.BEST_EFFORT
    timeout_s: float = 0.0
    margin: float = 0.25  # DEADLINE: start this fraction of the predicted time earlier still

    def __post_init__(self) -> None:
        if self.policy is PrefetchPolicy.TIMEOUT and not self.timeout_s > 0:
            raise ValueError(f"prefetch timeout_s must be positive for the timeout policy, got {self.timeout_s}")
        if not self.margin >= 0:
            raise ValueError(f"prefetch margin must be >= 0, got {self.margin}")

    def timing(self, now_s: float, deadline_s: float | None, predicted_s: float | None) -> PrefetchTiming | None:
        """When a prefetch under this rule starts: a schedule for DEADLINE with a prediction
        (``predicted_s``, None without a calibration), else None (it starts at once).

        Raises:
            ValueError: DEADLINE without ``deadline_s``.
        """
        if self.policy is not PrefetchPolicy.DEADLINE:
            return None
        if deadline_s is None:
            raise ValueError("the deadline prefetch policy needs deadline_s (time.monotonic() of the request's start)")
        return None if predicted_s is None else schedule(now_s, deadline_s, predicted_s, self.margin)

    def wait_s(self) -> float | None:
        """How long to wait: 0 (don't), None (until done), or seconds."""
        waits = {PrefetchPolicy.BEST_EFFORT: 0.0, PrefetchPolicy.WAIT: None, PrefetchPolicy.DEADLINE: 0.0}
        return waits.get(self.policy, self.timeout_s)


@dataclass(frozen=True)
class PrefetchTiming:
    """When a deadline prefetch starts, and what was predicted.

    Attributes:
        start_s: when to begin promoting (the caller's clock, seconds).
        predicted_s: predicted promotion time.
        late_s: by how much it is predicted to miss the deadline even if started now (0: on time).
    """

    start_s: float
    predicted_s: float
    late_s: float


def schedule(now_s: float, deadline_s: float, predicted_s: float, margin: float = 0.25) -> PrefetchTiming:
    """Start ``predicted_s * (1 + margin)`` before the deadline, but not before now."""
    if not predicted_s >= 0:
        raise ValueError(f"predicted_s must be >= 0, got {predicted_s}")
    if not margin >= 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    start = max(now_s, deadline_s - predicted_s * (1 + margin))
    return PrefetchTiming(start, predicted_s, max(0.0, now_s + predicted_s - deadline_s))
