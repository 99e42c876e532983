"""Daemon worker threads for calls that may never return (a store call into a hung pool).

A ``ThreadPoolExecutor`` would not do: its threads are joined at interpreter exit, so one call
stuck in a hung pool would hang the exit too, and a fixed number of workers lets stuck calls
starve every later one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any
from kvstrata.transfer.placement import io_thread_started


class Workers:
    """Daemon threads that run calls; a new one starts whenever none is idle. ``prepare``:
    run on the worker before each call (the pool client moves it into the pool's network).

    Each ``submit`` either takes an idle worker or starts one, so a job never waits behind a
    call that is stuck in the pool.
    """

    def __init__(self, name: str, prepare: Callable[[], None] | None = None) -> None:
        self._name = name
        self._prepare = prepare  # run on the worker before each call (a raise is the call's)
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._started = 0
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: workers are closed")
            spawn = self._idle == 0
            if spawn:
                self._started += 1
            else:
                self._idle -= 1
            number = self._started
        self._jobs.put((future, fn, args))
        if spawn:
            threading.Thread(target=self._run, name=f"{self._name}-{number}", daemon=True).start()
        return future

    def _run(self) -> None:
        io_thread_started()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    if self._prepare is not None:
                        self._prepare()
                    future.set_result(fn(*args))
                except BaseException as error:  # noqa: BLE001 - handed to the waiter
                    future.set_exception(error)
            # Hold nothing while idle: a daemon thread that drops the last reference to a tensor
            # (a future's callbacks reach the pool client and its registered memory) as the
            # interpreter finalizes is killed inside torch's deallocator, which aborts the
            # process ("terminate called without an active exception"; seen in ~40% of exits).
            del job, future, fn, args
            with self._lock:
                if self._closed:
                    return
                self._idle += 1

    def close(self) -> None:
        """Stop idle workers; busy ones stop when their call returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, 0
        for _ in range(idle):
            self._jobs.put(None)
