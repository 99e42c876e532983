"""A rank's packs: its slices of a block as one object in its own tiers, the slices in the pool.

A rank built by ``SlicedRank.open`` keeps, per block, one object of its heads in its device,
host and disk tiers (what a TP-matched rank keeps) and one object per slice in the shared pool.
Its own restores are of packs; ranks of other TP sizes (fresh caches, as other processes) find
the slices in the pool, and pack what they loaded when they release it. Real tiers, a real
Mooncake pool; every restore compared byte for byte with the heads stored.
"""

from __future__ import annotations

import dataclasses
import uuid

import pytest
import torch

from kvstrata.cache import CacheConfig, TieredCache
from kvstrata.cache.sliced import SlicedRank, instance_matches, pack_layout, rank_configs
from kvstrata.kv.heads import HeadSlicing
from kvstrata.kv.layout import KVLayout
from kvstrata.media import Medium
from kvstrata.policies.write import WritePolicy, WriteRule
from kvstrata.tiers.diskdir import SUFFIX
from tests.test_cache_sliced import BLOCK, GQA8, model_kv, same_bytes, seq

SLICING = HeadSlicing.for_group(GQA8)
SLICE = KVLayout.head_slice(GQA8, BLOCK)


def config(tmp_path, model: str, pool=None, disk: bool = True) -> CacheConfig:
    b = SLICE.block_bytes * 8  # a whole block of every head
    return CacheConfig(SLICE, model, device_bytes=16 * b, host_bytes=16 * b, disk_bytes=16 * b if disk else 0,
                       disk_dir=tmp_path if disk else None, write=WriteRule(WritePolicy.WRITE_THROUGH), pool=pool,
                       remote_bytes=256 * SLICE.block_bytes if pool is not None else 0, device="cpu")


def heads_of(kv: torch.Tensor, rank: SlicedRank) -> torch.Tensor:
    return kv[:, :, :, rank.heads.start:rank.heads.stop]


def open_ranks(tmp_path, model: str, tp: int, pool=None, disk: bool = True) -> list[SlicedRank]:
    """The ranks of a TP=``tp`` instance, each with its own tiers (its own disk directory)."""
    return [SlicedRank.open(config(tmp_path / f"tp{tp}-rank{r}", model, pool, disk), SLICING, tp, r) for r in range(tp)]


def restore(rank: SlicedRank, match) -> tuple[torch.Tensor, list[bool]]:
    with rank.load(match) as load:
        assert load.wait(10).blocks == match.blocks
        return load.kv(), [s.packed for s in match.segments]


def test_rank_configs_give_its_own_tiers_the_packs_and_the_pool_the_slices(tmp_path, pool):
    packs, slices = rank_configs(config(tmp_path, "m", pool), SLICING, 2, 1)
    assert packs.layout == pack_layout(SLICE, 4) and packs.layout.head_sliced and packs.layout.kv_heads == 4
    assert packs.pool is None and packs.remote_bytes == 0 and packs.disk_dir == tmp_path and packs.host_bytes > 0
    assert slices.layout == SLICE and slices.pool is pool and slices.disk_bytes == 0
    assert slices.host_bytes <= slices.device_bytes
    # the same block keys either way: the slices' namespace names the blocks
    assert packs.namespace() != slices.namespace()
    packs_only, none = rank_configs(config(tmp_path, "m"), SLICING, 2, 1)
    assert none is None and packs_only.disk_bytes > 0
    # the packs follow the config's write policy; other instances read the slices at once
    back = dataclasses.replace(config(tmp_path, "m", pool), write=WriteRule(WritePolicy.WRITE_BACK))
    packs, slices = rank_configs(back, SLICING, 2, 1)
    assert (packs.write.policy, slices.write.policy) == (WritePolicy.WRITE_BACK, WritePolicy.WRITE_THROUGH)


def test_a_rank_restores_its_own_packs_one_object_a_block_and_other_tps_the_pools_slices(tmp_path, pool):
    blocks, model = 3, f"packs-{uuid.uuid4().hex[:12]}"
    toks, kv = seq(21, blocks), model_kv(GQA8, blocks, 21)
    writers = open_ranks(tmp_path, model, 2, pool)
    try:
        for rank in writers:
            assert rank.store(toks, heads_of(kv, rank).clone()).result().new_blocks == blocks
        for rank, match in zip(writers, instance_matches(writers, writers[0].keys(toks))):
            assert match.blocks == blocks and match.media == (Medium.DEVICE,) * blocks
            loaded, packed = restore(rank, match)
            assert packed == [True] and same_bytes(loaded, heads_of(kv, rank))
            assert len(list(rank.packs.tier(Medium.DISK).directory.glob(f"*{SUFFIX}"))) == blocks  # one file a block
    finally:
        for rank in writers:
            rank.close()
    for tp in (1, 4):  # fresh ranks of other TP sizes: their own tiers are empty, the pool has the slices
        readers = open_ranks(tmp_path, model, tp, pool)
        try:
            for rank, match in zip(readers, instance_matches(readers, readers[0].keys(toks))):
                assert match.blocks == blocks and set(match.media) == {Medium.REMOTE}
                loaded, packed = restore(rank, match)
                assert packed == [False] and same_bytes(loaded, heads_of(kv, rank))
                rank.flush(10)  # what came as slices is now the rank's packs
                again = rank.match(rank.keys(toks))
                assert [s.packed for s in again.segments] == [True] and again.blocks == blocks
                loaded, _ = restore(rank, again)
                assert same_bytes(loaded, heads_of(kv, rank))
        finally:
            for rank in readers:
                rank.close()


