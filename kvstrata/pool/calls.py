"""A store call in flight on a pool client's worker, and the errors of a pool that cannot be used.

A call that timed out may still be running, and may still read or write the memory it was
given, at any later time: the caller must treat that memory as lost (never reuse it) unless it
can wait for the call itself (``on_late``, or ``CallTimedOut.settled``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

from kvstrata.errors import TierUnavailable

if TYPE_CHECKING:
    from kvstrata.pool.client import PoolClient

# How long a caller that overlaps work with a started call waits for the call to be inside the
# pool engine first (``PendingCall.handed_over``): a worker takes a call in microseconds, unless
# every worker is busy; then the caller goes on rather than wait for one.
HAND_OVER_S = 0.05


class PoolUnavailable(TierUnavailable):
    """The pool cannot be reached now (not running, not answering, or down after a fault)."""


class CallTimedOut(PoolUnavailable):
    """A store call ran past its timeout. It may still be running, and touching its memory,
    until ``settled`` (the call's own future) completes."""

    def __init__(self, *args: object, settled: Future | None = None) -> None:
        super().__init__(*args)
        self.settled = settled


class PendingCall:
    """A store call started by :meth:`PoolClient.start`: ``result()`` once, on the caller's
    thread. Its deadline runs from the start, so a call overlapped with other work is bounded
    as one waited for at once."""

    def __init__(self, client: PoolClient, what: str, future: Future, store: Any, generation: int, deadline: float,
                 timeout_s: float, on_late: Callable[[Any, Any], None] | None, entered: threading.Event) -> None:
        self._client, self._what, self._future, self._store = client, what, future, store
        self._generation, self._deadline, self._timeout_s, self._on_late = generation, deadline, timeout_s, on_late
        self._entered = entered

    def handed_over(self, timeout_s: float = HAND_OVER_S) -> bool:
        """Wait (at most ``timeout_s``) until a worker has taken the call into the pool engine,
        which releases the interpreter's lock while it moves bytes; whether it has.

        Call before CPU-bound work that holds that lock (a MAC over a block, in C, does): a
        worker that still needs the lock to start the call waits a switch interval (5 ms) for
        each of the few times it takes it, and the transfer does not begin until the work ends.
        Measured in the lab (256 MiB from the pool over a 2.5 Gbit/s link, gets pipelined in
        calls of 48, 12 and 4 blocks): each call waited out the previous call's checks (43 ms,
        then 12 ms) before its first byte moved; 0.92 s against 0.87 s for raw Mooncake."""
        return self._entered.wait(timeout_s)

    def result(self) -> Any:
        """The call's result.

        Raises:
            CallTimedOut: it ran past its deadline; the client is DOWN now.
            Exception: what the store call raised.
        """
        try:
            return self._future.result(timeout=max(0.0, self._deadline - time.monotonic()))
        except FutureTimeout:
            client, timeout_s = self._client, self._timeout_s
            client.mark_down(f"{self._what} did not return within {timeout_s:g} s", self._generation)
            if self._on_late is not None:
                try:
                    # Tracked as in flight, so closing waits for it too.
                    client.submit(after, self._future, self._on_late, self._store)
                except RuntimeError:
                    pass  # closed meanwhile
            raise CallTimedOut(f"pool at {client.address}: {self._what} did not return within {timeout_s:g} s",
                               settled=self._future) from None


def entering(entered: threading.Event, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, on a worker, once ``entered`` is set."""
    entered.set()  # the next line calls into the engine, which releases the lock while it moves bytes
    return fn(*args)


def after(stray: Future, on_late: Callable[[Any, Any], None], store: Any) -> None:
    """``on_late(store, result)`` once the ``stray`` call returns (on a worker), if it returned."""
    if stray.exception() is None:  # waits (on this worker) until the stray call returns
        on_late(store, stray.result())
