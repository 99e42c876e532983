"""A hybrid model's cache: one TieredCache per KV group, windows dropped, recurrent state as snapshots.

A hybrid model (Gemma 2/3, gpt-oss: sliding + full attention; Qwen3-Next, Bamba, Jamba: linear
attention or Mamba + attention) caches several kinds of thing (:mod:`kvstrata.kv.groups`). Its
:class:`GroupedCache` is one :class:`~kvstrata.cache.TieredCache` per group, each with its own
layout (:meth:`KVLayout.for_group`; a STATE group's: :func:`state_layout`) and its own namespace
(``kv_group`` = :func:`group_name`), so each group's blocks are stored under their own keys
(prefix key x group) and move through the tiers like any block.

The rules (``B`` = block tokens, a hit or store ending at token ``P``, a multiple of ``B``):

* A FULL/MLA group needs blocks ``[0, P/B)``.
* A SLIDING/CHUNKED group of span ``S`` needs the blocks overlapping ``[P - S, P)``
  (:func:`needed_blocks`). A store writes only the blocks some prefix end it is told of needs:
  blocks entirely before ``P - S`` are never written down.
* A STATE group needs a snapshot of the recurrent state after exactly ``P`` tokens, stored as one
  "block" keyed by the key of block ``P/B - 1`` in the group's namespace: the prefix's state at
  its last full block.

A lookup's usable hit is the longest ``P`` for which every group has what it needs; the match
carries one :class:`GroupMatch` per group, and :meth:`GroupedCache.load` loads each group's blocks
(and the snapshots) through its own TieredCache, reporting bytes per group.

Capacities: each tier's bytes are split between the groups as one stored sequence uses them.
Without ``GroupedConfig.context_tokens`` that is one block of each group (a STATE group's block
is one snapshot), so every group holds the same number of blocks in a tier: ``tier bytes //
(sum of one block of each group)``. With it, a sequence of that length: every block of a
FULL/MLA group, the blocks of a window (``ceil(span / B) + 1``) of a windowed one and two
snapshots (the two points :class:`~kvstrata.integrations.hf.hybrid.HybridLM` stores), so a
sliding-window model's tiers hold as many sequences as their full layers allow (the planner's
rule: :func:`kvstrata.plan.footprint.stored_bytes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kvstrata.cache.config import CacheConfig
from kvstrata.cache.results import LoadHandle, LoadResult
from kvstrata.cache.tiered import TieredCache
from kvstrata.index.keys import BlockKey, block_keys, token_array
from kvstrata.index.prefix import Match
from kvstrata.kv.dtypes import DType
from kvstrata.kv.groups import GroupKind, KVGroup
from kvstrata.kv.layout import KVLayout
from kvstrata.policies.eviction import Eviction
from kvstrata.policies.write import WriteRule
from kvstrata.pool.config import PoolConfig
from kvstrata.tensors import torch_dtype

_TIERS = ("device_bytes", "host_bytes", "disk_bytes", "remote_bytes")


def group_name(index: int, group: KVGroup) -> str:
    """A group's stable name, its namespace's ``kv_group``: position and kind (``"g0-sliding"``)."""
    return f"g{index}-{group.kind.value}"


def state_layout(group: KVGroup, tp: int = 1) -> KVLayout:
    """A STATE group's snapshot as one block: ``[layers, 1, 1, 1, bytes of one layer's state]``
    of opaque bytes (a one-byte dtype; the integration packs each layer's state into its row)."""
    if group.kind is not GroupKind.STATE:
        raise ValueError(f"state_layout takes a state group, got a {group.kind.value} group")
    layer_bytes = group.state_bytes * group.heads_per_gpu(tp) // group.state_heads
    return KVLayout(group.num_layers, 1, 1, layer_bytes, DType.FP8, kv_tensors=1)


def needed_blocks(group: KVGroup, tokens: int, block_tokens: int) -> range:
    """The blocks (indices into the prefix) a group needs to resume after ``tokens`` tokens (a
    multiple of ``block_tokens``): all of them, those overlapping the window, or the snapshot's."""
    blocks = tokens // block_tokens
    if group.kind is GroupKind.STATE:
        return range(blocks - 1, blocks) if blocks else range(0)
    first = max(0, tokens - group.span) // block_tokens if group.kind.windowed else 0
    return range(first, blocks)


@dataclass(frozen=True)
class GroupedConfig:
    """What a GroupedCache holds: the model's groups and the whole model's tier capacities
    (bytes; split as the module text says; 0 disables a tier). Other fields as in CacheConfig."""

    model_id: str
    groups: tuple[KVGroup, ...]
    block_tokens: int
    device_bytes: int
    host_bytes: int
    disk_bytes: int = 0
    disk_dir: Path | None = None  # each group's blocks in a subdirectory named after the group
    pool: PoolConfig | None = None
    remote_bytes: int = 0
    device: str | None = None
    tp_rank: int = 0
    tp_size: int = 1
    workers: int = 2
    write: WriteRule = field(default_factory=WriteRule)
    eviction: Eviction = Eviction.LRU
    context_tokens: int | None = None  # the sequence length tiers are split for (module text); None: a block each

    def __post_init__(self) -> None:
        if not isinstance(self.groups, tuple) or not self.groups or not all(isinstance(g, KVGroup) for g in self.groups):
            raise ValueError(f"grouped cache groups must be a non-empty tuple of KVGroup, got {self.groups!r}")
        if isinstance(self.block_tokens, bool) or not isinstance(self.block_tokens, int) or self.block_tokens < 1:
            raise ValueError(f"grouped cache block_tokens must be a positive integer, got {self.block_tokens!r}")
        if self.context_tokens is not None and (isinstance(self.context_tokens, bool)
                                                or not isinstance(self.context_tokens, int) or self.context_tokens < 1):
            raise ValueError(f"grouped cache context_tokens must be a positive integer or None, got {self.context_tokens!r}")
        self.configs()  # a capacity too small for one block of every group fails here

    def sequence_blocks(self) -> dict[str, int]:
        """Per group name, the blocks one stored sequence uses (1 each without ``context_tokens``)."""
        if self.context_tokens is None:
            return dict.fromkeys(self.names, 1)
        blocks = -(-self.context_tokens // self.block_tokens)
        return {name: (2 if not g.kind.per_token else
                       min(blocks, -(-g.span // self.block_tokens) + 1) if g.kind.windowed else blocks)
                for name, g in zip(self.names, self.groups)}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(group_name(i, g) for i, g in enumerate(self.groups))

    def layouts(self) -> dict[str, KVLayout]:
        """Each group's block layout, by name."""
        return {name: (KVLayout.for_group(g, self.block_tokens, self.tp_size) if g.kind.per_token
                       else state_layout(g, self.tp_size)) for name, g in zip(self.names, self.groups)}

    def configs(self) -> dict[str, CacheConfig]:
        """Each group's CacheConfig, by name: its layout, namespace and share of every tier."""
        layouts = self.layouts()
        one_of_each = sum(layout.block_bytes for layout in layouts.values())
        per_sequence = self.sequence_blocks()
        sequence = sum(per_sequence[name] * layout.block_bytes for name, layout in layouts.items())
        shares: dict[str, dict[str, int]] = {name: {} for name in layouts}
        for tier in _TIERS:
            total = getattr(self, tier)
            if total and total < one_of_each:
                raise ValueError(f"grouped cache {tier} ({total}) must be 0 or hold one block of every group "
                                 f"({one_of_each} bytes)")
            for name, layout in layouts.items():  # whole sequences first, then a block each at least
                blocks = total // sequence * per_sequence[name] if total >= sequence else 0
                shares[name][tier] = max(blocks, 1 if total else 0) * layout.block_bytes
        return {name: CacheConfig(
            layout, self.model_id, device_bytes=shares[name]["device_bytes"],
            host_bytes=shares[name]["host_bytes"], disk_bytes=shares[name]["disk_bytes"],
            disk_dir=self.disk_dir / name if self.disk_dir is not None else None, pool=self.pool,
            remote_bytes=shares[name]["remote_bytes"], device=self.device, tp_rank=self.tp_rank,
            tp_size=self.tp_size, workers=self.workers, write=self.write, eviction=self.eviction, kv_group=name,
        ) for name, layout in layouts.items()}


@dataclass(frozen=True)
class GroupMatch:
    """One group's part of a hit: ``match`` holds the prefix's blocks ``first_block`` on (a
    snapshot's match: its one block, ``first_block`` = the block it is keyed by)."""

    first_block: int
    match: Match


@dataclass(frozen=True)
class GroupedMatch:
    """The usable hit of a prompt: ``tokens`` (a multiple of ``block_tokens``; 0: a miss, and
    ``groups`` is empty) and each group's part of it, by group name."""

    tokens: int
    block_tokens: int
    total_blocks: int  # full blocks of the looked-up sequence
    groups: Mapping[str, GroupMatch]

    @property
    def blocks(self) -> int:
        return self.tokens // self.block_tokens


@dataclass(frozen=True)
class GroupKV:
    """A per-token group's KV to store: ``kv`` (``[layers, kv, tokens, kv_heads, head_dim]``) holds
    the prefix's tokens ``[start, start + tokens)``; ``start`` is a multiple of the block."""

    kv: torch.Tensor
    start: int = 0


@dataclass(frozen=True)
class GroupedLoadResult:
    """A grouped load's results: per group name its LoadResult (its ``restored_bytes`` are the
    bytes that crossed to the device) and ``loaded_bytes``, the bytes its load served."""

    loads: Mapping[str, LoadResult]
    loaded_bytes: Mapping[str, int]

    @property
    def restored_bytes(self) -> dict[str, int]:
        """Bytes that arrived on the device per group (0 for blocks already there)."""
        return {name: load.restored_bytes for name, load in self.loads.items()}


class GroupedLoad:
    """The loads of one grouped hit in flight: one LoadHandle per group."""

    def __init__(self, match: GroupedMatch, handles: Mapping[str, LoadHandle], layouts: Mapping[str, KVLayout]):
        self.match = match
        self.handles = dict(handles)
        self._layouts = layouts

    def wait(self, timeout: float | None = None) -> GroupedLoadResult:
        """Wait for every group (a failed group's error is raised)."""
        loads = {name: handle.wait(timeout) for name, handle in self.handles.items()}
        return GroupedLoadResult(loads, {name: load.blocks * self._layouts[name].block_bytes
                                         for name, load in loads.items()})

    def kv(self, name: str) -> torch.Tensor:
        """A per-token group's loaded blocks as ``[layers, kv, tokens, kv_heads, head_dim]``, the
        prefix's tokens ``[first_block * B, hit)``, a copy (waits for the load)."""
        handle = self.handles[name]
        handle.wait()
        return torch.cat([handle.block(b) for b in range(handle.blocks)], dim=2)

    def state(self, name: str) -> torch.Tensor:
        """A STATE group's snapshot as uint8 ``[layers, layer state bytes]``, a copy (waits for the load)."""
        handle = self.handles[name]
        handle.wait()
        return handle.block(0).view(torch.uint8).reshape(self._layouts[name].num_layers, -1).clone()

    def release(self) -> None:
        for handle in self.handles.values():
            handle.release()

    def __enter__(self) -> GroupedLoad:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


@dataclass(frozen=True)
class GroupedStoreResult:
    """Per group name: blocks offered (windows' dropped blocks excluded; snapshots for a STATE
    group) and blocks newly written to its device tier."""

    blocks: Mapping[str, int]
    new_blocks: Mapping[str, int]


class GroupedStore:
    """A grouped store in flight: the stores of each group's runs of blocks and snapshots."""

    def __init__(self, futures: Mapping[str, Sequence[Future]]) -> None:
        self.futures = futures

    def result(self, timeout: float | None = None) -> GroupedStoreResult:
        results = {name: [f.result(timeout) for f in futures] for name, futures in self.futures.items()}
        return GroupedStoreResult({name: sum(r.blocks for r in rs) for name, rs in results.items()},
                                  {name: sum(r.new_blocks for r in rs) for name, rs in results.items()})


class GroupedCache:
    """See the module docstring. ``caches``: each group's TieredCache by name, instead of those
    ``config`` describes (their configs must be ``config.configs()``'s); this cache closes them."""

    def __init__(self, config: GroupedConfig, caches: Mapping[str, TieredCache] | None = None) -> None:
        self.config = config
        self.groups = dict(zip(config.names, config.groups))
        self.layouts = config.layouts()
        if caches is None:
            built: dict[str, TieredCache] = {}
            try:
                for name, group_config in config.configs().items():
                    built[name] = TieredCache(group_config)
            except BaseException:
                for cache in built.values():
                    cache.close()
                raise
            caches = built
        if set(caches) != set(self.groups):
            raise ValueError(f"grouped cache caches must be one per group {sorted(self.groups)}, got {sorted(caches)}")
        self.caches = dict(caches)

    @property
    def block_tokens(self) -> int:
        return self.config.block_tokens

    def cache(self, name: str) -> TieredCache:
        """The TieredCache of group ``name``."""
        if name not in self.caches:
            raise ValueError(f"no KV group {name!r} in this cache (groups: {', '.join(self.caches)})")
        return self.caches[name]

    def _keys(self, name: str, ids: Any, tenant: str) -> list[BlockKey]:
        """The group's keys of every full block of ``ids``: a STATE group's in its namespace at
        the model's block size (its own layout's block is one snapshot, not ``B`` tokens)."""
        cache = self.caches[name]
        if self.groups[name].kind.per_token:
            return cache.keys(ids, tenant)
        return block_keys(ids, replace(cache.config.namespace(tenant), block_size=self.block_tokens))

    def lookup(self, tokens: Any, tenant: str = "") -> GroupedMatch:
        """The longest block-aligned prefix of ``tokens`` every group can resume from (:func:`longest_hit`)."""
        ids = token_array(tokens)
        B = self.block_tokens
        ids = ids[: len(ids) // B * B]
        keys = {name: self._keys(name, ids, tenant) for name in self.groups}
        return longest_hit(self.groups, self.caches, keys, B)

    def load(self, match: GroupedMatch) -> GroupedLoad:
        """Load every group's part of ``match`` (each through its own TieredCache)."""
        return GroupedLoad(match, {name: self.caches[name].load(part.match) for name, part in match.groups.items()},
                           self.layouts)

    def store(
        self,
        tokens: Any,
        kv: Mapping[str, GroupKV],
        snapshots: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
        hits: Sequence[int] = (),
        tenant: str = "",
    ) -> GroupedStore:
        """Store a sequence's blocks, group by group, and its state snapshots.

        Args:
            tokens: the sequence's token ids.
            kv: per per-token group name, its KV (:class:`GroupKV`). The stored prefix ends at
                the last full block all of them (and ``tokens``) reach.
            snapshots: per prefix length (tokens, a multiple of the block, at most the stored
                prefix), each STATE group's state after exactly that many tokens, uint8
                ``[layers, layer state bytes]`` (:meth:`GroupedLoad.state`'s shape).
            hits: further prefix lengths a later lookup should hit (a prompt asked again stops
                a block short of the answer): windowed groups keep their windows too.

        Raises:
            ValueError: a group missing or unknown, a length not a multiple of the block.
        """
        ids = token_array(tokens)
        B = self.block_tokens
        snapshots = snapshots or {}
        per_token = {name for name, g in self.groups.items() if g.kind.per_token}
        if set(kv) != per_token:
            raise ValueError(f"grouped store kv must name every per-token group {sorted(per_token)}, got {sorted(kv)}")
        end = min([len(ids)] + [part.start + part.kv.shape[2] for part in kv.values()]) // B * B
        for point in (*snapshots, *hits, *(part.start for part in kv.values())):
            if isinstance(point, bool) or not isinstance(point, int) or point % B or point < 0:
                raise ValueError(f"grouped store prefix lengths must be multiples of the block ({B}), got {point!r}")
        ends = sorted({end, *(p for p in (*hits, *snapshots) if 0 < p <= end)} - {0})
        futures: dict[str, list[Future]] = {}
        for name in per_token:
            futures[name] = self._store_group(name, ids[:end], kv[name], ends, tenant)
        states = [name for name, g in self.groups.items() if g.kind is GroupKind.STATE]
        for name in states:
            futures[name] = []
        for point in sorted(p for p in snapshots if 0 < p <= end):
            for name in states:
                if name not in snapshots[point]:
                    raise ValueError(f"grouped store snapshot at {point} tokens lacks state group {name!r}")
                key = self._keys(name, ids[:point], tenant)[-1]
                layout = self.layouts[name]
                state = snapshots[point][name].reshape(-1).view(torch_dtype(layout.dtype)).view(layout.block_shape)
                futures[name].append(self.caches[name].store_keys([key], state))
        return GroupedStore(futures)

    def _store_group(self, name: str, ids: Any, part: GroupKV, ends: Sequence[int], tenant: str) -> list[Future]:
        """Store the runs of a per-token group's blocks some end needs that ``part`` holds."""
        B = self.block_tokens
        wanted: set[int] = set()
        for end in ends:
            wanted.update(needed_blocks(self.groups[name], end, B))
        wanted = {b for b in wanted if b >= part.start // B}
        keys = self.caches[name].keys(ids, tenant)
        futures = []
        for run in _runs(sorted(wanted)):
            kv = part.kv[:, :, run.start * B - part.start: run.stop * B - part.start]
            futures.append(self.caches[name].store_keys(keys[run.start:run.stop], kv))
        return futures

    def close(self) -> None:
        for cache in self.caches.values():
            cache.close()

    def __enter__(self) -> GroupedCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def longest_hit(groups: Mapping[str, KVGroup], caches: Mapping[str, TieredCache],
                keys: Mapping[str, list[BlockKey]], block_tokens: int) -> GroupedMatch:
    """The longest block-aligned prefix every group can resume from (see the module text).

    Args:
        groups: each group by name.
        caches: each group's TieredCache by name.
        keys: each group's keys of every full block of the sequence (a STATE group's at
            ``block_tokens``), all of one length.
        block_tokens: tokens per block.

    Each candidate is probed from the longest down: FULL/MLA groups by one match of their run;
    windowed groups by a match of their window's blocks; STATE groups by whether the snapshot is
    known, here or in a shared pool (a snapshot another instance put there is discovered as any
    block is, by TieredCache.match).
    """
    total = min(len(k) for k in keys.values())
    full = {name: caches[name].match(keys[name]) for name, g in groups.items() if g.kind.keeps_every_token}
    states = [name for name, g in groups.items() if g.kind is GroupKind.STATE]
    for blocks in range(min([total] + [m.blocks for m in full.values()]), 0, -1):
        if any(not caches[name].match(keys[name][blocks - 1 : blocks]).blocks for name in states):
            continue  # cheap first: one block's lookup
        parts: dict[str, GroupMatch] = {}
        for name, group in groups.items():
            if name in full:
                m = full[name]
                parts[name] = GroupMatch(0, Match(m.keys[:blocks], m.media[:blocks], m.block_size, m.total_blocks))
                continue
            need = needed_blocks(group, blocks * block_tokens, block_tokens)
            match = caches[name].match(keys[name][need.start:need.stop])
            if match.blocks < len(need):
                break
            parts[name] = GroupMatch(need.start, match)
        else:
            return GroupedMatch(blocks * block_tokens, block_tokens, total, parts)
    return GroupedMatch(0, block_tokens, total, {})


def _runs(blocks: Sequence[int]) -> list[range]:
    """Increasing block indices as runs of consecutive ones."""
    runs: list[range] = []
    for b in blocks:
        if runs and runs[-1].stop == b:
            runs[-1] = range(runs[-1].start, b + 1)
        else:
            runs.append(range(b, b + 1))
    return runs
