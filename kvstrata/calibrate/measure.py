"""Measure this host's transfer paths, the way kvstrata moves bytes on them, and fit each one.

Every path is timed at several sizes: one warm-up, then ``repeats`` timed runs per size; a
size's figure is the median of its runs, its spread the relative half-range. The medians are
fitted with :func:`kvstrata.plan.host.fit_path` (``seconds = latency_s + bytes / bandwidth``).

Each measurement does what the tier it stands for does, so the fits compose into a restore
(see ``HostCalibration.restore_s``):

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
* pool get/put: one batched Mooncake call for all objects (``kvstrata.pool.raw.RawPool``),
  objects of ``object_bytes`` each.
* each tier's fixed cost of a restore (``restore_fixed``): restores of two tiny blocks through
  a ``TieredCache``, from the host, the disk and the pool.

The paths a restore's bytes move along are fitted as rates through the origin (``RATE_PATHS``),
every path on relative error. ``Prober`` hands ``validate`` the same steps one at a time, to
interleave with its restores.

Timing is noisy on shared machines: the medians absorb stray runs, the spread reports them.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import xxhash

from kvstrata.media import Medium
from kvstrata.plan import host as h
from kvstrata.pool.config import PoolConfig
from kvstrata.progress import NoProgress, Progress
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.tiers.base import Tier
from kvstrata.tiers.disk import READ_CHUNK_BYTES
from kvstrata.tiers.diskdir import SUFFIX
from kvstrata.timing import drop_page_cache, elapsed_s

MIB = 1 << 20
DEFAULT_SIZES = (4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB)
QUICK_SIZES = (4 * MIB, 16 * MIB, 64 * MIB)
HEADER_PAGE = 4096
COPY_PIECE_BYTES = 2 * MIB  # a layer range of one block, as the cache copies it (order of)


@dataclass(frozen=True)
class CalibrateConfig:
    """What to measure.

    Attributes:
        sizes: bytes per measurement (each path at every size).
        repeats: timed runs per size, after one warm-up (>= 1).
        threads: the N of the N-thread paths (the cache's transfer workers).
        directory: where scratch files go (None: the temp directory). Measure the disk the
            cache's disk tier will use.
        pool: the remote pool, or None (pool paths skipped).
        object_bytes: bytes per pool object (a block of the cache).
        cold: measure cold disk reads (drops the scratch files from the page cache).
    """

    sizes: tuple[int, ...] = DEFAULT_SIZES
    repeats: int = 5
    threads: int = 2
    directory: str | None = None
    pool: PoolConfig | None = None
    object_bytes: int = 8 * MIB
    cold: bool = True

    def __post_init__(self) -> None:
        if not self.sizes or any(s < self.threads * HEADER_PAGE for s in self.sizes):
            raise ValueError(f"calibrate sizes must be given and each >= {self.threads * HEADER_PAGE} bytes, got {self.sizes}")
        if self.repeats < 1:
            raise ValueError(f"calibrate repeats must be >= 1, got {self.repeats}")
        if self.threads < 1:
            raise ValueError(f"calibrate threads must be >= 1, got {self.threads}")
        if self.object_bytes < HEADER_PAGE or self.object_bytes % 128:
            raise ValueError(f"calibrate object_bytes must be >= {HEADER_PAGE} and a multiple of 128, "
                             f"got {self.object_bytes}")


@dataclass(frozen=True)
class Measurement:
    """One path at one size: the timed runs (seconds)."""

    path: h.CalPath
    size_bytes: int
    runs_s: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.runs_s)

    @property
    def spread(self) -> float:
        """(max - min) / 2 / median: how far a single run strays."""
        return (max(self.runs_s) - min(self.runs_s)) / 2 / self.median_s

    @property
    def gbps(self) -> float:
        return self.size_bytes / self.median_s / h.GB


@dataclass
class CalibrationRun:
    """What ``calibrate`` produced: the fits, the raw measurements, and what was skipped."""

    calibration: h.HostCalibration
    measurements: list[Measurement] = field(default_factory=list)
    skipped: dict[h.CalPath, str] = field(default_factory=dict)  # path -> why
    seconds: float = 0.0


# --- the paths ----------------------------------------------------------------------------------


def _buffer(nbytes: int, pin: bool = False) -> torch.Tensor:
    t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    t.fill_(1)  # pre-fault: first writes into fresh pages run several times slower
    return t


class _Scratch:
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


def _memcpy_1t(s: _Scratch, nbytes: int) -> Callable[[], float]:
    src, dst = s.pair(nbytes)

    def run() -> float:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return elapsed_s(lambda: dst.copy_(src))
        finally:
            torch.set_num_threads(threads)

    return run


def _memcpy_one(s: _Scratch, nbytes: int) -> Callable[[], float]:
    src, dst = s.pair(nbytes)
    return one_torch_copy(dst, src)


def one_torch_copy(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], float]:
    """A timed step: one ``torch._foreach_copy_`` of ``src`` into ``dst`` (flat uint8, as long) in
    COPY_PIECE_BYTES pieces, on torch's intra-op threads: a load into a CPU device tier (one
    dispatch of its blocks' copies); ``MEMCPY_ONE``, and the lab's staged restore's second hop."""
    cuts = range(0, dst.numel(), COPY_PIECE_BYTES)
    dsts = [dst[c : c + COPY_PIECE_BYTES] for c in cuts]
    srcs = [src[c : c + COPY_PIECE_BYTES] for c in cuts]
    return lambda: elapsed_s(lambda: torch._foreach_copy_(dsts, srcs))


def _memcpy_nt(s: _Scratch, nbytes: int) -> Callable[[], float]:
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


def _checksum(s: _Scratch, nbytes: int) -> Callable[[], float]:
    """xxh3 of each READ_CHUNK_BYTES piece in turn, as the disk tier verifies a read."""
    data = s.pair(nbytes)[0].numpy()

    def run() -> None:
        for o in range(0, nbytes, READ_CHUNK_BYTES):
            xxhash.xxh3_64_intdigest(data[o : o + READ_CHUNK_BYTES])

    return lambda: elapsed_s(run)


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


def _files(s: _Scratch, nbytes: int, parts: list[tuple[int, int]]) -> list[Path]:
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


def _disk_read(s: _Scratch, nbytes: int, cold: bool, threaded: bool) -> Callable[[], float]:
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


def _blocks_of(block_bytes: int, nbytes: int) -> KVLayout:
    """Blocks of ``block_bytes``, or of ``nbytes`` when that is less (one block then)."""
    return blocks_layout(min(block_bytes, nbytes) // 128 * 128)


def _disk_blocks(s: _Scratch, nbytes: int, cold: bool, layout: KVLayout) -> Callable[[], float]:
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


def _disk_write(s: _Scratch, nbytes: int) -> Callable[[], float]:
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


def _device_copy(nbytes: int, device: torch.device, pinned: bool, to_device: bool) -> Callable[[], float]:
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


# --- the run ------------------------------------------------------------------------------------


def calibrate(config: CalibrateConfig, progress: Progress | None = None) -> CalibrationRun:
    """Measure every path this host has and fit each. Skipped paths are named with the reason."""
    progress = progress or NoProgress()
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    run = CalibrationRun(h.HostCalibration(platform.node() or "unknown", str(device), config.threads))
    n = config.threads
    plans: list[tuple[str, Callable[[_Scratch, int], Callable[[], float]]]] = [
        (h.MEMCPY_1T, _memcpy_1t),
        (h.MEMCPY_NT, _memcpy_nt),
        (h.MEMCPY_ONE, _memcpy_one),
        (h.CHECKSUM, _checksum),
        (h.CHECKSUM_NT, _threaded_checksum),
        (h.DISK_WRITE, _disk_write),
        (h.DISK_READ_WARM, lambda s, b: _disk_read(s, b, cold=False, threaded=False)),
        (h.DISK_READ_WARM_NT, lambda s, b: _disk_read(s, b, cold=False, threaded=True)),
    ]
    plans.append((h.DISK_BLOCKS_WARM, lambda s, b: _disk_blocks(s, b, False, _blocks_of(config.object_bytes, b))))
    if config.cold:
        plans.append((h.DISK_BLOCKS_COLD, lambda s, b: _disk_blocks(s, b, True, _blocks_of(config.object_bytes, b))))
        plans += [
            (h.DISK_READ_COLD, lambda s, b: _disk_read(s, b, cold=True, threaded=False)),
            (h.DISK_READ_COLD_NT, lambda s, b: _disk_read(s, b, cold=True, threaded=True)),
        ]
    else:
        for path in (h.DISK_READ_COLD, h.DISK_READ_COLD_NT, h.DISK_BLOCKS_COLD):
            run.skipped[path] = "cold reads not asked for"
    if cuda:
        plans += [
            (h.H2D_PINNED, lambda s, b: _device_copy(b, device, True, True)),
            (h.H2D_PAGEABLE, lambda s, b: _device_copy(b, device, False, True)),
            (h.D2H_PINNED, lambda s, b: _device_copy(b, device, True, False)),
        ]
    else:
        for path in (h.H2D_PINNED, h.H2D_PAGEABLE, h.D2H_PINNED):
            run.skipped[path] = "no CUDA device"
    pool_steps = len(config.sizes) * (1 + config.repeats) * 2 if config.pool is not None else 0
    if config.pool is None:
        run.skipped[h.POOL_GET] = run.skipped[h.POOL_PUT] = "no pool configured (--pool FILE or $KVSTRATA_POOL)"
    progress.start(len(plans) * len(config.sizes) * (1 + config.repeats) + pool_steps)

    with tempfile.TemporaryDirectory(prefix="kvstrata-calibrate-", dir=config.directory) as scratch_dir:
        scratch = _Scratch(Path(scratch_dir), n)
        try:
            for path, make in plans:
                for size in config.sizes:
                    step = make(scratch, size)
                    runs = []
                    for i in range(1 + config.repeats):
                        progress.step(f"{path}, {size / MIB:g} MiB")
                        seconds = step()
                        if i:  # the first run warms up
                            runs.append(seconds)
                    run.measurements.append(Measurement(path, size, tuple(runs)))
                for f in Path(scratch_dir).glob("read-*"):
                    f.unlink()  # the next path writes its own (the sizes may split otherwise)
        finally:
            scratch.close()
    if config.pool is not None:
        try:
            run.measurements += _measure_pool(config, progress)
        except Exception as exc:  # noqa: BLE001 - a pool that fails is reported, not fatal
            run.skipped[h.POOL_GET] = run.skipped[h.POOL_PUT] = f"pool failed: {exc}"
    with tempfile.TemporaryDirectory(prefix="kvstrata-calibrate-", dir=config.directory) as scratch_dir:
        pool = config.pool if h.POOL_GET not in run.skipped else None  # a pool that failed above is skipped
        run.measurements += restore_fixed(device, n, config.repeats, Path(scratch_dir), pool)
    run.calibration = _fit(run.calibration, run.measurements)
    run.seconds = time.perf_counter() - started
    return run


def restore_fixed(device: torch.device, workers: int, repeats: int, directory: Path,
                  pool: PoolConfig | None = None) -> list[Measurement]:
    """Each tier's fixed cost of one restore (``RESTORE_FIXED``): loads of two tiny blocks
    (``TINY_LAYOUT``: 32 layers, whose bytes take no measurable time) from the host, the disk
    (page cache) and, with ``pool``, the remote tier, through the cache, split into layer ranges
    as a large load is; median of ``max(9, repeats)`` after a warm-up per tier."""
    from kvstrata.calibrate.restores import TINY_BLOCKS, TINY_LAYOUT, CacheRestores

    out: list[Measurement] = []
    benches = [((Medium.HOST, Medium.DISK), None)] + ([((Medium.REMOTE,), pool)] if pool is not None else [])
    for tiers, where in benches:
        with CacheRestores(TINY_LAYOUT, TINY_BLOCKS, workers, directory, pool=where, small_load_bytes=0,
                           device=str(device)) as bench:
            for tier in tiers:
                runs = [bench.restore(tier) for _ in range(1 + max(9, repeats))][1:]
                out.append(Measurement(h.RESTORE_FIXED[tier], bench.size, tuple(runs)))
    return out


class Prober:
    """The timed steps of the paths ``validate`` interleaves with restores, one per (path,
    size), each measured as ``calibrate`` measures it; disk block reads and pool gets in
    blocks of ``layout`` (the cache's).

    Args:
        directory: scratch files here (the disk the cache's disk tier uses).
        threads: the N of the N-thread paths.
        device: the device tier's torch device (host -> device paths on CUDA).
        layout: the cache's block layout.
        pool: the remote pool (``POOL_GET``), or None.
    """

    def __init__(self, directory: Path, threads: int, device: torch.device, layout: KVLayout,
                 pool: PoolConfig | None = None) -> None:
        self._scratch = _Scratch(directory, threads)
        self._device, self._layout, self._pool = device, layout, pool
        self._steps: dict[tuple[str, int], Callable[[], float]] = {}
        self._raws: list = []

    def step(self, path: h.CalPath, nbytes: int) -> Callable[[], float]:
        """One timed run of ``path`` over ``nbytes`` (made once, then reused)."""
        key = (path, nbytes)
        if key not in self._steps:
            self._steps[key] = self._make(path, nbytes)
        return self._steps[key]

    def _make(self, path: h.CalPath, nbytes: int) -> Callable[[], float]:
        s = self._scratch
        if path == h.MEMCPY_1T:
            return _memcpy_1t(s, nbytes)
        if path == h.MEMCPY_NT:
            return _memcpy_nt(s, nbytes)
        if path == h.MEMCPY_ONE:
            return _memcpy_one(s, nbytes)
        if path == h.CHECKSUM:
            return _checksum(s, nbytes)
        if path in (h.DISK_BLOCKS_WARM, h.DISK_BLOCKS_COLD):
            return _disk_blocks(s, nbytes, path == h.DISK_BLOCKS_COLD, self._layout)
        if path == h.H2D_PINNED:
            return _device_copy(nbytes, self._device, True, True)
        if path == h.POOL_GET and self._pool is not None:
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


def _threaded_checksum(s: _Scratch, nbytes: int) -> Callable[[], float]:
    """``_checksum`` on N threads at once, each over its share."""
    data = s.pair(nbytes)[0].numpy()
    parts = s.split(nbytes)

    def hash_part(part: tuple[int, int]) -> None:
        o, n = part
        for c in range(o, o + n, READ_CHUNK_BYTES):
            xxhash.xxh3_64_intdigest(data[c : min(c + READ_CHUNK_BYTES, o + n)])

    return lambda: elapsed_s(lambda: list(s.pool.map(hash_part, parts)))


def _measure_pool(config: CalibrateConfig, progress: Progress) -> list[Measurement]:
    """Pool get and put of ``size`` bytes in objects of ``object_bytes``, one batched call each."""
    from kvstrata.pool.raw import RawPool
    from kvstrata.pool.config import RemoteMode
    from kvstrata.tiers.poolvalue import HEADER_BYTES

    out: list[Measurement] = []
    for size in config.sizes:
        per = min(size, config.object_bytes)
        count = max(1, size // per)
        values = torch.randint(0, 256, (count, HEADER_BYTES + per), dtype=torch.uint8)
        names = [f"kvstrata-calibrate/{os.getpid()}/{size}/{i}" for i in range(count)]
        raw = RawPool(config.pool, RemoteMode.TCP, names, values)
        try:
            puts, gets = [], []
            for i in range(1 + config.repeats):
                progress.step(f"{h.POOL_PUT}, {size / MIB:g} MiB")
                put = raw.put_s()
                progress.step(f"{h.POOL_GET}, {size / MIB:g} MiB")
                get = raw.get_s()
                if i:
                    puts.append(put)
                    gets.append(get)
        finally:
            raw.close()
        out += [Measurement(h.POOL_PUT, count * per, tuple(puts)), Measurement(h.POOL_GET, count * per, tuple(gets))]
    return out


def fit_paths(measurements: list[Measurement]) -> dict[h.CalPath, h.PathFit]:
    """One fit per path, on relative error (every size predicted as well as the others); the
    paths a restore's bytes move along as a rate alone (``RATE_PATHS``)."""
    by_path: dict[h.CalPath, list[Measurement]] = {}
    for m in measurements:
        by_path.setdefault(m.path, []).append(m)
    return {path: h.fit_path([m.size_bytes for m in ms], [m.median_s for m in ms], max(m.spread for m in ms),
                             fixed=path in h.FIXED_COST_PATHS, relative=True, origin=path in h.RATE_PATHS)
            for path, ms in by_path.items()}


def _fit(base: h.HostCalibration, measurements: list[Measurement]) -> h.HostCalibration:
    paths = fit_paths(measurements)
    efficiency = {}
    if h.H2D_PINNED in paths and torch.cuda.is_available():
        efficiency = _pcie_efficiency(paths[h.H2D_PINNED].gbps)
    return h.HostCalibration(base.host, base.device, base.threads, paths, base.prefill, efficiency)


def _pcie_efficiency(h2d_gbps: float) -> dict[str, float]:
    """``pcie``: the measured pinned H2D rate over the spec rate of this GPU model's host link
    (a profile's efficiency multiplies the spec figure), capped at 1; {} for a GPU the catalog
    does not know."""
    from kvstrata.hardware.catalog import gpu_model

    name = torch.cuda.get_device_name()
    family = next((m for m in ("H100", "H200", "B200") if m in name), None)
    if family is None:
        return {}
    try:
        spec = gpu_model(f"{family}-PCIE" if "PCIe" in name else f"{family}-SXM")
    except ValueError:
        return {}
    return {"pcie": min(1.0, h2d_gbps / spec.host_link.one_way().spec_gbps)}
