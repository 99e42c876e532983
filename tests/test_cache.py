"""The tiered cache, scripted: each scenario says which tier serves a block, what is evicted in
which order, and how many bytes move between which tiers, and checks the bytes themselves.

Every tier is real: device and host pools are CPU tensors here (the device tier's stand-in
where there is no GPU), the disk tier writes real files under ``tmp_path``. A few scenarios
use a real tier with a gate (to hold a transfer mid-flight) or with faults made on the real
file system (a flipped byte, a truncated file, a directory where a file should be).

After every scenario ``assert_quiescent`` checks that no pin, WRITING or EVICTING slot was
left behind and that the prefix index agrees with the tier tables.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import threading
import time
from concurrent.futures import Future

import pytest
import torch
from cache_support import (
    LAYOUT,
    GatedDiskTier,
    GatedHostTier,
    assert_loaded_bytes,
    assert_quiescent,
    content,
    held_pins,
    kv_for,
    layout_for,
    same_bytes,
    tokens,
)
from prometheus_client.parser import text_string_to_metric_families

from kvstrata.cache import CacheConfig, LoadHandle, LoadResult, StoreResult, TieredCache
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.manager.plans import Failure, StopReason
from kvstrata.media import FetchPath, Medium
from kvstrata.policies.eviction import Eviction
from kvstrata.policies.prefetch import PrefetchPolicy, PrefetchRule
from kvstrata.policies.write import WritePolicy, WriteRule
from kvstrata.tiers import diskmanifest
from kvstrata.tiers.memory import DeviceTier, HostTier

D, H, K = Medium.DEVICE, Medium.HOST, Medium.DISK
B = LAYOUT.block_bytes


def make_config(tmp_path, device=4, host=8, disk=0, write=WritePolicy.WRITE_BACK, layout=LAYOUT,
                eviction=Eviction.LRU, model_id="tiny", selective_hits=2, disk_path=FetchPath.STAGED) -> CacheConfig:
    # Staged by default: the path a GPU's device tier takes (disk -> host -> device); the
    # direct path of a CPU-addressable device tier has its own tests.
    blocks = layout.block_bytes
    return CacheConfig(
        layout,
        model_id,
        device_bytes=device * blocks,
        host_bytes=host * blocks,
        disk_bytes=disk * blocks,
        disk_dir=tmp_path if disk else None,
        write=WriteRule(write, selective_hits),
        eviction=eviction,
        disk_path=disk_path,
    )


@pytest.fixture
def caches():
    """Builds caches and closes them after the test, checking each was left quiescent."""
    made: list[TieredCache] = []

    def make(config: CacheConfig, tiers=None) -> TieredCache:
        cache = TieredCache(config, tiers)
        made.append(cache)
        return cache

    yield make
    for cache in made:
        if not cache.closed:
            assert_quiescent(cache)
            cache.close()


def store(cache: TieredCache, toks, tenant: str = "") -> StoreResult:
    return cache.store(toks, kv_for(cache, toks, tenant), tenant=tenant).result(timeout=10)


def load(cache: TieredCache, toks, tenant: str = "") -> tuple[LoadResult, LoadHandle]:
    """Look up and load ``toks``; checks the loaded bytes; the caller releases."""
    handle = cache.load(cache.lookup(toks, tenant))
    result = handle.wait(timeout=10)
    assert handle.blocks == result.blocks
    assert_loaded_bytes(cache, handle, cache.keys(toks, tenant))
    return result, handle


def load_released(cache: TieredCache, toks, tenant: str = "") -> LoadResult:
    result, handle = load(cache, toks, tenant)
    handle.release()
    return result


def media(cache: TieredCache, toks, tenant: str = "") -> tuple[Medium, ...]:
    return cache.lookup(toks, tenant).media


def moved(cache: TieredCache) -> dict:
    return {pair: n for pair, n in cache.metrics.moved_bytes.items() if pair != (D, D)}


def gated_host_cache(tmp_path, caches, blocks=2, layout=LAYOUT, gate_from=0, **changes):
    """A CPU device tier over a gated host tier (4 blocks each; ``changes`` to the config):
    ``blocks`` blocks stored, the first two evicted to the host. Loads run as into a GPU
    (``layer_ranges``, on the workers) unless changed: a CPU device's copy runs in ``load()``."""
    changes = {"layer_ranges": True, **changes}
    config = dataclasses.replace(make_config(tmp_path, device=4, host=4, layout=layout), **changes)
    host = GatedHostTier(layout, config.host_bytes, gate_from=gate_from)
    cache = caches(config, [DeviceTier(layout, config.device_bytes, "cpu"), host])
    toks = tokens(1, blocks, layout)
    store(cache, toks)
    cache.evict(D, 2)
    return cache, host, toks


# --- lookup, load, store -----------------------------------------------------------------------


def test_lookup_gives_the_prefix_and_the_fastest_tier_of_each_block(tmp_path, caches):
    cache = caches(make_config(tmp_path, device=2, host=8))
    toks = tokens(1, 4, tail=5)
    assert store(cache, toks) == StoreResult(blocks=4, new_blocks=4, seconds=pytest.approx(0, abs=10))
    # Device holds 2: blocks 0 and 1 were evicted (LRU) to make room, and write-back demoted them.
    match = cache.lookup(toks + tokens(2, 3))
    assert (match.blocks, match.tokens, match.total_blocks) == (4, 64, 7)
    assert match.media == (H, H, D, D)
    assert match.keys == tuple(cache.keys(toks))
    diverging = toks[:32] + tokens(3, 2)
    assert cache.lookup(diverging).media == (H, H)
    assert cache.lookup(toks[:15]).blocks == 0  # a partial block is never keyed


