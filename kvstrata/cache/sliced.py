"""One rank's view of head-sliced KV: the same stored blocks for every tensor-parallel size.

A TieredCache whose layout is a head slice (:meth:`KVLayout.head_slice`) holds each block of a
prefix as ``slices`` objects, one per ``granularity`` KV heads, keyed by the block's key and the
slice (:func:`kvstrata.index.keys.slice_keys`), in a namespace without a TP size
(:mod:`kvstrata.kv.heads`). A :class:`SlicedRank` is rank r of a TP=t instance: it stores the
slices of the heads it holds (only the first of the ranks sharing a replicated head writes it),
looks up and loads exactly those, and puts them back together as its own KV, ``[layers, kv,
tokens, its heads, head_dim]``. Ranks of any TP size share what the slice cache's tiers hold (the
pool, a disk directory); a TP=t instance hits a prefix only if every rank's slices are there
(:func:`instance_matches`).

Packs. A rank may also have tiers of its own (``packs``: its device, host DRAM and disk, which no
other process reads), where each block is one object, its slices together in the rank's layout
(``[layers, kv, tokens, its heads, head_dim]``: what a TP-matched block holds), keyed by the
block's key and the rank's slice range (:func:`kvstrata.index.keys.pack_keys`). A restore from
them moves the objects a TP-matched one does, where the slices of a TP=1 rank of 8 KV heads are
8x the objects, each 1/8 the size (``kvstrata bench cache --tp-readers`` measures both). A
lookup takes the rank's packs first and the shared slices where they end; what a load brings as
slices the rank packs when it releases the load, so the next restore is its own.
:meth:`SlicedRank.open` builds both from one config: the rank's device, host and disk hold its
packs; the pool (with device and host tiers as big as the rank's device tier, to stage through)
the slices. Without a pool a rank's KV is its packs alone, which another TP size does not read.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from kvstrata.cache.config import CacheConfig
from kvstrata.cache.results import StoreResult
from kvstrata.cache.slicedload import Segment, SlicedLoad, SlicedMatch
from kvstrata.cache.tiered import TieredCache
from kvstrata.index.keys import BlockKey, Namespace, block_keys, pack_keys, slice_keys, token_array
from kvstrata.kv.heads import HeadSlicing
from kvstrata.kv.layout import KVLayout
from kvstrata.policies.write import WritePolicy, WriteRule
from kvstrata.tensors import check_kv

__all__ = ["SlicedLoad", "SlicedMatch", "SlicedRank", "instance_matches", "rank_configs"]

log = logging.getLogger(__name__)

def pack_layout(slice_layout: KVLayout, heads: int) -> KVLayout:
    """The layout of a rank's pack: a slice layout over the rank's ``heads`` heads."""
    return dataclasses.replace(slice_layout, kv_heads=heads)


def rank_configs(config: CacheConfig, slicing: HeadSlicing, tp_size: int,
                 tp_rank: int) -> tuple[CacheConfig, CacheConfig | None]:
    """``config`` (of a slice layout) split for one rank: its packs (the device, host and disk
    tiers) and the slices (the pool, with a device tier and a host tier as big as the device's
    to stage through, written through: other instances read the slices at once; None without a
    pool). The packs follow ``config``'s write policy."""
    layout = pack_layout(config.layout, len(slicing.rank_heads(tp_size, tp_rank)))
    packs = dataclasses.replace(config, layout=layout, pool=None, remote_bytes=0, pool_encrypt=False,
                                device_bytes=max(config.device_bytes, layout.block_bytes))
    if config.pool is None:
        return packs, None
    return packs, dataclasses.replace(config, host_bytes=min(config.host_bytes, config.device_bytes), disk_bytes=0,
                                      disk_dir=None, write=WriteRule(WritePolicy.WRITE_THROUGH))


