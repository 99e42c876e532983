"""The timed steps of ``calibrate`` and ``validate``, one per path and size: each moves bytes the
way the tier the path stands for does, so the fits compose into a restore (see
``HostCalibration.restore_s``). A step is made once (its buffers and files ready) and returns
its seconds each time it is called.

* memcpy: ``torch`` ``copy_`` between pre-faulted uint8 tensors; "1 thread" on the calling
  thread with one intra-op thread; "N threads" as the cache's load copies: 2N tasks on N
  threads, each a ``torch._foreach_copy_`` of ~2 MiB pieces.
* disk read: a file opened, its first page read (the block header), the rest read in
  ``READ_CHUNK_BYTES`` pieces with ``preadv`` into pre-faulted memory, closed: the disk tier's
  ``read_into`` without the checksum. Cold runs drop the file from the page cache first. "N
  threads": N files of ``size / N`` bytes, one per thread, as the engine's workers read blocks.
* disk block reads: blocks of a cache's size written once to a ``DiskTier`` of their own,
  read back with the tier's ``read_into`` (header and every layer's checksum verified), the
  blocks over the N threads: the disk tier's restore without the cache.
* disk write: a new file written with one ``writev``, fsynced, closed (then deleted, untimed).
* checksum: xxh3_64 over ``READ_CHUNK_BYTES`` pieces, as the disk tier verifies a read (from
  memory; the tier hashes a piece just read, still in the CPU cache, which is somewhat faster).
* host <-> device (CUDA only): a copy between host memory (pinned or pageable) and the GPU,
  synchronized.

``Prober`` hands ``validate`` the same steps one at a time, to interleave with its restores.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import xxhash

from kvstrata.plan.calpaths import CalPath
from kvstrata.pool.config import PoolConfig
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.tiers.base import Tier
from kvstrata.tiers.disk import READ_CHUNK_BYTES
from kvstrata.tiers.diskdir import SUFFIX
from kvstrata.timing import drop_page_cache, elapsed_s

MIB = 1 << 20
HEADER_PAGE = 4096
COPY_PIECE_BYTES = 2 * MIB  # a layer range of one block, as the cache copies it (order of)


def _buffer(nbytes: int, pin: bool = False) -> torch.Tensor:
    t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    t.fill_(1)  # pre-fault: first writes into fresh pages run several times slower
    return t


class Scratch:
    """Pre-faulted host buffers and scratch files, reused across sizes (grown on demand)."""

    def __init__(self, directory: Path, threads: int) -> None:
        self.directory = directory
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvstrata-calibrate")
        self.threads = threads
        self._src: torch.Tensor | None = None
        self._dst: torch.Tensor | None = None
        self.disk_tiers: dict[Path, Tier] = {}  # the block-read probes' own disk tiers, by directory
        self._readers: dict[int, ThreadPoolExecutor] = {}  # by thread count: as a disk tier reads

    def pair(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._src is None or self._src.numel() < nbytes:
            self._src = self._dst = None
            self._src = _buffer(nbytes)
            self._dst = _buffer(nbytes)
        return self._src[:nbytes], self._dst[:nbytes]

    def split(self, nbytes: int) -> list[tuple[int, int]]:
        """(offset, length) per thread, page-aligned, covering ``nbytes``."""
        step = -(-nbytes // self.threads // HEADER_PAGE) * HEADER_PAGE
        return [(o, min(step, nbytes - o)) for o in range(0, nbytes, step)]

    def disk_readers(self, count: int) -> ThreadPoolExecutor:
        """``count`` threads to read disk blocks on, as a load reads a disk tier (``TierCapabilities.readers``)."""
        if count not in self._readers:
            self._readers[count] = ThreadPoolExecutor(max_workers=count, thread_name_prefix="kvstrata-calibrate-read")
        return self._readers[count]

    def close(self) -> None:
        for tier in self.disk_tiers.values():
            tier.close()
        self.pool.shutdown(wait=True)
        for readers in self._readers.values():
            readers.shutdown(wait=True)


def memcpy_1t(s: Scratch, nbytes: int) -> Callable[[], float]:
    src, dst = s.pair(nbytes)

    def run() -> float:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return elapsed_s(lambda: dst.copy_(src))
        finally:
            torch.set_num_threads(threads)

    return run


def memcpy_one(s: Scratch, nbytes: int) -> Callable[[], float]:
    src, dst = s.pair(nbytes)
    return one_torch_copy(dst, src)


def one_torch_copy(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], float]:
    """A timed step: one ``torch._foreach_copy_`` of ``src`` into ``dst`` (flat uint8, as long) in
    COPY_PIECE_BYTES pieces, on torch's intra-op threads: a load into a CPU device tier (one
    dispatch of its blocks' copies); ``CalPath.MEMCPY_ONE``, and the lab's staged restore's second
    hop."""
    cuts = range(0, dst.numel(), COPY_PIECE_BYTES)
    dsts = [dst[c : c + COPY_PIECE_BYTES] for c in cuts]
    srcs = [src[c : c + COPY_PIECE_BYTES] for c in cuts]
    return lambda: elapsed_s(lambda: torch._foreach_copy_(dsts, srcs))


def memcpy_nt(s: Scratch, nbytes: int) -> Callable[[], float]:
    """N threads, 2N tasks, each one ``torch._foreach_copy_`` of its range in COPY_PIECE_BYTES
    pieces: how the cache's load copies layer ranges of many blocks on the engine's workers."""
    src, dst = s.pair(nbytes)
    tasks = -(-nbytes // (2 * s.threads))
    ranges = [(o, min(tasks, nbytes - o)) for o in range(0, nbytes, tasks)]

    def copy(part: tuple[int, int]) -> None:
        o, n = part
        cuts = range(o, o + n, COPY_PIECE_BYTES)
        ends = [min(c + COPY_PIECE_BYTES, o + n) for c in cuts]
        torch._foreach_copy_([dst[c:e] for c, e in zip(cuts, ends)], [src[c:e] for c, e in zip(cuts, ends)])

    return lambda: elapsed_s(lambda: list(s.pool.map(copy, ranges)))


def checksum(s: Scratch, nbytes: int) -> Callable[[], float]:
    """xxh3 of each READ_CHUNK_BYTES piece in turn, as the disk tier verifies a read."""
    data = s.pair(nbytes)[0].numpy()

    def run() -> None:
        for o in range(0, nbytes, READ_CHUNK_BYTES):
            xxhash.xxh3_64_intdigest(data[o : o + READ_CHUNK_BYTES])

    return lambda: elapsed_s(run)


def threaded_checksum(s: Scratch, nbytes: int) -> Callable[[], float]:
    """``checksum`` on N threads at once, each over its share."""
    data = s.pair(nbytes)[0].numpy()
    parts = s.split(nbytes)

    def hash_part(part: tuple[int, int]) -> None:
        o, n = part
        for c in range(o, o + n, READ_CHUNK_BYTES):
            xxhash.xxh3_64_intdigest(data[c : min(c + READ_CHUNK_BYTES, o + n)])

    return lambda: elapsed_s(lambda: list(s.pool.map(hash_part, parts)))


def _read_file(path: Path, dst: np.ndarray) -> None:
    """The disk tier's read without its checks: open, header page, payload in READ_CHUNK_BYTES
    pieces, close."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.pread(fd, HEADER_PAGE, 0)
        os.fstat(fd)
        for o in range(0, len(dst), READ_CHUNK_BYTES):
            view = memoryview(dst[o : o + READ_CHUNK_BYTES])
            offset = HEADER_PAGE + o
            while len(view):
                got = os.preadv(fd, [view], offset)
                if got == 0:
                    raise OSError(f"calibrate: {path} ended early")
                view, offset = view[got:], offset + got
    finally:
        os.close(fd)