@pytest.mark.parametrize("block_tokens", [16, 32, 256])
def test_bytes_restored_from_device_host_and_disk_equal_what_was_stored(tmp_path, caches, block_tokens):
    layout = layout_for(block_tokens)
    cache = caches(make_config(tmp_path, device=4, host=4, disk=8, layout=layout))
    n, b = 3, layout.block_bytes
    toks = tokens(1, n, layout, tail=3)
    store(cache, toks)

    result = load_released(cache, toks)  # from the device: nothing moves
    assert (result.blocks, result.tokens, result.bytes_from, result.stopped) == (n, n * block_tokens, {}, None)

    assert cache.evict(D, n) == n  # write-back demotes to the host
    assert media(cache, toks) == (H,) * n
    assert load_released(cache, toks).bytes_from == {H: n * b}

    assert cache.evict(D, n) == n  # already on the host: nothing to demote
    assert cache.evict(H, n) == n  # demoted to disk
    assert media(cache, toks) == (K,) * n
    result = load_released(cache, toks)  # disk -> host (staged) -> device
    assert result.blocks == n and result.bytes_from[K] == n * b
    assert moved(cache) == {(D, H): n * b, (H, D): 2 * n * b, (H, K): n * b, (K, H): n * b}


def test_store_returns_a_future_and_stores_each_block_once(tmp_path, caches):
    cache = caches(make_config(tmp_path))
    toks = tokens(1, 3, tail=7)
    future = cache.store(toks, kv_for(cache, toks))
    assert isinstance(future, Future)
    assert future.result(timeout=10).blocks == 3 and future.result().new_blocks == 3
    assert store(cache, toks).new_blocks == 0
    assert store(cache, tokens(1, 4)).new_blocks == 1  # the shared 3-block prefix is not rewritten


def test_each_layer_is_usable_while_later_layers_are_still_loading(tmp_path, caches):
    layout = layout_for(16, num_layers=4)
    # Not a small load (those are copied in one dispatch, every layer ready at once); layer
    # ranges asked for, as a GPU device tier has them (a CPU one copies every layer at once).
    cache, host, toks = gated_host_cache(tmp_path, caches, layout=layout, gate_from=1, small_load_bytes=0,
                                         layer_ranges=True)
    keys = cache.keys(toks)

    host.gate.clear()  # layers 1.. of every host read wait
    handle = cache.load(cache.lookup(toks))
    handle.wait_layer(0, timeout=10)
    assert not handle.done()
    with pytest.raises(TimeoutError):
        handle.wait_layer(3, timeout=0.05)
    assert handle.blocks == 2
    for i, key in enumerate(keys):
        assert same_bytes(handle.block(i)[0], content(layout, key)[0])
    host.gate.set()
    assert handle.wait(timeout=10).blocks == 2
    assert_loaded_bytes(cache, handle, keys)
    handle.release()


def test_a_small_load_is_one_dispatch_whose_layers_are_ready_together(tmp_path, caches):
    layout = layout_for(16, num_layers=4)
    cache, host, toks = gated_host_cache(tmp_path, caches, layout=layout)
    assert 2 * layout.block_bytes <= cache.config.small_load_bytes
    host.gate.clear()
    handle = cache.load(cache.lookup(toks))
    with pytest.raises(TimeoutError):  # layer 0 waits for the one copy, gated at layer 1
        handle.wait_layer(0, timeout=0.05)
    host.gate.set()
    handle.wait_layer(0, timeout=10)
    assert handle.wait(timeout=10).blocks == 2
    assert_loaded_bytes(cache, handle, cache.keys(toks))
    handle.release()


def test_a_cpu_device_tier_copies_a_large_load_in_one_dispatch(tmp_path, caches):
    # The default on a CPU device: the copy uses the cores the engine computes with, so layer
    # ranges on parallel threads would only contend for them.
    layout = layout_for(16, num_layers=4)
    cache, host, toks = gated_host_cache(tmp_path, caches, layout=layout, gate_from=1, small_load_bytes=0,
                                         layer_ranges=None)
    host.gate.clear()  # a read starting at layer 1 or later would wait: a one-range copy starts at 0
    handle = cache.load(cache.lookup(toks))
    assert handle.done()  # copied on this thread, in load(): no worker to hand it to and wait for
    assert handle.wait(timeout=10).blocks == 2
    assert not host.reads_waiting.acquire(blocking=False)
    assert_loaded_bytes(cache, handle, cache.keys(toks))
    handle.release()


# --- write policies ----------------------------------------------------------------------------


def test_write_through_sends_new_blocks_to_host_and_disk_at_once(tmp_path, caches):
    cache = caches(make_config(tmp_path, device=4, host=4, disk=8, write=WritePolicy.WRITE_THROUGH))
    toks = tokens(1, 3)
    store(cache, toks)
    keys = cache.keys(toks)
    assert media(cache, toks) == (D, D, D)
    for medium in (H, K):
        assert set(cache.manager.table(medium).ready_keys()) == set(keys)
    disk = cache.tier(K)
    assert sorted(p.name for p in disk.directory.glob("*.kvb")) == sorted(k.hex() + ".kvb" for k in keys)
    assert moved(cache) == {(D, H): 3 * B, (D, K): 3 * B}

    cache.evict(D, 3)
    cache.evict(H, 3)  # the lower tiers already hold them: evictions move nothing
    assert moved(cache) == {(D, H): 3 * B, (D, K): 3 * B}
    assert media(cache, toks) == (K, K, K)
    assert load_released(cache, toks).blocks == 3


def test_write_through_keeps_every_block_of_a_sequence_longer_than_the_device(tmp_path, caches):
    cache = caches(make_config(tmp_path, device=2, host=8, write=WritePolicy.WRITE_THROUGH))
    toks = tokens(1, 5)
    assert store(cache, toks).new_blocks == 5
    # Storing blocks 2..4 evicted 0..2 from the device; write-through had sent each one down.
    assert media(cache, toks) == (H, H, H, D, D)
    assert moved(cache) == {(D, H): 5 * B}
    assert load_released(cache, toks[: 2 * 16]).bytes_from == {H: 2 * B}


