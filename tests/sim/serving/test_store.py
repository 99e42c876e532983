"""kvstrata's tiers behind one simulated server: which tier serves each block of a lookup, from
when, what a store writes where, and where a load leaves its blocks."""

from __future__ import annotations

import pytest

from kvstrata.media import Medium
from kvstrata.sim.serving.store import ServerStore, StoreHit, TierLRU

DEVICE, HOST, DISK, REMOTE = Medium.DEVICE, Medium.HOST, Medium.DISK, Medium.REMOTE


def _store(*tiers: Medium, capacity: int = 16) -> ServerStore:
    return ServerStore({t: TierLRU(capacity) for t in tiers})


# --- one tier -------------------------------------------------------------------------------------


def test_lru_capacity_evicts_the_least_recently_used():
    lru = TierLRU(2)
    lru.put(1, 0.0)
    lru.put(2, 0.0)
    lru.put(3, 0.0)
    assert len(lru) == 2
    assert not lru.ready(1, 10.0) and lru.ready(2, 10.0) and lru.ready(3, 10.0)
    lru.touch(2)  # 3 is now the oldest
    lru.put(4, 0.0)
    assert lru.ready(2, 10.0) and not lru.ready(3, 10.0)
    lru.put(2, 0.0)  # put again: refreshed, not duplicated
    lru.put(5, 0.0)
    assert lru.ready(2, 10.0) and not lru.ready(4, 10.0) and len(lru) == 2


def test_capacity_zero_holds_nothing_and_negative_is_refused():
    lru = TierLRU(0)
    lru.put(1, 0.0)
    assert len(lru) == 0 and not lru.ready(1, 10.0)
    with pytest.raises(ValueError, match=">= 0 blocks"):
        TierLRU(-1)


def test_a_block_is_not_served_before_its_ready_time_and_a_second_put_keeps_the_earlier():
    lru = TierLRU(4)
    lru.put(7, 5.0)
    assert not lru.ready(7, 4.999)
    assert lru.ready(7, 5.0)
    lru.put(7, 9.0)  # stored again later: the copy that landed at 5 still serves
    assert lru.ready(7, 5.0)
    lru.put(8, 3.0)
    lru.put(8, 1.0)
    assert lru.ready(8, 1.0)


# --- lookups --------------------------------------------------------------------------------------


def test_the_fastest_tier_holding_a_block_serves_it():
    store = _store(DEVICE, HOST, DISK, REMOTE)
    for tier in (HOST, DISK, REMOTE):
        store.tiers[tier].put(1, 0.0)
    for tier in (DISK, REMOTE):
        store.tiers[tier].put(2, 0.0)
    store.tiers[REMOTE].put(3, 0.0)
    store.tiers[DEVICE].put(4, 0.0)
    store.tiers[REMOTE].put(4, 0.0)
    hit = store.lookup([1, 2, 3, 4], 1.0)
    assert hit.tiers == (HOST, DISK, REMOTE, DEVICE)
    assert hit.blocks == 4
    assert (hit.count(HOST), hit.count(DISK), hit.count(REMOTE), hit.count(DEVICE)) == (1, 1, 1, 1)


def test_a_gap_ends_the_run():
    store = _store(HOST, DISK)
    store.tiers[HOST].put(1, 0.0)
    store.tiers[DISK].put(3, 0.0)  # 2 held nowhere: 3 cannot be used
    assert store.lookup([1, 2, 3], 1.0) == StoreHit((HOST,))
    assert store.lookup([2, 3], 1.0) == StoreHit(())
    assert store.lookup([], 1.0).blocks == 0


def test_a_tier_serves_only_once_its_copy_has_landed():
    store = _store(HOST, DISK)
    store.tiers[HOST].put(1, 2.0)
    store.tiers[DISK].put(1, 1.0)
    assert store.lookup([1], 0.5) == StoreHit(())
    assert store.lookup([1], 1.5) == StoreHit((DISK,))  # the host's copy not there yet
    assert store.lookup([1], 2.0) == StoreHit((HOST,))


def test_a_server_without_a_tier_never_finds_blocks_there():
    pool = TierLRU(8)
    pool.put(1, 0.0)
    assert ServerStore({HOST: TierLRU(8)}).lookup([1], 1.0).blocks == 0
    assert ServerStore({HOST: TierLRU(8), REMOTE: pool}).lookup([1], 1.0) == StoreHit((REMOTE,))


# --- stores ---------------------------------------------------------------------------------------


