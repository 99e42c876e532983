"""Memory a cache serves KV from is its own (issue 41): another user who reaches the transfer
engine that the pool's client runs in the cache's process reads none of it and changes none of it.

Mooncake's handshake port gives any client the address of every buffer registered with the
engine, and a transfer-engine client may then read and write them. Here the pool is real (an
embedded pool of the test's own), and so is the attacker: a transfer engine of its own, run as
``nobody``, that asks the cache process's handshake port for its segment and reads, then
overwrites, every buffer it lists. A pool started by root runs in a network of its own, which
``nobody`` cannot reach (tests/pool/test_listeners.py); the attacker here is let in, as a
hostile process on a pool's shared network would be. What it can reach is the remote tier's own staging; a value
changed there after it landed is a miss, counted, never served.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch
from cache_support import assert_loaded_bytes, assert_quiescent, kv_for, tokens
from engine_support import attack, listening, segment_descriptor

from kvstrata.cache import CacheConfig, TieredCache
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.manager.plans import Failure, StopReason
from kvstrata.media import Medium
from kvstrata.policies.write import WritePolicy, WriteRule
from kvstrata.pool.config import read_secret
from kvstrata.tiers.staging import STAGE_BYTES

pytestmark = pytest.mark.slow  # minutes: the fast loop leaves it out (tests/conftest.py)

LAYOUT = KVLayout(num_layers=2, block_tokens=16, kv_heads=2, head_dim=32, dtype=DType.BF16)  # 8 KiB a block
B = LAYOUT.block_bytes
D, H, R = Medium.DEVICE, Medium.HOST, Medium.REMOTE
WAIT_S = 10.0


@pytest.fixture
def cache(private_pool):
    """Device (a CPU stand-in for HBM), host and pool tiers, write-through, sealed with the
    pool's secret: every stored block is in all three at once."""
    assert read_secret(private_pool.config) is not None
    config = CacheConfig(LAYOUT, f"served-{uuid.uuid4().hex[:12]}", device_bytes=8 * B, host_bytes=8 * B,
                         device="cpu", write=WriteRule(WritePolicy.WRITE_THROUGH), pool=private_pool.config,
                         remote_bytes=64 * B)
    made = TieredCache(config)
    yield made
    made.close()


def served(cache: TieredCache) -> list[tuple[str, torch.Tensor]]:
    """The memory KV is served from: each memory tier's whole buffer."""
    return [(medium.label, cache.tier(medium).buffer) for medium in (D, H)]


def engine_segments(network: str | None) -> dict[int, dict]:
    """{handshake port: the segment it hands out} of every transfer engine in this process, in
    the pool's network (a pool client parks its store for reuse: earlier tests' engines live on)."""
    found = {}
    for listener in listening(os.getpid(), network):
        segment = segment_descriptor(listener.port, network=network)
        if segment is not None and "buffers" in segment:
            found[listener.port] = segment
    assert found, f"no handshake port answers among this process's listeners {listening(os.getpid(), network)}"
    return found


def overlaps(memory: torch.Tensor, address: int, length: int) -> bool:
    start = memory.data_ptr()
    return start < address + length and address < start + memory.numel() * memory.element_size()


def stored_and_loaded_through_the_pool(cache: TieredCache, seq: int) -> list[int]:
    """A sequence stored (in every tier), then loaded back from the pool alone (so this thread's
    and the movers' staging buffers exist); its tokens."""
    toks = tokens(seq, 4, LAYOUT)
    cache.store(toks, kv_for(cache, toks)).result(timeout=WAIT_S)
    cache.evict(D, 8)
    cache.evict(H, 8)
    handle = cache.load(cache.lookup(toks))
    assert handle.wait(timeout=WAIT_S).blocks == 4
    assert_loaded_bytes(cache, handle, cache.keys(toks))
    handle.release()
    return toks


def test_no_memory_a_cache_serves_from_is_registered_with_the_transfer_engine(cache):
    stored_and_loaded_through_the_pool(cache, 1)
    segments = engine_segments(cache.config.pool.network).values()
    listed = [(b["addr"], b["length"]) for segment in segments for b in segment["buffers"]]
    registered = listed + [(lo, hi - lo) for lo, hi in cache.tier(R)._client._ranges]
    exposed = [(label, hex(a), n) for label, memory in served(cache) for a, n in registered if overlaps(memory, a, n)]
    assert exposed == [], f"served memory registered with the transfer engine: {exposed}"
    # What is registered: the remote tier's own staging (the movers' lanes), which the attacker sees.
    assert any(n == STAGE_BYTES for _, n in listed), listed


def test_another_user_who_overwrites_every_registered_buffer_changes_no_byte_the_cache_serves(cache):
    toks = stored_and_loaded_through_the_pool(cache, 2)
    keys = cache.keys(toks)
    cache.store(toks, kv_for(cache, toks)).result(timeout=WAIT_S)  # back in the host tier (and device)
    assert cache.lookup(toks).media == (D,) * 4
    before = {label: memory.clone() for label, memory in served(cache)}
    network = cache.config.pool.network  # the attacker, as nobody, inside it: every buffer read, overwritten
    hits = [hit for port in engine_segments(network) for hit in attack(port, network=network)]
    assert hits and all(h["read"] == 0 and h["wrote"] == 0 for h in hits), hits  # the attack itself worked
    assert all(torch.equal(memory, before[label]) for label, memory in served(cache)), "served memory changed"
    for drop in ((), (D,), (D, H)):  # served from the device tier, the host tier, then the pool
        for medium in drop:
            cache.evict(medium, 8)
        handle = cache.load(cache.lookup(toks))
        result = handle.wait(timeout=WAIT_S)
        assert result.blocks == 4, (drop, result)
        assert_loaded_bytes(cache, handle, keys)  # 0 wrong bytes
        handle.release()
    assert_quiescent(cache)


def test_bytes_changed_in_staging_after_they_landed_are_a_counted_miss(cache, monkeypatch):
    # An attacker's write into the tier's staging (registered, so reachable) that lands after the
    # get and before the copy out: what is verified is the copy, so it is a miss, never served.
    from kvstrata.tiers.remote import RemoteTier

    toks = stored_and_loaded_through_the_pool(cache, 3)
    keys = cache.keys(toks)
    cache.evict(D, 8)
    cache.evict(H, 8)
    check = RemoteTier._check_got

    def scribbled(tier, client, lane, keys_, names, blocks, batch, got, half, out):
        lane.stage[half, : len(batch), 100] ^= 0xFF  # one byte of each landed value
        return check(tier, client, lane, keys_, names, blocks, batch, got, half, out)

    monkeypatch.setattr(RemoteTier, "_check_got", scribbled)
    corrupt = cache.metrics.failed_legs[(D, Failure.CORRUPT)]
    handle = cache.load(cache.lookup(toks))
    result = handle.wait(timeout=WAIT_S)
    assert_loaded_bytes(cache, handle, keys)  # 0 wrong bytes
    handle.release()
    assert (result.blocks, result.stopped, result.stopped_at) == (0, StopReason.CORRUPT, R)
    assert cache.metrics.failed_legs[(D, Failure.CORRUPT)] > corrupt  # counted
    monkeypatch.undo()
    assert_quiescent(cache)
