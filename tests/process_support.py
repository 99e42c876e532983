"""Waiting in the pool and fault tests: for a condition, and for a killed process to be gone."""

from __future__ import annotations

import os
import signal
import time

from kvstrata.pool import embedded


def wait_until(predicate, timeout_s: float) -> bool:
    """Whether ``predicate()`` became true within ``timeout_s`` (polled every 20 ms)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def kill_and_reap(pid: int, timeout_s: float = 10.0) -> None:
    """SIGKILL ``pid``'s process group (the pool's processes lead their own) and wait until it
    is gone; reap it if it is our child, so it leaves no zombie."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:  # not our child (or reaped already): wait for it to vanish
            if not embedded._alive(pid):
                return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} still alive {timeout_s} s after SIGKILL")
