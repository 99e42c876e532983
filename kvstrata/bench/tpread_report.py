"""What ``kvstrata bench cache --tp-readers`` adds to the report: per (tier, reader TP) the restore
GB/s of head-sliced and TP-matched blocks and the paired ratio, the hash+lookup times of a TP=1
and a TP=t instance, and their goals.

Built from :class:`kvstrata.bench.tpread.TPRun`; part of :class:`kvstrata.bench.cache_report.CacheBenchReport`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from kvstrata.bench.goals import (
    SLICED_LOOKUP_TP_OF_TP1,
    SLICED_OF_MATCHED,
    Goal,
    sliced_lookup_figure,
    sliced_restore_figure,
)
from kvstrata.rounds import Compared, Spread
from kvstrata.bench.tpread import Layout, LookupRounds, Source, TPData, TPRun, step_name
from kvstrata.report import flatten

NOTE = ("restore = every rank's load() into its device tier and the copy into its KV tensor "
        "[layers, kv, tokens, its heads, head_dim], ranks one after another (one process); load_*: the load() "
        "alone, to its wait(), before that copy; each rank its own cache; "
        "head-sliced objects written by the reader TP's own ranks: sliced = as a rank keeps them in its own tiers "
        "(its slices of a block packed in one object), slices = one object per slice (as the shared pool holds "
        "them); ratio = median over rounds of head-sliced / "
        "TP-matched GB/s within a round; disk, cold: page cache dropped and the ballast released first; disk, warm: "
        "files in the page cache")


@dataclass(frozen=True)
class SlicedRestore:
    """One (tier, reader TP) row: head-sliced beside TP-matched, the same bytes."""

    source: Source
    tp: int
    restored_bytes: int  # per restore, all ranks together
    rate: Compared = field(metadata=flatten("", gbps="sliced_gbps", baseline_gbps="matched_gbps"))
    load: Compared = field(metadata=flatten("load_", gbps="load_sliced_gbps", baseline_gbps="load_matched_gbps"))
    # The same restore from one object per slice (what the shared tiers hold), beside TP-matched.
    slices: Compared = field(metadata=flatten("slices_", gbps="slices_gbps", baseline_gbps="slices_matched_gbps"))
    matched_objects: int  # per rank (rank 0), each of matched_object_bytes
    sliced_objects: int  # head-sliced as the rank restores from its own tiers: packs of its slices
    slices_objects: int  # one per slice
    matched_object_bytes: int
    sliced_object_bytes: int
    slices_object_bytes: int
    runs_gbps: dict[Layout, tuple[float, ...]]


@dataclass(frozen=True)
class SlicedLookup:
    """Hash+lookup of ``tokens`` ids, every block in the host tier, by an instance (see
    :func:`kvstrata.bench.tpread.lookup_rounds`); medians in ms and paired time ratios."""

    block_size: int
    tokens: int
    tp: int
    matched_tp1_ms: float
    sliced_tp1_ms: float
    sliced_tp_ms: float  # the slowest rank's, its ranks looking up at once
    sliced_tp_ranks_ms: float  # every rank's together: the instance's CPU time
    hash_ms: float  # the block keys alone (hashed once per instance)
    slice_keys_tp1_ms: float  # every rank's slice keys of the block keys, at TP=1 and TP=tp
    slice_keys_tp_ms: float
    tp_of_tp1: Spread  # sliced TP=tp / sliced TP=1: the goal's figure
    sliced_of_matched: Spread  # sliced TP=1 / matched TP=1
    where: str = ("sliced = per rank, its hash (the block keys) + its slice keys (one xxh3-128 per slice per block) + "
                  "its match of them; TP=t: the slowest rank (ranks are processes that look up at once), "
                  "sliced_tp_ranks_ms: all ranks together; slice_keys_*: every rank's slice keys alone")


@dataclass(frozen=True)
class TPReaders:
    readers: tuple[int, ...]
    kv_heads: int
    slices: int  # per block
    block_tokens: int
    blocks: int
    restores: tuple[SlicedRestore, ...]
    lookups: dict[int, SlicedLookup]
    verified_bytes: int  # restored by both layouts, every one compared byte for byte
    goals: tuple[Goal, ...]
    note: str = NOTE


def tp_report(data: TPData, readers: tuple[int, ...], run: TPRun) -> TPReaders:
    rounds = run.rounds
    restores = []
    for source in Source:
        for tp in readers:
            sliced, matched = step_name(Layout.SLICED, source, tp), step_name(Layout.MATCHED, source, tp)
            slices = step_name(Layout.SLICES, source, tp)
            size = run.restored_bytes[tp]
            objects, object_bytes = run.objects[tp], run.object_bytes[tp]
            restores.append(SlicedRestore(
                source, tp, size, rounds.rate_vs(sliced, matched, size),
                rounds.rate_vs(sliced + ".load", matched + ".load", size), rounds.rate_vs(slices, matched, size),
                objects[Layout.MATCHED], objects[Layout.SLICED], objects[Layout.SLICES],
                object_bytes[Layout.MATCHED], object_bytes[Layout.SLICED], object_bytes[Layout.SLICES],
                {layout: rounds.rate(step_name(layout, source, tp), size).runs for layout in Layout},
            ))
    lookups = {bs: _lookup(lr) for bs, lr in run.lookups.items()}
    goals = [Goal(sliced_restore_figure(r.source.value, r.tp), f">={SLICED_OF_MATCHED}x TP-matched", r.rate.ratio,
                  SLICED_OF_MATCHED) for r in restores]
    goals += [Goal(sliced_lookup_figure(bs, lk.tp), f"<={SLICED_LOOKUP_TP_OF_TP1}x TP=1", lk.tp_of_tp1.median,
                   SLICED_LOOKUP_TP_OF_TP1, at_most=True) for bs, lk in lookups.items()]
    return TPReaders(readers, data.slicing.kv_heads, data.slicing.slices, data.block_tokens, data.blocks,
                     tuple(restores), lookups, run.verified_bytes, tuple(goals))


def _lookup(lr: LookupRounds) -> SlicedLookup:
    rounds = lr.rounds

    def ms(name: str) -> float:
        return statistics.median(rounds.seconds[name]) * 1e3

    tp = f"sliced.tp{lr.tp}"
    return SlicedLookup(
        lr.block_size, lr.tokens, lr.tp, ms("matched.tp1"), ms("sliced.tp1"), ms(tp), ms(tp + ".ranks"), ms("hash"),
        ms("slice_keys.tp1"), ms(f"slice_keys.tp{lr.tp}"),
        rounds.time_ratio_spread(tp, "sliced.tp1"), rounds.time_ratio_spread("sliced.tp1", "matched.tp1"),
    )
