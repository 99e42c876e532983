"""Page-cache control for the benchmarks, on a real file: dropped, a read would wait for the
disk; warmed, the whole file is in memory."""

from __future__ import annotations

import os

import pytest

from kvstrata.timing import drop_page_cache, warm_page_cache

PAGE = 4096


def cached_pages(path, pages: int) -> int:
    """How many of the file's first ``pages`` pages a read that may not wait gets."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return sum(1 for i in range(pages) if _cached(fd, i * PAGE))
    finally:
        os.close(fd)


def _cached(fd: int, offset: int) -> bool:
    try:
        return os.preadv(fd, [bytearray(PAGE)], offset, os.RWF_NOWAIT) > 0
    except BlockingIOError:
        return False


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="needs preadv2 with RWF_NOWAIT (Linux)")
def test_warm_fills_the_page_cache_with_the_whole_file_and_drop_empties_it(tmp_path):
    path = tmp_path / "f.bin"
    pages = 3 * 1024 + 5  # 12 MiB and a bit: more than one of warm's reads
    path.write_bytes(os.urandom(pages * PAGE))
    assert drop_page_cache([path]) == 1
    if cached_pages(path, pages) == pages:
        pytest.skip("this file system keeps files in memory (tmpfs): nothing to drop")
    assert warm_page_cache([path]) == 1
    assert cached_pages(path, pages) == pages
    drop_page_cache([path])
    assert cached_pages(path, pages) < pages
