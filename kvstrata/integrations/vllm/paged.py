"""One KV cache group's bytes between vLLM's paged KV and its kvstrata cache, two ways.

:class:`OpaqueGroup` (``kv_sharing="tp-matched"``): a kvstrata block is this rank's vLLM block
of each layer as flat elements, in a namespace of the TP rank and size; only an instance of the
same TP size finds it. Nothing depends on the order inside vLLM's block.

:class:`SlicedGroup` (``kv_sharing="head-sliced"``): a block is stored as one object per KV
head (:mod:`kvstrata.cache.sliced`), in a namespace without a TP size, so an instance of any TP
size loads exactly its heads' slices of what another stored; the first rank holding a
replicated head (MLA's latent: rank 0) writes it, the others share that copy. The rank's own
tiers (device, host, disk) keep its slices of a block packed in one object, the pool the slices
(:meth:`SlicedRank.open`). This reads vLLM's block layout, checked at registration: vLLM 0.32's
CPU attention keeps
``[num_blocks, kv_heads, block_size, 2 * head_dim]`` per layer (per head: K's tokens, then V's),
its MLA ``[num_blocks, 1, block_size, kv_lora_rank + rope_dim]`` (one latent, the same on
every rank; ``[num_blocks, block_size, ...]`` is taken too). Both are viewed as ``[num_blocks, heads, kv, block_size, head_dim]`` and copied with one
index op per layer (saves) or one ``torch._foreach_copy_`` per layer (loads).

Both answer the same calls: ``keys``, ``match`` (in blocks), ``load`` (None when not every block
is there), ``copy_layer``, ``stage_layer``, ``store_keys``; ``layout`` is this rank's KV of a
block, ``[layers, kv, block_tokens, its heads, head_dim]``.

Loads are one copy where the blocks are in memory on a CPU server: they are loaded in place
(:mod:`kvstrata.cache.inplace`), so ``copy_layer`` copies each layer out of the host (or device)
tier's own slots into vLLM's blocks, with no copy into the cache's device tier first. Blocks on
disk or in the pool, and a GPU's, land in the device tier and are copied from there.

Saves are staged block by block (``[blocks, layers, kv, block_tokens, its heads, head_dim]``:
each block one contiguous run, as the tiers keep it) and stored with the cache's caller-memory
put (:mod:`kvstrata.cache.direct`): straight from the staging into the host tier and down (a
disk file, the pool), with no copy into kvstrata's device tier and back out. Staging on a GPU
stays on the GPU and goes through the cache's device tier (its stream, after an event).
"""

from __future__ import annotations

from concurrent.futures import Executor, Future
from dataclasses import replace
from typing import Any

import torch

from kvstrata.cache import TieredCache
from kvstrata.cache.results import StoreResult
from kvstrata.cache.sliced import SlicedLoad, SlicedRank, combined_stores
from kvstrata.index.keys import BlockKey
from kvstrata.index.prefix import Match
from kvstrata.integrations.vllm.events import LOCAL_TIERS, POOL, EventSource
from kvstrata.integrations.vllm.groups import VLLMGroup
from kvstrata.kv.groups import GroupKind, KVGroup
from kvstrata.kv.layout import KVLayout

_PREFIX = "KVStrataConnector:"


