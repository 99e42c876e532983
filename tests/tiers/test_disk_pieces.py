"""The disk tier moves blocks in pieces of a caller's memory (``write_pieces``, ``read_pieces``):
vectored writes and reads of the same file format, verified layer by layer where a layer spans
pieces, failing exactly as ``write`` and ``read_into`` do."""

from __future__ import annotations

import os
import time

import pytest
import torch

from kvstrata.errors import CorruptBlock
from kvstrata.tiers import disk
from kvstrata.tiers.blockfile import PAGE_BYTES
from kvstrata.tiers.disk import DiskTier
from tests.tiers.test_disk import SMALL, content, file_of, flip_byte, header_bytes_of, load, make_key, store

# SMALL is 4 layers of 1 KiB: these cut layers 1 and 2 across pieces.
UNEVEN = [1500, 1000, SMALL.block_bytes - 2500]


def pieces_of(block: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """A copy of ``block`` in separate pieces of ``sizes`` (each its own allocation)."""
    flat = block.reshape(-1)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [flat[at : at + size].clone() for at, size in zip(starts, sizes)]


def empty_pieces(sizes: list[int]) -> list[torch.Tensor]:
    return [torch.full((size,), 0xAA, dtype=torch.uint8) for size in sizes]


def joined(pieces: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(pieces).view(SMALL.num_layers, SMALL.layer_bytes)


@pytest.fixture
def tier(tmp_path):
    t = DiskTier(SMALL, 64 * SMALL.block_bytes, tmp_path / "disk")
    yield t
    t.close()


def test_a_file_written_from_pieces_is_the_file_written_whole(tmp_path):
    key = make_key(0)
    whole = DiskTier(SMALL, 4 * SMALL.block_bytes, tmp_path / "whole")
    split = DiskTier(SMALL, 4 * SMALL.block_bytes, tmp_path / "pieces")
    store(whole, key)
    assert split.write_pieces([0], [key], [pieces_of(content(SMALL, key), UNEVEN)]) == [None]
    assert file_of(split, key).read_bytes() == file_of(whole, key).read_bytes()
    whole.close()
    split.close()


def test_a_block_in_thousands_of_pieces_round_trips(tier):
    key = make_key(0)  # one-byte pieces: more than one writev / preadv takes (IOV_MAX)
    assert tier.write_pieces([0], [key], [pieces_of(content(SMALL, key), [1] * SMALL.block_bytes)]) == [None]
    assert torch.equal(load(tier, key), content(SMALL, key))
    out = empty_pieces([1] * SMALL.block_bytes)
    assert tier.read_pieces([0], [key], [out]) == [None]
    assert torch.equal(joined(out), content(SMALL, key))


@pytest.mark.parametrize("chunk", [100, 1024, 3 * 1024 + 5])
def test_reads_in_chunks_across_pieces_are_bit_exact(tier, monkeypatch, chunk):
    monkeypatch.setattr(disk, "READ_CHUNK_BYTES", chunk)
    keys = [make_key(i) for i in range(3)]
    for key in keys:
        store(tier, key)
    outs = [empty_pieces(UNEVEN) for _ in keys]
    assert tier.read_pieces([0] * 3, keys, outs) == [None] * 3
    for key, out in zip(keys, outs):
        assert torch.equal(joined(out), content(SMALL, key))


@pytest.mark.parametrize("layer", range(SMALL.num_layers))
def test_a_corrupted_payload_byte_fails_its_block_only(tier, layer):
    keys = [make_key(i) for i in range(3)]
    for key in keys:
        store(tier, key)
    header_bytes, _ = header_bytes_of(file_of(tier, keys[1]))
    flip_byte(file_of(tier, keys[1]), header_bytes + layer * SMALL.layer_bytes + SMALL.layer_bytes // 2)
    outs = [empty_pieces(UNEVEN) for _ in keys]
    errors = tier.read_pieces([0] * 3, keys, outs)
    assert isinstance(errors[1], CorruptBlock) and f"layer {layer}" in str(errors[1])
    assert errors[0] is None and errors[2] is None
    assert torch.equal(joined(outs[2]), content(SMALL, keys[2]))


def test_a_missing_or_truncated_file_fails_as_read_into_does(tier):
    gone, cut = make_key(0), make_key(1)
    store(tier, gone)
    store(tier, cut)
    os.unlink(file_of(tier, gone))
    os.truncate(file_of(tier, cut), file_of(tier, cut).stat().st_size - 1)
    errors = tier.read_pieces([0, 0], [gone, cut], [empty_pieces(UNEVEN), empty_pieces(UNEVEN)])
    for key, error in zip((gone, cut), errors):
        with pytest.raises(CorruptBlock) as expected:
            load(tier, key)
        assert type(error) is type(expected.value) and str(error) == str(expected.value)


def test_write_pieces_fails_per_block_and_leaves_no_file(tier):
    good, bad = make_key(0), b"short key"
    errors = tier.write_pieces([0, 0], [bad, good], [pieces_of(content(SMALL, good), UNEVEN)] * 2)
    assert isinstance(errors[0], ValueError) and errors[1] is None
    assert [p.name for p in tier.directory.iterdir() if p.suffix in (".kvb", ".tmp")] == [file_of(tier, good).name]


def test_read_pieces_pays_the_read_cap(tmp_path):
    gbps = 0.005
    t = DiskTier(SMALL, 8 * SMALL.block_bytes, tmp_path, read_gbps=gbps)
    keys = [make_key(i) for i in range(4)]
    for key in keys:
        store(t, key)
    start = time.perf_counter()
    assert t.read_pieces([0] * 4, keys, [empty_pieces(UNEVEN) for _ in keys]) == [None] * 4
    assert time.perf_counter() - start >= 4 * (PAGE_BYTES + SMALL.block_bytes) / (gbps * 1e9) - 0.002
    t.close()
