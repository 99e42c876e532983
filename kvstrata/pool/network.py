"""The pool's own network: a network namespace the embedded pool runs in, and its clients'
threads that talk to it.

Why: Mooncake's transfer engine (0.3.13) binds its handshake and TCP data listeners to the
wildcard address in its own code, in every process that joins the pool (the pool daemon and
each client); no option binds them elsewhere. Inside a network namespace of its own, a
wildcard is that namespace's: its one interface is its own loopback, and only a process that
can enter the namespace (CAP_SYS_ADMIN: root) reaches any listener there. Nothing the pool or
its clients start listens in the host's namespace, so no other user on the host, and nothing
on the network, can connect to them.

A client joins per thread: ``setns`` moves only the calling thread, and a socket belongs to
the namespace of the thread that made it. So every thread that calls into Mooncake (Mooncake's
own threads start on the thread that sets a store up, and inherit its namespace; a call opens
its connections on the calling thread) or opens a socket to the pool enters first
(:func:`enter`), and those are threads of kvstrata's own: no thread of the engine's is moved.

One namespace per user (``kvstrata-<uid>``), shared by every embedded pool the user starts (each
on loopback ports of its own there), and kept when a pool stops: a process can use the pools of
one network only. Mooncake runs its RPC to the master on threads of its own, started once per
process by the first store set up, on that store's thread: they stay in the namespace they
started in. A store set up later for a pool in another network has no route to its master (its
setup retried for 90 s, holding the interpreter lock), and so would every client after a pool
restarted in a namespace made anew. So namespaces are never made anew under a client's feet,
and a process that joined one network is refused, at once, a pool in another (the pool client
checks, :func:`joined`).

Needs root to make a namespace and to enter one (:func:`unavailable` says why not, in one line);
without it the embedded pool listens on the host's loopback, as Mooncake allows.
"""

from __future__ import annotations

import ctypes
import enum
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

NAMESPACES = Path("/run/netns")  # where iproute2 keeps named namespaces (bind mounts, root's)
CLONE_NEWNET = 0x40000000
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class PoolNetwork(enum.Enum):
    """Where an embedded pool listens."""

    AUTO = "auto"  # PRIVATE where this process can make it (root), else HOST
    PRIVATE = "private"  # a network namespace of its own: nothing on the host's network
    HOST = "host"  # the host's loopback (Mooncake's transfer ports on every interface)


class NetworkError(RuntimeError):
    """A pool network could not be made, found or entered (the message names it and why)."""


def name_for_user() -> str:
    """The namespace of this user's embedded pools."""
    return f"kvstrata-{os.geteuid()}"


def check_name(name: object) -> str:
    """``name`` if it can name a namespace (letters, digits, ``_.-``; no path).

    Raises:
        ValueError: one line naming it.
    """
    if not isinstance(name, str) or not NAME.fullmatch(name) or name in (".", ".."):
        raise ValueError(f"pool network must name a network namespace (letters, digits, _ . -), got {name!r}")
    return name


def unavailable() -> str | None:
    """Why this process cannot make a pool network (None: it can): not root, or no iproute2."""
    if os.geteuid() != 0:
        return "a private pool network needs root (it is a network namespace)"
    if shutil.which("ip") is None:
        return "a private pool network needs `ip` (iproute2): apt-get install iproute2"
    return None


def create(name: str) -> None:
    """Namespace ``name`` with its loopback up: made if missing, kept if there (clients of
    a pool in it stay in it, see above).

    Raises:
        NetworkError: ``ip`` refused (the message says what it said).
    """
    check_name(name)
    why = unavailable()
    if why is not None:
        raise NetworkError(why)
    if not exists(name):
        try:
            _ip("netns", "add", name)
        except NetworkError:
            if not exists(name):  # else another pool's start made it meanwhile
                raise
    _ip("-n", name, "link", "set", "lo", "up")


def exists(name: str) -> bool:
    return (NAMESPACES / check_name(name)).exists()