def test_write_back_demotes_only_on_eviction_in_lru_order(tmp_path, caches):
    cache = caches(make_config(tmp_path, device=3, host=2, disk=8, write=WritePolicy.WRITE_BACK))
    a, b, c, d, e, f = (tokens(i, 1) for i in range(1, 7))
    for seq in (a, b, c):
        store(cache, seq)
    assert moved(cache) == {}
    load_released(cache, a)  # a is now the most recently used
    store(cache, d)  # evicts b, the least recently used
    assert (media(cache, b), media(cache, a)) == ((H,), (D,))
    assert moved(cache) == {(D, H): B}
    store(cache, e)  # evicts c
    store(cache, f)  # evicts a; the host is full, so its LRU block, b, goes down to disk
    assert [media(cache, s) for s in (a, b, c, d, e, f)] == [(H,), (K,), (H,), (D,), (D,), (D,)]
    assert moved(cache) == {(D, H): 3 * B, (H, K): B}
    for seq in (a, b, c):
        load_released(cache, seq)


def test_write_back_eviction_of_more_blocks_than_the_host_holds_cascades_to_disk(tmp_path, caches):
    """Evicting the whole device at once into a host of half its size: the first half goes to
    the host, then the host makes room by sending its blocks to disk. None is lost; all restore."""
    cache = caches(make_config(tmp_path, device=8, host=4, disk=16, write=WritePolicy.WRITE_BACK,
                               disk_path=FetchPath.DIRECT))  # the restore's disk half skips the full host
    seq = tokens(9, 8)
    store(cache, seq)
    assert cache.evict(D, 8) == 8
    assert media(cache, seq) == (K,) * 4 + (H,) * 4  # LRU: the first half left the host for the second
    assert load_released(cache, seq).blocks == 8


def test_closing_a_write_back_cache_writes_its_memory_only_blocks_down_and_a_reopen_serves_them(tmp_path, caches):
    """A graceful stop keeps what write-back held in memory: every block only the device or the
    host had is written to disk at close, once each, and the disk reopened serves them all,
    byte for byte. Blocks already on disk are not written again."""
    cache = TieredCache(make_config(tmp_path, device=2, host=3, disk=16, write=WritePolicy.WRITE_BACK))
    seqs = [tokens(i, 1) for i in range(1, 8)]
    for seq in seqs:
        store(cache, seq)
    before = moved(cache)
    assert before.get((H, K)) == 2 * B  # 7 blocks through 2 + 3 slots: two went down on eviction
    cache.close()
    assert moved(cache)[(H, K)] - before[(H, K)] == 3 * B  # the host's three
    assert moved(cache)[(D, K)] == 2 * B  # the device's two (nowhere else)
    reopened = caches(make_config(tmp_path, device=2, host=3, disk=16, write=WritePolicy.WRITE_BACK))
    assert [media(reopened, s) for s in seqs] == [(K,)] * 7
    for seq in seqs:
        load_released(reopened, seq)


def test_closing_with_no_flush_budget_or_written_through_writes_nothing_more(tmp_path, caches):
    back = TieredCache(dataclasses.replace(make_config(tmp_path / "back", device=2, host=3, disk=16),
                                           write_back_flush_s=0))
    through = TieredCache(make_config(tmp_path / "through", device=2, host=3, disk=16,
                                      write=WritePolicy.WRITE_THROUGH))
    for cache in (back, through):
        for i in range(1, 6):
            store(cache, tokens(i, 1))
        before = moved(cache)
        cache.close()
        assert moved(cache) == before
    reopened = caches(make_config(tmp_path / "back", device=2, host=3, disk=16))
    assert [media(reopened, tokens(i, 1)) for i in range(1, 6)] == [()] * 5  # nothing was ever below the host
    with pytest.raises(ValueError, match="write_back_flush_s must be a number of seconds >= 0"):
        dataclasses.replace(make_config(tmp_path, device=2, host=3), write_back_flush_s=-1)


def test_selective_writes_a_block_down_on_its_nth_hit_and_drops_cold_blocks(tmp_path, caches):
    cache = caches(make_config(tmp_path, device=2, host=4, disk=8, write=WritePolicy.SELECTIVE, selective_hits=2))
    hot, cold = tokens(1, 1), tokens(2, 1)
    store(cache, hot)
    store(cache, cold)
    load_released(cache, hot)  # hit 1: stays on the device only
    assert moved(cache) == {} and cache.manager.where(cache.keys(hot)[0]) == (D,)
    load_released(cache, hot)  # hit 2: written to host and disk
    assert cache.manager.where(cache.keys(hot)[0]) == (D, H, K)
    assert moved(cache) == {(D, H): B, (D, K): B}
    load_released(cache, hot)  # later hits move nothing more
    assert moved(cache) == {(D, H): B, (D, K): B}

    assert cache.evict(D, 2) == 2
    assert media(cache, hot) == (H,)
    assert cache.lookup(cold).blocks == 0  # never hit: dropped, not demoted
    assert moved(cache) == {(D, H): B, (D, K): B}


def test_storing_blocks_that_sit_lower_down_puts_them_on_the_device_without_rewriting_them(tmp_path, caches):
    cache = caches(make_config(tmp_path, device=4, host=4, disk=8, write=WritePolicy.WRITE_THROUGH))
    toks = tokens(1, 2)
    store(cache, toks)
    cache.evict(D, 2)
    before = moved(cache)
    assert store(cache, toks).new_blocks == 2
    assert media(cache, toks) == (D, D)
    assert moved(cache) == before  # host and disk copies were already there
    load_released(cache, toks)
    cache.evict(D, 2)
    cache.evict(H, 2)
    assert load_released(cache, toks).bytes_from[K] == 2 * B


# --- eviction and pinning ----------------------------------------------------------------------


@pytest.mark.parametrize("eviction, victim", [(Eviction.LRU, 0), (Eviction.LFU, 1)])
def test_eviction_order_lru_by_default_lfu_as_option(tmp_path, caches, eviction, victim):
    cache = caches(make_config(tmp_path, device=3, host=8, eviction=eviction))
    seqs = [tokens(i, 1) for i in range(3)]
    for seq in seqs:
        store(cache, seq)
    for seq in (seqs[0], seqs[0], seqs[1], seqs[2]):  # A is used most, but least recently
        load_released(cache, seq)
    assert cache.evict(D, 1) == 1
    assert [media(cache, s) for s in seqs] == [(H,) if i == victim else (D,) for i in range(3)]


