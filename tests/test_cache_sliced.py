"""Head-sliced KV: blocks written at one TP size are read at any other, byte for byte.

Every (writer TP, reader TP) pair over {1, 2, 4, 8} on a GQA group of 8 KV heads and one of 2
(heads replicated past TP=2) and MLA's one latent: each reader rank gets exactly the bytes of the
heads it holds. A block one rank lacks a slice of is a miss for the whole instance. Real tiers:
one shared cache (device + host), and a disk directory written by one process's caches and
read by fresh ones.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kvstrata.cache import CacheConfig, TieredCache
from kvstrata.cache.sliced import SlicedRank, instance_matches
from kvstrata.index.keys import Namespace
from kvstrata.kv.fields import GeometryError
from kvstrata.kv.geometry import DType
from kvstrata.kv.groups import GroupKind, KVGroup
from kvstrata.kv.heads import HeadSlicing
from kvstrata.kv.layout import KVLayout
from kvstrata.media import Medium
from kvstrata.policies.write import WritePolicy, WriteRule

TPS = (1, 2, 4, 8)
BLOCK = 16
GQA8 = KVGroup(GroupKind.FULL, (0, 1), DType.BF16, kv_heads=8, head_dim=16)
GQA2 = KVGroup(GroupKind.FULL, (0, 1), DType.BF16, kv_heads=2, head_dim=16)
MLA = KVGroup(GroupKind.MLA, (0, 1), DType.BF16, kv_heads=1, head_dim=24)


def model_kv(group: KVGroup, blocks: int, seed: int) -> torch.Tensor:
    """The whole model's KV of a sequence, ``[layers, kv, tokens, all heads, head_dim]``: random bits."""
    heads = 1 if group.kind is GroupKind.MLA else group.kv_heads
    shape = (group.num_layers, group.kv_tensors, blocks * BLOCK, heads, group.head_dim)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen).view(torch.bfloat16)


def seq(seed: int, blocks: int) -> list[int]:
    return [seed * 100_000 + i for i in range(blocks * BLOCK)]


def config(group: KVGroup, tmp_path=None, blocks: int = 512, disk: int = 0, model_id: str = "tiny-sliced",
           **changes) -> CacheConfig:
    layout = KVLayout.head_slice(group, BLOCK)
    b = layout.block_bytes
    return CacheConfig(layout, model_id, device_bytes=blocks * b, host_bytes=blocks * b,
                       disk_bytes=disk * b, disk_dir=tmp_path if disk else None,
                       write=WriteRule(WritePolicy.WRITE_THROUGH), **changes)


def ranks(cache: TieredCache, group: KVGroup, tp: int) -> list[SlicedRank]:
    slicing = HeadSlicing.for_group(group)
    return [SlicedRank(cache, slicing, tp, r) for r in range(tp)]


def write(cache: TieredCache, group: KVGroup, tp: int, toks: list[int], kv: torch.Tensor) -> None:
    for rank in ranks(cache, group, tp):
        rank.store(toks, kv[:, :, :, rank.heads.start:rank.heads.stop].clone()).result()


def read(cache: TieredCache, group: KVGroup, tp: int, toks: list[int]) -> list[tuple[SlicedRank, torch.Tensor | None, int]]:
    """Each rank of a TP=``tp`` instance: its loaded KV and its blocks (the instance's common prefix)."""
    readers = ranks(cache, group, tp)
    out = []
    for rank, match in zip(readers, instance_matches(readers, readers[0].keys(toks))):
        with rank.load(match) as load:
            result = load.wait(10)
            out.append((rank, load.kv() if result.blocks else None, result.blocks))
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


