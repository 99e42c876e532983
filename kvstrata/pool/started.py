"""Which process a recorded pid is: its start time and executable, as ``pool.json`` keeps them.

A pid alone names whatever holds it now. Once the pool's processes are gone (killed, a reboot)
the kernel hands their pids to others, and signalling the recorded process groups would end
unrelated work. So ``pool start`` records, with each pid, the process's start time
(``/proc/<pid>/stat`` field 22, clock ticks after boot: two processes that hold one pid in turn
differ in it) and its executable (``/proc/<pid>/exe``), and ``pool stop`` signals a pid only
while both still match. A pid recorded without them (a ``pool.json`` older than this) names an
unknown process: it is never signalled.

A process is only stamped once ``start`` has it serving, and ``start`` may be killed before
that (SIGKILL, at any point): its processes run on, named in no ``pool.json``. So each start
first records a fresh random token in the run directory, and launches its processes with it in
their environment (``TOKEN_ENV``): whatever a killed start left running carries the token, which
``carrying`` finds. A process that carries it was launched by that start (or by one of its
processes): a token is made per start, kept in the owner's private run directory, and a
process's environment is set at its ``exec`` by its parent, so no unrelated process holds it.

Linux only (``/proc``), as the pool's engine is.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass

TOKEN_ENV = "KVSTRATA_POOL_START"  # the environment variable a start's processes carry its token in
EXEC_WAIT_S = 0.5  # how long an empty environment is read again (an exec takes ~1 ms; a busy host, more)


def new_token() -> str:
    """A fresh token for one start (128 random bits, hex)."""
    return secrets.token_hex(16)


def carrying(token: str) -> list[int]:
    """The pids of live processes launched with ``token`` (``TOKEN_ENV``) in their environment,
    among those whose environment this user may read (its own; every one for root). A zombie
    has none: it is not listed."""
    return [int(name) for name in os.listdir("/proc") if name.isdigit() and carries(int(name), token)]


def carries(pid: int, token: str) -> bool:
    """Whether the process that holds ``pid`` now was launched with ``token`` (``TOKEN_ENV``).

    A process in the middle of an ``exec`` (the pool's programs are wrappers that exec the
    engine's binaries) shows an empty environment for about a millisecond, between its new
    image and the environment it was given: measured here, a scan at that moment missed the
    daemon about one kill in three. So an empty environment of a process that has an executable
    (a kernel thread has none, nor a zombie) is read again, for up to ``EXEC_WAIT_S``.
    """
    entry = f"{TOKEN_ENV}={token}".encode()
    deadline = time.monotonic() + EXEC_WAIT_S
    while True:
        try:
            with open(f"/proc/{pid}/environ", "rb") as file:
                environ = file.read()
        except OSError:  # gone, or another user's
            return False
        if environ or not _has_exe(pid) or time.monotonic() > deadline:
            return entry in environ.split(b"\0")
        time.sleep(0.002)


def _has_exe(pid: int) -> bool:
    try:
        os.readlink(f"/proc/{pid}/exe")
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class ProcessStamp:
    """What tells a started process from a later one that holds its pid.

    Attributes:
        start_ticks: when it started, in clock ticks after boot (``/proc/<pid>/stat`` field 22).
        exe: the path of its executable (``/proc/<pid>/exe``).
    """

    start_ticks: int
    exe: str

    @classmethod
    def of(cls, pid: int) -> "ProcessStamp":
        """The stamp of the process that holds ``pid`` now.

        Raises:
            ProcessLookupError: no such process, or it has exited (a zombie has no executable).
        """
        try:
            with open(f"/proc/{pid}/stat", "rb") as file:
                stat = file.read()
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:  # gone; or a zombie, whose exe link reads ENOENT
            raise ProcessLookupError(f"no process {pid}") from None
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses; fields after the
        # last ")" start at field 3, so field 22 is the 20th of them.
        return cls(int(stat[stat.rindex(b")") + 1:].split()[19]), exe)

    def holds(self, pid: int) -> bool:
        """Whether ``pid`` is still the process this stamp was taken of."""
        try:
            return ProcessStamp.of(pid) == self
        except ProcessLookupError:
            return False

    def to_json(self) -> dict:
        return {"start_ticks": self.start_ticks, "exe": self.exe}

    @classmethod
    def from_json(cls, doc: dict) -> "ProcessStamp":
        """Raises TypeError for a document that is not a stamp."""
        if not (isinstance(doc, dict) and isinstance(doc.get("start_ticks"), int) and isinstance(doc.get("exe"), str)):
            raise TypeError(f"not a process stamp: {doc!r}")
        return cls(doc["start_ticks"], doc["exe"])
