"""Waiting in the pool and fault tests: for a condition, and for a killed process to be gone."""

from __future__ import annotations

import os
import signal
import subprocess
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
            if not embedded.process_alive(pid):
                return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} still alive {timeout_s} s after SIGKILL")


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads (if any is left) and reap ``proc``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def stop_process(pid: int, timeout_s: float = 5.0) -> None:
    """SIGSTOP ``pid`` and wait until every one of its threads is stopped: ``kill`` returns once
    the signal is sent, and on a busy host a thread of the process can still answer a request
    before it is scheduled to stop, which a test that hangs the process then misreads."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            return True
        states = (_stat(f"/proc/{pid}/task/{task}/stat") for task in tasks)
        return all(fields is None or fields[0] in ("T", "t") for fields in states)

    if not wait_until(stopped, timeout_s):
        raise AssertionError(f"process {pid} not stopped {timeout_s} s after SIGSTOP")


def children_running(fragment: str, parent: int | None = None) -> list[int]:
    """The children of ``parent`` (default: this process) whose command line holds ``fragment``
    (e.g. a server left behind). Read from the parent's own lists of children (one per thread),
    not a scan of every process: quick enough to catch a child between two steps of its parent."""
    parent = os.getpid() if parent is None else parent
    children = []
    try:
        for task in os.listdir(f"/proc/{parent}/task"):
            with open(f"/proc/{parent}/task/{task}/children") as f:
                children += f.read().split()
    except OSError:  # the parent is gone (or a thread of it)
        pass
    return [int(p) for p in children if fragment in _cmdline(p)]


def _stat(path: str) -> list[str] | None:
    """A /proc stat file's fields after the command name (state first, then the parent pid)."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