def test_store_writes_through_every_tier_each_ready_at_its_time():
    store = _store(DEVICE, HOST, DISK, REMOTE)
    ready = {DEVICE: 1.0, HOST: 1.5, DISK: 3.0, REMOTE: 2.0}
    assert store.store([1, 2], ready, 1.0) == 2
    for tier, t in ready.items():
        assert not store.tiers[tier].ready(1, t - 0.01)
        assert store.tiers[tier].ready(1, t) and store.tiers[tier].ready(2, t)


def test_fresh_names_the_keys_a_store_would_write():
    store = _store(DEVICE, HOST)
    store.tiers[DEVICE].put(1, 0.0)
    store.tiers[DEVICE].put(2, 5.0)
    assert store.fresh([1, 2, 3], 1.0) == [2, 3]
    assert _store(HOST).fresh([1, 2], 1.0) == [1, 2]


def test_store_leaves_keys_the_device_tier_holds_alone():
    store = _store(DEVICE, HOST, DISK)
    store.tiers[DEVICE].put(1, 0.0)
    stored = store.store([1, 2, 3], {DEVICE: 1.0, HOST: 1.0, DISK: 1.0}, 1.0)
    assert stored == 2
    assert not store.tiers[HOST].ready(1, 10.0) and not store.tiers[DISK].ready(1, 10.0)
    assert all(store.tiers[t].ready(k, 10.0) for t in (HOST, DISK) for k in (2, 3))


def test_a_device_copy_not_landed_yet_does_not_stop_a_store():
    store = _store(DEVICE, HOST)
    store.tiers[DEVICE].put(1, 5.0)  # a load still in flight at 1.0
    assert store.store([1], {DEVICE: 1.0, HOST: 1.0}, 1.0) == 1
    assert store.tiers[HOST].ready(1, 1.0)


def test_store_without_a_device_tier_writes_every_key():
    store = _store(HOST, DISK)
    assert store.store([1, 2], {HOST: 0.0, DISK: 0.0}, 0.0) == 2
    assert store.lookup([1, 2], 0.0) == StoreHit((HOST, HOST))


# --- loads ----------------------------------------------------------------------------------------


def test_a_pool_load_is_staged_in_host_written_down_to_disk_and_lands_in_the_device_tier():
    store = _store(DEVICE, HOST, DISK, REMOTE)
    store.tiers[REMOTE].put(1, 0.0)
    store.tiers[DISK].put(2, 0.0)
    hit = store.lookup([1, 2], 1.0)
    assert hit.tiers == (REMOTE, DISK)
    store.loaded([1, 2], hit, 1.25)
    assert store.tiers[DEVICE].ready(1, 1.25) and store.tiers[DEVICE].ready(2, 1.25)
    assert store.tiers[HOST].ready(1, 1.25) and store.tiers[DISK].ready(1, 1.25)
    assert not store.tiers[HOST].ready(2, 10.0)  # a disk load is not copied up to host
    assert not store.tiers[DEVICE].ready(1, 1.2)  # there from when the load ends
    assert store.lookup([1, 2], 2.0) == StoreHit((DEVICE, DEVICE))


def test_a_pool_load_into_a_server_without_a_disk_tier_stays_in_device_and_host():
    store = _store(DEVICE, HOST, REMOTE)
    store.tiers[REMOTE].put(1, 0.0)
    store.loaded([1], store.lookup([1], 0.0), 0.5)
    assert set(store.tiers) == {DEVICE, HOST, REMOTE}
    assert store.tiers[HOST].ready(1, 0.5) and store.tiers[DEVICE].ready(1, 0.5)


def test_a_load_refreshes_the_block_where_it_was_found():
    store = ServerStore({HOST: TierLRU(2)})
    store.tiers[HOST].put(1, 0.0)
    store.tiers[HOST].put(2, 0.0)
    store.loaded([1], store.lookup([1], 1.0), 1.0)
    store.tiers[HOST].put(3, 1.0)  # evicts 2, the least recently used now
    assert store.lookup([1], 2.0) == StoreHit((HOST,))
    assert store.lookup([2], 2.0).blocks == 0


def test_one_pool_is_shared_by_the_servers_on_it():
    pool = TierLRU(8)
    a = ServerStore({DEVICE: TierLRU(8), HOST: TierLRU(8), REMOTE: pool})
    b = ServerStore({DEVICE: TierLRU(8), HOST: TierLRU(8), REMOTE: pool})
    a.store([1], {DEVICE: 0.0, HOST: 0.0, REMOTE: 0.5}, 0.0)
    assert b.lookup([1], 0.4).blocks == 0
    assert b.lookup([1], 0.5) == StoreHit((REMOTE,))
    assert a.lookup([1], 0.5) == StoreHit((DEVICE,))
