"""A ballast file: memory freed just before a disk step, so every disk step of a benchmark
(``bench cache``) or of ``validate`` starts with the same supply of fresh pages for its page
cache, whichever step ran before it.

Why. A buffered read or write of N bytes first takes N bytes of free memory for the page cache.
On the VM of the benchmark (Firecracker, free page reporting at order 11, DAMON paging out idle
memory) memory that has sat free a while has been handed back to the host, and touching it
again costs a host fault per page: a first touch of fresh memory ran at 0.5-0.9 GB/s against
8-18 GB/s for memory just freed. So a disk step ran at the speed of whatever the step before it
had freed: in ``bench cache`` the second cold read of a round (ours or the plain read, either
way) ran ~3x slower than the first, and ours.disk.restore_cold / raw.read_cold was 0.25x-0.63x
in every round ours ran second and 1.2x-2.9x in every round it ran first (6 runs of 5 rounds),
so the median told the rotation (3 of 5 rounds ours second: 0.44x), not the cache. Touching
fresh anonymous memory (mmap, memset, munmap) before a step did not help; reading a file of the
step's size into the page cache and dropping it did: the plain cold read then ran at ~2.5 GB/s
in every round, and the paired ratio at 0.84x (0.51x-1.64x) with no order in it.

The ballast is written once (untimed), as large as the bytes a step moves plus its files'
headers, and ``release()`` reads it whole and drops it (untimed): a read of the disk, then
pages freed a moment before the timed step takes them.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvstrata.timing import drop_page_cache, warm_page_cache

_PIECE_BYTES = 8 << 20
HEADROOM_BYTES = 16 << 20  # block files' headers and a step's own small files


class Ballast:
    """A file of ``size_bytes`` (plus ``HEADROOM_BYTES``) at ``path``, written now.

    Raises:
        OSError: it could not be written (e.g. ENOSPC); nothing is left behind.
    """

    def __init__(self, path: str | os.PathLike[str], size_bytes: int) -> None:
        self.path = Path(path)
        self.size_bytes = size_bytes + HEADROOM_BYTES
        piece = bytes(min(_PIECE_BYTES, self.size_bytes))
        try:
            with open(self.path, "wb", buffering=0) as f:
                left = self.size_bytes
                while left:
                    left -= f.write(memoryview(piece)[: min(left, len(piece))])
        except BaseException:
            self.remove()
            raise
        drop_page_cache([self.path])

    def release(self) -> None:
        """Read the ballast into the page cache, then drop it: its pages are free, and fresh,
        for the next step."""
        warm_page_cache([self.path])
        drop_page_cache([self.path])

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