@pytest.mark.parametrize("group", [GQA8, GQA2, MLA], ids=["gqa-8-heads", "gqa-2-heads", "mla"])
def test_every_writer_tp_and_reader_tp_pair_reads_exactly_its_heads(group):
    blocks = 3
    with TieredCache(config(group)) as cache:
        for seed, (writer, reader) in enumerate(itertools.product(TPS, TPS)):
            toks, kv = seq(seed, blocks), model_kv(group, blocks, seed)
            write(cache, group, writer, toks, kv)
            for rank, loaded, got in read(cache, group, reader, toks):
                assert got == blocks, f"TP {writer} -> {reader}: rank {rank.tp_rank} loaded {got} of {blocks} blocks"
                want = kv[:, :, :, rank.heads.start:rank.heads.stop]
                assert same_bytes(loaded, want), f"TP {writer} -> {reader}: rank {rank.tp_rank} got other bytes"


@pytest.mark.parametrize("group, copies", [(GQA8, 8), (GQA2, 2), (MLA, 1)], ids=["gqa-8-heads", "gqa-2-heads", "mla"])
def test_one_copy_per_slice_whatever_tp_wrote_it(group, copies):
    """Replicated heads (2 heads at TP=8, MLA's latent on every rank) are stored once per block."""
    with TieredCache(config(group)) as cache:
        toks, kv = seq(1, 2), model_kv(group, 2, 1)
        for tp in TPS:
            write(cache, group, tp, toks, kv)
            assert len(cache.manager.table(Medium.HOST).ready_keys()) == 2 * copies, f"after TP {tp}"


def test_a_slice_one_rank_lacks_makes_its_block_a_miss_for_every_tp():
    group, blocks = GQA8, 4
    with TieredCache(config(group)) as cache:
        toks, kv = seq(7, blocks), model_kv(group, blocks, 7)
        writers = ranks(cache, group, 2)
        writers[0].store(toks, kv[:, :, :, 0:4].clone()).result()
        writers[1].store(toks[: 2 * BLOCK], kv[:, :, : 2 * BLOCK, 4:8].clone()).result()  # heads 4-7: blocks 0-1 only
        assert writers[0].lookup(toks).blocks == blocks  # rank 0's own slices are all there
        for tp in TPS:
            for rank, loaded, got in read(cache, group, tp, toks):
                assert got == 2, f"TP {tp} rank {rank.tp_rank} loaded {got} blocks, not the 2 every rank has"
                assert same_bytes(loaded, kv[:, :, : 2 * BLOCK, rank.heads.start:rank.heads.stop])


def test_slices_written_to_disk_by_one_tp_serve_fresh_caches_of_another(tmp_path):
    group, blocks = GQA8, 3
    toks, kv = seq(3, blocks), model_kv(group, blocks, 3)
    with TieredCache(config(group, tmp_path, disk=64)) as cache:
        write(cache, group, 8, toks, kv)
    with TieredCache(config(group, tmp_path, disk=64)) as cache:  # a new process's cache: the files only
        tp1 = ranks(cache, group, 1)[0]
        assert set(tp1.lookup(toks).media) == {Medium.DISK}
        with tp1.load(tp1.lookup(toks)) as load:  # routes and blocks counted in blocks, not 8 slices each
            result = load.wait(10)
            assert result.blocks == blocks and result.paths == {(Medium.DISK, Medium.DEVICE): blocks}
        for medium in (Medium.DEVICE, Medium.HOST):
            cache.evict(medium, 64)
        for rank, loaded, got in read(cache, group, 2, toks):
            assert got == blocks and same_bytes(loaded, kv[:, :, :, rank.heads.start:rank.heads.stop])


def test_a_head_sliced_namespace_names_no_tp_size_and_differs_from_every_tp_matched_one():
    sliced = config(GQA8).namespace()
    assert sliced.tp_free and sliced.tp_size is None
    assert sliced.digest == config(GQA8, tp_rank=1, tp_size=2).namespace().digest  # the rank does not matter
    matched = {CacheConfig(KVLayout.for_group(GQA8, BLOCK, tp), "tiny-sliced", device_bytes=1 << 20, host_bytes=0,
                           tp_rank=0, tp_size=tp).namespace().digest for tp in TPS}
    assert len(matched) == 4 and sliced.digest not in matched
    with pytest.raises(ValueError, match="both None"):
        Namespace("m", "bf16", "x", 16, tp_rank=None, tp_size=2)


