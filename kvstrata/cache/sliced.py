"""One rank's view of head-sliced KV: the same stored blocks for every tensor-parallel size.

A TieredCache whose layout is a head slice (:meth:`KVLayout.head_slice`) holds each block of a
prefix as ``slices`` objects, one per ``granularity`` KV heads, keyed by the block's key and the
slice (:func:`kvstrata.index.keys.slice_keys`), in a namespace without a TP size
(:mod:`kvstrata.kv.heads`). A :class:`SlicedRank` is rank r of a TP=t instance over such a
cache: it stores the slices of the heads it holds (only the first of the ranks sharing a
replicated head writes it), looks up and loads exactly those, and puts them back together as
its own KV, ``[layers, kv, tokens, its heads, head_dim]``. Ranks of any TP size share what the
cache's shared tiers hold (the pool, a disk directory); a TP=t instance hits a prefix only if
every rank's slices are there (:func:`instance_matches`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.cache.results import LoadHandle, LoadResult, StoreResult
from kvstrata.cache.tiered import TieredCache
from kvstrata.index.keys import BlockKey, slice_keys, token_array
from kvstrata.index.prefix import Match
from kvstrata.kv.heads import HeadSlicing
from kvstrata.kv.layout import KVLayout
from kvstrata.tensors import check_kv, torch_dtype


@dataclass(frozen=True)
class SlicedMatch:
    """A rank's cached prefix: ``match`` holds its slices of each matched block, block by block."""

    match: Match
    slices: int  # the rank's slices per block
    block_size: int  # tokens per block

    @property
    def blocks(self) -> int:
        return self.match.blocks // self.slices

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    @property
    def total_blocks(self) -> int:
        return self.match.total_blocks // self.slices

    def cut(self, blocks: int) -> "SlicedMatch":
        """The first ``blocks`` blocks of this match (the instance's common prefix)."""
        return SlicedMatch(self.match.cut(min(blocks, self.blocks) * self.slices), self.slices, self.block_size)

    def after(self, blocks: int) -> "SlicedMatch":
        """This match less its first ``blocks`` blocks (what a split loads while those compute)."""
        return SlicedMatch(self.match.after(min(blocks, self.blocks) * self.slices), self.slices, self.block_size)