def test_packs_on_disk_serve_the_same_rank_after_a_restart(tmp_path):
    blocks, model = 4, "packs-restart"
    toks, kv = seq(22, blocks), model_kv(GQA8, blocks, 22)
    for rank in open_ranks(tmp_path, model, 2):
        with rank:
            rank.store(toks, heads_of(kv, rank).clone()).result()
    for rank in open_ranks(tmp_path, model, 2):  # new processes, the same directories: the files only
        with rank:
            assert rank.cache is None  # no pool: a rank's KV is its packs alone
            match = rank.lookup(toks)
            assert match.media == (Medium.DISK,) * blocks
            loaded, packed = restore(rank, match)
            assert packed == [True] and same_bytes(loaded, heads_of(kv, rank))


def test_a_load_runs_packs_then_slices_then_packs_in_one_restore(tmp_path):
    """Runs of each kind: the rank's packs of blocks 0-1 and 4-5, the shared slices of blocks
    2-3 (a run goes on while its kind holds, and ends where it misses): one load, the blocks in
    order, the exact bytes."""
    blocks = 6
    toks, kv = seq(23, blocks), model_kv(GQA8, blocks, 23)
    shared = TieredCache(config(tmp_path / "shared", "mixed", disk=False))
    packs_layout = pack_layout(SLICE, 4)
    own = TieredCache(CacheConfig(packs_layout, "mixed", device_bytes=16 * packs_layout.block_bytes,
                                  host_bytes=0, device="cpu"))
    try:
        rank = SlicedRank(shared, SLICING, 2, 1, packs=own)
        writer = SlicedRank(shared, SLICING, 2, 1)  # the slices alone
        mine = heads_of(kv, rank).clone()
        keys = rank.keys(toks)
        writer.store_keys(keys[2:4], mine[:, :, 2 * BLOCK:4 * BLOCK].clone()).result()
        for run in ((0, 2), (4, 6)):
            own.store_keys(rank.pack_keys(keys[run[0]:run[1]]), mine[:, :, run[0] * BLOCK:run[1] * BLOCK]).result()
        match = rank.match(keys)
        assert [(s.packed, s.blocks) for s in match.segments] == [(True, 2), (False, 2), (True, 2)]
        with rank.load(match) as load:
            result = load.wait(10)
            assert result.blocks == blocks and result.paths == {(Medium.DEVICE,): blocks}
            assert same_bytes(load.kv(), mine)
            assert [(b, h, p.shape[3]) for b, h, p in load.pieces()][:4] == [(0, 0, 4), (1, 0, 4), (2, 0, 1), (2, 1, 1)]
            half = match.cut(3)
            assert [(s.packed, s.blocks) for s in half.segments] == [(True, 2), (False, 1)]
            assert [(s.packed, s.blocks) for s in match.after(3).segments] == [(False, 1), (True, 2)]
        rank.flush(10)  # the slices' run, 2-3, is packed on release
        assert [(s.packed, s.blocks) for s in rank.match(keys).segments] == [(True, blocks)]
    finally:
        own.close()
        shared.close()


def test_a_rank_that_lacks_its_pack_and_a_slice_misses_there():
    """A block the rank has neither a pack nor every slice of ends its match: never a partial load."""
    blocks = 3
    toks, kv = seq(24, blocks), model_kv(GQA8, blocks, 24)
    b = SLICE.block_bytes
    with TieredCache(CacheConfig(SLICE, "gap", device_bytes=64 * b, host_bytes=0, device="cpu")) as shared:
        packs_layout = pack_layout(SLICE, 8)
        with TieredCache(CacheConfig(packs_layout, "gap", device_bytes=8 * packs_layout.block_bytes, host_bytes=0,
                                     device="cpu")) as own:
            rank = SlicedRank(shared, SLICING, 1, 0, packs=own)
            keys = rank.keys(toks)
            own.store_keys(rank.pack_keys(keys[:1]), kv[:, :, :BLOCK].clone()).result()
            for j in range(7):  # 7 of block 1's 8 slices
                shared.store_keys(rank.slice_keys(keys[1:2])[j:j + 1], kv[:, :, BLOCK:2 * BLOCK, j:j + 1].clone()).result()
            match = rank.match(keys)
            assert match.blocks == 1 and [s.packed for s in match.segments] == [True]


def test_a_packs_cache_of_another_ranks_heads_is_refused_in_one_line():
    b = SLICE.block_bytes
    with TieredCache(CacheConfig(pack_layout(SLICE, 2), "m", device_bytes=8 * b, host_bytes=0, device="cpu")) as own:
        with pytest.raises(ValueError, match=r"^the packs cache's layout .* is not rank 0 of 2's") as info:
            SlicedRank(None, SLICING, 2, 0, packs=own)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="needs a cache of slices, of packs, or both"):
        SlicedRank(None, SLICING, 1, 0)


def test_a_pack_that_cannot_be_stored_costs_the_load_nothing(caplog):
    """The rank's own tiers closed under it: the load of slices still serves its KV and releases."""
    blocks = 2
    toks, kv = seq(25, blocks), model_kv(GQA8, blocks, 25)
    b = SLICE.block_bytes
    with TieredCache(CacheConfig(SLICE, "closed", device_bytes=64 * b, host_bytes=0, device="cpu")) as shared:
        own = TieredCache(CacheConfig(pack_layout(SLICE, 8), "closed", device_bytes=8 * 8 * b, host_bytes=0,
                                      device="cpu"))
        SlicedRank(shared, SLICING, 1, 0).store(toks, kv.clone()).result()
        rank = SlicedRank(shared, SLICING, 1, 0, packs=own)
        match = rank.lookup(toks)
        own.close()
        with rank.load(match) as load:
            assert load.wait(10).blocks == blocks and same_bytes(load.kv(), kv)
        assert "were not packed" in caplog.text
        assert shared.evict(Medium.DEVICE, 100) == 8 * blocks  # released: no slice left pinned
