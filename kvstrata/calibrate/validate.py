"""Check a calibration against real restores through the tiered cache.

For each size, KV of a real model's layout is stored in a ``TieredCache`` and restored to the
device tier from one tier at a time: the host, the disk with the files in the page cache
("warm"), the disk with them dropped from it between loads ("cold"), and the remote pool when
one is configured. The measured time is ``LoadResult.seconds`` (the cache's own clock, from
planning the load to the last byte landing), the median of ``repeats`` loads after one
warm-up; the prediction is ``HostCalibration.restore_s`` for the same bytes, blocks and
workers. Every restore is checked byte for byte against the KV stored (untimed).
"""

from __future__ import annotations

import statistics
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvstrata.progress import NoProgress, Progress
from kvstrata.timing import VerificationError, drop_page_cache
from kvstrata.cache import CacheConfig, TieredCache
from kvstrata.kv.layout import KVLayout
from kvstrata.kv.presets import load_geometry
from kvstrata.media import Medium
from kvstrata.plan.host import HostCalibration
from kvstrata.policies.write import WritePolicy, WriteRule
from kvstrata.pool.config import PoolConfig
from kvstrata.tensors import torch_dtype
from kvstrata.tiers.disk import SUFFIX, DiskTier

MIB = 1 << 20
DEFAULT_SIZES = (16 * MIB, 64 * MIB, 256 * MIB)
QUICK_SIZES = (16 * MIB, 64 * MIB)
GOAL = 0.10  # |predicted - measured| / measured
GOAL_MIN_BYTES = 64 * MIB  # the goal holds for restores of this size and larger


@dataclass(frozen=True)
class ValidateConfig:
    """What to restore.

    Attributes:
        sizes: KV bytes per restore (rounded down to whole blocks, at least one).
        repeats: timed loads per row after one warm-up (>= 1).
        workers: the cache's transfer threads.
        model: the model whose KV layout the blocks have.
        block_tokens: tokens per block.
        directory: where the disk tier's files go (None: the temp directory).
        pool: the remote pool, or None (no remote rows).
        cold: include cold disk rows.
    """

    sizes: tuple[int, ...] = DEFAULT_SIZES
    repeats: int = 5
    workers: int = 2
    model: str = "llama-3-8b"
    block_tokens: int = 64
    directory: str | None = None
    pool: PoolConfig | None = None
    cold: bool = True

    def __post_init__(self) -> None:
        if not self.sizes or any(s <= 0 for s in self.sizes):
            raise ValueError(f"validate sizes must be given and positive, got {self.sizes}")
        if self.repeats < 1:
            raise ValueError(f"validate repeats must be >= 1, got {self.repeats}")
        if self.workers < 1 or self.block_tokens < 1:
            raise ValueError("validate workers and block_tokens must be >= 1")