class OpaqueGroup:
    """A group's blocks as this rank's opaque vLLM blocks (TP-matched)."""

    def __init__(self, spec: VLLMGroup, cache: TieredCache, layers: list[torch.Tensor]) -> None:
        self.spec, self.cache, self.layers = spec, cache, layers
        self.caches = (cache,)
        self.layout = cache.layout
        self.writes = True  # every rank stores its own blocks

    @staticmethod
    def layout_of(spec: VLLMGroup, layers: list[torch.Tensor], block_size: int, device_type: str) -> KVLayout:
        group, first = spec.group, layers[0]
        if first[0].numel() != group.kv_tensors * block_size * group.kv_heads * group.head_dim:
            raise ValueError(f"{_PREFIX} vLLM block of shape {tuple(first.shape[1:])} ({first.dtype}) in KV cache "
                             f"group {spec.index} is not {group.kv_tensors} x {block_size} tokens x "
                             f"{group.kv_heads} heads x {group.head_dim}")
        return KVLayout(group.num_layers, block_size, group.kv_heads, group.head_dim, group.dtype,
                        group.kv_tensors, name=f"vllm-{device_type} opaque")

    def keys(self, tokens: list[int]) -> list[BlockKey]:
        return self.cache.keys(tokens)

    def event_sources(self) -> tuple[EventSource, ...]:
        """Its cache, its blocks keyed as they are (:mod:`~kvstrata.integrations.vllm.events`)."""
        return (EventSource(self.cache, LOCAL_TIERS | POOL, list),)

    def match(self, keys: list[BlockKey]) -> Match:
        return self.cache.match(keys)

    def load(self, keys: list[BlockKey]) -> Any:
        part = self.cache.match(keys)
        return self.cache.load(part, in_place=True) if part.blocks == len(keys) else None

    def copy_layer(self, handle: Any, layer: int, block_ids: list[int]) -> None:
        paged = self.layers[layer]
        dst = [paged[b] for b in block_ids]
        torch._foreach_copy_(dst, [handle.block(j)[layer].view(d.shape) for j, d in enumerate(dst)])

    def stage_layer(self, staged: torch.Tensor, layer: int, block_ids: list[int]) -> None:
        paged = self.layers[layer]
        # vLLM's block b of this layer, as flat elements, becomes staged[j, layer]: one copy each, one dispatch
        torch._foreach_copy_([staged[j, layer].view(-1) for j in range(len(block_ids))],
                             [paged[b].view(-1) for b in block_ids])

    def store_keys(self, keys: list[BlockKey], staged: torch.Tensor, saver: Executor) -> Future:
        return store_staged(self.cache, keys, staged, saver)


class SlicedGroup:
    """A group's blocks as head slices (see the module text): rank ``tp_rank`` of ``tp_size``."""

    def __init__(self, spec: VLLMGroup, rank: SlicedRank, layers: list[torch.Tensor]) -> None:
        self.spec, self.rank, self.layers = spec, rank, layers
        self.caches = rank.caches
        self.layout = self.rank.layout
        slicing, tp_size, tp_rank = rank.slicing, rank.tp_size, rank.tp_rank
        self.writes = self.rank.writes  # False: an earlier rank stores these heads
        if len(self.rank.heads) != spec.group.kv_heads:
            raise ValueError(f"{_PREFIX} KV cache group {spec.index}: vLLM holds {spec.group.kv_heads} KV heads on "
                             f"TP rank {tp_rank} of {tp_size}, the head split of {slicing.kv_heads} gives "
                             f"{len(self.rank.heads)}")
        self._heads = [_head_view(spec, t, self.layout) for t in layers]  # [num_blocks, heads, kv, bs, dim]

    @staticmethod
    def whole_group(spec: VLLMGroup, total_kv_heads: int) -> KVGroup:
        """The group over every rank's KV heads, the model's ``total_kv_heads`` (vLLM's spec
        has this rank's); MLA's one latent as it is."""
        return spec.group if spec.kind is GroupKind.MLA else replace(spec.group, kv_heads=total_kv_heads)

    def keys(self, tokens: list[int]) -> list[BlockKey]:
        return self.rank.keys(tokens)

    def event_sources(self) -> tuple[EventSource, ...]:
        """The rank's packs in its own tiers, its slices in the pool (:mod:`~kvstrata.integrations.vllm.events`)."""
        rank = self.rank
        packs = (EventSource(rank.packs, LOCAL_TIERS, rank.pack_keys),) if rank.packs is not None else ()
        slices = POOL if rank.packs is not None else LOCAL_TIERS | POOL  # no packs: the slices are in every tier
        return packs + ((EventSource(rank.cache, slices, rank.slice_keys),) if rank.cache is not None else ())

    def match(self, keys: list[BlockKey]) -> Match:
        """The leading blocks of ``keys`` of which every slice this rank holds is cached."""
        m = self.rank.match(keys)
        return Match(tuple(keys[: m.blocks]), m.media, m.block_size, len(keys))

    def load(self, keys: list[BlockKey]) -> SlicedLoad | None:
        m = self.rank.match(keys)
        return self.rank.load(m, in_place=True) if m.blocks == len(keys) else None

    def copy_layer(self, load: SlicedLoad, layer: int, block_ids: list[int]) -> None:
        heads = self._heads[layer]
        pieces = load.pieces()
        # a piece is [layers, kv, bs, its heads, dim] (a pack: the rank's, a slice: g of them);
        # vLLM's heads of a block [heads, kv, bs, dim]
        torch._foreach_copy_([heads[block_ids[b], h : h + piece.shape[3]] for b, h, piece in pieces],
                             [piece[layer].permute(2, 0, 1, 3) for _, _, piece in pieces])

    def stage_layer(self, staged: torch.Tensor, layer: int, block_ids: list[int]) -> None:
        view = self._heads[layer]  # vLLM's block b: [heads, kv, bs, dim] -> staged[j, layer]: [kv, bs, heads, dim]
        torch._foreach_copy_([staged[j, layer] for j in range(len(block_ids))],
                             [view[b].permute(1, 2, 0, 3) for b in block_ids])

    def store_keys(self, keys: list[BlockKey], staged: torch.Tensor, saver: Executor) -> Future:
        """The rank's packs put straight from the staging; the slices (the pool's) as before."""
        rank = self.rank
        if not rank.writes or not keys:
            return rank.store_keys(keys, layer_major(staged))
        futures = [store_staged(rank.packs, rank.pack_keys(keys), staged, saver)] if rank.packs is not None else []
        if rank.cache is not None:
            futures.append(rank.store_slices(keys, layer_major(staged)))
        return combined_stores(futures, len(keys))



