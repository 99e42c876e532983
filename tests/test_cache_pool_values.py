"""What a cache makes of pool values it did not expect: never wrong KV, a counted miss instead.

The pool is real (the session's pool, used here without its secret where a test says so), and so
is whoever writes the unexpected value: a raw Mooncake client putting bytes under a block's
object name, as a late put from reused memory or a replay would.
"""

from __future__ import annotations

import dataclasses
import uuid

import pytest
import torch
from cache_support import assert_loaded_bytes, assert_quiescent, kv_for, tokens

from kvstrata.cache import CacheConfig, TieredCache
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.manager.plans import Failure, StopReason
from kvstrata.media import Medium
from kvstrata.policies.write import WritePolicy, WriteRule
from kvstrata.pool.client import PoolClient
from kvstrata.pool.config import PoolConfig
from kvstrata.tiers import poolvalue

LAYOUT = KVLayout(num_layers=2, block_tokens=16, kv_heads=2, head_dim=32, dtype=DType.BF16)  # 8 KiB a block
B = LAYOUT.block_bytes
VALUE = poolvalue.HEADER_BYTES + B
D, R = Medium.DEVICE, Medium.REMOTE
WAIT_S = 10.0


@pytest.fixture
def caches():
    made: list[TieredCache] = []

    def make(pool: PoolConfig, model: str, remote_blocks: int = 64) -> TieredCache:
        # Device and pool only, write-through: every stored block is in the pool at once.
        config = CacheConfig(LAYOUT, model, device_bytes=8 * B, host_bytes=0, device="cpu",
                             write=WriteRule(WritePolicy.WRITE_THROUGH), pool=pool, remote_bytes=remote_blocks * B)
        made.append(TieredCache(config))
        return made[-1]

    yield make
    for cache in made:
        cache.close()


@pytest.fixture(scope="module")
def raw(pool):
    """A raw client of the pool and a registered buffer of two values."""
    client = PoolClient(pool)
    buffer = client.allocate(2 * VALUE)
    yield client, buffer
    client.close()


def raw_get(raw, name: str) -> bytes:
    client, buffer = raw
    (got,) = client.call("raw get", "batch_get_into", [name], [buffer.data_ptr()], [VALUE])
    assert got == VALUE, got
    return buffer[:VALUE].numpy().tobytes()


def raw_put(raw, name: str, value: bytes) -> None:
    client, buffer = raw
    client.call("raw remove", "remove", name, True)
    buffer[: len(value)] = torch.frombuffer(bytearray(value), dtype=torch.uint8)
    assert client.call("raw put", "batch_put_from", [name], [buffer.data_ptr()], [len(value)]) == [0]


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
    a, b = (raw_get(raw, tier.object_name(keys[i])) for i in (1, 2))
    raw_put(raw, tier.object_name(keys[1]), a[: poolvalue.HEADER_BYTES] + b[poolvalue.HEADER_BYTES :])
    match = reader.lookup(toks)
    assert match.media == (R,) * 4
    handle = reader.load(match)
    result = handle.wait(timeout=WAIT_S)
    assert_loaded_bytes(reader, handle, keys)  # 0 wrong bytes: what loaded is what was stored
    handle.release()
    assert (result.blocks, result.stopped, result.stopped_at) == (1, StopReason.CORRUPT, R)
    assert reader.metrics.failed_legs[(D, Failure.CORRUPT)] == 1  # counted
    assert_quiescent(reader)
