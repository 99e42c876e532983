"""Stores a pool client leaves behind (``kvstrata.pool.parking``): the kept ones no longer only
grow. A store kept open (its client closed while DOWN) is closed, off the caller's thread, once
more than ``KEPT_MOST`` are kept, its calls have all returned and its pool answers; one with a
call still running in it stays."""

from __future__ import annotations

import time
from concurrent.futures import Future

from kvstrata.pool import parking
from kvstrata.pool.client import PoolClient
from kvstrata.pool.config import RemoteMode
from tests.process_support import wait_until

CLOSE_S = 3.0  # closing one healthy store takes ~1 s; on a loaded 2-core host, more


def kept_store(pool) -> object:
    """A real store of ``pool`` left kept open: its client closed while DOWN."""
    client = PoolClient(pool, RemoteMode.TCP, backoff_s=60, backoff_max_s=60)
    store = client._store
    client.mark_down("test: a client closed while down keeps its store open")
    client.close()
    return store


def test_kept_stores_are_closed_past_the_bound_once_settled_and_their_pool_answers(pool):
    before = parking.kept()
    stores = [kept_store(pool) for _ in range(parking.KEPT_MOST + 3)]
    bound = max(before, parking.KEPT_MOST)
    assert wait_until(lambda: parking.kept() <= bound, (len(stores) + 2) * CLOSE_S), parking.kept()
    with parking._lock:
        still = {id(entry.store) for entry in parking._kept}
    assert sum(id(store) not in still for store in stores) >= len(stores) - parking.KEPT_MOST  # the oldest closed


def test_a_kept_store_with_a_call_still_running_is_never_closed(pool):
    running: Future = Future()  # a call abandoned in the store, not returned yet
    busy = kept_store(pool)
    with parking._lock:  # the entry just kept: now with that call in flight
        (entry,) = [e for e in parking._kept if e.store is busy]
        parking._kept[parking._kept.index(entry)] = parking._Kept(entry.store, entry.key, entry.memory, (running,))
    for _ in range(parking.KEPT_MOST + 1):  # past the bound: pruning runs
        kept_store(pool)
    assert wait_until(lambda: parking.kept() <= parking.KEPT_MOST + 1, (parking.KEPT_MOST + 3) * CLOSE_S)
    time.sleep(0.1)
    with parking._lock:
        assert any(e.store is busy for e in parking._kept)  # older than every other, and still open
    running.set_result(None)
