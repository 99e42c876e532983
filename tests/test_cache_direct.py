"""Puts and gets between the cache's tiers and a caller's own memory (``TieredCache.put`` /
``get_into``), on real tiers: a host tier, a disk directory, the session pool.

The caller's memory here is one buffer holding many blocks "piece j of every block together"
(as SGLang's page-first host pool holds K of every page, then V): no block lies in one run.
"""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from cache_support import LAYOUT, assert_quiescent, tokens
from kvstrata.cache import CacheConfig, TieredCache
from kvstrata.media import Medium
from kvstrata.policies.write import WritePolicy, WriteRule

HALF = LAYOUT.block_bytes // 2


def caller_memory(blocks: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (blocks * LAYOUT.block_bytes,), dtype=torch.uint8, generator=generator)


def pieces(memory: torch.Tensor, blocks: int) -> list[list[torch.Tensor]]:
    """Each block as two pieces: its first halves lie together, then its second halves."""
    first, second = memory[: blocks * HALF], memory[blocks * HALF :]
    return [[first[i * HALF : (i + 1) * HALF], second[i * HALF : (i + 1) * HALF]] for i in range(blocks)]


def whole(blocks: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [torch.cat(b) for b in blocks]


@pytest.fixture
def make(tmp_path):
    made = []

    def build(**fields) -> TieredCache:
        fields = {"host_bytes": 0, "disk_bytes": 0, "model_id": "direct-test", **fields}
        config = CacheConfig(layout=LAYOUT, device="cpu", device_bytes=LAYOUT.block_bytes, **fields)
        cache = TieredCache(config)
        made.append(cache)
        return cache

    yield build
    for cache in made:
        cache.close()


def test_a_put_writes_every_tier_below_the_device_and_a_get_reads_the_fastest(make, tmp_path):
    cache = make(host_bytes=8 * LAYOUT.block_bytes, disk_bytes=8 * LAYOUT.block_bytes, disk_dir=tmp_path)
    keys = cache.keys(tokens(1, 6))
    src = pieces(caller_memory(6), 6)
    result = cache.put(keys, src)
    assert result.stored == (True,) * 6 and result.written == 6
    assert [cache.manager.where(k) for k in keys] == [(Medium.HOST, Medium.DISK)] * 6
    assert cache.manager.table(Medium.DEVICE).used_blocks == 0  # the caller's memory plays the device
    again = cache.put(keys, src)
    assert again.stored == (True,) * 6 and again.written == 0  # there already: nothing written
    dst = pieces(torch.zeros(6 * LAYOUT.block_bytes, dtype=torch.uint8), 6)
    assert cache.get_into(keys, dst) == 6
    assert all(torch.equal(a, b) for a, b in zip(whole(dst), whole(src)))
    assert cache.metrics.moved_bytes[(Medium.HOST, Medium.DEVICE)] == 6 * LAYOUT.block_bytes  # read from the host
    assert_quiescent(cache)


def test_a_get_reads_the_leading_run_and_a_block_that_fails_verification_ends_it(make, tmp_path):
    cache = make(disk_bytes=8 * LAYOUT.block_bytes, disk_dir=tmp_path)
    keys = cache.keys(tokens(2, 5))
    src = pieces(caller_memory(5, seed=1), 5)
    assert cache.put(keys[:4], src[:4]).stored == (True,) * 4  # the fifth is never stored
    (victim,) = [p for p in tmp_path.rglob("*.kvb") if p.name.startswith(keys[2].hex())]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    dst = pieces(torch.zeros(5 * LAYOUT.block_bytes, dtype=torch.uint8), 5)
    assert cache.get_into(keys, dst) == 2
    assert all(torch.equal(a, b) for a, b in zip(whole(dst[:2]), whole(src[:2])))
    assert cache.match(keys).blocks == 2  # the corrupt copy left its tier
    assert_quiescent(cache)


def test_write_back_puts_a_batch_larger_than_the_host_tier_in_rounds_its_evictions_going_down(make, tmp_path):
    cache = make(host_bytes=2 * LAYOUT.block_bytes, disk_bytes=16 * LAYOUT.block_bytes, disk_dir=tmp_path,
                 write=WriteRule(WritePolicy.WRITE_BACK))
    keys = cache.keys(tokens(3, 7))
    src = pieces(caller_memory(7, seed=2), 7)
    result = cache.put(keys, src)
    assert result.stored == (True,) * 7 and result.written == 7
    assert [cache.manager.where(k) for k in keys] == [(Medium.DISK,)] * 5 + [(Medium.HOST,)] * 2
    dst = pieces(torch.zeros(7 * LAYOUT.block_bytes, dtype=torch.uint8), 7)
    assert cache.get_into(keys, dst) == 7
    assert all(torch.equal(a, b) for a, b in zip(whole(dst), whole(src)))
    assert_quiescent(cache)


def test_a_put_no_tier_has_room_for_is_refused_block_by_block(make, tmp_path):
    cache = make(disk_bytes=2 * LAYOUT.block_bytes, disk_dir=tmp_path)
    held = cache.keys(tokens(4, 2))
    assert cache.put(held, pieces(caller_memory(2), 2)).stored == (True, True)
    for key in held:  # readers hold both disk slots: nothing can leave
        assert cache.manager.pin(Medium.DISK, key) is not None
    keys = cache.keys(tokens(5, 3))
    assert cache.put(keys, pieces(caller_memory(3), 3)).stored == (False,) * 3
    cache.manager.unpin(Medium.DISK, held)
    assert cache.put(keys, pieces(caller_memory(3), 3)).stored == (True,) * 3
    assert_quiescent(cache)


def test_a_get_finds_blocks_another_cache_put_in_the_pool_from_the_callers_memory(make, pool):
    model = f"direct-{uuid.uuid4().hex[:8]}"
    writer = make(pool=pool, remote_bytes=16 * LAYOUT.block_bytes, model_id=model)
    reader = make(pool=pool, remote_bytes=16 * LAYOUT.block_bytes, model_id=model)
    memory = torch.zeros(8 * LAYOUT.block_bytes, dtype=torch.uint8)  # never registered: it moves through the tier's staging
    memory.copy_(caller_memory(8, seed=3))
    keys = writer.keys(tokens(6, 4))
    src = pieces(memory[: 4 * LAYOUT.block_bytes], 4)
    assert writer.put(keys, src).stored == (True,) * 4
    out = torch.zeros(4 * LAYOUT.block_bytes, dtype=torch.uint8)
    out.zero_()
    dst = pieces(out, 4)
    assert reader.get_into(keys, dst) == 4  # not known to the reader before: found in the pool
    assert all(torch.equal(a, b) for a, b in zip(whole(dst), whole(src)))
    assert reader.metrics.moved_bytes[(Medium.REMOTE, Medium.DEVICE)] == 4 * LAYOUT.block_bytes
    assert_quiescent(reader)
    assert_quiescent(writer)


def test_a_put_or_get_of_the_wrong_number_of_blocks_is_refused_in_one_line(make, tmp_path):
    cache = make(disk_bytes=4 * LAYOUT.block_bytes, disk_dir=tmp_path)
    keys = cache.keys(tokens(7, 2))
    with pytest.raises(ValueError, match="one block of pieces per key: 2 keys, 1 blocks"):
        cache.put(keys, pieces(caller_memory(1), 1))
    cache.put(keys, pieces(caller_memory(2), 2))
    with pytest.raises(ValueError, match="one block of pieces per key: 2 keys, 3 blocks"):
        cache.get_into(keys, pieces(caller_memory(3), 3))
    with pytest.raises(ValueError, match="pieces add up to"):
        cache.put(cache.keys(tokens(8, 1)), [[caller_memory(1)[:HALF]]])
    device_only = make()
    with pytest.raises(ValueError, match="no tier below the device"):
        device_only.put(keys, pieces(caller_memory(2), 2))


def test_a_block_held_only_in_a_tier_reads_from_it_at_the_tier_s_speed(make, tmp_path):
    """How a scheduler learns that a capped disk recovered: a block only that tier holds
    (``held_only_in``) read into the caller's memory comes from that tier, at its speed, and
    nothing moves; a tier holding no such block has none to offer."""
    cap_gbps = LAYOUT.block_bytes / 0.05 / 1e9  # a block in 50 ms
    cache = make(host_bytes=8 * LAYOUT.block_bytes, disk_bytes=8 * LAYOUT.block_bytes, disk_dir=tmp_path,
                 disk_read_gbps=cap_gbps)
    keys = cache.keys(tokens(3, 4))
    cache.put(keys, pieces(caller_memory(4), 4))
    assert cache.manager.held_only_in(Medium.DISK) is None  # every block is on the host too
    assert cache.manager.held_only_in(Medium.HOST) in keys
    cache.evict(Medium.HOST, 2)  # two blocks now only on the disk
    only_disk = [k for k in keys if cache.manager.where(k) == (Medium.DISK,)]
    key = cache.manager.held_only_in(Medium.DISK)
    assert len(only_disk) == 2 and key in only_disk
    start = time.perf_counter()
    assert cache.get_into([key], [[torch.zeros(LAYOUT.block_bytes, dtype=torch.uint8)]]) == 1
    assert time.perf_counter() - start >= 0.04  # the cap: the read came from the disk
    assert [cache.manager.where(k) for k in only_disk] == [(Medium.DISK,)] * 2  # nothing moved
    assert_quiescent(cache)
