"""Measure this host's transfer paths, the way kvstrata moves bytes on them, and fit each one.

Every path is timed at several sizes by its step (:mod:`kvstrata.calibrate.probes`): one
warm-up, then ``repeats`` timed runs per size; a size's figure is the median of its runs, its
spread the relative half-range. The medians are fitted with :func:`kvstrata.plan.host.fit_path`
(``seconds = latency_s + bytes / bandwidth``). Beside the probes' paths:

* pool get/put: one batched Mooncake call for all objects (``kvstrata.pool.raw.RawPool``),
  objects of ``object_bytes`` each.
* each tier's fixed cost of a restore (``restore_fixed``): restores of two tiny blocks through
  a ``TieredCache``, from the host, the disk and the pool.

The paths a restore's bytes move along are fitted as rates through the origin (``RATE_PATHS``),
every path on relative error.

Timing is noisy on shared machines: the medians absorb stray runs, the spread reports them.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvstrata.calibrate.probes import (
    HEADER_PAGE,
    MIB,
    Scratch,
    blocks_of,
    checksum,
    device_copy,
    disk_blocks,
    disk_read,
    disk_write,
    memcpy_1t,
    memcpy_nt,
    memcpy_one,
    threaded_checksum,
)
from kvstrata.media import Medium
from kvstrata.plan import host as h
from kvstrata.plan.calpaths import CalPath
from kvstrata.pool.config import PoolConfig
from kvstrata.progress import NoProgress, Progress

DEFAULT_SIZES = (4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB)
QUICK_SIZES = (4 * MIB, 16 * MIB, 64 * MIB)


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

    path: CalPath
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
    skipped: dict[CalPath, str] = field(default_factory=dict)  # path -> why
    seconds: float = 0.0


def calibrate(config: CalibrateConfig, progress: Progress | None = None) -> CalibrationRun:
    """Measure every path this host has and fit each. Skipped paths are named with the reason."""
    progress = progress or NoProgress()
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    run = CalibrationRun(h.HostCalibration(platform.node() or "unknown", str(device), config.threads))
    n = config.threads
    plans: list[tuple[str, Callable[[Scratch, int], Callable[[], float]]]] = [
        (CalPath.MEMCPY_1T, memcpy_1t),
        (CalPath.MEMCPY_NT, memcpy_nt),
        (CalPath.MEMCPY_ONE, memcpy_one),
        (CalPath.CHECKSUM, checksum),
        (CalPath.CHECKSUM_NT, threaded_checksum),
        (CalPath.DISK_WRITE, disk_write),
        (CalPath.DISK_READ_WARM, lambda s, b: disk_read(s, b, cold=False, threaded=False)),
        (CalPath.DISK_READ_WARM_NT, lambda s, b: disk_read(s, b, cold=False, threaded=True)),
    ]
    plans.append((CalPath.DISK_BLOCKS_WARM,
                  lambda s, b: disk_blocks(s, b, False, blocks_of(config.object_bytes, b))))
    if config.cold:
        plans.append((CalPath.DISK_BLOCKS_COLD,
                      lambda s, b: disk_blocks(s, b, True, blocks_of(config.object_bytes, b))))
        plans += [
            (CalPath.DISK_READ_COLD, lambda s, b: disk_read(s, b, cold=True, threaded=False)),
            (CalPath.DISK_READ_COLD_NT, lambda s, b: disk_read(s, b, cold=True, threaded=True)),
        ]
    else:
        for path in (CalPath.DISK_READ_COLD, CalPath.DISK_READ_COLD_NT, CalPath.DISK_BLOCKS_COLD):
            run.skipped[path] = "cold reads not asked for"
    if cuda:
        plans += [
            (CalPath.H2D_PINNED, lambda s, b: device_copy(b, device, True, True)),
            (CalPath.H2D_PAGEABLE, lambda s, b: device_copy(b, device, False, True)),
            (CalPath.D2H_PINNED, lambda s, b: device_copy(b, device, True, False)),
        ]
    else:
        for path in (CalPath.H2D_PINNED, CalPath.H2D_PAGEABLE, CalPath.D2H_PINNED):
            run.skipped[path] = "no CUDA device"
    pool_steps = len(config.sizes) * (1 + config.repeats) * 2 if config.pool is not None else 0
    if config.pool is None:
        no_pool = "no pool configured (--pool FILE or $KVSTRATA_POOL)"
        run.skipped[CalPath.POOL_GET] = run.skipped[CalPath.POOL_PUT] = no_pool
    progress.start(len(plans) * len(config.sizes) * (1 + config.repeats) + pool_steps)

    with tempfile.TemporaryDirectory(prefix="kvstrata-calibrate-", dir=config.directory) as scratch_dir:
        scratch = Scratch(Path(scratch_dir), n)
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
            run.skipped[CalPath.POOL_GET] = run.skipped[CalPath.POOL_PUT] = f"pool failed: {exc}"
    with tempfile.TemporaryDirectory(prefix="kvstrata-calibrate-", dir=config.directory) as scratch_dir:
        pool = config.pool if CalPath.POOL_GET not in run.skipped else None  # a pool that failed above is skipped
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
                progress.step(f"{CalPath.POOL_PUT}, {size / MIB:g} MiB")
                put = raw.put_s()
                progress.step(f"{CalPath.POOL_GET}, {size / MIB:g} MiB")
                get = raw.get_s()
                if i:
                    puts.append(put)
                    gets.append(get)
        finally:
            raw.close()
        out += [Measurement(CalPath.POOL_PUT, count * per, tuple(puts)),
                Measurement(CalPath.POOL_GET, count * per, tuple(gets))]
    return out


def fit_paths(measurements: list[Measurement]) -> dict[CalPath, h.PathFit]:
    """One fit per path, on relative error (every size predicted as well as the others); the
    paths a restore's bytes move along as a rate alone (``RATE_PATHS``)."""
    by_path: dict[CalPath, list[Measurement]] = {}
    for m in measurements:
        by_path.setdefault(m.path, []).append(m)
    return {path: h.fit_path([m.size_bytes for m in ms], [m.median_s for m in ms], max(m.spread for m in ms),
                             fixed=path in h.FIXED_COST_PATHS, relative=True, origin=path in h.RATE_PATHS)
            for path, ms in by_path.items()}


def _fit(base: h.HostCalibration, measurements: list[Measurement]) -> h.HostCalibration:
    paths = fit_paths(measurements)
    efficiency = {}
    if CalPath.H2D_PINNED in paths and torch.cuda.is_available():
        efficiency = _pcie_efficiency(paths[CalPath.H2D_PINNED].gbps)
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
