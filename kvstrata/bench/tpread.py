"""``kvstrata bench cache --tp-readers 1,2,4,8``: restores of head-sliced blocks at each reader TP
size against TP-matched blocks, the same bytes in the same run; and the hash+lookup of a 128K-token
prompt by a TP=1 and a TP=t instance of each layout.

The bytes: the bench's KV (the model's one per-token group, random, blocks of the bench's
block tokens). At reader TP ``t`` the same KV is held twice, by ``t`` ranks each time:

- TP-matched: rank ``r`` has a ``TieredCache`` of ``KVLayout.for_group(group, block_tokens, t)``
  whose namespace names ``tp_rank=r, tp_size=t``: one object per block, the rank's heads.
- head-sliced: rank ``r`` is a :class:`~kvstrata.cache.sliced.SlicedRank` over a ``TieredCache``
  of the slice layout (one KV head per slice): one object per slice of each block, keyed by the
  block and the slice, in the TP-free namespace. The slices are written by the TP=``t`` instance
  itself, each rank its own (the bytes are those a TP=1 writer stores: ``tests/test_cache_sliced.py``).

Each rank has a cache of its own (device, host and disk tiers, a disk directory each), as each
rank of an instance is a process of its own; a disk tier locks its directory, so the ranks of
one host could not share one anyway. The ranks of one layout restore one after another in this
process (into a CPU stand-in for the device where there is no CUDA), so a figure is all ranks'
bytes over the sum of their times.

A restore, per rank: ``load()`` of its blocks (matched) or slices (sliced) into its device tier,
then the bytes put into the rank's KV tensor ``[layers, kv, tokens, its heads, head_dim]``
(preallocated, pre-faulted): matched, its blocks in one ``torch._foreach_copy_``; sliced,
``SlicedLoad.kv(out)``. The same bytes land in the same tensor for both. Timed: from ``load()``
to the last byte in the tensor; the lookup before it is not timed (the lookup rows time it).
Untimed, before: the tensor and the device tier are zeroed (from disk, the host tier too);
after: the tensor is compared byte for byte with the heads stored, so a restore that moved
nothing or the wrong bytes fails the run.

Sources, each a warm-up round then ``repeats`` rounds, matched and sliced back to back in an
order that rotates (:mod:`kvstrata.rounds`): the host tier (blocks on the host only);
the disk tier cold (blocks on disk only, every file dropped from the page cache and the ballast
released first, as ``bench cache``'s cold disk restore) and warm (the files read into the page
cache first, as its warm one).
"""

from __future__ import annotations

import dataclasses
import enum
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvstrata.bench.baselines import synchronize
from kvstrata.bench.lookup import interleaved, token_ids
from kvstrata.rounds import Rounds, rotated
from kvstrata.cache import CacheConfig, TieredCache
from kvstrata.cache.sliced import SlicedRank, instance_matches, pack_layout
from kvstrata.calibrate.ballast import Ballast
from kvstrata.index.keys import BlockKey, slice_keys
from kvstrata.kv import load_geometry
from kvstrata.kv.geometry import DType
from kvstrata.kv.groups import GroupKind, KVGroup
from kvstrata.kv.heads import HeadSlicing
from kvstrata.kv.layout import KVLayout
from kvstrata.media import Medium
from kvstrata.policies.write import WritePolicy, WriteRule
from kvstrata.progress import Progress
from kvstrata.tensors import torch_dtype
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.diskdir import SUFFIX
from kvstrata.tiers.memory import MemoryTier
from kvstrata.timing import VerificationError, drop_page_cache, warm_page_cache

MODEL_ID = "kvstrata-bench-tp"


class Source(enum.Enum):
    """Where a restore's blocks are before it (and only there)."""

    HOST = "host"
    DISK_COLD = "disk, cold"
    DISK_WARM = "disk, warm"


class Layout(enum.Enum):
    """How a rank holds the bytes it restores."""

    MATCHED = "matched"  # TP-matched: one object a block, the rank's heads, its TP in the namespace
    SLICED = "sliced"  # head-sliced as a rank keeps it in its own tiers: its slices of a block packed in one object
    SLICES = "slices"  # head-sliced as the shared tiers hold it: one object per slice of a block


def model_group(model: str) -> KVGroup:
    """The model's one per-token KV group.

    Raises:
        ValueError: the model has several groups, or caches a state.
    """
    groups = load_geometry(model).groups
    if len(groups) != 1 or not groups[0].kind.per_token:
        raise ValueError(f"bench cache --tp-readers: {model!r} needs one per-token KV group, it has "
                         f"{', '.join(g.kind.value for g in groups)}")
    return groups[0]