def test_a_rank_that_holds_part_of_a_slice_is_refused_in_one_line():
    with pytest.raises(GeometryError, match="not whole slices of 4 heads"):
        HeadSlicing(8, 4).rank_slices(4, 1)
    with pytest.raises(GeometryError, match="must divide the 8 KV heads"):
        HeadSlicing(8).rank_heads(3, 0)
    with pytest.raises(GeometryError, match="granularity"):
        HeadSlicing(8, 3)
    with TieredCache(config(GQA8)) as cache, pytest.raises(ValueError, match="slices hold 1 KV heads"):
        SlicedRank(cache, HeadSlicing(8, 2), 2, 0)


def test_slices_in_the_shared_pool_serve_fresh_ranks_of_other_tp_sizes(pool):
    """Each rank is its own cache (as in its own process), all on one pool: TP=4 ranks write,
    TP=2 and TP=8 ranks (caches that never saw the blocks) find their slices there."""
    import uuid

    group, blocks = GQA8, 3
    toks, kv = seq(11, blocks), model_kv(group, blocks, 11)
    model = f"sliced-{uuid.uuid4().hex[:12]}"

    def rank_caches(tp: int) -> list[tuple[TieredCache, SlicedRank]]:
        out = []
        for r in range(tp):
            cache = TieredCache(config(group, blocks=32, model_id=model, pool=pool,
                                       remote_bytes=256 * KVLayout.head_slice(group, BLOCK).block_bytes))
            out.append((cache, SlicedRank(cache, HeadSlicing.for_group(group), tp, r)))
        return out

    writers = rank_caches(4)
    try:
        for _, rank in writers:
            rank.store(toks, kv[:, :, :, rank.heads.start:rank.heads.stop].clone()).result()
    finally:
        for cache, _ in writers:
            cache.close()
    for tp in (2, 8):
        readers = rank_caches(tp)
        try:
            matches = instance_matches([r for _, r in readers], readers[0][1].keys(toks))
            for (_, rank), match in zip(readers, matches):
                assert match.blocks == blocks and set(match.media) == {Medium.REMOTE}
                with rank.load(match) as load:
                    assert load.wait(10).blocks == blocks
                    assert same_bytes(load.kv(), kv[:, :, :, rank.heads.start:rank.heads.stop])
        finally:
            for cache, _ in readers:
                cache.close()


def test_a_rank_whose_device_tier_is_smaller_than_a_store_stores_every_slice_in_the_pool(pool):
    """A rank's slices are stored one slice after another: at once, each slice's store pinned the
    small device tier with its write-downs and the others were refused (nothing reached the pool)."""
    import uuid

    group, blocks = GQA2, 9
    toks, kv = seq(12, blocks), model_kv(group, blocks, 12)
    layout = KVLayout.head_slice(group, BLOCK)
    cfg = CacheConfig(layout, f"sliced-{uuid.uuid4().hex[:12]}", device_bytes=4 * layout.block_bytes,
                      host_bytes=4 * layout.block_bytes, device="cpu", pool=pool, remote_bytes=256 * layout.block_bytes)
    with TieredCache(cfg) as cache:
        rank = SlicedRank(cache, HeadSlicing.for_group(group), 1, 0)
        result = rank.store(toks, kv).result()
        assert (result.new_blocks, result.refused_blocks) == (blocks, 0)
        for medium in (Medium.DEVICE, Medium.HOST):
            cache.evict(medium, 64)
        match = rank.match(rank.keys(toks))
        assert match.blocks == blocks and set(match.media) == {Medium.REMOTE}


def test_a_load_of_nothing_is_empty_kv_of_the_layouts_dtype():
    with TieredCache(config(GQA8)) as cache:
        rank = ranks(cache, GQA8, 2)[1]
        with rank.load(rank.lookup(seq(99, 2))) as load:
            assert load.wait(10).blocks == 0
            kv = load.kv()
            assert kv.shape == (2, 2, 0, 4, 16) and kv.dtype == torch.bfloat16
