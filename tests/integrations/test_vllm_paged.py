"""The connector's copies, byte for byte, without an engine: vLLM CPU's paged KV (attention
``[blocks, heads, block, 2*head_dim]``, MLA ``[blocks, 1, block, latent]``) staged and stored by
the ranks of one TP size, loaded into other block ids by the ranks of another, through one real
cache; a paged tensor of another layout refused in one line; and TP-matched blocks copied into
vLLM's out of the host tier's slots, from a disk through the cache's device tier."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from kvstrata.cache import CacheConfig, TieredCache  # noqa: E402
from kvstrata.cache.sliced import SlicedRank, pack_layout  # noqa: E402
from kvstrata.integrations.vllm.groups import VLLMGroup  # noqa: E402
from kvstrata.integrations.vllm.paged import OpaqueGroup, SlicedGroup, staging  # noqa: E402
from kvstrata.kv.geometry import DType  # noqa: E402
from kvstrata.kv.groups import GroupKind, KVGroup  # noqa: E402
from kvstrata.kv.heads import HeadSlicing  # noqa: E402
from kvstrata.kv.layout import KVLayout  # noqa: E402
from kvstrata.media import Medium  # noqa: E402

BLOCK, LAYERS, NUM_BLOCKS = 4, 2, 6
HEADS, DIM, LATENT = 4, 8, 24


def whole(kind: GroupKind) -> KVGroup:
    if kind is GroupKind.MLA:
        return KVGroup(kind, tuple(range(LAYERS)), DType.BF16, kv_heads=1, head_dim=LATENT)
    return KVGroup(kind, tuple(range(LAYERS)), DType.BF16, kv_heads=HEADS, head_dim=DIM)


def paged(kind: GroupKind, heads: int, gen: torch.Generator | None) -> list[torch.Tensor]:
    """vLLM CPU's paged KV of each layer for ``heads`` heads: random, or zeros."""
    shape = (NUM_BLOCKS, 1, BLOCK, LATENT) if kind is GroupKind.MLA else (NUM_BLOCKS, heads, BLOCK, 2 * DIM)
    if gen is None:
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    return [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]


def rank_groups(cache: TieredCache, kind: GroupKind, tp: int, gen: torch.Generator | None,
                packs: dict | None = None) -> list[SlicedGroup]:
    """The ``tp`` ranks' groups over the shared slices in ``cache``; with ``packs`` ((tp, rank) ->
    TieredCache, filled as needed: a rank's own tiers, kept for the same rank later) packs too."""
    group = whole(kind)
    slicing = HeadSlicing.for_group(group)
    out = []
    for r in range(tp):
        heads = len(slicing.rank_heads(tp, r))
        spec = VLLMGroup(0, replace(group, kv_heads=heads) if kind is not GroupKind.MLA else group,
                         tuple(f"model.layers.{i}.attn" for i in range(LAYERS)), "")
        own = None
        if packs is not None:
            if (tp, r) not in packs:
                layout = pack_layout(cache.layout, heads)
                packs[tp, r] = TieredCache(CacheConfig(layout, "paged-test", device_bytes=64 * layout.block_bytes,
                                                       host_bytes=64 * layout.block_bytes, device="cpu"))
            own = packs[tp, r]
        out.append(SlicedGroup(spec, SlicedRank(cache, slicing, tp, r, packs=own), paged(kind, heads, gen)))
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["slices", "packs"])
@pytest.mark.parametrize("kind", [GroupKind.FULL, GroupKind.MLA])
@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(1, 2), (2, 1), (4, 2), (1, 8), (2, 2)])
def test_blocks_staged_at_one_tp_load_into_another_tps_blocks(kind, writer_tp, reader_tp, packed):
    """Readers of another TP size load the writers' slices; with packs, those of the writers' own
    TP size (the same ranks, their own tiers) load their packs, whole rank blocks."""
    group = whole(kind)
    layout = KVLayout.head_slice(group, BLOCK)
    config = CacheConfig(layout, "paged-test", device_bytes=64 * layout.block_bytes, host_bytes=0, device="cpu")
    tokens = list(range(1000, 1000 + 2 * BLOCK))
    packs: dict | None = {} if packed else None
    with TieredCache(config) as cache, contextlib.ExitStack() as stack:
        stack.callback(lambda: [c.close() for c in (packs or {}).values()])
        writers = rank_groups(cache, kind, writer_tp, torch.Generator().manual_seed(1), packs)
        src_ids = [4, 1]  # vLLM's blocks of the prefix in the writer...
        for w in writers:
            keys = w.keys(tokens)
            kv = staging(w.layout, len(src_ids), w.layers[0])  # block-major, as the worker stages saves
            for layer in range(LAYERS):
                w.stage_layer(kv, layer, src_ids)
            with ThreadPoolExecutor(1) as saver:
                w.store_keys(keys, kv, saver).result()
        readers = rank_groups(cache, kind, reader_tp, None, packs)
        dst_ids = [0, 5]  # ... and the reader's
        for rd in readers:
            load = rd.load(rd.keys(tokens))
            assert load is not None and rd.match(rd.keys(tokens)).blocks == 2
            own = packed and reader_tp == writer_tp and rd.writes  # its own packs, else the shared slices
            assert [s.packed for s in load.match.segments] == [own]
            for layer in range(LAYERS):
                load.wait_layer(layer)
                rd.copy_layer(load, layer, dst_ids)
            load.release()
    for layer in range(LAYERS):
        for s, d in zip(src_ids, dst_ids):
            # the block's every head as the writers hold them (a replica's rank writes nothing)
            every = torch.cat([w.layers[layer][s] for w in writers if w.writes])
            for rd in readers:
                h = rd.rank.heads
                assert torch.equal(rd.layers[layer][d], every[h.start : h.stop]), (layer, s, rd.rank.tp_rank)
                untouched = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
                assert not rd.layers[layer][untouched].any()  # only the blocks asked for were written


