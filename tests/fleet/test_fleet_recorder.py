"""A server's stores and drops, per tier, as events keyed by vLLM's hashes: aliases learnt at a
store, used at a drop, forgotten when no tier holds the block; a step's events merged."""

from __future__ import annotations

import pytest

from kvstrata.fleet.events import Batch, Removed, Stored
from kvstrata.fleet.index import FleetIndex
from kvstrata.fleet.recorder import EventRecorder
from kvstrata.media import Medium

H, S, P = Medium.HOST, Medium.DISK, Medium.REMOTE
K = [bytes([i]) * 16 for i in range(4)]  # kvstrata's keys
V = [bytes([100 + i]) * 32 for i in range(4)]  # vLLM's hashes of the same blocks


def test_stores_and_drops_become_events_with_vllms_hashes_merged_per_tier():
    rec = EventRecorder()
    rec.stored(H, K[:2], V[:2])
    rec.stored(H, K[2:3], V[2:3])
    rec.stored(S, K[:1], V[:1])
    rec.removed(H, K[:1])
    rec.stored(H, K[:1], V[:1])  # held on host again
    assert rec.take(7.0) == Batch(7.0, (Stored((V[0], V[1], V[2]), H), Stored((V[0],), S), Removed((V[0],), H),
                                        Stored((V[0],), H)))
    assert rec.take(8.0) is None


def test_an_alias_lives_while_some_tier_holds_the_block():
    rec = EventRecorder()
    rec.stored(H, K[:1], V[:1])
    rec.stored(P, K[:1], V[:1])
    rec.removed(H, K[:1])
    assert rec.held() == 1
    rec.removed(P, K[:1])
    assert rec.held() == 0
    rec.removed(P, K[:1])  # learnt no more: nothing to publish
    assert rec.unknown == 1
    assert rec.take(1.0) == Batch(1.0, (Stored((V[0],), H), Stored((V[0],), P), Removed((V[0],), H),
                                        Removed((V[0],), P)))


def test_a_store_already_held_or_a_drop_not_held_publishes_nothing():
    rec = EventRecorder()
    rec.stored(H, K[:1], V[:1])
    rec.take(0.0)
    rec.stored(H, K[:1], V[:1])
    rec.removed(S, K[:1])
    assert rec.take(1.0) is None
    assert rec.unknown == 0


def test_a_key_has_one_vllm_hash():
    rec = EventRecorder()
    with pytest.raises(ValueError, match="2 keys for 1 block hashes"):
        rec.stored(H, K[:2], V[:1])
    rec.stored(H, K[:1], V[:1])
    with pytest.raises(ValueError, match="two vLLM hashes"):
        rec.stored(S, K[:1], V[1:2])


def test_a_fleet_index_fed_by_recorders_reaches_what_the_servers_hold():
    index = FleetIndex(["a", "b"])
    a = EventRecorder()
    a.stored(H, K[:3], V[:3])
    a.stored(P, K[:2], V[:2])
    index.apply("a", a.take(1.0))
    assert index.reach("a", V) == (H, H, H)
    assert index.reach("b", V) == (P, P)
    a.removed(H, K[1:2])
    index.apply("a", a.take(2.0))
    assert index.reach("a", V) == (H, P, H)  # block 1 still in the pool
