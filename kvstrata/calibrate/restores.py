"""Restores through a real ``TieredCache``: what ``validate`` measures, and what the tiers'
fixed costs (``HostCalibration``'s ``RESTORE_FIXED``) are measured with.

A :class:`CacheRestores` holds ``blocks`` blocks of random KV in every tier it has (write-back:
``store`` fills the device tier; evicting a tier demotes its blocks to the next one down), so
each restore finds the blocks in exactly the tier it restores from. A restore's time is
``LoadResult.seconds``, the cache's own clock from planning the load to the last byte landing;
every restore is then checked byte for byte against the KV stored (untimed).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import torch

from kvstrata.cache import CacheConfig, TieredCache
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.media import Medium
from kvstrata.policies.write import WritePolicy, WriteRule
from kvstrata.pool.config import PoolConfig
from kvstrata.tensors import torch_dtype
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.diskdir import SUFFIX
from kvstrata.timing import VerificationError, drop_page_cache

# Blocks whose bytes take no measurable time, in as many layers as a real model's (32), so a
# restore of them makes the same copy tasks, layer events and per-layer checksums: 1 KiB blocks.
TINY_LAYOUT = KVLayout(32, 2, 1, 8, DType.BF16)
TINY_BLOCKS = 2


class CacheRestores:
    """A cache holding ``blocks`` blocks in each of its tiers; ``restore`` times one load.

    Args:
        layout: the blocks' layout.
        blocks: blocks per restore.
        workers: the cache's transfer threads.
        directory: the disk tier's directory (local tiers); ignored with ``pool``.
        pool: a remote pool: the cache then has a device and a remote tier only.
        small_load_bytes: the cache's one-dispatch threshold; 0 splits even tiny loads into
            layer ranges as a large load is split (how the fixed cost is measured).
    """

    def __init__(self, layout: KVLayout, blocks: int, workers: int, directory: Path,
                 pool: PoolConfig | None = None, small_load_bytes: int | None = None,
                 device: str | None = None) -> None:
        self.layout, self.blocks = layout, blocks
        size = blocks * layout.block_bytes
        self.tokens = list(range(blocks * layout.block_tokens))
        shape = (layout.num_layers, layout.kv_tensors, len(self.tokens), layout.kv_heads, layout.head_dim)
        itemsize = torch.empty((), dtype=torch_dtype(layout.dtype)).element_size()
        self.kv_bytes = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8)
        local = pool is None
        extra = {} if small_load_bytes is None else {"small_load_bytes": small_load_bytes}
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
            workers=workers,
            pool=pool,
            remote_bytes=size if not local else 0,
            device=device,
            **extra,
        ))
        if pool is not None and self.cache.remote_error is not None:  # unreachable: its tier is there, down
            self.cache.close()
            raise RuntimeError(f"validate: the pool could not be reached ({self.cache.remote_error})")
        result = self.cache.store(self.tokens, self.kv_bytes.view(torch_dtype(layout.dtype))).result()
        if result.new_blocks != blocks:
            self.cache.close()
            raise RuntimeError(f"validate: stored {result.new_blocks} of {blocks} blocks")
        self._at = Medium.DEVICE

    @property
    def size(self) -> int:
        return self.blocks * self.layout.block_bytes

    def restore(self, tier: Medium, cold: bool = False) -> float:
        """One load of every block from ``tier`` (host, disk or remote) alone, the disk's
        files dropped from the page cache first when ``cold``; returns ``LoadResult.seconds``."""
        source = tier
        self._sink_to(source)
        if cold:
            self.drop_disk()
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
                if not torch.equal(handle.block(i).view(torch.uint8).cpu(), self.kv_bytes[:, :, i * bs : (i + 1) * bs]):
                    raise VerificationError(f"restored block {i} differs from the block stored")
        finally:
            handle.release()
        # Back to the source alone: the copies above it go (evicting demotes to tiers that
        # already hold the blocks, so nothing is written).
        for medium in self.cache.media:
            if medium.value < source.value:
                self.cache.evict(medium, self.blocks)
        return result.seconds

    def drop_disk(self) -> None:
        disk = self.cache.tier(Medium.DISK)
        assert isinstance(disk, DiskTier)
        drop_page_cache(sorted(disk.directory.glob(f"*{SUFFIX}")))

    def close(self) -> None:
        self.cache.close()

    def __enter__(self) -> CacheRestores:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _sink_to(self, source: Medium) -> None:
        """Demote the blocks tier by tier until they are in ``source`` alone (once: a restore
        leaves them there)."""
        for medium in self.cache.media:
            if self._at.value <= medium.value < source.value:
                if self.cache.evict(medium, self.blocks) != self.blocks:
                    raise RuntimeError(f"validate: could not evict every block from the {medium.label} tier")
        self._at = max(self._at, source, key=lambda m: m.value)
