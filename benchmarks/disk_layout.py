"""File per block vs slab file: write and read throughput on this machine's disk.

Writes ``--total-mib`` of random bytes as blocks of each size, both ways, then reads them back
warm (page cache) and cold (after ``fsync`` + ``POSIX_FADV_DONTNEED`` per file). Prints decimal
GB/s (1 GB = 1e9 bytes).

- file: one file per block, written as the disk tier does (temp file, ``writev``, ``os.replace``),
  read with ``open`` + ``preadv`` straight into the destination buffer + ``close``.
- slab: one preallocated file; block i lives at offset ``i * block_bytes`` (``pwrite`` / ``preadv``).

"write" is buffered (page cache, no fsync); "write+fsync" adds an ``fsync`` per block for file
(a durable atomic write needs one per file) and one per block for slab too (same guarantee).

"cold random" reads the blocks in a shuffled order (a prefix's blocks sit in whatever slots were
free, so a restore does not read a slab front to back); "cold rand 4T" does so from 4 threads.

Usage: python benchmarks/disk_layout.py [--dir DIR] [--total-mib 256] [--repeat 3]

Measured (basis: this script, 256 MiB, median of 3 per run, lowest-highest of 3 runs; 256 KiB of
2) on the development VM: 2 vCPU AMD EPYC, 24 GB RAM, virtio disk, ext4 mounted with discard.
Decimal GB/s; the disk is noisy run to run.

    block   layout  write      write+fsync  read warm    read cold  cold random  cold rand 4T
    32 MiB  file    1.0-2.6    1.2-2.1      13.6-15.2    1.8-2.3    1.5-2.1      1.6-2.7
    32 MiB  slab    3.7-7.9    1.3-2.4       9.5-15.5    2.3-3.2    1.8-2.4      2.0-2.6
    1 MiB   file    1.2-2.6    0.4-0.9      11.5-14.2    1.1-1.5    1.1-1.4      1.8-2.2
    1 MiB   slab    6.2-7.9    0.7-1.6      12.7-15.2    2.6-3.1    1.4-1.5      2.0-2.2
    256 KiB file    0.4-0.5    0.2-0.3      11.0-11.6    0.9-1.1    0.8-0.9      1.2-1.6
    256 KiB slab    6.5-7.4    0.6-0.7      11.1-13.4    2.3-2.5    1.0-1.2      1.1-1.7
    32 KiB  file    0.05-0.06  0.03-0.05     3.6-4.2     0.3-0.4    0.3-0.4      0.7-0.8
    32 KiB  slab    4.3-4.5    0.12-0.14     5.9-8.6     2.7-2.9    0.5-0.6      0.9-1.1

Reading: in the order a restore reads (cold random, and with threads) a file per block is level
with a slab at >= 1 MiB; a slab only pulls ahead when read front to back (readahead across
blocks). Writes cost a file per block one create + rename (~100-500 us here), which dominates
below ~1 MiB.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

SIZES = {"32MiB": 32 << 20, "1MiB": 1 << 20, "256KiB": 256 << 10, "32KiB": 32 << 10}


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read_exact(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise EOFError
        view, offset = view[n:], offset + n


def file_write(root: str, blocks: np.ndarray, fsync: bool) -> list[str]:
    paths = []
    for i, block in enumerate(blocks):
        final = os.path.join(root, f"{i:08x}.kvb")
        tmp = final + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.writev(fd, [memoryview(block)])
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        paths.append(final)
    return paths


def file_read(paths: list[str], out: np.ndarray, order: np.ndarray) -> None:
    for i in order:
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            _read_exact(fd, memoryview(out[i]), 0)
        finally:
            os.close(fd)


def slab_write(path: str, blocks: np.ndarray, fsync: bool) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, blocks.nbytes)
        size = blocks.shape[1]
        for i, block in enumerate(blocks):
            os.pwrite(fd, memoryview(block), i * size)
            if fsync:
                os.fdatasync(fd)
    finally:
        os.close(fd)


def slab_read(path: str, out: np.ndarray, order: np.ndarray) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = out.shape[1]
        for i in order:
            _read_exact(fd, memoryview(out[i]), int(i) * size)
    finally:
        os.close(fd)


def threaded(read, target, out: np.ndarray, order: np.ndarray, threads: int) -> None:
    """``read`` split over ``threads`` threads (preadv releases the GIL)."""
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda part: read(target, out, part), np.array_split(order, threads)))


def measure(root: str, total_bytes: int, block_bytes: int, repeat: int) -> dict[str, dict[str, float]]:
    count = total_bytes // block_bytes
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(count, block_bytes), dtype=np.uint8)
    out = np.empty_like(blocks)
    results: dict[str, dict[str, list[float]]] = {"file": {}, "slab": {}}

    def record(kind: str, what: str, seconds: float) -> None:
        results[kind].setdefault(what, []).append(total_bytes / seconds / 1e9)

    sequential = np.arange(count)
    shuffled = rng.permutation(count)  # a prefix's blocks sit in whatever slots were free
    for _ in range(repeat):
        for kind in ("file", "slab"):
            read = file_read if kind == "file" else slab_read
            for fsync in (False, True):
                work = tempfile.mkdtemp(dir=root)
                slab = os.path.join(work, "slab")
                os.sync()  # start each timed write with no dirty pages from the last run
                t0 = time.perf_counter()
                paths = file_write(work, blocks, fsync) if kind == "file" else slab_write(slab, blocks, fsync)
                record(kind, "write+fsync" if fsync else "write", time.perf_counter() - t0)
                if not fsync:
                    target = paths if kind == "file" else slab
                    for what, order, threads in (
                        ("read warm", sequential, 1),
                        ("read cold", sequential, 1),
                        ("cold random", shuffled, 1),
                        ("cold rand 4T", shuffled, 4),
                    ):
                        if what != "read warm":
                            for path in paths if kind == "file" else [slab]:
                                _drop_cache(path)
                        out[:] = 0
                        t0 = time.perf_counter()
                        threaded(read, target, out, order, threads)
                        record(kind, what, time.perf_counter() - t0)
                        assert np.array_equal(out, blocks)
                shutil.rmtree(work)
    return {k: {w: float(np.median(v)) for w, v in d.items()} for k, d in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="a directory on the disk to measure (default: the temp dir)")
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell; the median is shown")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="kvstrata-disk-bench-", dir=args.dir)
    try:
        columns = ("write", "write+fsync", "read warm", "read cold", "cold random", "cold rand 4T")
        print(f"{args.total_mib} MiB per run, median of {args.repeat}, decimal GB/s, dir {root}")
        print(f"{'block':>6} {'layout':>5} " + " ".join(f"{c:>12}" for c in columns))
        for label, size in SIZES.items():
            cells = measure(root, args.total_mib << 20, size, args.repeat)
            for kind in ("file", "slab"):
                print(f"{label:>6} {kind:>5} " + " ".join(f"{cells[kind][c]:>12.2f}" for c in columns))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
