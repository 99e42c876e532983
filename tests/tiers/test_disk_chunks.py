"""The disk tier reads a block in pieces of whole layers (``READ_CHUNK_BYTES``) and checks each
piece as it lands: every split of a read into pieces returns the same bytes and catches the
same corruption as one read of the whole block."""

from __future__ import annotations

import pytest
import torch

from kvstrata.tiers import disk
from tests.tiers.test_disk import (
    SMALL,
    content,
    file_of,
    flip_byte,
    header_bytes_of,
    load,
    make_key,
    store,
)

# SMALL has 4 layers of 1 KiB: pieces of 1, 2 and 3 layers (3 does not divide 4), and all 4.
PIECES = {"1 layer": 1024, "2 layers": 2048, "3 layers": 3 * 1024 + 5, "whole block": 1 << 20, "under a layer": 100}


@pytest.fixture(params=list(PIECES), ids=list(PIECES))
def tier(request, tmp_path, monkeypatch):
    monkeypatch.setattr(disk, "READ_CHUNK_BYTES", PIECES[request.param])
    t = disk.DiskTier(SMALL, 8 * SMALL.block_bytes, tmp_path / "disk")
    yield t
    t.close()


@pytest.mark.parametrize("layers", [slice(None), slice(0, 1), slice(1, 4), slice(2, 3), slice(3, 3)])
def test_reads_in_pieces_are_bit_exact(tier, layers):
    key = make_key(0)
    store(tier, key)
    assert torch.equal(load(tier, key, layers), content(SMALL, key)[layers])


@pytest.mark.parametrize("bad_layer", range(SMALL.num_layers))
def test_a_corrupt_layer_is_caught_in_whichever_piece_holds_it(tier, bad_layer):
    key = make_key(0)
    store(tier, key)
    header_bytes, _ = header_bytes_of(file_of(tier, key))
    flip_byte(file_of(tier, key), header_bytes + bad_layer * SMALL.layer_bytes + SMALL.layer_bytes - 1)
    with pytest.raises(disk.CorruptBlock, match=f"layer {bad_layer}"):
        load(tier, key)
    good = [i for i in range(SMALL.num_layers) if i != bad_layer]
    for i in good:  # the other layers still read, alone
        assert torch.equal(load(tier, key, slice(i, i + 1)), content(SMALL, key)[i : i + 1])
