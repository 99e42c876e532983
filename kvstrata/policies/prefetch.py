"""Prefetch policies: how long a queued request waits for blocks promoted from slow tiers."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PrefetchPolicy(enum.Enum):
    BEST_EFFORT = "best-effort"  # start promotions, never wait: the load uses what has arrived
    WAIT = "wait"  # wait until every promotion completes
    TIMEOUT = "timeout"  # wait up to a deadline, then go with what has arrived


@dataclass(frozen=True)
class PrefetchRule:
    policy: PrefetchPolicy = PrefetchPolicy.BEST_EFFORT
    timeout_s: float = 0.0

    def __post_init__(self) -> None:
        if self.policy is PrefetchPolicy.TIMEOUT and not self.timeout_s > 0:
            raise ValueError(f"prefetch timeout_s must be positive for the timeout policy, got {self.timeout_s}")

    def wait_s(self) -> float | None:
        """How long to wait: 0 (don't), None (until done), or seconds."""
        return {PrefetchPolicy.BEST_EFFORT: 0.0, PrefetchPolicy.WAIT: None}.get(self.policy, self.timeout_s)