def check_readers(model: str, readers: tuple[int, ...]) -> HeadSlicing:
    """The model's slicing, once every reader TP splits its heads.

    Raises:
        ValueError: a TP size that does not (naming it), or a model that cannot be sliced.
    """
    slicing = HeadSlicing.for_group(model_group(model))
    for tp in readers:
        try:
            slicing.rank_slices(tp, 0)
        except ValueError as exc:
            raise ValueError(f"bench cache --tp-readers: TP={tp} does not fit {model}: {exc}") from None
    return slicing


@dataclasses.dataclass(frozen=True)
class TPData:
    """What every reader TP restores: the model's group, its block tokens, the token ids and
    the whole model's KV as bytes, uint8 ``[layers, kv, tokens, kv_heads, head_dim * itemsize]``."""

    group: KVGroup
    slicing: HeadSlicing
    block_tokens: int
    tokens: list[int]
    kv_bytes: torch.Tensor

    @property
    def blocks(self) -> int:
        return len(self.tokens) // self.block_tokens

    def rank_kv(self, heads: range) -> torch.Tensor:
        """A rank's KV, ``[layers, kv, tokens, its heads, head_dim]`` of the model's dtype, contiguous."""
        return self.kv_bytes[:, :, :, heads.start:heads.stop].contiguous().view(torch_dtype(self.group.dtype))


