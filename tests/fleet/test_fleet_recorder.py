"""A server's stores and drops, per tier, as events keyed by vLLM's hashes: aliases learnt from a
save, the tiers' changes heard from the block manager's index (a real cache's: stores, write-downs,
evictions), a step's events merged; nothing published for a key whose hash was never learnt."""

from __future__ import annotations

import pytest
import torch

from tests.cache_support import LAYOUT, kv_for, tokens

from kvstrata.cache import CacheConfig, TieredCache
from kvstrata.fleet.events import Batch, Removed, Stored
from kvstrata.fleet.index import FleetIndex
from kvstrata.fleet.recorder import EventRecorder
from kvstrata.index.prefix import PrefixIndex
from kvstrata.media import Medium
from kvstrata.policies.write import WritePolicy, WriteRule

H, S, P = Medium.HOST, Medium.DISK, Medium.REMOTE
K = [bytes([i]) * 16 for i in range(4)]  # kvstrata's keys
V = [bytes([100 + i]) * 32 for i in range(4)]  # vLLM's hashes of the same blocks


def test_stores_and_drops_become_events_with_vllms_hashes_merged_per_tier():
    rec = EventRecorder()
    rec.stored(H, K[:2], V[:2])
    rec.stored(H, K[2:3], V[2:3])
    rec.stored(S, K[:1])
    rec.removed(H, K[:1])
    rec.stored(H, K[:1])  # held on host again
    assert rec.take(7.0) == Batch(7.0, (Stored((V[0], V[1], V[2]), H), Stored((V[0],), S), Removed((V[0],), H),
                                        Stored((V[0],), H)))
    assert rec.take(8.0) is None


def test_an_alias_learnt_before_the_store_is_kept_while_held_then_among_the_pending():
    """Learnt, then held; once no tier holds the block its alias goes back among the pending (a
    demotion may be on its way), bounded: stored again, it is named again, until forgotten."""
    rec = EventRecorder(pending_limit=1)
    rec.learn(K[:1], V[:1])  # the save: its store is on its way
    assert rec.pending() == 1 and rec.take(0.0) is None
    rec.stored(H, K[:1])
    rec.stored(P, K[:1])
    rec.removed(H, K[:1])
    assert (rec.held(), rec.pending()) == (1, 0)
    rec.removed(P, K[:1])
    assert (rec.held(), rec.pending()) == (0, 1)
    rec.stored(S, K[:1])  # its demotion landed
    assert rec.take(1.0) == Batch(1.0, (Stored((V[0],), H), Stored((V[0],), P), Removed((V[0],), H),
                                        Removed((V[0],), P), Stored((V[0],), S)))
    rec.removed(S, K[:1])
    rec.learn(K[1:2], V[1:2])  # the pending alias of K[0] is the oldest: forgotten
    rec.stored(S, K[:1])
    assert rec.unknown == 1
    assert rec.take(2.0) == Batch(2.0, (Removed((V[0],), S),))


def test_a_block_held_before_its_hash_is_learnt_is_published_when_a_save_names_it():
    """A block recovered from disk at a start: unknown until a save names its tokens, then
    published on the tiers holding it; its drop before that publishes nothing."""
    rec = EventRecorder()
    rec.stored(S, K[:2])
    rec.stored(H, K[:1])
    rec.removed(S, K[1:2])
    assert rec.take(0.0) is None and rec.unknown == 4
    rec.learn(K[:1], V[:1])
    assert rec.take(1.0) == Batch(1.0, (Stored((V[0],), H), Stored((V[0],), S)))


def test_a_store_already_held_or_a_drop_not_held_publishes_nothing():
    rec = EventRecorder()
    rec.stored(H, K[:1], V[:1])
    rec.take(0.0)
    rec.stored(H, K[:1])
    rec.removed(S, K[:1])
    rec.removed(S, K[3:])
    assert rec.take(1.0) is None
    assert rec.unknown == 0