def test_a_paged_layout_head_slices_cannot_read_is_refused_in_one_line():
    group = whole(GroupKind.FULL)
    layout = KVLayout.head_slice(group, BLOCK)
    config = CacheConfig(layout, "paged-test", device_bytes=8 * layout.block_bytes, host_bytes=0, device="cpu")
    spec = VLLMGroup(3, group, ("model.layers.0.attn", "model.layers.1.attn"), "")
    other = [torch.zeros((NUM_BLOCKS, 2 * BLOCK, HEADS, DIM), dtype=torch.bfloat16)] * LAYERS  # heads innermost
    with TieredCache(config) as cache:
        with pytest.raises(ValueError, match=r"^KVStrataConnector: KV cache group 3: vLLM's paged KV of shape "
                                             r"\(6, 8, 4, 8\) is not \[blocks, 4, 4, 16\]") as info:
            SlicedGroup(spec, SlicedRank(cache, HeadSlicing.for_group(group), 1, 0), other)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("source", [Medium.HOST, Medium.DISK])
def test_tp_matched_blocks_in_memory_are_copied_into_vllms_blocks_from_where_they_lie(tmp_path, source):
    """Blocks held in host memory are copied into vLLM's blocks out of the host tier's own
    slots: none passes through the cache's device tier. Blocks on disk load into the device
    tier first. Both land byte for byte in the blocks asked for and nowhere else."""
    group = whole(GroupKind.FULL)
    spec = VLLMGroup(0, group, tuple(f"model.layers.{i}.attn" for i in range(LAYERS)), "")
    written = paged(GroupKind.FULL, HEADS, torch.Generator().manual_seed(2))
    layout = OpaqueGroup.layout_of(spec, written, BLOCK, "cpu")
    host = 8 * layout.block_bytes if source is Medium.HOST else 0
    config = CacheConfig(layout, "paged-test", device_bytes=8 * layout.block_bytes, host_bytes=host,
                         disk_bytes=8 * layout.block_bytes, disk_dir=tmp_path / "disk", device="cpu")
    tokens = list(range(2000, 2000 + 3 * BLOCK))
    src_ids, dst_ids = [5, 0, 3], [1, 4, 2]
    with TieredCache(config) as cache:
        writer = OpaqueGroup(spec, cache, written)
        keys = writer.keys(tokens)
        kv = staging(writer.layout, len(src_ids), written[0])
        for layer in range(LAYERS):
            writer.stage_layer(kv, layer, src_ids)
        with ThreadPoolExecutor(1) as saver:
            assert writer.store_keys(keys, kv, saver).result().blocks == 3
        assert all(cache.manager.where(k)[0] is source for k in keys)
        reader = OpaqueGroup(spec, cache, paged(GroupKind.FULL, HEADS, None))
        load = reader.load(keys)
        for layer in range(LAYERS):
            load.wait_layer(layer)
            reader.copy_layer(load, layer, dst_ids)
        result = load.wait()
        tier = cache.tier(Medium.HOST if source is Medium.HOST else Medium.DEVICE).buffer
        start, end = tier.data_ptr(), tier.data_ptr() + tier.numel()
        assert all(start <= load.block(j).data_ptr() < end for j in range(3))  # copied from that tier's slots
        load.release()
        assert result.blocks == 3 and result.restored_bytes == 3 * layout.block_bytes
        assert {route[0] for route in result.paths} == {source}
        on_device = [Medium.DEVICE in cache.manager.where(k) for k in keys]
        assert on_device == [source is not Medium.HOST] * 3  # host blocks never went through it
    for layer in range(LAYERS):
        for s, d in zip(src_ids, dst_ids):
            assert torch.equal(reader.layers[layer][d], written[layer][s])
        untouched = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
        assert not reader.layers[layer][untouched].any()