class RankSet:
    """The ``tp`` ranks of one layout, each with its own cache, and their KV tensors ``outs``
    (shared with the other layout's set: the same bytes land in the same place)."""

    def __init__(self, layout: Layout, data: TPData, tp: int, outs: list[torch.Tensor], directory: Path,
                 workers: int, device: torch.device) -> None:
        self.layout, self.data, self.tp, self.outs = layout, data, tp, outs
        self.heads = [data.slicing.rank_heads(tp, r) for r in range(tp)]
        slices = [data.slicing.rank_slices(tp, r) for r in range(tp)]
        bt = data.block_tokens
        slice_layout = KVLayout.head_slice(data.group, bt, data.slicing.granularity)
        layouts = ([KVLayout.for_group(data.group, bt, tp)] * tp if layout is Layout.MATCHED else
                   [pack_layout(slice_layout, len(h)) for h in self.heads] if layout is Layout.SLICED else
                   [slice_layout] * tp)
        # Objects per rank: a block, or a slice of a block.
        self.objects = [data.blocks * (len(s) if layout is Layout.SLICES else 1) for s in slices]
        self.caches: list[TieredCache] = []
        try:
            for r in range(tp):
                capacity = self.objects[r] * layouts[r].block_bytes
                self.caches.append(TieredCache(CacheConfig(
                    layouts[r], MODEL_ID, device_bytes=capacity, host_bytes=capacity, disk_bytes=capacity,
                    disk_dir=directory / f"{layout.value}-tp{tp}-rank{r}", write=WriteRule(WritePolicy.WRITE_BACK),
                    workers=workers, tp_rank=r, tp_size=tp, device=str(device))))
        except BaseException:
            self.close()
            raise
        self.ranks = ([SlicedRank(c, data.slicing, tp, r) for r, c in enumerate(self.caches)] if layout is Layout.SLICES
                      else [SlicedRank(None, data.slicing, tp, r, packs=c) for r, c in enumerate(self.caches)]
                      if layout is Layout.SLICED else [])
        # matched: one namespace per rank; head-sliced: the blocks' (every rank's, every TP's)
        self.block_keys = [c.keys(data.tokens) for c in self.caches] if layout is Layout.MATCHED else \
            [rank.keys(data.tokens) for rank in self.ranks]
        self.restored_bytes = sum(o * lay.block_bytes for o, lay in zip(self.objects, layouts))

    # --- placing the blocks (untimed) ----------------------------------------------------------

    def store(self) -> None:
        """Every rank stores its heads of every block into its device tier, then they go down to
        its host tier (write-back eviction)."""
        for r, cache in enumerate(self.caches):
            kv = self.data.rank_kv(self.heads[r]).to(self.outs[r].device)
            if self.layout is Layout.MATCHED:
                futures = [cache.store_keys(self.block_keys[r], kv)]
            elif self.layout is Layout.SLICED:  # (a rank holding a replicated head too: its cache is its own)
                futures = [cache.store_keys(self.ranks[r].pack_keys(self.block_keys[r]), kv)]
            else:  # each rank its own slices (a rank holding a replicated head too: its cache is its own)
                g = self.data.slicing.granularity
                futures = [cache.store_keys(slice_keys(self.block_keys[r], range(j, j + 1)), kv[:, :, :, i * g:(i + 1) * g])
                           for i, j in enumerate(self.ranks[r].slices)]
            stored = sum(f.result().new_blocks for f in futures)
            if stored != self.objects[r]:
                raise VerificationError(f"{self.layout.value} TP={self.tp} rank {r} stored {stored} of {self.objects[r]}")
            self._demote(r, Medium.DEVICE)

    def to_disk(self) -> None:
        """Every rank's objects go from its host tier to its disk tier (write-back eviction);
        the files are fsynced and dropped from the page cache."""
        for r in range(self.tp):
            self._demote(r, Medium.HOST)
        drop_page_cache(self.disk_files())

    def _demote(self, r: int, medium: Medium) -> None:
        below = Medium.HOST if medium is Medium.DEVICE else Medium.DISK
        moved = self.caches[r].evict(medium, self.objects[r])
        if moved != self.objects[r]:
            raise VerificationError(f"{self.layout.value} TP={self.tp} rank {r}: evicted {moved} of {self.objects[r]}")
        self._expect(r, below)

    def disk_files(self) -> list[Path]:
        files: list[Path] = []
        for cache in self.caches:
            tier = cache.tier(Medium.DISK)
            assert isinstance(tier, DiskTier)
            files += tier.directory.glob(f"*{SUFFIX}")
        return files

    # --- the restore ---------------------------------------------------------------------------

    def restore_s(self, source: Source, ballast: Ballast) -> tuple[float, float]:
        """Every rank's restore of its blocks from ``source`` (see the module text), one after
        another; returns their seconds in all, and of their loads alone (to ``wait()``, before
        the copy into the KV tensor). Verified, untimed; afterwards the blocks are where they
        were (the copies above ``source`` evicted)."""
        medium = Medium.HOST if source is Source.HOST else Medium.DISK
        if source is Source.DISK_COLD:
            ballast.release()
        for r in range(self.tp):
            self._zero(r, Medium.DEVICE)
            if medium is Medium.DISK:
                self._zero(r, Medium.HOST)
            self.outs[r].zero_()
        if medium is Medium.DISK:
            (drop_page_cache if source is Source.DISK_COLD else warm_page_cache)(self.disk_files())
        synchronize(*self.outs)
        times = [self._restore_rank_s(r, medium) for r in range(self.tp)]
        for r in range(self.tp):
            want = self.data.kv_bytes[:, :, :, self.heads[r].start:self.heads[r].stop]
            if not torch.equal(self.outs[r].view(torch.uint8), want.to(self.outs[r].device)):
                raise VerificationError(f"{self.layout.value} TP={self.tp} rank {r}: restored KV differs from the KV stored")
            for above in (Medium.DEVICE, Medium.HOST):
                if above.value < medium.value:
                    self.caches[r].evict(above, self.objects[r])
            self._expect(r, medium)
        return sum(t for t, _ in times), sum(t for _, t in times)

    def _restore_rank_s(self, r: int, medium: Medium) -> tuple[float, float]:
        """Rank ``r``'s restore: seconds in all, and of its load alone (to its ``wait()``)."""
        out, bt = self.outs[r], self.data.block_tokens
        matched = self.layout is Layout.MATCHED
        source = self.caches[r] if matched else self.ranks[r]  # the paged blocks as stored, or the rank's heads
        match = source.match(self.block_keys[r])
        self._check_match(r, match, medium)
        start = time.perf_counter()
        with source.load(match) as load:
            load.wait()
            loaded_s = time.perf_counter() - start
            loaded = load.blocks
            if matched:
                torch._foreach_copy_([out[:, :, b * bt:(b + 1) * bt] for b in range(loaded)],
                                     [load.block(b) for b in range(loaded)])
            else:
                load.kv(out)
            synchronize(out)
            seconds = time.perf_counter() - start
        if loaded != self.data.blocks:
            raise VerificationError(f"{self.layout.value} TP={self.tp} rank {r} restored {loaded} of {self.data.blocks} blocks")
        return seconds, loaded_s

    # --- checks --------------------------------------------------------------------------------

    def _check_match(self, r: int, match, medium: Medium) -> None:
        if match.blocks != self.data.blocks or set(match.media) != {medium}:
            raise RuntimeError(f"{self.layout.value} TP={self.tp} rank {r}: expected {self.data.blocks} blocks on "
                               f"{medium.label} only, lookup found {match.blocks} on {set(match.media)}")

    def _expect(self, r: int, medium: Medium) -> None:
        keys = (self.block_keys[r] if self.layout is Layout.MATCHED else self.ranks[r].pack_keys(self.block_keys[r])
                if self.layout is Layout.SLICED else self.ranks[r].slice_keys(self.block_keys[r]))
        match = self.caches[r].match(keys)
        if match.blocks != self.objects[r] or set(match.media) != {medium}:
            raise RuntimeError(f"{self.layout.value} TP={self.tp} rank {r}: expected every object on "
                               f"{medium.label} alone, lookup found {set(match.media)}")

    def _zero(self, r: int, medium: Medium) -> None:
        tier = self.caches[r].tier(medium)
        assert isinstance(tier, MemoryTier)
        for slot in range(tier.slots):
            tier.view(slot).zero_()

    def close(self) -> None:
        for cache in self.caches:
            cache.close()


