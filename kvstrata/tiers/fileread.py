"""Reading a block's payload off its file: from the page cache where it is there, else straight
from the disk with ``O_DIRECT`` in large pieces; each piece verified as soon as it lands.

Why two ways (measured by ``kvstrata bench cache`` on the 2-vCPU VM of the benchmark, ext4 on
virtio, 16 files of 32 MiB):

- Cold, a buffered read is a page-cache fill and then a copy out of it, and the kernel's
  readahead keeps about one request in flight per reader. ``O_DIRECT`` lands the bytes in the
  destination by DMA (no copy, no page cache to fill) and a read of ``DIRECT_PIECE_BYTES``
  goes to the device as several requests at once (``max_sectors_kb`` each): 2 readers of 4 MiB
  pieces read at ~1.9 GB/s, 4 at ~2.2, where one plain ``readinto`` of the same bytes as one
  file reads at 1.3-1.7.
- Warm, the bytes are in memory already: a buffered read copies them at memory speed, where
  ``O_DIRECT`` would read them off the disk again. Pieces of ``CACHED_PIECE_BYTES`` are hashed
  while they are still in the CPU's cache.

Which one. A read first asks for its first piece with ``RWF_NOWAIT``, which copies what the
page cache holds and never waits for the disk; if the piece came whole the block is read from
the page cache, piece by piece (each with ``RWF_NOWAIT``), else it and every later piece come
off the disk with ``O_DIRECT`` (set on the open file with ``fcntl``). A block is written whole
and dropped from the cache whole (or aged out in order), so one probe decides well; a piece
the cache held only in part is read again from the disk, never stitched.

Where ``O_DIRECT`` cannot be used the read is buffered, as before: rows that are not whole
pages (``ALIGN_BYTES``), a destination or an offset not on a page boundary, a kernel without
``RWF_NOWAIT`` for the file, or a file system that refuses ``O_DIRECT`` (``EINVAL``: the reader
then stops trying).
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable

import numpy as np

ALIGN_BYTES = 4096  # O_DIRECT: buffer address, file offset and length in whole pages
CACHED_PIECE_BYTES = 1 << 20
DIRECT_PIECE_BYTES = 8 << 20

_HAS_DIRECT = hasattr(os, "O_DIRECT") and hasattr(os, "RWF_NOWAIT")


class Truncated(Exception):
    """The file ended before the bytes asked for."""


Verify = Callable[[np.ndarray, int], None]
"""(rows that landed, index of the first of them) -> None, or raises."""


class PayloadReader:
    """Reads rows of a block file into memory, page cache first, else ``O_DIRECT``.

    One per tier: it remembers, for all its reads, that the file system refused ``O_DIRECT``.
    Thread-safe (the flag only goes from True to False).

    Args:
        row_bytes: bytes per row (a layer of a block).
        cached_piece_bytes: rows per buffered read, in bytes (at least one row).
        direct_piece_bytes: rows per ``O_DIRECT`` read, in bytes (at least one row).
    """

    def __init__(self, row_bytes: int, cached_piece_bytes: int = CACHED_PIECE_BYTES,
                 direct_piece_bytes: int = DIRECT_PIECE_BYTES) -> None:
        self.row_bytes = row_bytes
        self.cached_rows = max(1, cached_piece_bytes // row_bytes)
        self.direct_rows = max(1, direct_piece_bytes // row_bytes)
        self.direct = _HAS_DIRECT and row_bytes % ALIGN_BYTES == 0

    def read(self, fd: int, rows: np.ndarray, offset: int, verify: Verify) -> None:
        """Fill ``rows`` (uint8 ``[n, row_bytes]``, C-contiguous) from the file's bytes at
        ``offset``, calling ``verify(piece, first_row)`` on each piece as it lands.

        Raises:
            Truncated: the file ended first.
            OSError: the read failed.
            Exception: whatever ``verify`` raises (``rows`` then holds some of the bytes).
        """
        n = len(rows)
        if not (self.direct and rows.ctypes.data % ALIGN_BYTES == 0 and offset % ALIGN_BYTES == 0):
            for first in range(0, n, self.cached_rows):  # the plain way: buffered, blocking
                piece = rows[first : first + self.cached_rows]
                _read_exact(fd, piece, offset + first * self.row_bytes)
                verify(piece, first)
            return
        first = 0
        while first < n:  # from the page cache while it holds the pieces
            piece = rows[first : first + self.cached_rows]
            if not self._cached(fd, piece, offset + first * self.row_bytes):
                break
            verify(piece, first)
            first += len(piece)
        if first == n:
            return
        self._set_direct(fd)
        for first in range(first, n, self.direct_rows):
            piece = rows[first : first + self.direct_rows]
            self._direct(fd, piece, offset + first * self.row_bytes)
            verify(piece, first)

    def _cached(self, fd: int, piece: np.ndarray, offset: int) -> bool:
        """Read ``piece`` if the page cache holds all of it (the bytes then landed); False if not
        (what did land is read again)."""
        view = memoryview(piece.reshape(-1))
        try:
            got = os.preadv(fd, [view], offset, os.RWF_NOWAIT)
        except BlockingIOError:  # EAGAIN: its first page is not cached
            return False
        except OSError as error:
            if error.errno != errno.EOPNOTSUPP:
                raise
            self.direct = False  # the file system takes no RWF_NOWAIT: no way to tell cached
            return False  # pieces from disk ones; this read goes on buffered (O_DIRECT not set)
        if got == len(view):
            return True
        if got == 0:  # nothing cached and nothing left: the file ended
            raise Truncated
        return False

    def _set_direct(self, fd: int) -> None:
        if not self.direct:
            return
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            self.direct = False  # the file system does no direct I/O (the reads below fall back)

    def _direct(self, fd: int, piece: np.ndarray, offset: int) -> None:
        """``piece`` off the disk with ``O_DIRECT`` where the file has it set, else buffered."""
        view = memoryview(piece.reshape(-1))
        while len(view):
            try:
                got = os.preadv(fd, [view], offset)
            except OSError as error:
                if error.errno != errno.EINVAL or not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                    raise
                self.direct = False  # refused after all: the rest of this read goes buffered
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                continue
            if got == 0:
                raise Truncated
            view, offset = view[got:], offset + got
            if len(view) and got % ALIGN_BYTES:  # a short read off a page: finish it buffered
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)


def _read_exact(fd: int, piece: np.ndarray, offset: int) -> None:
    view = memoryview(piece.reshape(-1))
    while len(view):
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise Truncated
        view, offset = view[got:], offset + got
