"""``kvstrata bench restart``: how soon a cache whose disk tier holds many blocks serves a hit
after a restart (opening ``TieredCache`` on the directory).

Set-up, untimed: a directory of ``blocks`` block files of a small layout (a 512-byte payload
at 16 tokens a block: each file is one 4 KiB header page plus the payload, so 100K blocks
take ~0.5 GB), written through a ``DiskTier`` under the cache's namespace for the keys of one
long prompt; then, once the last write is ``diskmanifest.SETTLE_NS`` old (30 s), a cache opened on
it and closed once, as a cache that ran a while would leave it.

Each round, timed: open ``TieredCache`` on the directory (its disk tier recovers the blocks),
look up the prompt's first block and load it (disk -> device), check its bytes; the time to
first hit runs from before the open to the loaded block. ``cold``: the block files' (and any
other file's in the directory) pages are evicted from the page cache before each round
(``POSIX_FADV_DONTNEED``; the kernel's inode and directory caches stay warm, which needs root
to drop). The cache is closed after each round, untimed (its close is timed apart).

The restarts use only the cache's public API, so the same code times any checkout.
The goal (:data:`kvstrata.bench.goals.RESTART_FIRST_HIT_S`) judges the slowest round's first hit.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvstrata.bench.goals import RESTART_FIRST_HIT_S, Goal, LookupFigure
from kvstrata.cache.config import CacheConfig
from kvstrata.cache.tiered import TieredCache
from kvstrata.index.keys import block_keys
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.media import Medium
from kvstrata.progress import NoProgress, Progress
from kvstrata.tiers import diskmanifest
from kvstrata.tiers.disk import DiskTier

HEADER_BYTES = 4096  # one page per block file (kvstrata.tiers.blockfile), for the space check
GOAL_BLOCKS = 100_000


@dataclass(frozen=True)
class RestartBenchConfig:
    """What ``kvstrata bench restart`` measures.

    Attributes:
        blocks: blocks on disk.
        block_tokens: tokens per block (a block holds one layer of one 8-wide head: 64 B a token).
        repeats: timed restarts.
        cold: evict the files' pages from the page cache before each restart.
        directory: where the tier's directory goes (a temporary directory inside it, removed
            after); None: the system's temporary directory.
    """

    blocks: int = 100_000
    block_tokens: int = 16
    repeats: int = 3
    cold: bool = True
    directory: str | None = None

    def __post_init__(self) -> None:
        for name in ("blocks", "block_tokens", "repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"bench restart: {name} must be a positive integer, got {value!r}")

    @property
    def layout(self) -> KVLayout:
        return KVLayout(1, self.block_tokens, 1, 8, DType.BF16)

    def file_bytes(self) -> int:
        return self.blocks * (HEADER_BYTES + self.layout.block_bytes)


@dataclass(frozen=True)
class RestartTimes:
    """Seconds per timed restart (one value a round), the median of each, and the set-up's."""

    blocks: int
    file_bytes: int
    cold: bool
    build_s: float
    open_s: tuple[float, ...]
    first_hit_s: tuple[float, ...]
    close_s: tuple[float, ...]
    recovered_blocks: int
    open_median_s: float
    first_hit_median_s: float
    close_median_s: float


def cache_config(config: RestartBenchConfig, disk_dir: Path) -> CacheConfig:
    layout = config.layout
    return CacheConfig(layout, "bench/restart", device_bytes=64 * layout.block_bytes, host_bytes=0,
                       disk_bytes=config.blocks * layout.block_bytes, disk_dir=disk_dir, device="cpu")


def prompt(config: RestartBenchConfig) -> np.ndarray:
    """The prompt whose blocks fill the disk (uint32 ids, ``blocks`` full blocks)."""
    return np.random.default_rng(0).integers(0, 128_256, size=config.blocks * config.block_tokens, dtype=np.uint32)


def payload(config: RestartBenchConfig) -> torch.Tensor:
    """Every block's bytes, uint8 ``[layers, layer_bytes]``."""
    layout = config.layout
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (layout.num_layers, layout.layer_bytes), dtype=torch.uint8, generator=gen)


