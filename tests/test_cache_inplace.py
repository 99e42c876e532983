"""Loads served in place on a CPU: blocks in memory are read out of their tier's own slots.

A load asked for in place of blocks all in memory (host, device, or both) copies nothing: the
handle's blocks alias the slots that hold them, pinned until the handle is released (eviction
cannot take them, then can), and the device tier gains nothing. A match with a block on disk is
an ordinary load (into the device tier). Either way the bytes are the stored ones.
"""

from __future__ import annotations

import time
import uuid

from kvstrata.cache import CacheConfig, TieredCache
from kvstrata.media import Medium
from tests.cache_support import assert_loaded_bytes, assert_quiescent, kv_for, layout_for, pins, tokens

LAYOUT = layout_for(16, num_layers=3)
BLOCKS = 6


def _config(tmp_path, host_blocks: int = 4 * BLOCKS) -> CacheConfig:
    b = LAYOUT.block_bytes
    return CacheConfig(LAYOUT, f"inplace-{uuid.uuid4().hex[:8]}", device_bytes=4 * BLOCKS * b,
                       host_bytes=host_blocks * b, disk_bytes=4 * BLOCKS * b, disk_dir=tmp_path, device="cpu")


def _written_down(cache: TieredCache, toks: list[int], medium: Medium) -> None:
    cache.store(toks, kv_for(cache, toks)).result()
    keys = cache.keys(toks)
    deadline = time.monotonic() + 10  # write-through runs behind the store
    while not all(medium in cache.manager.where(k) for k in keys) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(medium in cache.manager.where(k) for k in keys)


def _inside(block, buffer) -> bool:
    return buffer.data_ptr() <= block.data_ptr() < buffer.data_ptr() + buffer.numel()


def test_blocks_in_host_memory_are_served_from_their_slots_and_pinned_until_release(tmp_path):
    toks = tokens(1, BLOCKS, LAYOUT)
    with TieredCache(_config(tmp_path)) as cache:
        _written_down(cache, toks, Medium.HOST)
        cache.evict(Medium.DEVICE, 10_000)
        keys = cache.keys(toks)
        handle = cache.load(cache.lookup(toks), in_place=True)
        result = handle.wait(timeout=0)  # finished when it returns: nothing was moved
        assert result.blocks == BLOCKS and result.restored_bytes == BLOCKS * LAYOUT.block_bytes
        assert result.paths == {(Medium.HOST, Medium.DEVICE): BLOCKS}
        host = cache.tier(Medium.HOST).buffer
        assert all(_inside(handle.block(i), host) for i in range(BLOCKS))
        assert_loaded_bytes(cache, handle, keys)
        assert not any(Medium.DEVICE in cache.manager.where(k) for k in keys)  # no copy into the device tier
        assert set(pins(cache)) == {(Medium.HOST, k) for k in keys}
        assert cache.evict(Medium.HOST, 10_000) == 0  # pinned while the caller reads them
        handle.release()
        handle.release()  # idempotent
        assert_quiescent(cache)
        assert cache.evict(Medium.HOST, 10_000) == BLOCKS


def test_blocks_split_between_device_and_host_are_each_served_from_where_they_are(tmp_path):
    toks = tokens(2, BLOCKS, LAYOUT)
    with TieredCache(_config(tmp_path)) as cache:
        _written_down(cache, toks, Medium.HOST)
        keys = cache.keys(toks)
        cache.evict(Medium.DEVICE, 10_000)
        with cache.load(cache.match(keys[:2])):  # an ordinary load puts the first two on the device
            pass
        assert [Medium.DEVICE in cache.manager.where(k) for k in keys] == [True] * 2 + [False] * (BLOCKS - 2)
        with cache.load(cache.lookup(toks), in_place=True) as handle:
            result = handle.wait()
            device, host = cache.tier(Medium.DEVICE).buffer, cache.tier(Medium.HOST).buffer
            assert [_inside(handle.block(i), device) for i in range(BLOCKS)] == [True] * 2 + [False] * (BLOCKS - 2)
            assert all(_inside(handle.block(i), host) for i in range(2, BLOCKS))
            assert_loaded_bytes(cache, handle, keys)
        assert result.paths == {(Medium.DEVICE,): 2, (Medium.HOST, Medium.DEVICE): BLOCKS - 2}
        assert result.restored_bytes == (BLOCKS - 2) * LAYOUT.block_bytes
        assert_quiescent(cache)


def test_a_match_with_a_block_on_disk_is_an_ordinary_load(tmp_path):
    toks = tokens(3, BLOCKS, LAYOUT)
    with TieredCache(_config(tmp_path, host_blocks=0)) as cache:
        _written_down(cache, toks, Medium.DISK)
        cache.evict(Medium.DEVICE, 10_000)
        keys = cache.keys(toks)
        with cache.load(cache.lookup(toks), in_place=True) as handle:
            handle.wait()
            assert all(_inside(handle.block(i), cache.tier(Medium.DEVICE).buffer) for i in range(BLOCKS))
            assert_loaded_bytes(cache, handle, keys)
        assert all(Medium.DEVICE in cache.manager.where(k) for k in keys)
        assert_quiescent(cache)