# --- the run ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TPRun:
    """What :func:`run_tp_readers` measured: the rounds (named ``<layout>.<source>.tp<t>``, and
    the loads alone ``<layout>.<source>.tp<t>.load``),
    per reader TP the bytes a restore moves and each layout's objects per rank, the lookup
    rounds per block size, and the bytes verified."""

    rounds: Rounds
    restored_bytes: dict[int, int]
    objects: dict[int, dict[Layout, int]]  # rank 0's
    object_bytes: dict[int, dict[Layout, int]]
    lookups: dict[int, "LookupRounds"]
    verified_bytes: int


def step_name(layout: Layout, source: Source, tp: int) -> str:
    return f"{layout.value}.{source.name.lower()}.tp{tp}"


def progress_steps(readers: tuple[int, ...], repeats: int, block_sizes: tuple[int, ...]) -> int:
    return len(readers) * (1 + len(Source) * (repeats + 1)) + len(block_sizes)


def run_tp_readers(data: TPData, readers: tuple[int, ...], repeats: int, workers: int, lookup_repeats: int,
                   block_sizes: tuple[int, ...], lookup_tokens: int, directory: Path, ballast: Ballast,
                   device: torch.device, progress: Progress) -> TPRun:
    """Every reader TP's restores (both layouts, each source), then the lookups; see the module text.

    Raises:
        VerificationError: a restore brought back other bytes than were stored, or fewer.
    """
    rounds = Rounds()
    restored: dict[int, int] = {}
    objects: dict[int, dict[Layout, int]] = {}
    object_bytes: dict[int, dict[Layout, int]] = {}
    verified = 0
    for tp in readers:
        outs = [torch.zeros((data.group.num_layers, data.group.kv_tensors, len(data.tokens), len(h), data.group.head_dim),
                            dtype=torch_dtype(data.group.dtype), device=device)
                for h in (data.slicing.rank_heads(tp, r) for r in range(tp))]
        sets: dict[Layout, RankSet] = {}
        try:
            for layout in Layout:
                sets[layout] = RankSet(layout, data, tp, outs, directory, workers, device)
                sets[layout].store()
            progress.step(f"TP={tp}: stored both layouts")
            for source in Source:
                if source is Source.DISK_COLD:
                    for s in sets.values():
                        s.to_disk()
                for r in range(repeats + 1):
                    for layout in rotated(list(Layout), r):
                        seconds, load_s = sets[layout].restore_s(source, ballast)
                        verified += sets[layout].restored_bytes
                        if r:  # round 0 warms up
                            rounds.add(step_name(layout, source, tp), seconds)
                            rounds.add(step_name(layout, source, tp) + ".load", load_s)
                    progress.step(f"TP={tp}: {source.value} restore, " + (f"round {r}/{repeats}" if r else "warm-up"))
            restored[tp] = sets[Layout.MATCHED].restored_bytes
            objects[tp] = {layout: s.objects[0] for layout, s in sets.items()}
            object_bytes[tp] = {layout: s.caches[0].layout.block_bytes for layout, s in sets.items()}
        finally:
            for s in sets.values():
                s.close()
            for path in directory.glob("*-tp*-rank*"):
                shutil.rmtree(path, ignore_errors=True)
    lookups = {}
    for bs in block_sizes:
        lookups[bs] = lookup_rounds(data, max(readers), bs, lookup_tokens, lookup_repeats)
        progress.step(f"head-sliced hash+lookup, block {bs}")
    return TPRun(rounds, restored, objects, object_bytes, lookups, verified)