def build(config: RestartBenchConfig, disk_dir: Path, progress: Progress) -> float:
    """Write the blocks (as the cache names them), open a cache on them once and close it;
    returns the seconds it took."""
    start = time.perf_counter()
    cache_cfg = cache_config(config, disk_dir)
    namespace = cache_cfg.namespace()
    keys = block_keys(prompt(config), namespace)
    data = payload(config)
    tier = DiskTier(config.layout, cache_cfg.disk_bytes, disk_dir, namespace_tag=namespace.tag)
    try:
        tenth = max(1, len(keys) // 10)
        for i, key in enumerate(keys):
            tier.write(i, key, data)
            if (i + 1) % tenth == 0:
                progress.step(f"writing blocks: {i + 1} of {len(keys)}")
    finally:
        tier.close()
    time.sleep(diskmanifest.SETTLE_NS / 1e9)  # no block "just written" at the close: a cache that ran a while
    TieredCache(cache_cfg).close()  # what a cache that ran leaves behind
    return time.perf_counter() - start


def evict_pages(directory: Path) -> None:
    """Evict every file under ``directory`` from the page cache (one sync, then fadvise each)."""
    os.sync()
    for root, _, names in os.walk(directory):
        for name in names:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def restart_once(config: RestartBenchConfig, disk_dir: Path) -> tuple[float, float, float, int]:
    """One timed restart: (open s, first hit s, close s, blocks the disk tier holds)."""
    cache_cfg = cache_config(config, disk_dir)
    first = prompt(config)[: config.block_tokens]
    expected = payload(config)
    start = time.perf_counter()
    cache = TieredCache(cache_cfg)
    try:
        opened = time.perf_counter()
        match = cache.lookup(first)
        if match.blocks != 1 or match.media != (Medium.DISK,):
            raise RuntimeError(f"bench restart: the first block was not found on disk after the restart ({match})")
        with cache.load(match) as handle:
            handle.wait()
            if not torch.equal(handle.block(0).contiguous().view(torch.uint8).reshape(expected.shape).cpu(), expected):
                raise RuntimeError("bench restart: the first hit's bytes are not the block written")
        hit = time.perf_counter()
        recovered = len(cache.manager.ready_keys(Medium.DISK))
    finally:
        closing = time.perf_counter()
        cache.close()
        closed = time.perf_counter()
    return opened - start, hit - start, closed - closing, recovered


def time_restarts(config: RestartBenchConfig, progress: Progress | None = None) -> RestartTimes:
    """Build the directory, time ``repeats`` restarts, remove it.

    Raises:
        OSError: the file system has not room for the blocks (with a margin of a quarter).
    """
    progress = progress or NoProgress()
    progress.start(10 + config.repeats + 1)
    scratch = Path(tempfile.mkdtemp(prefix="kvstrata-restart-", dir=config.directory))
    try:
        free = shutil.disk_usage(scratch).free
        need = config.file_bytes()
        if free < need * 1.25:
            raise OSError(f"bench restart: {need / 1e9:.2f} GB of block files need room; {free / 1e9:.2f} GB free "
                          f"in {scratch.parent}")
        build_s = build(config, scratch / "disk", progress)
        progress.step("built")
        rows = []
        for r in range(config.repeats):
            if config.cold:
                evict_pages(scratch)
            rows.append(restart_once(config, scratch / "disk"))
            progress.step(f"restart {r + 1} of {config.repeats}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    opens, hits, closes, recovered = zip(*rows)
    return RestartTimes(config.blocks, config.file_bytes(), config.cold, build_s, opens, hits, closes,
                        min(recovered), statistics.median(opens), statistics.median(hits), statistics.median(closes))


@dataclass(frozen=True)
class RestartBenchReport:
    config: RestartBenchConfig
    times: RestartTimes
    goals: tuple[Goal, ...]


def run_restart_bench(config: RestartBenchConfig, progress: Progress | None = None) -> RestartBenchReport:
    """Run the benchmark; returns the report, the goal judged (only at 100K blocks: what it names)."""
    times = time_restarts(config, progress)
    goals = () if config.blocks != GOAL_BLOCKS else (
        Goal(LookupFigure.RESTART, f"<={RESTART_FIRST_HIT_S:g} s", max(times.first_hit_s), RESTART_FIRST_HIT_S,
             at_most=True),)
    return RestartBenchReport(config, times, goals)