def test_a_block_in_use_is_never_evicted_until_its_handle_is_released(tmp_path, caches):
    cache = caches(make_config(tmp_path, device=2, host=4))
    waiting, busy = tokens(1, 1), tokens(2, 2)
    store(cache, waiting)
    cache.evict(D, 1)
    store(cache, busy)
    result, handle = load(cache, busy)
    assert result.blocks == 2
    assert_quiescent(cache, held=held_pins(cache, [handle]))

    assert cache.evict(D, 2) == 0
    assert store(cache, tokens(3, 2)).new_blocks == 0  # nothing fits: refused cleanly
    assert cache.lookup(tokens(3, 2)).blocks == 0
    refused = load_released(cache, waiting)  # on the host, but no device slot can be had
    assert (refused.blocks, refused.stopped) == (0, StopReason.DEVICE_FULL)
    assert_loaded_bytes(cache, handle, cache.keys(busy))  # pinned bytes untouched
    assert_quiescent(cache, held=held_pins(cache, [handle]))

    handle.release()
    assert load_released(cache, waiting).blocks == 1  # evicts one of busy's blocks now
    assert cache.evict(D, 2) == 2


def test_a_load_longer_than_the_device_loads_the_prefix_that_fits(tmp_path, caches):
    cache = caches(make_config(tmp_path, device=2, host=8))
    toks = tokens(1, 4)
    store(cache, toks)
    cache.evict(D, 2)
    result = load_released(cache, toks)
    assert (result.blocks, result.tokens, result.stopped) == (2, 32, StopReason.DEVICE_FULL)


def test_a_stale_match_loads_what_is_still_cached(tmp_path, caches):
    cache = caches(make_config(tmp_path, device=4, host=0))
    toks = tokens(1, 2)
    store(cache, toks)
    match = cache.lookup(toks)
    cache.evict(D, 4)  # no lower tier: gone everywhere
    with cache.load(match) as handle:
        result = handle.wait(timeout=10)
    assert (result.blocks, result.stopped) == (0, StopReason.GONE)


# --- load handles --------------------------------------------------------------------------------


def test_release_is_idempotent_and_only_drops_its_own_pins(tmp_path, caches):
    cache = caches(make_config(tmp_path))
    toks = tokens(1, 2)
    store(cache, toks)
    _, first = load(cache, toks)
    _, second = load(cache, toks)
    first.release()
    first.release()
    assert_quiescent(cache, held=held_pins(cache, [second]))
    with second:
        pass
    assert_quiescent(cache)


def test_release_of_a_load_in_flight_waits_for_it_and_leaves_no_pins(tmp_path, caches):
    cache, host, toks = gated_host_cache(tmp_path, caches)
    host.gate.clear()
    handle = cache.load(cache.lookup(toks))
    assert host.reads_waiting.acquire(timeout=10)  # the copy is in flight
    releaser = threading.Thread(target=handle.release)
    releaser.start()
    releaser.join(0.1)
    host.gate.set()
    releaser.join(10)
    assert not releaser.is_alive() and handle.done()
    assert_quiescent(cache)


def test_a_failed_load_surfaces_its_error_and_leaves_no_pins(tmp_path, caches):
    cache, host, toks = gated_host_cache(tmp_path, caches, blocks=3)  # blocks 0, 1 on the host, 2 on the device
    host.fail_reads = True
    handle = cache.load(cache.lookup(toks))
    with pytest.raises(OSError, match="injected"):
        handle.wait(timeout=10)
    with pytest.raises(OSError, match="injected"):
        handle.wait_layer(0, timeout=10)
    handle.release()
    assert_quiescent(cache)
    host.fail_reads = False
    with pytest.raises(OSError), cache.load(cache.lookup(toks)) as failing:
        host.fail_reads = True
        failing.wait(timeout=10)
    host.fail_reads = False
    assert_quiescent(cache)
    assert load_released(cache, toks).blocks == 3


def test_two_loads_of_one_prefix_racing_stay_exact_and_balanced(tmp_path, caches):
    cache, host, toks = gated_host_cache(tmp_path, caches)
    host.gate.clear()
    first = cache.load(cache.lookup(toks))
    assert host.reads_waiting.acquire(timeout=10)  # first holds WRITING device slots for both
    second = cache.load(cache.lookup(toks))
    result = second.wait(timeout=10)  # does not wait on the first: loads what it can have now
    assert (result.blocks, result.stopped) == (0, StopReason.LOADING_ELSEWHERE)
    host.gate.set()
    assert first.wait(timeout=10).blocks == 2
    assert_loaded_bytes(cache, first, cache.keys(toks))
    second.release()
    first.release()
    assert load_released(cache, toks).bytes_from == {}


# --- prefetch ------------------------------------------------------------------------------------


def gated_disk_cache(tmp_path, caches):
    config = make_config(tmp_path, device=4, host=4, disk=8, write=WritePolicy.WRITE_THROUGH)
    disk = GatedDiskTier(LAYOUT, config.disk_bytes, tmp_path / "disk")
    cache = caches(config, [DeviceTier(LAYOUT, config.device_bytes, "cpu"), HostTier(LAYOUT, config.host_bytes), disk])
    toks = tokens(1, 3)
    store(cache, toks)
    cache.evict(D, 3)
    cache.evict(H, 3)
    assert media(cache, toks) == (K, K, K)
    return cache, disk, toks


def test_prefetch_wait_promotes_disk_blocks_to_the_host_before_returning(tmp_path, caches):
    cache, _, toks = gated_disk_cache(tmp_path, caches)
    future = cache.prefetch(toks, PrefetchRule(PrefetchPolicy.WAIT))
    assert future.done() and future.result() == 3
    assert media(cache, toks) == (H, H, H)
    assert moved(cache)[(K, H)] == 3 * B
    assert load_released(cache, toks).bytes_from == {H: 3 * B}


