"""The disk tier under faults: corruption, truncation, crashes, a full disk, restarts, threads.

Every failure here is real: bytes flipped in real files, a writer process killed with SIGKILL,
a tmpfs that runs out of space, a file size limit (RLIMIT_FSIZE) that makes writes fail.
Run as a script (``python test_disk.py writer|efbig ...``) this file is also the child process
those tests spawn, so the child writes exactly the content the test checks against.
"""

from __future__ import annotations

import errno
import json
import os
import random
import resource
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from kvstrata.errors import CorruptBlock
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.tiers import blockfile
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.diskdir import DirectoryInUse

SMALL = KVLayout(num_layers=4, block_tokens=16, kv_heads=2, head_dim=8, dtype=DType.BF16)  # 4 x 1 KiB
CHILD = KVLayout(num_layers=8, block_tokens=16, kv_heads=4, head_dim=128, dtype=DType.BF16)  # 8 x 32 KiB


# --- deterministic blocks (shared with the child processes) -----------------------------------


def make_key(i: int, salt: str = "") -> bytes:
    return xxhash.xxh3_128_digest(f"kvstrata-test-disk:{salt}:{i}".encode())


def content(layout: KVLayout, key: bytes) -> torch.Tensor:
    """The block the tests (and the child writers) store under ``key``."""
    data = np.random.default_rng(int.from_bytes(key, "little")).bytes(layout.block_bytes)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(layout.num_layers, layout.layer_bytes)


def store(tier: DiskTier, key: bytes, block: torch.Tensor | None = None) -> None:
    # A disk block's file is named by its key: the slot (the block manager's) is not used.
    tier.write(0, key, content(tier.layout, key) if block is None else block)


def load(tier: DiskTier, key: bytes, layers: slice = slice(None)) -> torch.Tensor:
    start, stop, _ = layers.indices(tier.layout.num_layers)
    dst = torch.empty(stop - start, tier.layout.layer_bytes, dtype=torch.uint8)
    tier.read_into(0, key, dst, layers)
    return dst


def file_of(tier: DiskTier, key: bytes) -> Path:
    return tier.directory / f"{key.hex()}.kvb"


def block_files(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.endswith(".kvb")}


def temp_files(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def header_bytes_of(path: Path) -> tuple[int, int]:
    """(header_bytes, body_bytes) as stored in the file."""
    with open(path, "rb") as f:
        return struct.unpack_from("<II", f.read(20), 12)


def file_verifies(path: Path, layout: KVLayout) -> bool:
    """Whether a block file is whole and every checksum in it holds (independent of any tier)."""
    data = path.read_bytes()
    try:
        header = blockfile.decode_header(data)
        payload = np.frombuffer(data, np.uint8, offset=header.header_bytes)
        if len(data) != header.file_bytes or header.layout != layout.describe():
            return False
        blockfile.verify_layers(header, payload.reshape(header.num_layers, header.layer_bytes), 0)
    except (CorruptBlock, ValueError):
        return False
    return header.key.hex() + ".kvb" == path.name


@pytest.fixture
def tier(tmp_path):
    t = DiskTier(SMALL, 64 * SMALL.block_bytes, tmp_path / "disk")
    yield t
    t.close()


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout",
    [
        KVLayout(4, 16, 2, 8, DType.BF16),
        KVLayout(3, 32, 1, 16, DType.FP8),
        KVLayout(2, 256, 2, 4, DType.FP32),
        KVLayout(5, 16, 1, 64, DType.FP16, kv_tensors=1),  # MLA: one latent
        KVLayout(600, 16, 1, 1, DType.FP8),  # 600 layer checksums: a header of two pages
    ],
    ids=["t16-bf16", "t32-fp8", "t256-fp32", "t16-mla", "600-layers"],
)
def test_round_trip_is_bit_exact(tmp_path, layout):
    tier = DiskTier(layout, 8 * layout.block_bytes, tmp_path)
    keys = [make_key(i, layout.describe()) for i in range(5)]
    for key in keys:
        store(tier, key)
    for key in keys:
        assert torch.equal(load(tier, key), content(layout, key))
        assert torch.equal(load(tier, key, slice(1, -1)), content(layout, key)[1:-1])
        header_bytes, _ = header_bytes_of(file_of(tier, key))
        assert header_bytes % 4096 == 0  # the payload is page-aligned in the file
        assert file_of(tier, key).stat().st_size == header_bytes + layout.block_bytes
    tier.close()


