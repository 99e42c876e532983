"""A load given up in flight: the blocks it has not started reading are not read, nothing is lost.

The disk tier is capped (each block takes tens of ms to read), so a load of many blocks from it
is still reading when it is cancelled. Its reads already running land; the rest never start:
the load ends stopped (``CANCELLED``) long before the whole would have taken, every block stays
on the disk, every slot and pin is settled, and a later load reads the same bytes.
"""

from __future__ import annotations

import time
import uuid

from kvstrata.cache import CacheConfig, TieredCache
from kvstrata.manager.plans import StopReason
from kvstrata.media import Medium
from kvstrata.tiers.blockfile import PAGE_BYTES
from tests.cache_support import assert_loaded_bytes, assert_quiescent, kv_for, layout_for, tokens

LAYOUT = layout_for(16, num_layers=4)  # 4 layers x 2 KiB a block... and a page of header on disk
BLOCKS = 24
GBPS = 0.0001  # 0.1 MB/s: a block's file (a page and its payload) takes ~0.1 s


def _on_disk(cache: TieredCache, toks: list[int]) -> None:
    cache.store(toks, kv_for(cache, toks)).result()
    keys = cache.keys(toks)
    deadline = time.monotonic() + 10  # the write-down runs behind the store
    while not all(Medium.DISK in cache.manager.where(k) for k in keys) and time.monotonic() < deadline:
        time.sleep(0.01)
    cache.evict(Medium.DEVICE, 10_000)


def test_a_cancelled_load_stops_reading_and_keeps_every_block(tmp_path):
    b = LAYOUT.block_bytes
    config = CacheConfig(LAYOUT, f"cancel-{uuid.uuid4().hex[:8]}", device_bytes=2 * BLOCKS * b, host_bytes=0,
                         disk_bytes=2 * BLOCKS * b, disk_dir=tmp_path, device="cpu", disk_read_gbps=GBPS)
    per_block_s = (PAGE_BYTES + b) / (GBPS * 1e9)
    toks = tokens(1, BLOCKS)
    with TieredCache(config) as cache:
        _on_disk(cache, toks)
        match = cache.lookup(toks)
        assert match.count(Medium.DISK) == BLOCKS
        start = time.perf_counter()
        handle = cache.load(match)
        time.sleep(per_block_s)
        handle.cancel()
        assert handle.cancelled()
        result = handle.wait(timeout=BLOCKS * per_block_s)
        elapsed = time.perf_counter() - start
        handle.release()
        assert result.stopped is StopReason.CANCELLED and result.blocks < BLOCKS // 2
        assert elapsed < BLOCKS * per_block_s / 2, (elapsed, BLOCKS * per_block_s)
        # nothing lost, nothing left pinned or half-written; the blocks read before the cancel are right
        keys = cache.keys(toks)
        assert cache.lookup(toks).blocks == BLOCKS and all(Medium.DISK in cache.manager.where(k) for k in keys)
        assert_quiescent(cache)
        with cache.load(cache.match(keys[:2])) as again:
            again.wait()
            assert again.blocks == 2
            assert_loaded_bytes(cache, again, keys[:2])


def test_an_uncancelled_load_is_not_cut(tmp_path):
    b = LAYOUT.block_bytes
    config = CacheConfig(LAYOUT, f"cancel-{uuid.uuid4().hex[:8]}", device_bytes=8 * b, host_bytes=0,
                         disk_bytes=8 * b, disk_dir=tmp_path, device="cpu", disk_read_gbps=0.01)
    toks = tokens(2, 4)
    with TieredCache(config) as cache:
        _on_disk(cache, toks)
        with cache.load(cache.lookup(toks)) as handle:
            result = handle.wait()
            assert result.stopped is None and handle.blocks == 4 and not handle.cancelled()
            assert_loaded_bytes(cache, handle, cache.keys(toks))
