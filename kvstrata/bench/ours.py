"""Our side of the cache benchmark: each step moves every block one hop through ``TieredCache``.

The cache has a device, a host and a disk tier and the write-back policy, so no step writes
further down than it means to: ``store()`` fills the device tier only, evicting the device
tier demotes its blocks to the host (the host store), evicting the host demotes them to disk
(the disk store), and ``load()`` of blocks that sit in one tier only restores from that tier.
Between steps, untimed, blocks are evicted from the tiers above so the next step finds them
where it needs them.

Verification. Before each step that fills a tier, the destination slots are zeroed (untimed);
every restore's device blocks are then compared byte for byte with the KV that was stored, so
a step that moved nothing or the wrong bytes fails the run instead of looking fast.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvstrata.calibrate.kvdata import kv_block, timed_restore
from kvstrata.cache import CacheConfig, TieredCache
from kvstrata.kv.layout import KVLayout
from kvstrata.media import Medium
from kvstrata.policies.write import WritePolicy, WriteRule
from kvstrata.tensors import torch_dtype
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.diskdir import SUFFIX
from kvstrata.tiers.memory import MemoryTier
from kvstrata.timing import VerificationError, drop_page_cache, warm_page_cache


class OursCache:
    """A ``TieredCache`` sized to hold the benchmark's blocks in every tier.

    Args:
        layout: the block layout.
        kv_bytes: the KV to store, uint8 ``[layers, kv, tokens, kv_heads, head_dim * itemsize]``
            (a byte view of the model-dtype KV), on the device.
        tokens: the token ids, one full block per ``layout.block_tokens``.
        directory: where the disk tier keeps its files.
        workers: the transfer worker's byte movers.
        device: the device tier's torch device.
    """

    def __init__(
        self,
        layout: KVLayout,
        kv_bytes: torch.Tensor,
        tokens: list[int],
        directory: Path,
        workers: int,
        device: torch.device,
    ) -> None:
        self.layout = layout
        self.blocks = len(tokens) // layout.block_tokens
        self.kv_bytes = kv_bytes
        self.kv = kv_bytes.view(torch_dtype(layout.dtype))  # [layers, kv, tokens, kv_heads, head_dim]
        self.tokens = tokens
        self.size_bytes = self.blocks * layout.block_bytes
        capacity = self.size_bytes
        config = CacheConfig(
            layout=layout,
            model_id="kvstrata-bench",
            device_bytes=capacity,
            host_bytes=capacity,
            disk_bytes=capacity,
            disk_dir=Path(directory),
            write=WriteRule(WritePolicy.WRITE_BACK),
            workers=workers,
            device=str(device),
        )
        self.cache = TieredCache(config)
        self.verified_bytes = 0

    # --- steps: each returns the seconds its timed part took -----------------------------------

    def device_store_s(self) -> float:
        """``store()`` of every block into the (empty) device tier."""
        return self._filled_s(Medium.DEVICE, lambda: self.cache.store(self.tokens, self.kv).result().new_blocks,
                              "store wrote {} of {} blocks to the device tier")

    def device_hit_s(self) -> float:
        """``load()`` of blocks already on the device: pins only, no bytes move."""
        return self._restore_s(Medium.DEVICE)

    def host_store_s(self) -> float:
        """Evict the device tier: each block is written device -> host (write-back demotion)."""
        return self._filled_s(Medium.HOST, lambda: self.cache.evict(Medium.DEVICE, self.blocks),
                              "evicted {} of {} device blocks")

    def host_restore_s(self) -> float:
        """``load()`` of blocks on the host only, into the device tier."""
        return self._restore_s(Medium.HOST)

    def disk_store_s(self) -> float:
        """Evict the host tier: each block is written host -> disk as a file (buffered, as the
        cache's disk tier is configured). Afterwards, untimed, the files are fsynced and dropped
        from the page cache, as the plain write's file is."""
        seconds = self._filled_s(Medium.DISK, lambda: self.cache.evict(Medium.HOST, self.blocks),
                                 "evicted {} of {} host blocks")
        drop_page_cache(self.disk_files())
        return seconds

    def disk_restore_s(self, cold: bool) -> float:
        """``load()`` of blocks on disk only: staged disk -> host, then host -> device (on a CPU
        stand-in for the device, disk -> device). ``cold``: the files dropped from the page
        cache first, else read into it first (untimed, both)."""
        self._zero(Medium.HOST)
        self._set_page_cache(cold)
        return self._restore_s(Medium.DISK)

    def disk_read_s(self, cold: bool, dst: torch.Tensor) -> float:
        """The disk tier alone: ``read_into`` of every block, in order, on this thread, into
        ``dst`` (pre-faulted host uint8 of the benchmark's size), verified (untimed)."""
        disk = self.disk_tier
        blocks = dst.view(self.blocks, self.layout.num_layers, self.layout.layer_bytes)
        keys = self.cache.keys(self.tokens)
        dst.zero_()
        self._set_page_cache(cold)
        start = time.perf_counter()
        for i, key in enumerate(keys):
            disk.read_into(0, key, blocks[i])  # the file is named by the key: no slot
        seconds = time.perf_counter() - start
        for i in range(self.blocks):
            want = self._block(i).reshape(self.layout.num_layers, -1).cpu()
            if not torch.equal(blocks[i], want):
                raise VerificationError(f"disk tier read of block {i} returned other bytes than were stored")
        self.verified_bytes += self.size_bytes
        return seconds

    def reset(self) -> None:
        """Evict every block from the disk (the last tier holding them): the next round starts empty."""
        self.cache.evict(Medium.DISK, self.blocks)
        if self.cache.lookup(self.tokens).blocks:
            raise RuntimeError("benchmark blocks still cached after the reset")

    def close(self) -> None:
        self.cache.close()

    # --- helpers -------------------------------------------------------------------------------

    @property
    def disk_tier(self) -> DiskTier:
        tier = self.cache.tier(Medium.DISK)
        assert isinstance(tier, DiskTier)
        return tier

    def disk_files(self) -> list[Path]:
        return sorted(self.disk_tier.directory.glob(f"*{SUFFIX}"))

    def _set_page_cache(self, cold: bool) -> None:
        files = self.disk_files()
        if cold:
            drop_page_cache(files)
        else:  # the disk tier's cold reads bypass the page cache: fill it here
            warm_page_cache(files)

    def _restore_s(self, source: Medium) -> float:
        match = self.cache.lookup(self.tokens)
        if match.blocks != self.blocks or match.count(source) != self.blocks:
            raise RuntimeError(f"expected {self.blocks} blocks on {source.label} only, lookup found {match.media}")
        if source is not Medium.DEVICE:
            self._zero(Medium.DEVICE)
        _, seconds = timed_restore(self.cache, match, self.kv_bytes)
        self.verified_bytes += self.size_bytes
        # Back to where the blocks were: the copies above the source go (they are there too).
        for medium in (Medium.DEVICE, Medium.HOST):
            if medium.value < source.value:
                self.cache.evict(medium, self.blocks)
        self._expect(source)
        return seconds

    def _filled_s(self, medium: Medium, fill: Callable[[], int], short: str) -> float:
        """Seconds of ``fill()``, which moves every block into ``medium`` (memory slots zeroed
        first, untimed) and returns how many it moved; ``short`` formats (moved, expected)."""
        if medium is not Medium.DISK:
            self._zero(medium)
        start = time.perf_counter()
        moved = fill()
        seconds = time.perf_counter() - start
        if moved != self.blocks:
            raise VerificationError(short.format(moved, self.blocks))
        self._expect(medium)
        return seconds

    def _block(self, i: int) -> torch.Tensor:
        return kv_block(self.kv_bytes, self.layout, i)

    def _zero(self, medium: Medium) -> None:
        tier = self.cache.tier(medium)
        assert isinstance(tier, MemoryTier)
        for slot in range(tier.slots):
            tier.view(slot).zero_()

    def _expect(self, medium: Medium) -> None:
        match = self.cache.lookup(self.tokens)
        if match.blocks != self.blocks or match.count(medium) != self.blocks or set(match.media) != {medium}:
            raise RuntimeError(f"expected every block on {medium.label} alone, lookup found {set(match.media)}")