def test_a_key_keeps_the_first_hash_learnt_and_pending_aliases_are_bounded():
    rec = EventRecorder(pending_limit=2)
    with pytest.raises(ValueError, match="2 keys for 1 block hashes"):
        rec.learn(K[:2], V[:1])
    rec.stored(H, K[:1], V[:1])
    rec.learn(K[:1], V[1:2])  # the same tokens under a LoRA or a cache salt: vLLM's first hash stays
    assert rec.conflicts == 1
    rec.learn(K[1:4], V[1:4])  # three stores on their way: the oldest alias is forgotten
    assert rec.pending() == 2
    rec.stored(S, K[:4])
    assert rec.take(1.0) == Batch(1.0, (Stored((V[0],), H), Stored((V[0], V[2], V[3]), S)))
    assert rec.unknown == 1
    with pytest.raises(ValueError, match="pending_limit"):
        EventRecorder(pending_limit=-1)


def test_the_index_tells_its_listener_what_it_holds_then_each_change_once():
    index = PrefixIndex()
    index.add(K[0], S)
    rec = EventRecorder()
    rec.learn(K[:3], V[:3])
    index.listen(rec)
    index.add(K[0], S)  # no change: nothing told
    index.add_many([K[1], K[2], K[1]], H)
    index.discard(K[3], H)  # not held: nothing told
    index.discard(K[1], H)
    assert rec.take(1.0) == Batch(1.0, (Stored((V[0],), S), Stored((V[1], V[2]), H), Removed((V[1],), H)))
    with pytest.raises(ValueError, match="already has a listener"):
        index.listen(EventRecorder())


def test_a_real_caches_stores_write_downs_and_evictions_are_heard(tmp_path):
    """A cache of 2 host blocks over a disk, write-back: blocks put into the host are published
    there; as the host evicts, each is removed from the host and stored on disk; an explicit
    eviction from disk removes it there. The events name only the hashes learnt."""
    b = LAYOUT.block_bytes
    config = CacheConfig(LAYOUT, "events", device_bytes=2 * b, host_bytes=2 * b, disk_bytes=8 * b, disk_dir=tmp_path,
                         write=WriteRule(WritePolicy.WRITE_BACK))
    with TieredCache(config) as cache:
        rec = EventRecorder()
        cache.manager.listen(rec)
        toks = tokens(1, 4)
        keys = cache.keys(toks)
        hashes = [f"vllm-{i}".encode() for i in range(4)]
        rec.learn(keys, hashes)
        kv, bs = kv_for(cache, toks), LAYOUT.block_tokens
        for i in range(4):  # one block at a time into the host, as the connector puts a save
            block = kv[:, :, i * bs:(i + 1) * bs].contiguous()
            assert cache.put(keys[i:i + 1], [[block.view(-1).view(torch.uint8)]]).stored == (True,)
        batch = rec.take(1.0)
        assert batch is not None
        held = FleetIndex(["s"])
        held.apply("s", batch)
        assert [held.held("s", h) for h in hashes] == [(S,), (S,), (H,), (H,)]
        assert {h for e in batch.events for h in e.hashes} == set(hashes)
        assert Removed((hashes[0],), H) in batch.events and Stored((hashes[0],), S) in batch.events
        assert cache.evict(S, 1) == 1
        assert rec.take(2.0) == Batch(2.0, (Removed((hashes[0],), S),))


def test_a_fleet_index_fed_by_recorders_reaches_what_the_servers_hold():
    index = FleetIndex(["a", "b"])
    a = EventRecorder()
    a.stored(H, K[:3], V[:3])
    a.stored(P, K[:2])
    index.apply("a", a.take(1.0))
    assert index.reach("a", V) == (H, H, H)
    assert index.reach("b", V) == (P, P)
    a.removed(H, K[1:2])
    index.apply("a", a.take(2.0))
    assert index.reach("a", V) == (H, P, H)  # block 1 still in the pool