def exec_prefix(name: str) -> list[str]:
    """The command prefix that runs a program inside namespace ``name``."""
    return ["ip", "netns", "exec", check_name(name)]


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NetworkError(f"`ip {' '.join(args)}` failed: {done.stderr.strip() or done.stdout.strip()}")


_libc = ctypes.CDLL(None, use_errno=True)
_here = threading.local()  # per thread: .inode, the namespace it is in once it has moved
PROCESS = Path("/proc/self/ns/net")  # the namespace of the process's main thread


def enter(name: str | None) -> None:
    """Move the calling thread into namespace ``name`` (None: the process's own), unless it
    is there already. Cheap when it is (one ``stat``).

    Raises:
        NetworkError: no such namespace (its pool is stopped), or this process may not enter
            it (not root).
    """
    if name is None:
        if getattr(_here, "inode", None) is not None:
            _move(PROCESS, "this process's network namespace")
            _here.inode = None
        return
    path = _paths.get(name) or _path(name)
    try:
        inode = os.stat(path).st_ino  # on every call into the pool: a str path, no checks (~1 us)
    except FileNotFoundError:
        raise NetworkError(f"pool network {name} does not exist ({path}): is the pool running?") from None
    if getattr(_here, "inode", None) == inode:
        return
    _move(path, f"pool network {name}")
    _here.inode = inode


_paths: dict[str, str] = {}


def _path(name: str) -> str:
    _paths[name] = path = str(NAMESPACES / check_name(name))
    return path


def _move(path: Path | str, what: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _setns(fd, what)
    finally:
        os.close(fd)


def identity(name: str | None) -> int | None:
    """Which namespace ``name`` is now (its inode; None: the process's own network, or no
    namespace of that name)."""
    if name is None:
        return None
    try:
        return os.stat(NAMESPACES / check_name(name)).st_ino
    except FileNotFoundError:
        return None


_joined_lock = threading.Lock()
_joined: tuple[str | None, int | None] | None = None  # the network of this process's first store


def joined(name: str | None) -> str | None:
    """Why this process cannot set up a Mooncake store for a pool in network ``name`` (None:
    it can); the first to ask claims the process for ``name`` (see above). Call it just before
    a store's setup, and only then."""
    global _joined
    want = (name, identity(name))
    with _joined_lock:
        if _joined is None:
            _joined = want
            return None
        if _joined == want:
            return None
        had = _joined[0] or "the host's network"
    other = name or "the host's network"
    return (f"this process joined a pool in {had} first, and Mooncake's RPC threads stay there: a pool in "
            f"{other} cannot be reached from it (run that client in a process of its own, or start both pools "
            "with the same --network)")


def _setns(fd: int, what: str) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        hint = ": joining it needs root (CAP_SYS_ADMIN)" if err == 1 else ""
        raise NetworkError(f"cannot enter {what}: {os.strerror(err)}{hint}")


def run_in(name: str | None, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` inside namespace ``name``: on a thread of its own that enters it (the
    caller's thread stays where it is); None: on the caller's thread.

    Raises:
        NetworkError: as :func:`enter`; else whatever ``fn`` raises.
    """
    if name is None:
        return fn(*args)
    with ThreadPoolExecutor(1, thread_name_prefix="kvstrata-pool-net") as pool:
        return pool.submit(_entered, name, fn, *args).result()


def _entered(name: str, fn: Callable[..., T], *args: Any) -> T:
    enter(name)
    return fn(*args)


class Runner:
    """One thread inside namespace ``name`` that runs calls in turn (``run``); None: calls run
    on the caller's thread. For a client that drives Mooncake itself (the raw pool)."""

    def __init__(self, name: str | None) -> None:
        self.name = name
        self._thread = None if name is None else ThreadPoolExecutor(1, thread_name_prefix="kvstrata-pool-net")

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._thread is None:
            return fn(*args)
        return self._thread.submit(_entered, self.name, fn, *args).result()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