def test_reads_into_a_slice_of_a_host_pool_and_a_strided_tensor(tier):
    key = make_key(0)
    store(tier, key)
    pool = torch.zeros(3, SMALL.num_layers, SMALL.layer_bytes, dtype=torch.uint8)
    tier.read_into(0, key, pool[1])
    assert torch.equal(pool[1], content(SMALL, key))
    assert not pool[0].any() and not pool[2].any()  # neighbours untouched
    strided = torch.zeros(SMALL.layer_bytes, SMALL.num_layers, dtype=torch.uint8).t()
    assert not strided.is_contiguous()
    tier.read_into(0, key, strided)
    assert torch.equal(strided, content(SMALL, key))


def test_write_takes_a_strided_source(tier):
    key = make_key(0)
    block = content(SMALL, key)
    strided = block.t().contiguous().t()  # same values, column-major storage
    store(tier, key, strided)
    assert torch.equal(load(tier, key), block)


def test_fsync_mode_round_trips(tmp_path):
    tier = DiskTier(SMALL, 4 * SMALL.block_bytes, tmp_path, fsync=True)
    store(tier, make_key(0))
    assert torch.equal(load(tier, make_key(0)), content(SMALL, make_key(0)))
    tier.close()


def test_wrong_shapes_are_refused(tier):
    key = make_key(0)
    with pytest.raises(ValueError):
        tier.write(0, key, torch.zeros(SMALL.num_layers, SMALL.layer_bytes + 1, dtype=torch.uint8))
    with pytest.raises(ValueError):
        tier.write(0, key, torch.zeros(SMALL.num_layers, SMALL.layer_bytes // 2, dtype=torch.int16))
    with pytest.raises(ValueError):
        tier.write(0, b"short", content(SMALL, key))
    store(tier, key)
    with pytest.raises(ValueError):
        tier.read_into(0, key, torch.empty(2, SMALL.layer_bytes, dtype=torch.uint8), slice(0, 3))
    with pytest.raises(ValueError):
        tier.read_into(0, key, torch.empty(2, SMALL.layer_bytes, dtype=torch.uint8), slice(0, 4, 2))
    assert temp_files(tier.directory) == []


# --- partial layer reads ---------------------------------------------------------------------


@pytest.mark.parametrize("layers", [slice(0, 1), slice(1, 3), slice(3, 4), slice(2, None), slice(0, 0)])
def test_partial_layer_reads_are_bit_exact(tier, layers):
    key = make_key(0)
    store(tier, key)
    assert torch.equal(load(tier, key, layers), content(SMALL, key)[layers])


def test_partial_reads_verify_exactly_their_layers(tier):
    key = make_key(0)
    store(tier, key)
    header_bytes, _ = header_bytes_of(file_of(tier, key))
    flip_byte(file_of(tier, key), header_bytes + 2 * SMALL.layer_bytes + 7)  # a byte of layer 2
    block = content(SMALL, key)
    assert torch.equal(load(tier, key, slice(0, 2)), block[0:2])
    assert torch.equal(load(tier, key, slice(3, 4)), block[3:4])
    for layers in (slice(2, 3), slice(1, 3), slice(None)):
        with pytest.raises(CorruptBlock, match="layer 2"):
            load(tier, key, layers)


# --- corruption ------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_corrupted_payload_byte_is_never_served(tier, where):
    key = make_key(0)
    store(tier, key)
    header_bytes, _ = header_bytes_of(file_of(tier, key))
    offset = {"first": 0, "middle": SMALL.block_bytes // 2, "last": SMALL.block_bytes - 1}[where]
    flip_byte(file_of(tier, key), header_bytes + offset)
    with pytest.raises(CorruptBlock):
        load(tier, key)


HEADER_FIELDS = {  # offset of a byte inside each header field (see kvstrata.tiers.blockfile)
    "magic": lambda body: 0,
    "version": lambda body: 8,
    "header_bytes": lambda body: 13,
    "body_bytes": lambda body: 16,
    "key": lambda body: 25,
    "payload_bytes": lambda body: 37,
    "num_layers": lambda body: 44,
    "layer_bytes": lambda body: 49,
    "layout_text": lambda body: 62,
    "layer_checksum": lambda body: body - 3,
    "header_checksum": lambda body: body + 1,
}


@pytest.mark.parametrize("field", list(HEADER_FIELDS))
def test_a_corrupted_header_is_never_served(tier, field):
    key = make_key(0)
    store(tier, key)
    _, body_bytes = header_bytes_of(file_of(tier, key))
    flip_byte(file_of(tier, key), HEADER_FIELDS[field](body_bytes))
    with pytest.raises(CorruptBlock):
        load(tier, key)


@pytest.mark.parametrize("keep", ["empty", "30 bytes", "header only", "all but one byte"])
def test_a_truncated_file_is_never_served(tier, keep):
    key = make_key(0)
    store(tier, key)
    path = file_of(tier, key)
    size = path.stat().st_size
    header_bytes, _ = header_bytes_of(path)
    os.truncate(path, {"empty": 0, "30 bytes": 30, "header only": header_bytes, "all but one byte": size - 1}[keep])
    with pytest.raises(CorruptBlock):
        load(tier, key)
    with pytest.raises(CorruptBlock):  # even a partial read whose own bytes are all still there
        load(tier, key, slice(0, 1))


def test_a_file_with_trailing_bytes_is_never_served(tier):
    key = make_key(0)
    store(tier, key)
    with open(file_of(tier, key), "ab") as f:
        f.write(b"x")
    with pytest.raises(CorruptBlock):
        load(tier, key)


def test_a_missing_file_or_another_keys_file_is_never_served(tier):
    a, b = make_key(0), make_key(1)
    store(tier, a)
    store(tier, b)
    os.replace(file_of(tier, a), file_of(tier, b))  # b's name now holds a's block
    with pytest.raises(CorruptBlock, match="no file"):
        load(tier, a)
    with pytest.raises(CorruptBlock, match="holds block"):
        load(tier, b)


# --- restart ---------------------------------------------------------------------------------


def test_restart_recovers_exactly_the_blocks_whose_headers_verify(tmp_path):
    directory = tmp_path / "disk"
    tier = DiskTier(SMALL, 16 * SMALL.block_bytes, directory)
    keys = [make_key(i) for i in range(8)]
    for key in keys:
        store(tier, key)
    header_bytes, _ = header_bytes_of(file_of(tier, keys[0]))
    flip_byte(file_of(tier, keys[0]), 40)  # header
    os.truncate(file_of(tier, keys[1]), header_bytes + 100)  # truncated payload
    os.truncate(file_of(tier, keys[2]), 10)  # truncated header
    flip_byte(file_of(tier, keys[3]), header_bytes + 5)  # payload: caught on read, not at start
    tier.close()
    (directory / f".{keys[4].hex()}.7.tmp").write_bytes(b"half a block")  # a crashed writer's
    (directory / "notes.txt").write_text("not ours")

    tier = DiskTier(SMALL, 16 * SMALL.block_bytes, directory)
    recovered = tier.recover()
    assert sorted(recovered) == sorted(keys[3:])  # each once
    assert block_files(directory) == {f"{k.hex()}.kvb" for k in keys[3:]}
    assert temp_files(directory) == []
    assert (directory / "notes.txt").exists()  # files that are not ours stay
    for key in keys[4:]:
        assert torch.equal(load(tier, key), content(SMALL, key))
    with pytest.raises(CorruptBlock):
        load(tier, keys[3])
    tier.close()


def test_restart_with_less_capacity_keeps_and_serves_every_block_in_write_order(tmp_path, caplog):
    tier = DiskTier(SMALL, 6 * SMALL.block_bytes, tmp_path)
    keys = [make_key(i) for i in range(6)]
    for age, key in enumerate(keys):
        store(tier, key)
        os.utime(file_of(tier, key), ns=(10**18 + age * 10**9, 10**18 + age * 10**9))
    tier.close()

    with caplog.at_level("WARNING", logger="kvstrata.tiers"):
        tier = DiskTier(SMALL, 4 * SMALL.block_bytes, tmp_path)
    assert any("6 blocks found, 4 fit" in r.getMessage() and "all kept" in r.getMessage()
               for r in caplog.records)  # said, not silent
    # Nothing deleted at the start (the block manager evicts the excess as new blocks need
    # room); oldest write first: the order it adopts them in, so LRU after a restart evicts
    # the least recently written first.
    assert tier.recover() == keys
    assert block_files(tmp_path) == {f"{k.hex()}.kvb" for k in keys}
    for key in keys:
        assert torch.equal(load(tier, key), content(SMALL, key))
    tier.close()


def test_restart_with_another_layout_serves_nothing_of_the_old_one(tmp_path):
    old = KVLayout(4, 16, 2, 8, DType.BF16)
    new = KVLayout(4, 32, 1, 8, DType.BF16)  # same bytes per layer and per block, other shape
    assert (old.layer_bytes, old.block_bytes) == (new.layer_bytes, new.block_bytes)
    tier = DiskTier(old, 8 * old.block_bytes, tmp_path)
    key = make_key(0)
    store(tier, key)
    tier.close()

    tier = DiskTier(new, 8 * new.block_bytes, tmp_path)
    assert tier.recover() == []
    assert block_files(tmp_path) == set()
    with pytest.raises(CorruptBlock):
        tier.read_into(0, key, torch.empty(new.num_layers, new.layer_bytes, dtype=torch.uint8))
    tier.close()


def test_a_block_renamed_from_another_layout_is_refused_on_read(tmp_path):
    other = KVLayout(4, 32, 1, 8, DType.BF16)
    a = DiskTier(other, 4 * other.block_bytes, tmp_path / "a")
    b = DiskTier(SMALL, 4 * SMALL.block_bytes, tmp_path / "b")
    key = make_key(0)
    store(a, key)
    store(b, key)
    shutil.copyfile(file_of(a, key), file_of(b, key))  # behind b's back, after recovery
    with pytest.raises(CorruptBlock, match="layout"):
        load(b, key)
    a.close()
    b.close()


# --- namespaces, ownership, discard ------------------------------------------------------------


def test_namespaces_live_apart(tmp_path):
    a = DiskTier(SMALL, 4 * SMALL.block_bytes, tmp_path, namespace_tag="aaaa")
    b = DiskTier(SMALL, 4 * SMALL.block_bytes, tmp_path, namespace_tag="bbbb")
    key = make_key(0)
    other = content(SMALL, make_key(99))
    store(a, key)
    store(b, key, other)
    assert torch.equal(load(a, key), content(SMALL, key))
    assert torch.equal(load(b, key), other)
    a.close()
    b.close()
    root = DiskTier(SMALL, 4 * SMALL.block_bytes, tmp_path)  # the untagged tier: neither's blocks
    assert root.recover() == []
    root.close()
    a = DiskTier(SMALL, 4 * SMALL.block_bytes, tmp_path, namespace_tag="aaaa")
    assert a.recover() == [key]
    a.close()
    with pytest.raises(ValueError):
        DiskTier(SMALL, 4 * SMALL.block_bytes, tmp_path, namespace_tag="../escape")


def test_a_directory_has_one_open_tier(tmp_path):
    first = DiskTier(SMALL, 4 * SMALL.block_bytes, tmp_path)
    with pytest.raises(DirectoryInUse):
        DiskTier(SMALL, 4 * SMALL.block_bytes, tmp_path)
    first.close()
    first.close()  # idempotent
    DiskTier(SMALL, 4 * SMALL.block_bytes, tmp_path).close()


def test_discard_deletes_the_file_of_a_leaving_block(tier):
    # (No new write of the key can race the deletion: the block manager discards while the block
    # is EVICTING, before the key can be stored again; tests/manager checks that order.)
    key, other = make_key(0), make_key(1)
    store(tier, key)
    store(tier, other)
    tier.discard(0, key)
    assert not file_of(tier, key).exists()
    assert torch.equal(load(tier, other), content(SMALL, other))
    tier.discard(0, key)  # already gone: nothing to do


# --- crashes ---------------------------------------------------------------------------------


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.slow  # writers in other processes, killed mid-write over and over (~15 s)
def test_a_writer_killed_mid_write_leaves_only_verified_blocks(tmp_path):
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    done: set[bytes] = set()
    for round_ in range(2):
        child = _spawn("writer", str(tmp_path), str(round_ * 100_000))
        assert child.stdout.readline().strip() == "started", child.stderr.read()
        time.sleep(rng.uniform(0.0, 0.3))
        child.send_signal(signal.SIGKILL)
        out, err = child.communicate()
        assert child.returncode == -signal.SIGKILL, f"writer ended on its own: {err}"
        done.update(_finished_keys(out))
        for path in tmp_path.glob("*.kvb"):  # no torn block under a final name, before any recovery
            assert file_verifies(path, CHILD), f"seed {seed}: {path.name} is torn"

    tier = DiskTier(CHILD, 4096 * CHILD.block_bytes, tmp_path)
    served = set(tier.recover())
    assert done <= served, f"seed {seed}: blocks the writer finished were lost"
    for key in served:  # every block served is exactly what the writer wrote for its key
        assert torch.equal(load(tier, key), content(CHILD, key)), f"seed {seed}"
    assert temp_files(tmp_path) == []
    assert len(done) > 0
    tier.close()


def _finished_keys(out: str) -> set[bytes]:
    """Keys of the writer's complete "done <hex>" lines. The kill may cut the last line short
    (print's pieces can reach the pipe in more than one write): a cut line names no key."""
    keys = set()
    for line in out.splitlines(keepends=True):
        parts = line.split()
        if line.endswith("\n") and len(parts) == 2 and parts[0] == "done" and len(parts[1]) % 2 == 0:
            keys.add(bytes.fromhex(parts[1]))
    return keys


def _writer(directory: str, first: int) -> None:
    """Write blocks in a loop until killed; print each key once ``write`` returned for it."""
    tier = DiskTier(CHILD, 4096 * CHILD.block_bytes, directory)
    print("started", flush=True)
    for i in range(first, first + 3000):
        key = make_key(i, "writer")
        tier.write(0, key, content(CHILD, key))
        print("done", key.hex(), flush=True)
    tier.close()


# --- a full disk -----------------------------------------------------------------------------


def test_a_full_disk_fails_the_write_cleanly(tiny_tmpfs):
    layout = KVLayout(4, 16, 4, 128, DType.BF16)  # 128 KiB blocks: seven fit in 1 MiB
    tier = DiskTier(layout, 64 * layout.block_bytes, tiny_tmpfs)
    stored: list[bytes] = []
    failure = None
    for i in range(16):
        key = make_key(i, "full")
        try:
            tier.write(0, key, content(layout, key))
        except OSError as e:
            failure = (key, e)
            break
        stored.append(key)
    assert failure is not None and failure[1].errno == errno.ENOSPC
    assert len(stored) >= 2
    assert temp_files(tiny_tmpfs) == []
    for key in stored:
        assert torch.equal(load(tier, key), content(layout, key))
    # Making room lets the same block through.
    tier.discard(0, stored[0])
    store(tier, failure[0])
    assert torch.equal(load(tier, failure[0]), content(layout, failure[0]))
    tier.close()


def test_a_file_size_limit_fails_the_write_cleanly(tmp_path):
    """RLIMIT_FSIZE (no root needed): the write dies with EFBIG part-way through the payload."""
    child = _spawn("efbig", str(tmp_path))
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    report = json.loads(out.splitlines()[-1])
    assert report["errno"] == errno.EFBIG
    assert temp_files(tmp_path) == []
    tier = DiskTier(CHILD, 16 * CHILD.block_bytes, tmp_path)
    stored = [bytes.fromhex(k) for k in report["stored"]]
    assert set(tier.recover()) == set(stored) and len(stored) == 3
    for key in stored:
        assert torch.equal(load(tier, key), content(CHILD, key))
    tier.close()


def _efbig(directory: str) -> None:
    tier = DiskTier(CHILD, 16 * CHILD.block_bytes, directory)
    stored = []
    for i in range(3):
        key = make_key(i, "efbig")
        store(tier, key)
        stored.append(key.hex())
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write with EFBIG, don't kill us
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (CHILD.block_bytes // 2, hard))
    key = make_key(3, "efbig")
    try:
        tier.write(0, key, content(CHILD, key))
        code = 0
    except OSError as e:
        code = e.errno
    tier.close()
    print(json.dumps({"errno": code, "stored": stored}), flush=True)


# --- threads ---------------------------------------------------------------------------------


def test_threads_writing_and_reading_different_keys_stay_bit_exact(tmp_path):
    tier = DiskTier(CHILD, 256 * CHILD.block_bytes, tmp_path)
    threads, per_thread = 8, 12
    start = threading.Barrier(threads)
    written: set[bytes] = set()  # blocks whose write returned (the table's READY)
    lock = threading.Lock()

    def work(t: int) -> int:
        start.wait()
        checked = 0
        mine = [make_key(i, f"thread{t}") for i in range(per_thread)]
        for i, key in enumerate(mine):
            store(tier, key)
            with lock:
                written.add(key)
            for other in (key, mine[i // 2], make_key(i, f"thread{(t + 1) % threads}")):
                with lock:
                    ready = other in written  # another thread's block, once written
                if ready:
                    assert torch.equal(load(tier, other), content(CHILD, other))
                    assert torch.equal(load(tier, other, slice(2, 5)), content(CHILD, other)[2:5])
                    checked += 1
        return checked

    with ThreadPoolExecutor(threads) as pool:
        checked = list(pool.map(work, range(threads)))
    assert sum(checked) >= threads * per_thread * 2
    assert len(block_files(tmp_path)) == threads * per_thread
    tier.close()


if __name__ == "__main__":
    {"writer": lambda: _writer(sys.argv[2], int(sys.argv[3])), "efbig": lambda: _efbig(sys.argv[2])}[sys.argv[1]]()
