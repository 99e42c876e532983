"""A pool client's circuit breaker: UP, or DOWN with a background thread probing the pool.

* UP: calls go to the store.
* DOWN: a call timed out, the caller reported a transport failure (``mark_down``), or the pool
  could not be reached at all. Calls fail at once with PoolUnavailable (nobody waits on a pool
  known to be down). One background thread per client probes, ``backoff_s`` after the fault,
  then twice as long after each failed probe (up to ``backoff_max_s``, jittered), never on a
  caller's thread. What a probe does is the client's (``PoolClient._probe``): passing makes it
  UP, and ``on_up`` then hears what happened (``Reconnected``).
"""

from __future__ import annotations

import random
import threading
import time
import weakref
from dataclasses import dataclass

from kvstrata.pool.config import PoolConfig
from kvstrata.transfer.placement import io_thread_started


@dataclass(frozen=True)
class Reconnected:
    """A client is UP again, after a fault or after starting without the pool.

    Attributes:
        pool: where the pool is now.
        previous: where it was when the client went down.
        new_store: a new connection (the pool came back elsewhere, restarted, or was never
            reached: its objects may be other ones); False: the old one answers again.
        reason: why the client was down.
        down_s: how long it was down.
    """

    pool: PoolConfig
    previous: PoolConfig
    new_store: bool
    reason: str
    down_s: float

    @property
    def moved(self) -> bool:
        """The pool is reached at other addresses (or settings) than before."""
        return self.pool != self.previous


class Breaker:
    """The state of one client's breaker. It is part of the client's state: every method is
    called with the client's lock held (the client checks it together with its store and
    generation), except :meth:`backoff`'s random draw, which needs none."""

    def __init__(self, backoff_s: float, backoff_max_s: float) -> None:
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.down: str | None = None  # why calls fail now; None: UP
        self.probe_error: str | None = None  # what the last probe of a DOWN client found
        self.down_at = 0.0
        self.down_pool: PoolConfig | None = None  # where the pool was when the client went down
        self.next_probe = 0.0
        self.probing = False
        self.wake = threading.Event()  # set when the client closes: the probing thread ends

    def trip(self, reason: str, pool: PoolConfig) -> bool:
        """DOWN for ``reason``; whether a probing thread must start (none runs yet)."""
        self.down, self.down_at, self.down_pool, self.probe_error = reason, time.monotonic(), pool, None
        start, self.probing = not self.probing, True
        return start

    def reset(self, pool: PoolConfig, new_store: bool) -> Reconnected:
        """UP again, at ``pool``: what happened."""
        event = Reconnected(pool, self.down_pool or pool, new_store, self.down or "", time.monotonic() - self.down_at)
        self.down, self.probing = None, False
        return event

    def reason(self) -> str | None:
        """Why calls fail now (None: UP), and what the last probe found."""
        if self.down is None or self.probe_error is None:
            return self.down
        return f"{self.down}; last probe: {self.probe_error}"

    def next_probe_in(self) -> float:
        return max(0.0, self.next_probe - time.monotonic())

    def backoff(self, failures: int) -> float:
        """The wait before the next probe after ``failures`` failed ones."""
        delay = min(self.backoff_max_s, self.backoff_s * 2 ** min(failures, 32))
        return delay * random.uniform(0.5, 1.0)  # clients that lost the pool together do not probe together


def probe_until_up(ref: weakref.ref, wake: threading.Event) -> None:
    """The probing thread of a DOWN client (``ref``): probe, back off, until it is UP, closed or
    gone. It holds the client only while probing: a daemon thread that drops the last reference
    to the client's registered memory as the interpreter finalizes aborts the process."""
    io_thread_started()
    failures = 0
    while True:
        client = ref()
        delay = None if client is None else client._backoff(failures)
        del client
        if delay is None or wake.wait(delay):
            return
        client = ref()
        if client is None or client._probe(failures):
            return
        del client
        failures += 1
