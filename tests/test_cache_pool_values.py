"""What a cache makes of pool values it did not expect: never wrong KV, a counted miss instead.

The pool is real (the session's pool, used here without its secret where a test says so), and so
is whoever writes the unexpected value: a raw Mooncake client putting bytes under a block's
object name, as a late put from reused memory or a replay would.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
import uuid

import pytest
from cache_support import assert_loaded_bytes, assert_quiescent, kv_for, tokens

from kvstrata.cache import CacheConfig, TieredCache
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.manager.plans import Failure, StopReason
from kvstrata.media import Medium
from kvstrata.policies.write import WritePolicy, WriteRule
from kvstrata.pool.config import PoolConfig
from kvstrata.tiers import poolvalue
from tests.pool_support import RawPool

LAYOUT = KVLayout(num_layers=2, block_tokens=16, kv_heads=2, head_dim=32, dtype=DType.BF16)  # 8 KiB a block
B = LAYOUT.block_bytes
VALUE = poolvalue.HEADER_BYTES + B
D, R = Medium.DEVICE, Medium.REMOTE
WAIT_S = 10.0
SLACK_S = 3.0  # scheduling slack on a loaded 2-core host, on top of a configured bound
FAST_S = 0.3  # a call to a pool known to be down: no pool call at all


@pytest.fixture
def caches():
    made: list[TieredCache] = []

    def make(pool: PoolConfig, model: str, remote_blocks: int = 64, layout: KVLayout = LAYOUT) -> TieredCache:
        # Device and pool only, write-through: every stored block is in the pool at once.
        block = layout.block_bytes
        config = CacheConfig(layout, model, device_bytes=8 * block, host_bytes=0, device="cpu",
                             write=WriteRule(WritePolicy.WRITE_THROUGH), pool=pool, remote_bytes=remote_blocks * block)
        made.append(TieredCache(config))
        return made[-1]

    yield make
    for cache in made:
        cache.close()


@pytest.fixture(scope="module")
def raw(pool):
    """A raw client of the pool and a registered buffer of two values."""
    raw = RawPool(pool, 2 * VALUE)
    yield raw
    raw.close()


def store(cache: TieredCache, toks: list[int]) -> None:
    cache.store(toks, kv_for(cache, toks)).result(timeout=WAIT_S)


def test_without_a_secret_another_blocks_bytes_under_a_valid_header_are_a_counted_miss(pool, caches, raw):
    # A late put from memory reused meanwhile: block 1's own header (its key, its payload's
    # checksum, as its writer made it) over block 2's bytes. Before every unsealed value carried
    # a checksum the reader checks, the reader loaded block 2's bytes as block 1.
    unsealed = dataclasses.replace(pool, secret_file=None)
    model = f"pool-values-{uuid.uuid4().hex[:12]}"
    writer, reader = caches(unsealed, model), caches(unsealed, model)
    toks = tokens(1, 4, LAYOUT)
    store(writer, toks)
    keys = reader.keys(toks)
    tier = reader.tier(R)
    a, b = (raw.get(tier.object_name(keys[i])) for i in (1, 2))
    assert len(a) == len(b) == VALUE
    raw.put(tier.object_name(keys[1]), a[: poolvalue.HEADER_BYTES] + b[poolvalue.HEADER_BYTES :])
    match = reader.lookup(toks)
    assert match.media == (R,) * 4
    handle = reader.load(match)
    result = handle.wait(timeout=WAIT_S)
    assert_loaded_bytes(reader, handle, keys)  # 0 wrong bytes: what loaded is what was stored
    handle.release()
    assert (result.blocks, result.stopped, result.stopped_at) == (1, StopReason.CORRUPT, R)
    assert reader.metrics.failed_legs[(D, Failure.CORRUPT)] == 1  # counted
    assert_quiescent(reader)


# 4 layers x K,V x 16 tokens x 8 heads x 128 dims x bf16: 256 KiB a block, 256 of them in a 64 MiB segment.
BIG = KVLayout(num_layers=4, block_tokens=16, kv_heads=8, head_dim=128, dtype=DType.BF16)


def test_blocks_the_pool_evicted_are_missed_by_the_lookup_counted_never_promised_to_a_load(private_pool, caches):
    # 160 sequences of 4 blocks (160 MiB) into a 64 MiB segment: the pool evicts most of them,
    # while the cache's view of it (1024 blocks) still lists every block it put. Before lookups
    # asked the pool about the blocks only it holds, they promised evicted blocks, and loads
    # then stopped at them (MISSING).
    cache = caches(private_pool.config, f"pool-evicted-{uuid.uuid4().hex[:12]}", remote_blocks=1024, layout=BIG)
    sequences = [tokens(100 + i, 4, BIG) for i in range(160)]
    for toks in sequences:
        cache.store(toks, kv_for(cache, toks)).result(timeout=WAIT_S)
    cache.evict(D, cache.manager.table(D).capacity_blocks)  # every block's only copy is the pool's
    listed = cache.manager.ready_keys(R)
    gone = {key for key, here in zip(listed, cache.tier(R).exists(listed)) if not here}
    assert len(gone) > 100, (len(listed), len(gone))  # the pool did evict, under the view
    # A lookup asks about the blocks it matched: in each sequence, those before the first the
    # view does not list (a put the full pool refused); a listed block after one is not matched.
    matched, listed_set = set(), set(listed)
    for toks in sequences:
        keys = cache.keys(toks)
        matched.update(keys[: next((i for i, key in enumerate(keys) if key not in listed_set), len(keys))])
    stops = []
    for toks in sequences:
        keys = cache.keys(toks)
        match = cache.lookup(toks)
        assert all(cache.tier(R).exists(list(match.keys)))  # only blocks the pool holds are promised
        handle = cache.load(match)
        result = handle.wait(timeout=WAIT_S)
        assert_loaded_bytes(cache, handle, keys)
        handle.release()
        stops.append(result.stopped)
        cache.evict(D, cache.manager.table(D).capacity_blocks)
    assert StopReason.MISSING not in stops
    assert cache.metrics.failed_legs[(D, Failure.MISSING)] == 0
    assert cache.metrics.pool_dropped_blocks == len(gone & matched)  # each counted once
    assert b"kvstrata_pool_dropped_blocks_total" in cache.metrics.exposition()
    assert_quiescent(cache)


def test_a_lookup_while_the_pool_hangs_costs_one_bounded_wait_and_drops_nothing(private_pool, caches):
    # The lookup asks the pool about blocks only it holds; a pool that does not answer says
    # nothing about them: they stay in the view (and the load finds the pool down, at once).
    cache = caches(private_pool.config, f"pool-hung-{uuid.uuid4().hex[:12]}")
    toks = tokens(7, 4, LAYOUT)
    store(cache, toks)
    cache.evict(D, cache.manager.table(D).capacity_blocks)
    budget_s = cache.config.pool_timeout_s
    os.kill(private_pool.master_pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        match = cache.lookup(toks)
        assert time.monotonic() - start < budget_s + SLACK_S
        assert match.media == (R,) * 4 and cache.remote_error is not None
        assert cache.metrics.pool_dropped_blocks == 0 and len(cache.manager.ready_keys(R)) == 4
        start = time.monotonic()
        cache.lookup(toks)  # the pool is down now: no wait at all
        assert time.monotonic() - start < FAST_S
    finally:
        os.kill(private_pool.master_pid, signal.SIGCONT)