def test_prefetch_best_effort_returns_at_once(tmp_path, caches):
    cache, disk, toks = gated_disk_cache(tmp_path, caches)
    disk.gate.clear()
    start = time.perf_counter()
    future = cache.prefetch(toks)  # best effort is the default
    assert time.perf_counter() - start < 1 and not future.done()
    disk.gate.set()
    assert future.result(timeout=10) == 3
    assert media(cache, toks) == (H, H, H)


def test_prefetch_timeout_waits_up_to_its_deadline(tmp_path, caches):
    cache, disk, toks = gated_disk_cache(tmp_path, caches)
    disk.gate.clear()
    start = time.perf_counter()
    future = cache.prefetch(toks, PrefetchRule(PrefetchPolicy.TIMEOUT, timeout_s=0.2))
    assert 0.2 <= time.perf_counter() - start < 5 and not future.done()
    disk.gate.set()
    assert future.result(timeout=10) == 3
    assert load_released(cache, toks).bytes_from == {H: 3 * B}


def deadline_cache(tmp_path, caches, predicted_s):
    """Three blocks on disk only, and a calibration predicting ``predicted_s`` to promote them."""
    from kvstrata.plan.calpaths import CalPath
    from kvstrata.plan.host import HostCalibration, PathFit

    gbps = 3 * B / predicted_s / 1e9
    paths = {CalPath.DISK_READ_WARM: PathFit(0.0, gbps), CalPath.MEMCPY_1T: PathFit(0.0, 1e9)}  # copies: free
    calibration = HostCalibration("test", "cpu", 1, paths)
    config = dataclasses.replace(make_config(tmp_path, device=4, host=4, disk=8, write=WritePolicy.WRITE_THROUGH),
                                 calibration=calibration, workers=1)
    cache = caches(config)
    toks = tokens(1, 3)
    store(cache, toks)
    cache.evict(D, 3)
    cache.evict(H, 3)
    assert media(cache, toks) == (K, K, K)
    assert cache.predict_promotion_s(cache.lookup(toks)) == pytest.approx(predicted_s, rel=1e-3)
    return cache, toks


def test_deadline_prefetch_starts_as_late_as_its_predicted_time_allows(tmp_path, caches):
    cache, toks = deadline_cache(tmp_path, caches, predicted_s=0.4)
    seen = []
    start = time.monotonic()
    sampler = threading.Timer(0.15, lambda: seen.append(media(cache, toks)))
    sampler.start()
    rule = PrefetchRule(PrefetchPolicy.DEADLINE, margin=0.25)
    future = cache.prefetch(toks, rule, deadline_s=start + 1.0)
    assert time.monotonic() - start < 0.1 and not future.done()  # a scheduler's call: it never blocks
    sampler.join()
    assert seen == [(K, K, K)]  # not begun early: the host tier's room served others meanwhile
    assert future.timing.start_s == pytest.approx(start + 1.0 - 0.4 * 1.25, abs=0.05)
    assert future.timing.late_s == 0
    assert future.result(timeout=10) == 3
    assert time.monotonic() - start >= 0.45  # done after its scheduled start
    assert media(cache, toks) == (H, H, H)


def test_deadline_prefetch_that_cannot_make_it_starts_now_and_says_how_late(tmp_path, caches):
    cache, toks = deadline_cache(tmp_path, caches, predicted_s=2.0)
    start = time.monotonic()
    future = cache.prefetch(toks, PrefetchRule(PrefetchPolicy.DEADLINE), deadline_s=start + 0.05)
    assert future.timing.start_s == pytest.approx(start, abs=0.05)
    assert future.timing.late_s == pytest.approx(1.95, abs=0.05)
    assert future.result(timeout=10) == 3


def test_deadline_prefetch_needs_a_deadline_and_is_cancelled_by_close(tmp_path, caches):
    cache, toks = deadline_cache(tmp_path, caches, predicted_s=0.1)
    with pytest.raises(ValueError, match="deadline_s"):
        cache.prefetch(toks, PrefetchRule(PrefetchPolicy.DEADLINE))
    future = cache.prefetch(toks, PrefetchRule(PrefetchPolicy.DEADLINE, margin=0), deadline_s=time.monotonic() + 60)
    assert not future.done()
    cache.close()
    with pytest.raises(RuntimeError, match="closed before this prefetch began"):
        future.result(timeout=5)


# --- metrics -------------------------------------------------------------------------------------


def test_metrics_count_hits_per_tier_misses_bytes_per_pair_and_gbps(tmp_path, caches):
    cache = caches(make_config(tmp_path, device=4, host=8))
    toks = tokens(1, 4)
    store(cache, toks)
    cache.evict(D, 2)  # blocks 0 and 1 (least recently stored) go to the host
    match = cache.lookup(toks + tokens(2, 2))
    assert match.media == (H, H, D, D)
    assert cache.metrics.hit_blocks == {D: 2, H: 2, K: 0, Medium.REMOTE: 0}
    assert cache.metrics.miss_blocks == 2
    cache.metrics._recent.clear()
    with cache.load(match) as handle:
        result = handle.wait(timeout=10)
    assert (result.blocks, result.bytes_from, result.stopped) == (4, {H: 2 * B}, None)
    assert result.gbps > 0
    assert moved(cache) == {(D, H): 2 * B, (H, D): 2 * B}
    records = cache.metrics.recent()
    assert {(r.src, r.dst) for r in records} == {(H, D)} and sum(r.bytes for r in records) == 2 * B
    assert all(r.bytes > 0 and r.seconds > 0 for r in records)  # a positive GB/s each

    families = {f.name: f for f in text_string_to_metric_families(cache.metrics.exposition().decode())}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("kvstrata_moved_bytes_total", (("dst", "device"), ("src", "host")))] == 2 * B
    assert samples[("kvstrata_moved_bytes_total", (("dst", "host"), ("src", "device")))] == 2 * B
    assert samples[("kvstrata_lookup_blocks_total", (("tier", "host"),))] == 2
    assert samples[("kvstrata_lookup_blocks_total", (("tier", "device"),))] == 2
    assert samples[("kvstrata_lookup_miss_blocks_total", ())] == 2
    assert samples[("kvstrata_transfer_gbps_count", (("dst", "device"), ("src", "host")))] >= len(records)