def _files(s: Scratch, nbytes: int, parts: list[tuple[int, int]]) -> list[Path]:
    """One scratch file per part (a header page, then the part's bytes); written once."""
    src = s.pair(nbytes)[0].numpy()
    paths = []
    for i, (o, n) in enumerate(parts):
        path = s.directory / f"read-{nbytes}-{len(parts)}-{i}.bin"
        if not path.exists():
            with open(path, "wb") as f:
                f.write(bytes(HEADER_PAGE))
                f.write(memoryview(src[o : o + n]))
        paths.append(path)
    return paths


def disk_read(s: Scratch, nbytes: int, cold: bool, threaded: bool) -> Callable[[], float]:
    parts = s.split(nbytes) if threaded else [(0, nbytes)]
    paths = _files(s, nbytes, parts)
    dst = s.pair(nbytes)[1].numpy()
    jobs = list(zip(paths, parts))

    def one(job: tuple[Path, tuple[int, int]]) -> None:
        path, (o, n) = job
        _read_file(path, dst[o : o + n])

    def run() -> float:
        if cold:
            drop_page_cache(paths)
        if threaded:
            return elapsed_s(lambda: list(s.pool.map(one, jobs)))
        return elapsed_s(lambda: one(jobs[0]))

    return run


def blocks_layout(block_bytes: int) -> KVLayout:
    """A layout of 32 layers whose blocks are ``block_bytes`` (a multiple of 128) bytes."""
    if block_bytes % 128:
        raise ValueError(f"block bytes must be a multiple of 128, got {block_bytes}")
    return KVLayout(32, 1, 1, block_bytes // 128, DType.BF16)


def blocks_of(block_bytes: int, nbytes: int) -> KVLayout:
    """Blocks of ``block_bytes``, or of ``nbytes`` when that is less (one block then)."""
    return blocks_layout(min(block_bytes, nbytes) // 128 * 128)


def disk_blocks(s: Scratch, nbytes: int, cold: bool, layout: KVLayout) -> Callable[[], float]:
    """The disk tier's restore without the cache: ``nbytes`` (whole blocks) in blocks of ``layout`` written
    once to a ``DiskTier`` of their own, each read back with the tier's own ``read_into`` (the
    header read and verified, the payload in READ_CHUNK_BYTES pieces, each layer's xxh3 checked
    as it lands), the blocks spread over as many threads as a load reads a disk tier on
    (``DiskTier.capabilities.readers``, beside the N byte movers).

    The tier's own code, not a copy of it: measured on the loaded 2-core VM, a plain loop of
    preadv + one xxh3 per piece ran ~25% faster than the tier's read of the same bytes, which
    the prediction then missed by as much."""
    from kvstrata.tiers.disk import DiskTier

    count = max(1, nbytes // layout.block_bytes)
    directory = s.directory / f"tier-{count}x{layout.block_bytes}"
    tier = s.disk_tiers.get(directory)
    src = s.pair(count * layout.block_bytes)[0].view(count, layout.num_layers, layout.layer_bytes)
    keys = [i.to_bytes(16, "little") for i in range(count)]
    if tier is None:
        tier = s.disk_tiers[directory] = DiskTier(layout, count * layout.block_bytes, directory)
        for i, key in enumerate(keys):
            tier.write(i, key, src[i])
    dst = s.pair(count * layout.block_bytes)[1].view(count, layout.num_layers, layout.layer_bytes)

    def one(i: int) -> None:
        tier.read_into(i, keys[i], dst[i])

    def run() -> float:
        if cold:
            drop_page_cache(sorted(directory.rglob(f"*{SUFFIX}")))
        return elapsed_s(lambda: list(readers.map(one, range(count))))

    readers = s.disk_readers(DiskTier.capabilities.readers or s.threads)
    return run


def disk_write(s: Scratch, nbytes: int) -> Callable[[], float]:
    src = memoryview(s.pair(nbytes)[0].numpy())
    path = s.directory / f"write-{nbytes}.bin"

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            written = 0
            while written < nbytes:
                written += os.writev(fd, [src[written:]])
            os.fsync(fd)
        finally:
            os.close(fd)

    def run() -> float:
        try:
            return elapsed_s(write)
        finally:
            path.unlink(missing_ok=True)

    return run


def device_copy(nbytes: int, device: torch.device, pinned: bool, to_device: bool) -> Callable[[], float]:
    host = _buffer(nbytes, pin=pinned)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src, dst = (host, dev) if to_device else (dev, host)

    def run() -> float:
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=pinned)
        torch.cuda.synchronize(device)
        return time.perf_counter() - start

    return run


class Prober:
    """The timed steps of the paths ``validate`` interleaves with restores, one per (path,
    size), each measured as ``calibrate`` measures it; disk block reads and pool gets in
    blocks of ``layout`` (the cache's).

    Args:
        directory: scratch files here (the disk the cache's disk tier uses).
        threads: the N of the N-thread paths.
        device: the device tier's torch device (host -> device paths on CUDA).
        layout: the cache's block layout.
        pool: the remote pool (``CalPath.POOL_GET``), or None.
    """

    def __init__(self, directory: Path, threads: int, device: torch.device, layout: KVLayout,
                 pool: PoolConfig | None = None) -> None:
        self._scratch = Scratch(directory, threads)
        self._device, self._layout, self._pool = device, layout, pool
        self._steps: dict[tuple[str, int], Callable[[], float]] = {}
        self._raws: list = []

    def step(self, path: CalPath, nbytes: int) -> Callable[[], float]:
        """One timed run of ``path`` over ``nbytes`` (made once, then reused)."""
        key = (path, nbytes)
        if key not in self._steps:
            self._steps[key] = self._make(path, nbytes)
        return self._steps[key]

    def _make(self, path: CalPath, nbytes: int) -> Callable[[], float]:
        s = self._scratch
        if path == CalPath.MEMCPY_1T:
            return memcpy_1t(s, nbytes)
        if path == CalPath.MEMCPY_NT:
            return memcpy_nt(s, nbytes)
        if path == CalPath.MEMCPY_ONE:
            return memcpy_one(s, nbytes)
        if path == CalPath.CHECKSUM:
            return checksum(s, nbytes)
        if path in (CalPath.DISK_BLOCKS_WARM, CalPath.DISK_BLOCKS_COLD):
            return disk_blocks(s, nbytes, path == CalPath.DISK_BLOCKS_COLD, self._layout)
        if path == CalPath.H2D_PINNED:
            return device_copy(nbytes, self._device, True, True)
        if path == CalPath.POOL_GET and self._pool is not None:
            return self._pool_get(nbytes, self._layout.block_bytes)
        raise ValueError(f"no probe for path {path.label!r} here")

    def _pool_get(self, nbytes: int, block_bytes: int) -> Callable[[], float]:
        from kvstrata.pool.config import RemoteMode
        from kvstrata.pool.raw import RawPool
        from kvstrata.tiers.poolvalue import HEADER_BYTES

        count = max(1, nbytes // block_bytes)
        values = torch.randint(0, 256, (count, HEADER_BYTES + block_bytes), dtype=torch.uint8)
        names = [f"kvstrata-validate/{os.getpid()}/{id(self)}/{nbytes}/{i}" for i in range(count)]
        raw = RawPool(self._pool, RemoteMode.TCP, names, values)
        self._raws.append(raw)
        raw.put_s()
        return raw.get_s

    def close(self) -> None:
        for raw in self._raws:
            raw.close()
        self._scratch.close()
