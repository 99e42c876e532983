"""One thread that runs callbacks at set times (deadline prefetches), not a thread per callback."""

from __future__ import annotations

import heapq
import logging
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from kvstrata.transfer.placement import io_thread_started

_log = logging.getLogger(__name__)


@dataclass(order=True)
class _Entry:
    when_s: float
    number: int
    run: Callable[[], None] = field(compare=False)
    on_cancel: Callable[[], None] = field(compare=False)


class Timers:
    """Callbacks at ``time.monotonic()`` instants, run one after another on one daemon thread.

    A callback either runs or is cancelled (``close`` cancels every pending one and calls its
    ``on_cancel``), never both: the entry leaves the schedule under the lock before either.
    A callback should be short (hand work to an executor).
    """

    def __init__(self, name: str = "kvstrata-timers") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._heap: list[_Entry] = []
        self._numbers = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    def at(self, when_s: float, run: Callable[[], None], on_cancel: Callable[[], None] = lambda: None) -> None:
        """Run ``run()`` at ``when_s`` (now, if past).

        Raises:
            RuntimeError: closed.
        """
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self._name}: closed")
            heapq.heappush(self._heap, _Entry(when_s, next(self._numbers), run, on_cancel))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._heap)

    def _loop(self) -> None:
        io_thread_started()
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0].when_s > time.monotonic()):
                    timeout = self._heap[0].when_s - time.monotonic() if self._heap else None
                    self._cond.wait(timeout)
                if self._closed:
                    return
                entry = heapq.heappop(self._heap)
            try:
                entry.run()
            except Exception:  # noqa: BLE001 - one callback's error must not stop the others
                _log.exception("%s: a timed callback raised", self._name)

    def close(self) -> None:
        """Cancel every pending callback (calling its ``on_cancel``) and stop the thread. Idempotent."""
        with self._cond:
            self._closed = True
            pending, self._heap = self._heap, []
            self._cond.notify()
        for entry in sorted(pending):
            entry.on_cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
