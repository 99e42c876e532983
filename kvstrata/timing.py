"""What every measurement of this host shares (calibration, validation, the benchmarks): the
wall clock, page-cache control so a read comes from the disk (or from memory), the garbage
collector held off, and the error that voids a run.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager


class VerificationError(RuntimeError):
    """Bytes read back differ from the bytes written: the run's figures are worthless."""


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, back on after only if it was on: a
    collection landing in a timed sample is noise, not the cost of the code, and a burst of
    long-lived objects (a cache recovering 100K blocks) sets off collections that walk every
    object in the process for nothing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def elapsed_s(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` takes on the wall clock."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def drop_page_cache(paths: Iterable[str | os.PathLike[str]]) -> int:
    """Write back and evict ``paths`` from the page cache, so the next read comes from the disk.

    ``POSIX_FADV_DONTNEED`` evicts clean pages only, hence the ``fsync`` first. Returns the
    number of files dropped.
    """
    count = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        count += 1
    return count


_WARM_PIECE_BYTES = 8 << 20


def warm_page_cache(paths: Iterable[str | os.PathLike[str]]) -> int:
    """Read ``paths`` whole (buffered, into a scratch buffer), so the page cache holds them and
    the next read comes from memory: a read that bypasses the cache (``O_DIRECT``) leaves it
    cold. Returns the number of files read."""
    scratch = bytearray(_WARM_PIECE_BYTES)
    count = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(scratch):
                pass
        count += 1
    return count