# --- faults ----------------------------------------------------------------------------------------


def flip_last_byte(path):
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x01]))


def flip_header_byte(path):
    with open(path, "r+b") as f:
        f.seek(20)  # inside the key
        byte = f.read(1)
        f.seek(20)
        f.write(bytes([byte[0] ^ 0x01]))


def truncate(path):
    os.truncate(path, os.path.getsize(path) - 100)


def on_disk_only(tmp_path, caches, blocks):
    cache = caches(make_config(tmp_path, device=4, host=4, disk=8, write=WritePolicy.WRITE_THROUGH))
    toks = tokens(1, blocks)
    store(cache, toks)
    cache.evict(D, blocks)
    cache.evict(H, blocks)
    assert media(cache, toks) == (K,) * blocks
    return cache, toks, cache.keys(toks)


def file_of(cache, key):
    return cache.tier(K).directory / f"{key.hex()}.kvb"


@pytest.mark.parametrize("damage", [flip_last_byte, flip_header_byte, truncate])
def test_a_damaged_disk_block_mid_match_is_dropped_and_the_load_stops_before_it(tmp_path, caches, damage):
    cache, toks, keys = on_disk_only(tmp_path, caches, 4)
    damage(file_of(cache, keys[2]))
    result, handle = load(cache, toks)
    assert result.blocks == 2
    assert (result.stopped, result.stopped_at) == (StopReason.CORRUPT, K)
    handle.release()
    assert cache.manager.table(K).state(keys[2]) is None and not file_of(cache, keys[2]).exists()
    assert cache.manager.where(keys[2]) == ()
    assert cache.manager.where(keys[3]) == (H, K)  # staged alongside, kept on the host
    assert media(cache, toks) == (D, D)
    assert_quiescent(cache)


def test_a_damaged_block_another_reader_holds_stays_listed_until_the_last_reader_drops_it(tmp_path, caches):
    cache, toks, keys = on_disk_only(tmp_path, caches, 2)
    disk = cache.manager.table(K)
    flip_last_byte(file_of(cache, keys[1]))
    assert cache.manager.pin(K, keys[1]) is not None  # a reader (say, a prefetch) that has not read yet
    result = load_released(cache, toks)
    assert (result.blocks, result.stopped, result.stopped_at) == (1, StopReason.CORRUPT, K)
    # It could not be removed while pinned: it stays READY, so the index keeps listing it.
    assert disk.state(keys[1]) is not None and K in cache.manager.where(keys[1])
    assert_quiescent(cache, held={(K, keys[1]): 1})
    cache.manager.unpin(K, [keys[1]])
    assert load_released(cache, toks).blocks == 1  # the next reader drops it for good
    assert disk.state(keys[1]) is None and cache.manager.where(keys[1]) == ()


def test_a_damaged_first_block_loads_nothing(tmp_path, caches):
    cache, toks, keys = on_disk_only(tmp_path, caches, 2)
    truncate(file_of(cache, keys[0]))
    result = load_released(cache, toks)
    assert (result.blocks, result.stopped, result.stopped_at) == (0, StopReason.CORRUPT, K)
    assert cache.lookup(toks).blocks == 0


def test_prefetch_drops_a_damaged_disk_block(tmp_path, caches):
    cache, toks, keys = on_disk_only(tmp_path, caches, 3)
    flip_last_byte(file_of(cache, keys[1]))
    assert cache.prefetch(toks, PrefetchRule(PrefetchPolicy.WAIT)).result() == 2
    assert cache.manager.table(K).state(keys[1]) is None and not file_of(cache, keys[1]).exists()
    assert media(cache, toks) == (H,)
    assert load_released(cache, toks).blocks == 1


def directory_in_place(path, other):
    path.unlink()
    path.mkdir()  # reading it fails with EISDIR: an I/O error, not a checksum miss


def fifo_in_place(path, other):
    path.unlink()
    os.mkfifo(path)  # opening it for reading would block until a writer came


def link_in_place(path, other):
    path.unlink()
    path.symlink_to(other)  # another block's file: never followed


@pytest.mark.parametrize("unreadable", [directory_in_place, fifo_in_place, link_in_place])
def test_an_unreadable_disk_block_is_a_miss_and_leaves_its_tier(tmp_path, caches, unreadable):
    cache, toks, keys = on_disk_only(tmp_path, caches, 3)
    unreadable(file_of(cache, keys[1]), file_of(cache, keys[2]))
    result = load_released(cache, toks)  # in bounded time: the FIFO is never waited on
    assert (result.blocks, result.stopped, result.stopped_at) == (1, StopReason.CORRUPT, K)
    assert cache.manager.where(keys[1]) == () and cache.manager.table(K).state(keys[1]) is None
    again = load_released(cache, toks)  # the entry is gone: the prefix ends before it
    assert (again.blocks, again.stopped) == (1, None)
    assert_quiescent(cache)


@pytest.mark.parametrize("mode_of", ["directory", "file"])
def test_disk_blocks_are_private_to_their_owner(tmp_path, caches, mode_of):
    cache, toks, keys = on_disk_only(tmp_path, caches, 2)
    disk = cache.tier(K)
    path = disk.directory if mode_of == "directory" else file_of(cache, keys[0])
    assert stat.S_IMODE(path.stat().st_mode) == (0o700 if mode_of == "directory" else 0o600)


