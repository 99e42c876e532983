"""The disk tier's manifest: a restart takes the files it wrote without reading their headers,
and only those: a file put in place of one, added, or written too shortly before the close has
its header checked; a file damaged in place is taken, and never served (reads check every layer)."""

from __future__ import annotations

import os

import pytest
import torch

from kvstrata.errors import CorruptBlock
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.tiers import diskmanifest
from kvstrata.tiers.disk import DiskTier
from tests.tiers.test_disk import SMALL, block_files, content, flip_byte, load, make_key, store

CAPACITY = 16 * SMALL.block_bytes


@pytest.fixture
def settled(monkeypatch):
    """Every block counts as settled at close (the tests do not wait out SETTLE_NS)."""
    monkeypatch.setattr(diskmanifest, "SETTLE_NS", 0)


@pytest.fixture
def header_reads(monkeypatch):
    """How many block headers recovery reads and checks."""
    calls: list[bytes] = []
    original = DiskTier._verified_stamp

    def counted(self, path, key):
        calls.append(key)
        return original(self, path, key)

    monkeypatch.setattr(DiskTier, "_verified_stamp", counted)
    return calls


def written(directory, n: int) -> list[bytes]:
    tier = DiskTier(SMALL, CAPACITY, directory)
    keys = [make_key(i) for i in range(n)]
    for key in keys:
        store(tier, key)
    tier.close()
    return keys


def test_a_restart_after_a_close_reads_no_header_and_serves_every_block(tmp_path, settled, header_reads):
    keys = written(tmp_path, 6)
    assert (tmp_path / diskmanifest.NAME).exists()
    tier = DiskTier(SMALL, CAPACITY, tmp_path)
    assert tier.recover() == keys  # write order, as without a manifest
    assert header_reads == []
    for key in keys:
        assert torch.equal(load(tier, key), content(SMALL, key))
    tier.close()


def test_blocks_written_just_before_the_close_are_not_vouched_for(tmp_path, header_reads):
    keys = written(tmp_path, 3)  # SETTLE_NS as shipped: their bytes may not be on the disk yet
    tier = DiskTier(SMALL, CAPACITY, tmp_path)
    assert sorted(header_reads) == sorted(keys)
    assert tier.recover() == keys
    tier.close()


@pytest.mark.parametrize("change", ["another block's file", "a copy of itself", "a copy with its times"])
def test_a_file_put_in_place_of_one_after_the_close_has_its_header_checked(tmp_path, settled, header_reads, change):
    keys = written(tmp_path, 4)
    path = tmp_path / f"{keys[1].hex()}.kvb"
    if change == "another block's file":
        os.replace(tmp_path / f"{keys[2].hex()}.kvb", path)  # same size and times, another inode
    else:
        copy = tmp_path / "copy"
        copy.write_bytes(path.read_bytes())
        if change == "a copy with its times":
            os.utime(copy, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns))
        os.replace(copy, path)
    tier = DiskTier(SMALL, CAPACITY, tmp_path)
    survivors = [keys[0], keys[3]] if change == "another block's file" else keys
    assert sorted(tier.recover()) == sorted(survivors)
    assert header_reads == [keys[1]]
    assert block_files(tmp_path) == {f"{k.hex()}.kvb" for k in survivors}
    tier.close()


@pytest.mark.parametrize("damage", ["truncate", "flip the header", "flip the payload"])
def test_a_file_damaged_in_place_after_the_close_is_taken_but_never_served(tmp_path, settled, header_reads, damage):
    # Same inode: the manifest vouches for it, with no system call per block; the read checks
    # header, size and every layer anyway.
    keys = written(tmp_path, 3)
    path = tmp_path / f"{keys[0].hex()}.kvb"
    size = os.path.getsize(path)
    {"truncate": lambda: os.truncate(path, size - 1), "flip the header": lambda: flip_byte(path, 40),
     "flip the payload": lambda: flip_byte(path, size - 3)}[damage]()
    tier = DiskTier(SMALL, CAPACITY, tmp_path)
    assert tier.recover() == keys
    assert header_reads == []
    with pytest.raises(CorruptBlock):
        load(tier, keys[0])
    for key in keys[1:]:
        assert torch.equal(load(tier, key), content(SMALL, key))
    tier.close()


