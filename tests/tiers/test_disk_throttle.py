"""The disk tier's read cap: reads of N bytes at C GB/s take at least N / C, in aggregate.

Only lower bounds are asserted (a shared machine can always be slower); bytes counted are the
file's header and the payload read.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import xxhash

from kvstrata.cache import CacheConfig, TieredCache
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.media import Medium
from kvstrata.tiers.blockfile import PAGE_BYTES
from kvstrata.tiers.disk import DiskTier

LAYOUT = KVLayout(num_layers=4, block_tokens=16, kv_heads=4, head_dim=128, dtype=DType.BF16)  # 4 x 16 KiB
FILE_BYTES = PAGE_BYTES + LAYOUT.block_bytes  # a one-page header, then the payload
TOLERANCE_S = 0.002  # clock granularity


def make_key(i: int) -> bytes:
    return xxhash.xxh3_128_digest(f"kvstrata-test-throttle:{i}".encode())


def filled(tier: DiskTier, blocks: int) -> list[bytes]:
    keys = [make_key(i) for i in range(blocks)]
    for key in keys:
        data = np.random.default_rng(int.from_bytes(key, "little")).integers(0, 256, LAYOUT.block_bytes, np.uint8)
        tier.write(0, key, torch.from_numpy(data).view(LAYOUT.num_layers, LAYOUT.layer_bytes))  # slot: unused
    return keys


def read(tier: DiskTier, key: bytes, layers: slice = slice(None)) -> None:
    start, stop, _ = layers.indices(LAYOUT.num_layers)
    tier.read_into(0, key, torch.empty(stop - start, LAYOUT.layer_bytes, dtype=torch.uint8), layers)


@pytest.mark.parametrize("gbps", [0.005, 0.02])
def test_reads_in_one_thread_take_at_least_bytes_over_the_cap(tmp_path, gbps):
    tier = DiskTier(LAYOUT, 64 * LAYOUT.block_bytes, tmp_path, read_gbps=gbps)
    keys = filled(tier, 8)
    start = time.perf_counter()
    for key in keys:
        read(tier, key)
    elapsed = time.perf_counter() - start
    assert elapsed >= len(keys) * FILE_BYTES / (gbps * 1e9) - TOLERANCE_S
    tier.close()


def test_the_cap_holds_in_aggregate_across_threads(tmp_path):
    gbps = 0.02
    tier = DiskTier(LAYOUT, 64 * LAYOUT.block_bytes, tmp_path, read_gbps=gbps)
    keys = filled(tier, 16)
    start = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda k: read(tier, k), keys))
    elapsed = time.perf_counter() - start
    assert elapsed >= len(keys) * FILE_BYTES / (gbps * 1e9) - TOLERANCE_S  # 4 readers, one rate
    tier.close()


def test_a_partial_read_pays_for_the_layers_it_reads(tmp_path):
    gbps = 0.005
    tier = DiskTier(LAYOUT, 64 * LAYOUT.block_bytes, tmp_path, read_gbps=gbps)
    [key] = filled(tier, 1)
    start = time.perf_counter()
    read(tier, key, slice(0, 1))
    elapsed = time.perf_counter() - start
    assert elapsed >= (PAGE_BYTES + LAYOUT.layer_bytes) / (gbps * 1e9) - TOLERANCE_S
    tier.close()


def test_the_cap_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="read_gbps must be positive"):
        DiskTier(LAYOUT, 64 * LAYOUT.block_bytes, tmp_path, read_gbps=0.0)


def test_the_cache_caps_its_disk_tier_from_the_config(tmp_path):
    gbps, blocks = 0.01, 8
    b = LAYOUT.block_bytes
    config = CacheConfig(LAYOUT, f"throttle-{uuid.uuid4().hex[:8]}", device_bytes=4 * blocks * b, host_bytes=0,
                         disk_bytes=4 * blocks * b, disk_dir=tmp_path, device="cpu", disk_read_gbps=gbps)
    tokens = list(range(blocks * LAYOUT.block_tokens + 1))
    kv = torch.zeros(LAYOUT.num_layers, 2, len(tokens), LAYOUT.kv_heads, LAYOUT.head_dim, dtype=torch.bfloat16)
    with TieredCache(config) as cache:
        cache.store(tokens, kv).result()
        keys = cache.keys(tokens)[:blocks]
        deadline = time.monotonic() + 10  # the write-down to disk runs behind the store
        while not all(Medium.DISK in cache.manager.where(k) for k in keys) and time.monotonic() < deadline:
            time.sleep(0.01)
        cache.evict(Medium.DEVICE, 10_000)
        match = cache.lookup(tokens)
        assert match.count(Medium.DISK) == blocks
        start = time.perf_counter()
        with cache.load(match) as handle:
            result = handle.wait()
        elapsed = time.perf_counter() - start
        assert result.paths == {(Medium.DISK, Medium.DEVICE): blocks}
        assert elapsed >= blocks * FILE_BYTES / (gbps * 1e9) - TOLERANCE_S