def test_a_disk_tier_on_a_full_file_system_holds_what_fits_and_keeps_taking_new_blocks(tiny_tmpfs, caches, caplog):
    layout = KVLayout(num_layers=4, block_tokens=16, kv_heads=4, head_dim=128, dtype=DType.BF16)  # 128 KiB blocks
    b = layout.block_bytes
    config = CacheConfig(layout, "full", device_bytes=4 * b, host_bytes=4 * b, disk_bytes=64 * b,  # 8 MiB, on 1 MiB
                         disk_dir=tiny_tmpfs, write=WriteRule(WritePolicy.WRITE_THROUGH))
    cache = caches(config)
    seqs = [tokens(100 + i, 2, layout) for i in range(8)]
    with caplog.at_level("WARNING", logger="kvstrata.cache"):
        for toks in seqs:
            store(cache, toks)
    disk = cache.manager.table(K)
    assert disk.capacity_blocks < 8 <= 64  # what the file system really holds (about 7 blocks)
    assert any("disk tier ran out of space" in r.getMessage() for r in caplog.records)
    assert cache.metrics.failed_legs[(K, Failure.NO_SPACE)] >= 1
    # The newest blocks made it to disk (older ones made room), not "0 of 2" from the first ENOSPC on.
    for toks in seqs[-2:]:
        assert all(K in cache.manager.where(key) for key in cache.keys(toks))
    cache.evict(D, 4)
    cache.evict(H, 4)
    assert load_released(cache, seqs[-1]).bytes_from == {K: 2 * b}


def test_a_disk_directory_removed_under_an_open_cache_is_reported_not_acknowledged_as_written(tmp_path, caches,
                                                                                              caplog):
    import shutil

    cache, toks, keys = on_disk_only(tmp_path, caches, 2)
    shutil.rmtree(cache.tier(K).directory)
    fresh = tokens(7, 2)
    with caplog.at_level("ERROR", logger="kvstrata.tiers"):
        assert store(cache, fresh).new_blocks == 2  # on the device and the host, not on the gone disk
    assert any("was removed while open" in r.getMessage() for r in caplog.records)
    assert cache.metrics.failed_legs[(K, Failure.UNAVAILABLE)] == 2
    assert all(K not in cache.manager.where(key) for key in cache.keys(fresh))
    result = load_released(cache, toks)  # the blocks it had there are misses now
    assert (result.blocks, result.stopped) == (0, StopReason.CORRUPT)
    assert_quiescent(cache)


# --- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_kv, message",
    [
        (lambda t: torch.zeros(2, 2, t, 2, 32, dtype=torch.bfloat16), "shape"),  # heads
        (lambda t: torch.zeros(3, 2, t, 1, 32, dtype=torch.bfloat16), "shape"),  # layers
        (lambda t: torch.zeros(2, 2, t, 1, 64, dtype=torch.bfloat16), "shape"),  # head_dim
        (lambda t: torch.zeros(2, t, 1, 32, dtype=torch.bfloat16), "shape"),  # a dimension short
        (lambda t: torch.zeros(2, 2, t, 1, 32, dtype=torch.float16), "dtype"),
        (lambda t: torch.zeros(2, 2, t, 1, 32, dtype=torch.float32), "dtype"),
        (lambda t: [[0.0] * t], "torch.Tensor"),
    ],
)
def test_kv_of_the_wrong_shape_or_dtype_is_refused(tmp_path, caches, make_kv, message):
    cache = caches(make_config(tmp_path))
    toks = tokens(1, 2)
    with pytest.raises(ValueError, match=message):
        cache.store(toks, make_kv(len(toks)))
    assert cache.lookup(toks).blocks == 0


@pytest.mark.parametrize("tenant", [None, 3, b"alice"])
def test_a_bad_tenant_is_refused(tmp_path, caches, tenant):
    cache = caches(make_config(tmp_path))
    toks = tokens(1, 2)
    kv = kv_for(cache, toks)
    for call in (
        lambda: cache.lookup(toks, tenant=tenant),
        lambda: cache.store(toks, kv, tenant=tenant),
        lambda: cache.store(toks[:5], kv[:, :, :5], tenant=tenant),  # no full block, still refused
        lambda: cache.prefetch(toks, tenant=tenant),
    ):
        with pytest.raises(ValueError, match="tenant"):
            call()


@pytest.mark.parametrize("bad", [b"\x01\x02" * 32, "abc" * 20, {1: 2}, {1, 2, 3}, None, (t for t in range(64)),
                                 [[1] * 32, [2] * 32], 7], ids=["bytes", "str", "dict", "set", "None", "generator",
                                                               "2-d", "scalar"])
def test_store_refuses_the_tokens_lookup_refuses(tmp_path, caches, bad):
    cache = caches(make_config(tmp_path))
    kv = kv_for(cache, tokens(1, 2))
    for call in (lambda: cache.store(bad, kv), lambda: cache.lookup(bad), lambda: cache.prefetch(bad)):
        with pytest.raises(ValueError, match="tokens"):
            call()
    assert cache.manager.indexed_blocks() == 0


def test_load_takes_a_match_and_a_closed_cache_answers_nothing(tmp_path, caches):
    cache = caches(make_config(tmp_path))
    with pytest.raises(ValueError, match="Match of a lookup"):
        cache.load(None)
    toks = tokens(1, 2)
    store(cache, toks)
    cache.close()
    for call in (lambda: cache.lookup(toks), lambda: cache.store(toks, kv_for(cache, toks)), lambda: cache.evict(D, 1)):
        with pytest.raises(RuntimeError, match="closed"):
            call()


