"""System calls a disk tier builds on: vectored I/O carried to completion, and a read pacer.

``write_all`` and ``read_exact`` move a list of buffers to or from one file with ``writev`` and
``preadv``, at most ``IOV_MAX`` buffers a call, until every byte has moved (a call may move fewer
than asked: near the file size limit, or at the end of a file).

Read cap. ``ReadPacer`` emulates slower storage (``DiskTier(read_gbps=...)``): every read books
its bytes (header and payload) on one virtual clock shared by all threads, at ``gbps`` decimal
GB/s, and returns no earlier than its bytes' finish on that clock; the real read runs meanwhile.
So reads of N bytes in aggregate, from any number of threads, take at least N / rate (a rate
limiter without burst).
"""

from __future__ import annotations

import errno
import os
import threading
import time

IOV_MAX = 1024  # buffers per readv/writev at most (Linux's UIO_MAXIOV)


def write_all(fd: int, buffers: list[memoryview]) -> None:
    """``writev`` until every byte is written (a write may be short near the file size limit)."""
    buffers = [b for b in buffers if len(b)]
    while buffers:
        written = os.writev(fd, buffers[:IOV_MAX])
        if written == 0:
            raise OSError(errno.EIO, "write returned 0 bytes")
        _advance(buffers, written)


def read_exact(fd: int, views: list[memoryview], offset: int) -> bool:
    """Fill ``views`` in order from ``offset`` (``preadv``); False if the file ends first."""
    views = [v for v in views if len(v)]
    while views:
        got = os.preadv(fd, views[:IOV_MAX], offset)
        if got == 0:
            return False
        offset += got
        _advance(views, got)
    return True


def _advance(views: list[memoryview], done: int) -> None:
    """Drop the first ``done`` bytes from ``views`` (in place)."""
    while views and done >= len(views[0]):
        done -= len(views[0])
        views.pop(0)
    if done:
        views[0] = views[0][done:]


def unlink_quietly(path: str | os.PathLike[str]) -> None:
    """Delete ``path``; already gone is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ReadPacer:
    """A virtual clock of reads at ``gbps``: each read books the next ``bytes / rate`` seconds
    after the last booking (or now, if the clock is idle) and waits until its booking ends."""

    def __init__(self, gbps: float) -> None:
        if not gbps > 0:
            raise ValueError(f"disk tier: read_gbps must be positive, got {gbps}")
        self.bytes_per_s = gbps * 1e9
        self._lock = threading.Lock()
        self._free_at = 0.0  # time.monotonic() when the clock is next free

    def book(self, nbytes: int) -> float:
        """Book ``nbytes``; returns the monotonic time the read may return at."""
        with self._lock:
            self._free_at = max(self._free_at, time.monotonic()) + nbytes / self.bytes_per_s
            return self._free_at

    @staticmethod
    def wait(finish: float) -> None:
        while (left := finish - time.monotonic()) > 0:
            time.sleep(left)
