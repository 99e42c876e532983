"""Reading block payloads page cache first, else with O_DIRECT (``kvstrata.tiers.fileread``), on
real files: cold and warm reads return the same bytes, a cold read bypasses the page cache where
the file system does direct I/O, every piece is verified, and each way the direct path can be
refused (an unaligned destination or offset, a file system without O_DIRECT) falls back to a
plain read rather than failing."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstrata.errors import CorruptBlock
from kvstrata.tensors import page_aligned
from kvstrata.tiers import fileread
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.fileread import ALIGN_BYTES, PayloadReader, Truncated
from kvstrata.timing import drop_page_cache, warm_page_cache
from tests.tiers.test_disk import CHILD, content, file_of, flip_byte, header_bytes_of, make_key, store

ROW = 2 * ALIGN_BYTES
ROWS = 24
HEAD = ALIGN_BYTES  # the payload starts a page in, as in a block file


@pytest.fixture
def payload(tmp_path: Path) -> tuple[Path, np.ndarray]:
    data = np.random.default_rng(7).integers(0, 256, (ROWS, ROW), dtype=np.uint8)
    path = tmp_path / "payload.bin"
    path.write_bytes(bytes(HEAD) + data.tobytes())
    return path, data


def aligned_rows(rows: int, skew: int = 0) -> np.ndarray:
    """Zeroed uint8 ``[rows, ROW]`` starting ``skew`` bytes past a page boundary."""
    raw = page_aligned(rows * ROW + skew)
    raw.zero_()
    return raw[skew:].numpy().reshape(rows, ROW)


def cached(path: Path, offset: int) -> bool:
    """Whether the page cache holds the page at ``offset`` (a read that may not wait)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.preadv(fd, [bytearray(ALIGN_BYTES)], offset, os.RWF_NOWAIT) > 0
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def direct_io_works(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


def read(reader: PayloadReader, path: Path, rows: np.ndarray, first_row: int = 0) -> list[tuple[int, int]]:
    """Read ``rows`` from row ``first_row`` of the payload; returns the pieces verified, (first, count)."""
    pieces: list[tuple[int, int]] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        reader.read(fd, rows, HEAD + first_row * ROW, lambda piece, first: pieces.append((first, len(piece))))
    finally:
        os.close(fd)
    return pieces


def covers(pieces: list[tuple[int, int]], rows: int) -> bool:
    """The pieces verified are every row once, in order."""
    at = 0
    for first, count in pieces:
        if first != at or count < 1:
            return False
        at += count
    return at == rows


@pytest.mark.parametrize("cold", [True, False], ids=["cold", "warm"])
@pytest.mark.parametrize("first_row", [0, 5])
def test_cold_and_warm_reads_are_bit_exact_and_verify_every_row(payload, cold, first_row):
    path, data = payload
    (drop_page_cache if cold else warm_page_cache)([path])
    reader = PayloadReader(ROW, cached_piece_bytes=3 * ROW, direct_piece_bytes=5 * ROW)
    rows = aligned_rows(ROWS - first_row)
    pieces = read(reader, path, rows, first_row)
    assert np.array_equal(rows, data[first_row:])
    assert covers(pieces, ROWS - first_row)


def test_a_cold_read_bypasses_the_page_cache_and_a_warm_one_uses_it(payload):
    path, data = payload
    if not direct_io_works(path):
        pytest.skip("this file system does no O_DIRECT")
    reader = PayloadReader(ROW, cached_piece_bytes=4 * ROW, direct_piece_bytes=8 * ROW)
    drop_page_cache([path])
    rows = aligned_rows(ROWS)
    pieces = read(reader, path, rows)
    assert np.array_equal(rows, data)
    assert [count for _, count in pieces] == [8, 8, 8]  # the probe found nothing cached: O_DIRECT pieces
    assert not cached(path, HEAD + ROWS * ROW - ALIGN_BYTES)  # the bytes came by DMA, not through the cache
    assert reader.direct

    warm_page_cache([path])
    rows = aligned_rows(ROWS)
    pieces = read(reader, path, rows)
    assert np.array_equal(rows, data)
    assert [count for _, count in pieces] == [4] * (ROWS // 4)  # page-cache pieces all the way


@pytest.mark.parametrize("skew", [0, 512], ids=["aligned", "unaligned destination"])
def test_a_block_cached_in_part_is_read_whole_and_right(payload, skew):
    path, data = payload
    drop_page_cache([path])
    fd = os.open(path, os.O_RDONLY)
    os.pread(fd, 6 * ROW, HEAD)  # the first 6 rows come into the page cache, the rest stay cold
    os.close(fd)
    rows = aligned_rows(ROWS, skew)
    pieces = read(PayloadReader(ROW, cached_piece_bytes=4 * ROW, direct_piece_bytes=8 * ROW), path, rows)
    assert np.array_equal(rows, data)
    assert covers(pieces, ROWS)


def test_an_unaligned_offset_reads_plainly(tmp_path):
    data = np.random.default_rng(8).integers(0, 256, (4, ROW), dtype=np.uint8)
    path = tmp_path / "odd.bin"
    path.write_bytes(bytes(100) + data.tobytes())  # the payload off a page boundary
    drop_page_cache([path])
    rows = aligned_rows(4)
    fd = os.open(path, os.O_RDONLY)
    try:
        PayloadReader(ROW).read(fd, rows, 100, lambda piece, first: None)
    finally:
        os.close(fd)
    assert np.array_equal(rows, data)


def test_rows_that_are_not_whole_pages_never_try_o_direct():
    assert not PayloadReader(ALIGN_BYTES + 512).direct
    assert not PayloadReader(1024).direct


def test_a_file_system_that_refuses_o_direct_is_read_plainly_from_then_on(payload, monkeypatch):
    path, data = payload
    real = fcntl.fcntl
    refused = []

    def no_direct(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "direct I/O not supported")
        return real(fd, cmd, arg)

    monkeypatch.setattr(fileread.fcntl, "fcntl", no_direct)
    reader = PayloadReader(ROW, cached_piece_bytes=4 * ROW)
    for _ in range(2):
        drop_page_cache([path])
        rows = aligned_rows(ROWS)
        assert covers(read(reader, path, rows), ROWS)
        assert np.array_equal(rows, data)
    assert len(refused) == 1 and not reader.direct  # tried once, then never again


def test_a_file_shorter_than_asked_is_truncated_cold_or_warm(payload):
    path, _ = payload
    os.truncate(path, HEAD + 10 * ROW)
    for fill in (drop_page_cache, warm_page_cache):
        fill([path])
        with pytest.raises(Truncated):
            read(PayloadReader(ROW, cached_piece_bytes=4 * ROW), path, aligned_rows(ROWS))


# --- through the disk tier: a cold block read with O_DIRECT is still verified --------------------


@pytest.fixture
def tier(tmp_path):
    t = DiskTier(CHILD, 4 * CHILD.block_bytes, tmp_path / "disk")
    yield t
    t.close()


def aligned_block(layers: int = CHILD.num_layers) -> torch.Tensor:
    dst = page_aligned(layers * CHILD.layer_bytes).view(layers, CHILD.layer_bytes)
    dst.zero_()
    return dst


@pytest.mark.parametrize("layers", [slice(None), slice(2, 7)])
def test_a_cold_block_reads_bit_exact_into_a_page_aligned_slot(tier, layers):
    key = make_key(1)
    store(tier, key)
    drop_page_cache([file_of(tier, key)])
    start, stop, _ = layers.indices(CHILD.num_layers)
    dst = aligned_block(stop - start)
    tier.read_into(0, key, dst, layers)
    assert torch.equal(dst, content(CHILD, key)[layers])


@pytest.mark.parametrize("bad_layer", [0, 5, CHILD.num_layers - 1])
def test_a_corrupt_layer_of_a_cold_block_is_caught(tier, bad_layer):
    key = make_key(2)
    store(tier, key)
    path = file_of(tier, key)
    header_bytes, _ = header_bytes_of(path)
    flip_byte(path, header_bytes + bad_layer * CHILD.layer_bytes + 17)
    drop_page_cache([path])
    with pytest.raises(CorruptBlock, match=f"layer {bad_layer}"):
        tier.read_into(0, key, aligned_block())


def test_a_cold_block_cut_short_is_a_corrupt_block(tier):
    key = make_key(3)
    store(tier, key)
    path = file_of(tier, key)
    os.truncate(path, path.stat().st_size - CHILD.layer_bytes)
    drop_page_cache([path])
    with pytest.raises(CorruptBlock):
        tier.read_into(0, key, aligned_block())