@pytest.mark.parametrize(("field", "value", "message"), [
    ("host_bytes", 1.5, "host_bytes must be an integer"),
    ("device_bytes", "1GB", "device_bytes must be an integer"),
    ("device_bytes", True, "device_bytes must be an integer"),
    ("device_bytes", 0, "device_bytes must hold at least one block"),
    ("device_bytes", B - 1, "device_bytes must hold at least one block"),
    ("host_bytes", B // 2, "host_bytes must be 0 .* or hold at least one block"),
    ("workers", 0, "workers must be >= 1"),
    ("pool_timeout_s", 0, "pool_timeout_s must be a number of seconds > 0, got 0"),
    ("pool_connect_timeout_s", "5", "pool_connect_timeout_s must be a number of seconds > 0, got '5'"),
    ("pool_backoff_s", float("nan"), "pool_backoff_s must be a number of seconds > 0"),
    ("pool_backoff_max_s", 0.1, "pool_backoff_max_s must be >= pool_backoff_s, got 0.1 < 0.5"),
])
def test_a_config_that_cannot_work_is_refused_in_one_line(field, value, message):
    with pytest.raises(ValueError, match=message):
        CacheConfig(LAYOUT, **{"model_id": "m", "device_bytes": 4 * B, "host_bytes": 0, field: value})


@pytest.mark.parametrize("field, value", [("model_id", ""), ("tp_rank", 2)])
def test_a_bad_namespace_is_refused_by_the_config(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        CacheConfig(LAYOUT, **{"model_id": "m", "device_bytes": B, "host_bytes": 0, "tp_size": 2, field: value})


# --- namespaces ------------------------------------------------------------------------------------


def test_two_models_sharing_a_disk_directory_never_see_each_others_blocks(tmp_path, caches):
    one = caches(make_config(tmp_path, disk=8, write=WritePolicy.WRITE_THROUGH, model_id="model-a"))
    two = caches(make_config(tmp_path, disk=8, write=WritePolicy.WRITE_THROUGH, model_id="model-b"))
    toks = tokens(1, 2)
    store(one, toks)
    assert two.lookup(toks).blocks == 0
    store(two, toks)
    assert not set(one.keys(toks)) & set(two.keys(toks))
    for cache in (one, two):
        cache.evict(D, 2)
        cache.evict(H, 2)
        assert media(cache, toks) == (K, K)
        assert load_released(cache, toks).bytes_from[K] == 2 * B  # its own bytes (checked in load)
        assert set(cache.manager.table(K).ready_keys()) == set(cache.keys(toks))
    assert one.tier(K).directory != two.tier(K).directory
    assert one.tier(K).directory.parent == two.tier(K).directory.parent == tmp_path


def test_two_tenants_never_see_each_others_blocks(tmp_path, caches):
    cache = caches(make_config(tmp_path, disk=8, write=WritePolicy.WRITE_THROUGH))
    toks = tokens(1, 2)
    store(cache, toks, tenant="alice")
    assert cache.lookup(toks, tenant="bob").blocks == 0
    assert cache.lookup(toks).blocks == 0
    store(cache, toks, tenant="bob")
    for tenant in ("alice", "bob"):
        assert load_released(cache, toks, tenant).blocks == 2  # bytes checked against its own keys
    assert not set(cache.keys(toks, "alice")) & set(cache.keys(toks, "bob"))


def test_blocks_on_disk_survive_a_restart_bit_exact(tmp_path, caches):
    config = make_config(tmp_path, disk=8, write=WritePolicy.WRITE_THROUGH)
    first = caches(config)
    toks = tokens(1, 3)
    store(first, toks)
    first.close()
    again = caches(config)
    assert media(again, toks) == (K, K, K)
    assert load_released(again, toks).bytes_from[K] == 3 * B


def test_a_disk_reopened_smaller_serves_every_block_then_evicts_the_excess_by_lru_as_new_ones_come(tmp_path, caches):
    # 8 blocks on disk, reopened at 3: nothing is deleted at the start and every block is served
    # with its bytes. Each new block then evicts two (the least recently used) until the tier
    # holds 3, one after that; the files on disk are the blocks the table holds, at every step.
    config = make_config(tmp_path, device=4, host=8, disk=8, write=WritePolicy.WRITE_THROUGH)
    first = caches(config)
    old = [tokens(i, 1) for i in range(8)]
    for seq in old:
        store(first, seq)
    first.close()
    cache = caches(dataclasses.replace(config, disk_bytes=3 * B))
    disk = cache.manager.table(K)
    old_keys = [cache.keys(seq)[0] for seq in old]

    def on_disk() -> set:
        files = {p.name for p in cache.tier(K).directory.glob("*.kvb")}
        assert files == {k.hex() + ".kvb" for k in disk.ready_keys()}  # no file kept past its block, none lost
        return set(disk.ready_keys())

    assert on_disk() == set(old_keys) and (disk.capacity_blocks, disk.excess_blocks) == (3, 5)
    for seq in old:  # in order: the LRU order is old[0] (least recent) .. old[7]
        assert media(cache, seq) == (K,)
        assert load_released(cache, seq).bytes_from[K] == B  # bytes checked
    new = [tokens(100 + i, 1) for i in range(6)]
    new_keys = [cache.keys(seq)[0] for seq in new]
    expected = [old_keys[2:] + new_keys[:1], old_keys[4:] + new_keys[:2], old_keys[6:] + new_keys[:3],
                new_keys[:4], new_keys[2:5], new_keys[3:6]]
    for seq, held in zip(new, expected, strict=True):
        store(cache, seq)
        assert on_disk() == set(held)
    assert (len(disk.ready_keys()), disk.excess_blocks, disk.counts().evicted_blocks) == (3, 0, 11)
    for seq in new[3:]:
        cache.evict(D, 4)
        cache.evict(H, 8)
        assert load_released(cache, seq).bytes_from[K] == B
    cache.close()
    again = caches(dataclasses.replace(config, disk_bytes=3 * B))  # the manifest agrees: the same 3
    assert set(again.manager.ready_keys(K)) == set(new_keys[3:])


@pytest.mark.parametrize("damage", [flip_last_byte, flip_header_byte, truncate])
def test_a_block_damaged_on_disk_between_runs_is_never_served(tmp_path, caches, monkeypatch, damage):
    # The restart takes the block on the manifest's word (same inode, header not read); the load
    # reads it, checks it, drops it and stops before it.
    monkeypatch.setattr(diskmanifest, "SETTLE_NS", 0)
    config = make_config(tmp_path, disk=8, write=WritePolicy.WRITE_THROUGH)
    first = caches(config)
    toks = tokens(1, 3)
    store(first, toks)
    keys = first.keys(toks)
    first.close()
    damage(first.tier(K).directory / f"{keys[1].hex()}.kvb")
    again = caches(config)
    assert media(again, toks) == (K, K, K)
    result = load_released(again, toks)
    assert (result.blocks, result.stopped, result.stopped_at) == (1, StopReason.CORRUPT, K)
    assert again.manager.where(keys[1]) == () and not file_of(again, keys[1]).exists()
    assert media(again, toks) == (D,)