# --- hash + lookup ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LookupRounds:
    """The interleaved rounds of the lookup variants (:func:`lookup_rounds`) of one block size."""

    rounds: Rounds
    block_size: int
    tokens: int
    tp: int


def lookup_rounds(data: TPData, tp: int, block_size: int, tokens: int, repeats: int) -> LookupRounds:
    """Hash + lookup of ``tokens`` random ids, every block present in the host tier, by an
    instance: ``matched.tp1`` (one cache's ``lookup``), ``sliced.tp1`` and ``sliced.tp<tp>``:
    each rank's hash + match of its slices (``sliced.tp<n>.rank<r>``, as its own process makes
    it), the instance's figure its slowest rank's in each round (its ranks are processes that
    look up at once), and ``sliced.tp<n>.ranks`` their sum (the CPU time of the instance); and
    the parts: ``hash`` (the block keys alone) and ``slice_keys.tp<n>`` (every rank's slice
    keys of ready block keys). These are the slices' keys, as a lookup in the pool makes them
    (a rank's packs are one key a block). Each rank has its cache (its process); blocks are
    adopted without bytes (a one-layer layout of the model's heads, 8 elements each: the bytes
    are not read)."""
    ids = token_ids(tokens)
    kind = GroupKind.MLA if data.group.kind is GroupKind.MLA else GroupKind.FULL
    group = KVGroup(kind, (0,), DType.BF16, kv_heads=data.group.kv_heads, head_dim=8)
    blocks = tokens // block_size
    caches: list[TieredCache] = []

    def cache(layout: KVLayout, objects: int, tp_size: int = 1, tp_rank: int = 0) -> TieredCache:
        caches.append(TieredCache(CacheConfig(layout, MODEL_ID, device_bytes=layout.block_bytes,
                                              host_bytes=objects * layout.block_bytes, device="cpu",
                                              tp_rank=tp_rank, tp_size=tp_size)))
        return caches[-1]

    try:
        matched = cache(KVLayout.for_group(group, block_size, 1), blocks)
        matched.manager.adopt(Medium.HOST, matched.keys(ids))
        slice_layout = KVLayout.head_slice(group, block_size, data.slicing.granularity)
        instances: dict[int, list[SlicedRank]] = {}
        for size in dict.fromkeys((1, tp)):
            instances[size] = []
            for r in range(size):
                rank = SlicedRank(cache(slice_layout, blocks * len(data.slicing.rank_slices(size, r)), size, r),
                                  data.slicing, size, r)
                rank.cache.manager.adopt(Medium.HOST, rank.slice_keys(rank.keys(ids)))
                instances[size].append(rank)
        keys = instances[1][0].keys(ids)
        _check_all_present(matched.lookup(ids).blocks, [m.blocks for s in instances.values()
                                                        for m in instance_matches(s, keys)], blocks)
        variants: dict[str, Callable[[], object]] = {"matched.tp1": lambda: matched.lookup(ids),
                                                     "hash": lambda: instances[1][0].keys(ids)}
        for size, ranks in instances.items():
            for r, rank in enumerate(ranks):
                variants[f"sliced.tp{size}.rank{r}"] = _rank_lookup(rank, ids)
            variants[f"slice_keys.tp{size}"] = _slice_keys_of(ranks, keys)
        rounds = interleaved(variants, repeats)
        for size, ranks in instances.items():  # the instance: its ranks at once (the slowest), and in all
            per_rank = [rounds.seconds[f"sliced.tp{size}.rank{r}"] for r in range(size)]
            for samples in zip(*per_rank):
                rounds.add(f"sliced.tp{size}", max(samples))
                rounds.add(f"sliced.tp{size}.ranks", sum(samples))
    finally:
        for c in caches:
            c.close()
    return LookupRounds(rounds, block_size, tokens, tp)


def _rank_lookup(rank: SlicedRank, ids: np.ndarray) -> Callable[[], object]:
    """A rank's hash + lookup, as its own process makes it: the block keys, its slice keys, its match."""
    return lambda: rank.match(rank.keys(ids))


def _slice_keys_of(ranks: list[SlicedRank], keys: list[BlockKey]) -> Callable[[], object]:
    return lambda: [rank.slice_keys(keys) for rank in ranks]


def _check_all_present(matched: int, sliced: list[int], blocks: int) -> None:
    if matched != blocks or any(n != blocks for n in sliced):
        raise RuntimeError(f"lookup benchmark caches are not the all-present case: {matched}, {sliced} of {blocks}")