class SlicedRank:
    """Rank ``tp_rank`` of a ``tp_size``-way instance over head-sliced KV of a group whose
    ``slicing.kv_heads`` KV heads it cuts (see the module text): ``cache`` holds slices (shared),
    ``packs`` the rank's own packs; either may be None, not both. The caches are the caller's
    to close (or, built by :meth:`open`, the rank's: :meth:`close`)."""

    def __init__(self, cache: TieredCache | None, slicing: HeadSlicing, tp_size: int, tp_rank: int,
                 packs: TieredCache | None = None) -> None:
        if cache is None and packs is None:
            raise ValueError("a SlicedRank needs a cache of slices, of packs, or both")
        self.slicing = slicing
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.heads = slicing.rank_heads(tp_size, tp_rank)
        self.slices = slicing.rank_slices(tp_size, tp_rank)
        self.writes = slicing.writes(tp_size, tp_rank)
        base = cache if cache is not None else packs
        assert base is not None
        slice_layout = dataclasses.replace(base.layout, kv_heads=slicing.granularity)
        for c in (cache, packs):
            if c is not None and not c.layout.head_sliced:
                raise ValueError(f"a SlicedRank needs a cache of a head-sliced layout, got {c.layout.name!r}")
        if cache is not None and cache.layout.kv_heads != slicing.granularity:
            raise ValueError(f"the cache's slices hold {cache.layout.kv_heads} KV heads, the slicing "
                             f"{slicing.granularity}")
        want = pack_layout(slice_layout, len(self.heads))
        if packs is not None and packs.layout != want:
            raise ValueError(f"the packs cache's layout {packs.layout.describe()} is not rank {tp_rank} of "
                             f"{tp_size}'s, {want.describe()}")
        if cache is not None and packs is not None and cache.config.namespace() != dataclasses.replace(
                packs.config, layout=cache.layout).namespace():
            raise ValueError("the packs and slices caches name their blocks differently (model id, group or tenant)")
        self.cache, self.packs = cache, packs
        self.layout = KVLayout(slice_layout.num_layers, slice_layout.block_tokens, len(self.heads),
                               slice_layout.head_dim, slice_layout.dtype, slice_layout.kv_tensors)
        self._config = dataclasses.replace(base.config, layout=slice_layout)  # the slices' namespace names blocks
        self._namespaces: dict[str, Namespace] = {}
        self._owned: tuple[TieredCache, ...] = ()
        self._packing: list[Future] = []
        self._lock = threading.Lock()

    @classmethod
    def open(cls, config: CacheConfig, slicing: HeadSlicing, tp_size: int, tp_rank: int) -> "SlicedRank":
        """The rank over caches built from ``config`` (a slice layout) by :func:`rank_configs`;
        closed with the rank."""
        built: list[TieredCache] = []
        try:
            for part in rank_configs(config, slicing, tp_size, tp_rank):
                built.append(TieredCache(part) if part is not None else None)  # type: ignore[arg-type]
            rank = cls(built[1], slicing, tp_size, tp_rank, packs=built[0])
        except BaseException:
            for c in built:
                if c is not None:
                    c.close()
            raise
        rank._owned = tuple(c for c in built if c is not None)
        return rank

    @property
    def caches(self) -> tuple[TieredCache, ...]:
        return tuple(c for c in (self.packs, self.cache) if c is not None)

    def keys(self, tokens: Any, tenant: str = "") -> list[BlockKey]:
        """The prefix's block keys (the same at every TP size)."""
        namespace = self._namespaces.get(tenant)
        if namespace is None:
            namespace = self._namespaces.setdefault(tenant, self._config.namespace(tenant))
        return block_keys(tokens, namespace)

    def slice_keys(self, keys: list[BlockKey]) -> list[BlockKey]:
        """This rank's slices of each of ``keys``' blocks, block by block."""
        return slice_keys(keys, self.slices)

    def pack_keys(self, keys: list[BlockKey]) -> list[BlockKey]:
        """This rank's pack of each of ``keys``' blocks."""
        return pack_keys(keys, self.slices)

    def lookup(self, tokens: Any, tenant: str = "") -> SlicedMatch:
        return self.match(self.keys(tokens, tenant))

    def match(self, keys: list[BlockKey]) -> SlicedMatch:
        """The leading run of ``keys``' blocks of which the rank holds a pack or every slice:
        runs of packs and of slices, packs first. A run ends where its kind misses, so the
        next is of the other kind."""
        segments: list[Segment] = []
        position, last = 0, None
        packs = self.pack_keys(keys) if self.packs is not None else []
        while position < len(keys):
            segment = None
            if self.packs is not None and last is not True:
                m = self.packs.match(packs[position:])
                segment = Segment(m, tuple(keys[position:position + m.blocks]), 1, True) if m.blocks else None
            if segment is None and self.cache is not None and last is not False:
                s = len(self.slices)
                m = self.cache.match(self.slice_keys(keys[position:]))
                whole = m.blocks // s
                segment = Segment(m.cut(whole * s), tuple(keys[position:position + whole]), s, False) if whole else None
            if segment is None:
                break
            segments.append(segment)
            position, last = position + segment.blocks, segment.packed
        return SlicedMatch(tuple(segments), self.layout.block_tokens, len(keys))

    def load(self, match: SlicedMatch, in_place: bool = False) -> SlicedLoad:
        """Bring the match's packs and slices to the device tiers (each segment one load;
        ``in_place``: see :meth:`TieredCache.load`)."""
        handles = []
        try:
            for segment in match.segments:
                cache = self.packs if segment.packed else self.cache
                assert cache is not None
                handles.append(cache.load(segment.match, in_place=in_place))
        except BaseException:
            for handle in handles:
                handle.release()
            raise
        packs = self.packs is not None and self.writes and any(not s.packed for s in match.segments)
        return SlicedLoad(match, handles, self.layout, self.slicing.granularity, self._pack if packs else None)

    def _pack(self, load: SlicedLoad) -> None:
        """Store what ``load`` brought as slices as this rank's packs (in the background). Best
        effort: a load that failed packs nothing, and a pack that cannot be stored (the rank's
        tiers closed, say) is logged, never the load's caller's error."""
        try:
            load.wait(0)
        except Exception:  # noqa: BLE001 - a failed load packs nothing; its caller saw why
            return
        assert self.packs is not None
        try:
            for keys, kv in load.sliced_runs():
                future = self.packs.store_keys(self.pack_keys(list(keys)), kv)
                with self._lock:
                    self._packing = [f for f in self._packing if not f.done()] + [future]
        except Exception as exc:  # noqa: BLE001 - see above
            log.warning("rank %d of %d: the slices loaded were not packed: %s", self.tp_rank, self.tp_size, exc)

    def store(self, tokens: Any, kv: torch.Tensor, tenant: str = "") -> Future:
        """Save this rank's part of the full blocks of ``kv`` (``[layers, kv, tokens, its heads,
        head_dim]``) keyed by ``tokens``. Returns a Future of StoreResult, in blocks."""
        check_kv(kv, self.layout)
        ids = token_array(tokens)
        count = min(kv.shape[2], len(ids)) // self.layout.block_tokens
        return self.store_keys(self.keys(ids[: count * self.layout.block_tokens], tenant), kv)

    def store_keys(self, keys: list[BlockKey], kv: torch.Tensor) -> Future:
        """Save this rank's part of ``kv``'s first ``len(keys)`` blocks under ``keys``: one pack a
        block in its own tiers, its slices in the shared ones. A rank sharing replicated heads
        with an earlier rank stores nothing (that rank's copy serves both)."""
        check_kv(kv, self.layout, len(keys) * self.layout.block_tokens)
        if not self.writes or not keys:
            return _done(StoreResult(len(keys), 0, 0.0))
        futures = [self.packs.store_keys(self.pack_keys(keys), kv)] if self.packs is not None else []
        if self.cache is not None:
            futures.append(self.store_slices(keys, kv))
        return combined_stores(futures, len(keys))

    def store_slices(self, keys: list[BlockKey], kv: torch.Tensor) -> Future:
        """Store this rank's slices of ``kv``'s blocks in the shared cache, one slice's store after
        another: each may use the whole device tier (stores at once into a device tier smaller
        than their blocks refused each other, every block pinned by the other's write-downs)."""
        g = self.slicing.granularity
        cache = self.cache
        assert cache is not None
        starts = [lambda i=i, j=j: cache.store_keys(slice_keys(keys, range(j, j + 1)), kv[:, :, :, i * g:(i + 1) * g])
                  for i, j in enumerate(self.slices)]
        return _in_turn(starts, len(keys))

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the packs of loaded slices stored so far."""
        with self._lock:
            pending, self._packing = self._packing, []
        for future in pending:
            future.result(timeout)

    def close(self) -> None:
        """Close the caches :meth:`open` built (others are their owner's). Idempotent."""
        for cache in self._owned:
            cache.close()

    def __enter__(self) -> "SlicedRank":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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


def _combined(results: Sequence[StoreResult], blocks: int, seconds: float) -> StoreResult:
    """Parts' StoreResults as one: blocks new only where every part was; refused where any was."""
    return StoreResult(blocks, min((r.new_blocks for r in results), default=0), seconds,
                       max((r.refused_blocks for r in results), default=0))


def _in_turn(starts: Sequence[Callable[[], Future]], blocks: int) -> Future:
    """One Future of the StoreResults of stores started one after another (``starts``: each
    starts one and returns its Future), as :func:`combined_stores` combines them."""
    out: Future = Future()
    out.set_running_or_notify_cancel()
    results: list[StoreResult] = []

    def step(done: Future | None = None) -> None:
        try:
            if done is not None:
                results.append(done.result())
            if len(results) < len(starts):
                starts[len(results)]().add_done_callback(step)
                return
        except BaseException as exc:  # noqa: BLE001 - the caller's Future carries it
            out.set_exception(exc)
            return
        out.set_result(_combined(results, blocks, sum(r.seconds for r in results)))

    step()
    return out


def combined_stores(futures: list[Future], blocks: int) -> Future:
    """One Future of the parts' StoreResults: blocks new only where every part was; refused
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
        out.set_result(_combined(results, blocks, max(r.seconds for r in results)))

    for future in futures:
        future.add_done_callback(one_done)
    return out