def staging(layout: KVLayout, blocks: int, like: torch.Tensor) -> torch.Tensor:
    """An empty staging for ``blocks`` blocks of ``layout``, block-major, on ``like``'s device and dtype."""
    return torch.empty((blocks, layout.num_layers, layout.kv_tensors, layout.block_tokens, layout.kv_heads,
                        layout.head_dim), dtype=like.dtype, device=like.device)


def layer_major(staged: torch.Tensor) -> torch.Tensor:
    """A block-major staging as the cache's ``store_keys`` takes KV: ``[layers, kv, tokens, heads, dim]`` (a copy)."""
    n, layers, kvt, bs, heads, dim = staged.shape
    return staged.permute(1, 2, 0, 3, 4, 5).reshape(layers, kvt, n * bs, heads, dim)


def store_staged(cache: TieredCache, keys: list[BlockKey], staged: torch.Tensor, saver: Executor) -> Future:
    """Store the staged blocks under ``keys``: from CPU memory, put straight into the tiers below
    the device on ``saver``'s thread (one copy into the host tier, a write to disk); from a GPU,
    through the device tier. A Future of a StoreResult either way."""
    if staged.is_cuda or len(cache.media) < 2:
        return cache.store_keys(keys, layer_major(staged))
    flat = staged.view(staged.shape[0], -1).view(torch.uint8)
    put = saver.submit(cache.put, keys, [[flat[j]] for j in range(len(keys))])
    out: Future = Future()
    out.set_running_or_notify_cancel()

    def done(f: Future) -> None:
        error = f.exception()
        if error is not None:
            out.set_exception(error)
            return
        result = f.result()
        out.set_result(StoreResult(len(keys), result.new, result.seconds, sum(not s for s in result.stored)))

    put.add_done_callback(done)
    return out


def _head_view(spec: VLLMGroup, paged: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """vLLM's paged KV of one layer as ``[num_blocks, heads, kv, block_size, head_dim]`` (a view).

    Raises:
        ValueError: the tensor is not laid out as vLLM 0.32's CPU attention or MLA keeps it.
    """
    n, bs, heads, dim = paged.shape[0], layout.block_tokens, layout.kv_heads, layout.head_dim
    if layout.kv_tensors == 1 and tuple(paged.shape) in ((n, bs, dim), (n, 1, bs, dim)):  # MLA: one latent per token
        return paged.view(n, 1, 1, bs, dim)
    if layout.kv_tensors == 2 and tuple(paged.shape) == (n, heads, bs, 2 * dim) and paged.is_contiguous():
        return paged.view(n, heads, 2, bs, dim)  # per head: K's block_size rows, then V's
    expected = (f"[blocks, (1,) {bs}, {dim}]" if layout.kv_tensors == 1 else f"[blocks, {heads}, {bs}, {2 * dim}]")
    raise ValueError(f"{_PREFIX} KV cache group {spec.index}: vLLM's paged KV of shape {tuple(paged.shape)} is not "
                     f"{expected}, the layout head-sliced blocks copy from (use kv_sharing='tp-matched')")