def test_fsynced_blocks_are_vouched_for_as_soon_as_written(tmp_path, header_reads):
    tier = DiskTier(SMALL, CAPACITY, tmp_path, fsync=True)
    keys = [make_key(i) for i in range(3)]
    for key in keys:
        store(tier, key)
    tier.close()  # SETTLE_NS as shipped: fsynced writes are on the disk already
    tier = DiskTier(SMALL, CAPACITY, tmp_path)
    assert tier.recover() == keys and header_reads == []
    tier.close()


@pytest.mark.parametrize("manifest", ["damaged", "truncated", "another layout", "another namespace", "absent"])
def test_a_manifest_the_tier_cannot_trust_makes_it_check_every_header(tmp_path, settled, header_reads, manifest):
    keys = written(tmp_path, 3)
    path = tmp_path / diskmanifest.NAME
    data = path.read_bytes()
    stamps = diskmanifest.decode(data, SMALL.describe(), "")
    assert set(stamps) == set(keys)
    if manifest == "damaged":
        flip_byte(path, len(data) // 2)
    elif manifest == "truncated":
        os.truncate(path, len(data) - 9)
    elif manifest == "another layout":
        other = KVLayout(4, 32, 1, 8, DType.BF16)
        path.write_bytes(diskmanifest.encode(other.describe(), "", stamps))
    elif manifest == "another namespace":
        path.write_bytes(diskmanifest.encode(SMALL.describe(), "tenant-b", stamps))
    else:
        path.unlink()
    tier = DiskTier(SMALL, CAPACITY, tmp_path)
    assert sorted(header_reads) == sorted(keys)
    assert tier.recover() == keys
    tier.close()


def test_a_stale_manifest_from_a_crash_vouches_only_for_files_still_as_it_saw_them(tmp_path, settled, header_reads):
    keys = written(tmp_path, 4)
    tier = DiskTier(SMALL, CAPACITY, tmp_path)
    tier.discard(0, keys[0])
    tier.discard(0, keys[1])
    store(tier, keys[1], content(SMALL, make_key(50)))  # rewritten: another file under the same name
    store(tier, make_key(4))  # new since the manifest
    tier._stamps = None  # a crash: the close writes no manifest (the flock goes with the process)
    tier.close()
    assert header_reads == []

    tier = DiskTier(SMALL, CAPACITY, tmp_path)
    assert sorted(header_reads) == sorted([keys[1], make_key(4)])
    assert sorted(tier.recover()) == sorted([*keys[1:], make_key(4)])
    assert torch.equal(load(tier, keys[1]), content(SMALL, make_key(50)))
    tier.close()


def test_the_manifest_follows_discards_and_writes_and_the_capacity(tmp_path, settled, header_reads):
    keys = written(tmp_path, 6)
    tier = DiskTier(SMALL, 4 * SMALL.block_bytes, tmp_path)  # less room: all kept, for the manager to evict
    assert tier.recover() == keys
    for key in keys[:2] + keys[3:4]:
        tier.discard(0, key)
    store(tier, make_key(9))
    tier.close()
    stamps = diskmanifest.decode((tmp_path / diskmanifest.NAME).read_bytes(), SMALL.describe(), "")
    assert set(stamps) == {keys[2], keys[4], keys[5], make_key(9)}
    tier = DiskTier(SMALL, CAPACITY, tmp_path)
    assert tier.recover() == [keys[2], keys[4], keys[5], make_key(9)]
    assert header_reads == []
    tier.close()


def test_a_manifest_round_trips_and_refuses_what_is_not_one():
    stamps = {make_key(i): diskmanifest.Stamp(2**63 + i, 4096 + i, -i if i % 2 else 10**18 + i) for i in range(5)}
    data = diskmanifest.encode("layout", "tag", stamps)
    assert diskmanifest.decode(data, "layout", "tag") == stamps
    assert diskmanifest.decode(diskmanifest.encode("layout", "tag", {}), "layout", "tag") == {}
    for bad in (b"", data[:20], data[:-1], b"x" + data[1:]):
        assert diskmanifest.decode(bad, "layout", "tag") is None
