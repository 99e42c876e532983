"""A rank's match and load of head-sliced KV (:mod:`kvstrata.cache.sliced`): runs of blocks, each
from the rank's packs (one object a block: its slices together, in its own tiers) or from the
shared slices (one object per slice of a block), put back together as the rank's KV.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.cache.results import LoadHandle, LoadResult
from kvstrata.index.keys import BlockKey
from kvstrata.index.prefix import Match
from kvstrata.kv.layout import KVLayout
from kvstrata.media import Medium
from kvstrata.tensors import check_kv, torch_dtype


@dataclass(frozen=True)
class Segment:
    """A run of a rank's cached blocks in one of its two caches.

    Attributes:
        match: the run's stored objects: one a block (``packed``), or the rank's slices of each
            block, block by block.
        block_keys: the run's block keys (the prefix's, the same at every TP size).
        per_block: objects per block: 1 packed, else the rank's slices.
        packed: from the rank's packs (its own tiers), else from the shared slices.
    """

    match: Match
    block_keys: tuple[BlockKey, ...]
    per_block: int
    packed: bool

    @property
    def blocks(self) -> int:
        return len(self.block_keys)

    @property
    def media(self) -> tuple[Medium, ...]:
        """Per block, the slowest medium any of its objects is on (what its load waits for)."""
        media, s = self.match.media, self.per_block
        if s == 1:
            return media
        return tuple(max(media[i:i + s], key=lambda m: m.value) for i in range(0, len(media), s))

    def cut(self, blocks: int) -> "Segment":
        return Segment(self.match.cut(blocks * self.per_block), self.block_keys[:blocks], self.per_block, self.packed)

    def after(self, blocks: int) -> "Segment":
        return Segment(self.match.after(blocks * self.per_block), self.block_keys[blocks:], self.per_block, self.packed)


@dataclass(frozen=True)
class SlicedMatch:
    """A rank's cached prefix: ``segments``, consecutive runs of blocks (each from its packs or
    from the shared slices), ``blocks`` in all of the ``total_blocks`` looked up."""

    segments: tuple[Segment, ...]
    block_size: int  # tokens per block
    total_blocks: int

    @property
    def blocks(self) -> int:
        return sum(s.blocks for s in self.segments)

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    @property
    def media(self) -> tuple[Medium, ...]:
        """Per matched block, the slowest medium holding a part of it."""
        return tuple(m for s in self.segments for m in s.media)

    @property
    def block_keys(self) -> tuple[BlockKey, ...]:
        return tuple(k for s in self.segments for k in s.block_keys)

    def cut(self, blocks: int) -> "SlicedMatch":
        """The first ``blocks`` blocks of this match (the instance's common prefix)."""
        out, left = [], blocks
        for s in self.segments:
            if left <= 0:
                break
            out.append(s.cut(left) if s.blocks > left else s)
            left -= s.blocks
        return SlicedMatch(tuple(out), self.block_size, self.total_blocks)

    def after(self, blocks: int) -> "SlicedMatch":
        """This match less its first ``blocks`` blocks (what a split loads while those compute)."""
        out, skip = [], blocks
        for s in self.segments:
            if skip >= s.blocks:
                skip -= s.blocks
                continue
            out.append(s.after(skip) if skip else s)
            skip = 0
        return SlicedMatch(tuple(out), self.block_size, self.total_blocks)


Piece = tuple[int, int, torch.Tensor]  # (block, first head within the rank, device tensor of its heads)


class SlicedLoad:
    """A rank's load in flight, one cache load per segment; :meth:`kv` is the rank's KV.

    Args:
        match: what is loaded.
        handles: one per segment, in order.
        layout: the rank's KV of a block (all its heads).
        granularity: heads per slice.
        on_release: called once with the load, when it is released (its device copies still
            pinned): the rank packs what came as slices.
    """

    def __init__(self, match: SlicedMatch, handles: Sequence[LoadHandle], layout: KVLayout, granularity: int,
                 on_release: Callable[["SlicedLoad"], None] | None = None) -> None:
        self.match = match
        self.handles = list(handles)
        self.layout = layout
        self._granularity = granularity
        self._on_release = on_release
        self._released = False

    def wait(self, timeout: float | None = None) -> LoadResult:
        """The load's result, counted in whole blocks (a block some slice of which did not load
        is not loaded, nor is any after it); its routes too (a block whose slices came by two
        routes counts half on each, with two slices)."""
        results = [h.wait(timeout) for h in self.handles]
        blocks = self.blocks
        bytes_from: dict[Medium, int] = {}
        paths: dict = {}
        for segment, result in zip(self.match.segments, results):
            for medium, n in result.bytes_from.items():
                bytes_from[medium] = bytes_from.get(medium, 0) + n
            s = segment.per_block
            for route, n in result.paths.items():
                paths[route] = paths.get(route, 0) + (n // s if n % s == 0 else n / s)
        stopped = next((r for r in results if r.stopped is not None), None)
        return LoadResult(blocks, blocks * self.layout.block_tokens, bytes_from, max((r.seconds for r in results), default=0.0),
                          stopped.stopped if stopped else None, sum(r.restored_bytes for r in results), paths,
                          stopped.stopped_at if stopped else None)

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        for handle in self.handles:
            handle.wait_layer(layer, timeout)

    def done(self) -> bool:
        """Every part of the load has ended (loaded, failed or stopped)."""
        return all(h.done() for h in self.handles)

    def cancel(self) -> None:
        """Give every part up (:meth:`LoadHandle.cancel`)."""
        for handle in self.handles:
            handle.cancel()

    @property
    def blocks(self) -> int:
        """Whole blocks loaded, from the first on (a segment loaded short ends the count)."""
        total = 0
        for segment, handle in zip(self.match.segments, self.handles):
            loaded = handle.blocks // segment.per_block
            total += loaded
            if loaded < segment.blocks:
                break
        return total

    def _loaded(self) -> list[tuple[Segment, int, list[Piece]]]:
        """Each segment with loaded blocks: the segment, its first block's index in the load,
        and its pieces ``(block, first head within the rank, device tensor)``, in order."""
        out = []
        left, first = self.blocks, 0
        for segment, handle in zip(self.match.segments, self.handles):
            n = min(left, segment.blocks)
            if not n:
                break
            s, g = segment.per_block, self._granularity
            out.append((segment, first, [(first + i // s, (i % s) * g, handle.block(i)) for i in range(n * s)]))
            first, left = first + n, left - n
        return out

    def pieces(self) -> list[Piece]:
        """``(block, first head within the rank, device tensor)`` of every loaded object, in
        order (a pack is every head of its block; a slice ``granularity`` of them): what an
        engine copies into its own KV at those heads."""
        return [piece for _, _, pieces in self._loaded() for piece in pieces]

    def sliced_runs(self) -> list[tuple[tuple[BlockKey, ...], torch.Tensor]]:
        """Each loaded run of blocks that came as slices: its block keys and its KV put
        together as the rank's (a new tensor on the device): what the rank packs."""
        runs = []
        for segment, first, pieces in self._loaded():
            if not segment.packed:
                n = len(pieces) // segment.per_block
                runs.append((segment.block_keys[:n], assemble(pieces, self.layout, n, first_block=first)))
        return runs

    def kv(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The loaded blocks as the rank's KV, ``[layers, kv, blocks*block_tokens, heads, head_dim]``
        (into ``out`` when given, which must hold that many tokens), in one batched copy."""
        return assemble(self.pieces(), self.layout, self.blocks, out)

    def release(self) -> None:
        """Unpin the loaded device copies (once the rank packed what came as slices). Idempotent."""
        if self._released:
            return
        self._released = True
        try:
            if self._on_release is not None and all(h.done() for h in self.handles):
                self._on_release(self)
        finally:
            for handle in self.handles:
                handle.release()

    def __enter__(self) -> "SlicedLoad":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def assemble(pieces: list[Piece], layout: KVLayout, blocks: int, out: torch.Tensor | None = None,
             first_block: int = 0) -> torch.Tensor:
    """``pieces`` of blocks ``first_block ..`` put together as ``blocks`` blocks of a rank's KV,
    ``[layers, kv, blocks*block_tokens, heads, head_dim]`` (into ``out`` when given), in one
    batched copy; a piece's width in heads is its own (a pack: every head, a slice: a few)."""
    tokens = blocks * layout.block_tokens
    if out is None:
        shape = (layout.num_layers, layout.kv_tensors, tokens, layout.kv_heads, layout.head_dim)
        out = torch.empty(shape, dtype=torch_dtype(layout.dtype), device=pieces[0][2].device if pieces else "cpu")
    else:
        check_kv(out, layout, tokens)
    t, heads = layout.block_tokens, layout.kv_heads
    if pieces:  # a pack is every head: its block's tokens, no head slice (one view fewer a block)
        torch._foreach_copy_([out[:, :, (b - first_block) * t:(b - first_block + 1) * t] if p.shape[3] == heads else
                              out[:, :, (b - first_block) * t:(b - first_block + 1) * t, h:h + p.shape[3]]
                              for b, h, p in pieces], [p for _, _, p in pieces])
    return out