class SlicedLoad:
    """A rank's load in flight; :meth:`kv` is its slices put back together as the rank's KV."""

    def __init__(self, handle: LoadHandle, rank: "SlicedRank") -> None:
        self.handle = handle
        self._rank = rank

    def wait(self, timeout: float | None = None) -> LoadResult:
        """The load's result, counted in whole blocks (a block some slice of which did not load
        is not loaded); its routes too (a block whose slices came by two routes counts half on
        each, with two slices)."""
        result = self.handle.wait(timeout)
        blocks, s = self.blocks, len(self._rank.slices)
        paths = {route: n // s if n % s == 0 else n / s for route, n in result.paths.items()}
        return dataclasses.replace(result, blocks=blocks, tokens=blocks * self._rank.layout.block_tokens, paths=paths)

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        self.handle.wait_layer(layer, timeout)

    @property
    def blocks(self) -> int:
        """Whole blocks loaded (every slice of them)."""
        return self.handle.blocks // len(self._rank.slices)

    def pieces(self) -> list[tuple[int, int, torch.Tensor]]:
        """``(block, first head within the rank, device slice)`` of every loaded slice, in order:
        what an engine copies into its own KV at those heads."""
        s, g = len(self._rank.slices), self._rank.slicing.granularity
        return [(i // s, (i % s) * g, self.handle.block(i)) for i in range(self.blocks * s)]

    def kv(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The loaded blocks as the rank's KV, ``[layers, kv, blocks*block_tokens, heads, head_dim]``
        (into ``out`` when given, which must hold that many tokens), in one batched copy."""
        layout = self._rank.layout
        tokens = self.blocks * layout.block_tokens
        if out is None:
            shape = (layout.num_layers, layout.kv_tensors, tokens, layout.kv_heads, layout.head_dim)
            out = torch.empty(shape, dtype=torch_dtype(layout.dtype),
                              device=self.handle.block(0).device if tokens else "cpu")
        else:
            check_kv(out, layout, tokens)
        t, g = layout.block_tokens, self._rank.slicing.granularity
        pieces = self.pieces()
        if pieces:
            torch._foreach_copy_([out[:, :, b * t:(b + 1) * t, h:h + g] for b, h, _ in pieces],
                                 [piece for _, _, piece in pieces])
        return out

    def release(self) -> None:
        self.handle.release()

    def __enter__(self) -> "SlicedLoad":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class SlicedRank:
    """Rank ``tp_rank`` of a ``tp_size``-way instance over a head-sliced ``cache`` whose group has
    ``slicing.kv_heads`` KV heads (see the module text). The cache is the caller's to close."""

    def __init__(self, cache: TieredCache, slicing: HeadSlicing, tp_size: int, tp_rank: int) -> None:
        slice_layout = cache.layout
        if not slice_layout.head_sliced:
            raise ValueError(f"a SlicedRank needs a cache of a head-sliced layout, got {slice_layout.name!r}")
        if slice_layout.kv_heads != slicing.granularity:
            raise ValueError(f"the cache's slices hold {slice_layout.kv_heads} KV heads, the slicing "
                             f"{slicing.granularity}")
        self.cache = cache
        self.slicing = slicing
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.heads = slicing.rank_heads(tp_size, tp_rank)
        self.slices = slicing.rank_slices(tp_size, tp_rank)
        self.writes = slicing.writes(tp_size, tp_rank)
        self.layout = KVLayout(slice_layout.num_layers, slice_layout.block_tokens, len(self.heads),
                               slice_layout.head_dim, slice_layout.dtype, slice_layout.kv_tensors)

    def keys(self, tokens: Any, tenant: str = "") -> list[BlockKey]:
        """The prefix's block keys (the same at every TP size)."""
        return self.cache.keys(tokens, tenant)

    def slice_keys(self, keys: list[BlockKey]) -> list[BlockKey]:
        """This rank's slices of each of ``keys``' blocks, block by block."""
        return slice_keys(keys, self.slices)

    def lookup(self, tokens: Any, tenant: str = "") -> SlicedMatch:
        return self.match(self.keys(tokens, tenant))

    def match(self, keys: list[BlockKey]) -> SlicedMatch:
        """The leading run of ``keys``' blocks of which every slice of this rank is cached."""
        sliced = SlicedMatch(self.cache.match(self.slice_keys(keys)), len(self.slices), self.layout.block_tokens)
        return sliced.cut(sliced.blocks)

    def load(self, match: SlicedMatch) -> SlicedLoad:
        return SlicedLoad(self.cache.load(match.match), self)

    def store(self, tokens: Any, kv: torch.Tensor, tenant: str = "") -> Future:
        """Save this rank's slices of the full blocks of ``kv`` (``[layers, kv, tokens, its heads,
        head_dim]``) keyed by ``tokens``. Returns a Future of StoreResult, in blocks."""
        check_kv(kv, self.layout)
        ids = token_array(tokens)
        count = min(kv.shape[2], len(ids)) // self.layout.block_tokens
        return self.store_keys(self.keys(ids[: count * self.layout.block_tokens], tenant), kv)

    def store_keys(self, keys: list[BlockKey], kv: torch.Tensor) -> Future:
        """Save this rank's slices of ``kv``'s first ``len(keys)`` blocks under ``keys``. A rank
        sharing replicated heads with an earlier rank stores nothing (that rank's copy serves both)."""
        check_kv(kv, self.layout, len(keys) * self.layout.block_tokens)
        if not self.writes or not keys:
            return _done(StoreResult(len(keys), 0, 0.0))
        g = self.slicing.granularity
        return _combined([self.cache.store_keys(slice_keys(keys, range(j, j + 1)), kv[:, :, :, i * g:(i + 1) * g])
                          for i, j in enumerate(self.slices)], len(keys))


def instance_matches(ranks: Sequence[SlicedRank], keys: list[BlockKey]) -> list[SlicedMatch]:
    """Each rank's match of ``keys``, cut to the blocks every rank has: what a TP=t instance whose
    ranks are ``ranks`` can load (a block one rank lacks a slice of is a miss for all)."""
    matches = [rank.match(keys) for rank in ranks]
    common = min((m.blocks for m in matches), default=0)
    return [m.cut(common) for m in matches]


def _done(result: StoreResult) -> Future:
    future: Future = Future()
    future.set_result(result)
    return future


def _combined(futures: list[Future], blocks: int) -> Future:
    """One Future of the slices' StoreResults: blocks new only where every slice was; refused
    where any was."""
    out: Future = Future()
    out.set_running_or_notify_cancel()
    left, lock = [len(futures)], threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            results = [f.result() for f in futures]
        except BaseException as exc:  # noqa: BLE001 - the caller's Future carries it
            out.set_exception(exc)
            return
        out.set_result(StoreResult(blocks, min(r.new_blocks for r in results), max(r.seconds for r in results),
                                   max(r.refused_blocks for r in results)))

    for future in futures:
        future.add_done_callback(one_done)
    return out