@dataclass(frozen=True)
class Row:
    """One restore path at one size: predicted against measured."""

    path: str
    bytes: int
    blocks: int
    predicted_s: float
    measured_s: float
    runs_s: tuple[float, ...]

    @property
    def error(self) -> float:
        """(predicted - measured) / measured: positive when the prediction is too slow."""
        return (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def in_goal_range(self) -> bool:
        return self.bytes >= GOAL_MIN_BYTES

    @property
    def meets_goal(self) -> bool | None:
        """Within ``GOAL``; None below ``GOAL_MIN_BYTES`` (no goal there)."""
        return abs(self.error) <= GOAL if self.in_goal_range else None

    @property
    def spread(self) -> float:
        return (max(self.runs_s) - min(self.runs_s)) / 2 / self.measured_s

    def to_json(self) -> dict:
        return {**asdict(self), "runs_s": list(self.runs_s), "error": self.error, "spread": self.spread,
                "meets_goal": self.meets_goal}


def layout_for(config: ValidateConfig) -> KVLayout:
    return KVLayout.from_geometry(load_geometry(config.model), config.block_tokens)


def validate(calibration: HostCalibration, config: ValidateConfig, progress: Progress | None = None) -> list[Row]:
    """Restore from every tier at every size; one Row per (tier, size)."""
    progress = progress or NoProgress()
    layout = layout_for(config)
    per_size = 2 + (1 if config.cold else 0) + (1 if config.pool is not None else 0)
    progress.start(len(config.sizes) * per_size * (1 + config.repeats))
    rows: list[Row] = []
    for size in config.sizes:
        blocks = max(1, size // layout.block_bytes)
        with tempfile.TemporaryDirectory(prefix="kvstrata-validate-", dir=config.directory) as scratch:
            bench = _Restores(layout, blocks, config, Path(scratch))
            try:
                rows += bench.local_rows(calibration, progress)
            finally:
                bench.close()
            if config.pool is not None:
                remote = _Restores(layout, blocks, config, Path(scratch), pool=config.pool)
                try:
                    rows.append(remote.remote_row(calibration, progress))
                finally:
                    remote.close()
    return rows


class _Restores:
    """A cache that holds ``blocks`` blocks in every tier, and the KV they came from.

    Write-back: ``store`` fills the device tier only; evicting a tier demotes its blocks to the
    next tier down, so each row finds the blocks in exactly the tier it restores from.
    """

    def __init__(self, layout: KVLayout, blocks: int, config: ValidateConfig, directory: Path,
                 pool: PoolConfig | None = None) -> None:
        self.layout, self.blocks, self.config = layout, blocks, config
        size = blocks * layout.block_bytes
        self.tokens = list(range(blocks * layout.block_tokens))
        shape = (layout.num_layers, layout.kv_tensors, len(self.tokens), layout.kv_heads, layout.head_dim)
        itemsize = torch.empty((), dtype=torch_dtype(layout.dtype)).element_size()
        kv_bytes = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8)
        self.kv_bytes = kv_bytes  # [layers, kv, tokens, kv_heads, head_dim * itemsize]
        local = pool is None
        self.cache = TieredCache(CacheConfig(
            layout=layout,
            # Fresh random bytes each run: a fresh namespace too, since a shared pool keeps (and
            # never overwrites) an earlier run's objects under the same keys.
            model_id=f"kvstrata-validate-{uuid.uuid4().hex[:12]}",
            device_bytes=size,
            host_bytes=size if local else 0,
            disk_bytes=size if local else 0,
            disk_dir=Path(directory) if local else None,
            write=WriteRule(WritePolicy.WRITE_BACK),
            workers=config.workers,
            pool=pool,
            remote_bytes=size if not local else 0,
        ))
        if pool is not None and self.cache.remote_error is not None:  # unreachable: its tier is there, down
            raise RuntimeError(f"validate: the pool could not be reached ({self.cache.remote_error})")
        result = self.cache.store(self.tokens, kv_bytes.view(torch_dtype(layout.dtype))).result()
        if result.new_blocks != blocks:
            raise RuntimeError(f"validate: stored {result.new_blocks} of {blocks} blocks")

    @property
    def size(self) -> int:
        return self.blocks * self.layout.block_bytes

    def local_rows(self, calibration: HostCalibration, progress: Progress) -> list[Row]:
        cfg = self.config
        self._move_down(Medium.DEVICE)
        rows = [self._row("host -> device", Medium.HOST, calibration.restore_s("host", self.size, self.blocks, cfg.workers), progress)]
        self._move_down(Medium.HOST)
        rows.append(self._row("disk (page cache) -> device", Medium.DISK,
                              calibration.restore_s("disk", self.size, self.blocks, cfg.workers, cold=False), progress))
        if cfg.cold:
            rows.append(self._row("disk (cold) -> device", Medium.DISK,
                                  calibration.restore_s("disk", self.size, self.blocks, cfg.workers, cold=True),
                                  progress, before=self._drop_disk))
        return rows

    def remote_row(self, calibration: HostCalibration, progress: Progress) -> Row:
        self._move_down(Medium.DEVICE)
        predicted = calibration.restore_s("remote", self.size, self.blocks, self.config.workers)
        return self._row("remote -> device", Medium.REMOTE, predicted, progress)

    def close(self) -> None:
        self.cache.close()

    # --- helpers -------------------------------------------------------------------------------

    def _row(self, name: str, source: Medium, predicted: float, progress: Progress,
             before: Callable[[], None] | None = None) -> Row:
        runs = []
        for i in range(1 + self.config.repeats):
            progress.step(f"{name}, {self.size / MIB:g} MiB")
            if before is not None:
                before()
            seconds = self._restore(source)
            if i:
                runs.append(seconds)
        return Row(name, self.size, self.blocks, predicted, statistics.median(runs), tuple(runs))

    def _restore(self, source: Medium) -> float:
        """One load of every block from ``source`` alone; returns ``LoadResult.seconds``."""
        match = self.cache.lookup(self.tokens)
        if match.blocks != self.blocks or set(match.media) != {source}:
            raise RuntimeError(f"validate: expected {self.blocks} blocks on {source.label} only, found {set(match.media)}")
        handle = self.cache.load(match)
        try:
            result = handle.wait()
            if result.blocks != self.blocks:
                raise VerificationError(f"load restored {result.blocks} of {self.blocks} blocks ({result.stopped})")
            bs = self.layout.block_tokens
            for i in range(self.blocks):
                if not torch.equal(handle.block(i).view(torch.uint8), self.kv_bytes[:, :, i * bs : (i + 1) * bs]):
                    raise VerificationError(f"restored block {i} differs from the block stored")
        finally:
            handle.release()
        # Back to the source alone: the copies above it go (evicting demotes to tiers that
        # already hold the blocks, so nothing is written).
        for medium in self.cache.media:
            if medium.value < source.value:
                self.cache.evict(medium, self.blocks)
        return result.seconds

    def _move_down(self, medium: Medium) -> None:
        if self.cache.evict(medium, self.blocks) != self.blocks:
            raise RuntimeError(f"validate: could not evict every block from the {medium.label} tier")

    def _drop_disk(self) -> None:
        disk = self.cache.tier(Medium.DISK)
        assert isinstance(disk, DiskTier)
        drop_page_cache(sorted(disk.directory.glob(f"*{SUFFIX}")))
