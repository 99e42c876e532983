"""The worker's load and store counters, written as JSON to ``stats_path``.

vLLM's own metrics say how many prompt tokens an engine found cached, not what kvstrata moved:
these counters do (bytes per source route, seconds, failures), rewritten whole after every step
that loaded or saved and at shutdown, atomically (a reader never sees half a file). Tests and
benchmarks read the file; its keys are the fields below plus ``stored_bytes`` and ``media``.

Per KV cache group (``groups``, vLLM's group order): what each group's cache moved, since a
sliding group loads only its window and a hybrid model's bytes are not the hit's tokens times
one block size. The top-level byte and block counters are the sums over the groups.

The same counters travel to vLLM's ``/metrics`` (:mod:`kvstrata.integrations.vllm.prom`), read
through :meth:`WorkerStats.totals`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstrata.media import Medium, route_text
from kvstrata.transfer.placement import io_thread_started

if TYPE_CHECKING:
    from concurrent.futures import Future

    from kvstrata.cache import LoadResult, StoreResult, TieredCache


@dataclass
class GroupStats:
    """One KV cache group's counters (kept under :class:`WorkerStats`' lock)."""

    namespace: str  # the group's kv_group ("" for a one-group model)
    kind: str  # GroupKind value: full, sliding, chunked
    span: int | None  # the sliding window or attention chunk, in tokens
    layers: int
    block_bytes: int
    loaded_blocks: int = 0  # blocks copied into vLLM's blocks from kvstrata
    restored_bytes: int = 0
    load_paths: Counter = field(default_factory=Counter)
    stored_blocks: int = 0  # full blocks offered to the group's cache
    new_blocks: int = 0  # blocks it did not hold yet

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["load_paths"] = {route_text(r): n for r, n in self.load_paths.items()}
        data["stored_bytes"] = self.new_blocks * self.block_bytes
        return data


@dataclass(frozen=True)
class LoadStoreTotals:
    """The worker's load and store counters at one moment (:meth:`WorkerStats.totals`).

    ``loaded_blocks`` and ``loaded_bytes`` are by source tier (the first medium of each block's
    route), over every group: vLLM blocks copied into vLLM's KV, and their bytes (this rank's).
    """

    load_requests: int
    load_seconds: float
    loaded_blocks: dict[Medium, float]  # a head-sliced block whose slices came two ways counts half on each
    loaded_bytes: dict[Medium, float]
    store_requests: int
    new_blocks: int
    store_seconds: float
    failed_blocks: int
    recomputed_blocks: int
    dropped_blocks: int
    saved_bytes: int = 0  # this rank's bytes copied out of vLLM's KV for saves (every block offered to the caches)
    async_loads: int = 0  # loads run off vLLM's step, ended


@dataclass
class WorkerStats:
    """The worker's counters; stores may complete on the cache's threads, hence the lock."""

    block_bytes: int = 0  # one token block over every group
    vllm_block_shape: list[int] = field(default_factory=list)  # one layer's block in vLLM's cache
    load_requests: int = 0
    loaded_tokens: int = 0  # hit tokens whose KV (every group's part of it) came from kvstrata
    restored_bytes: int = 0  # bytes kvstrata brought to its device tier (not already there)
    load_seconds: float = 0.0  # kvstrata's own load time (to its device tier), summed
    load_paths: Counter = field(default_factory=Counter)
    store_requests: int = 0
    stored_blocks: int = 0  # full blocks offered to the caches, every group's
    new_blocks: int = 0  # blocks the caches did not hold yet
    store_seconds: float = 0.0  # copy out of vLLM + store + write-down, summed
    failed_blocks: int = 0
    recomputed_blocks: int = 0  # failed blocks vLLM was told to recompute (kv_load_failure_policy "recompute")
    dropped_blocks: int = 0  # blocks of saves dropped: the stores in flight held save_backlog_bytes, or its load failed
    late_loads: int = 0  # loads given up past their budget (the prefill of their tokens): computed instead
    async_loads: int = 0  # loads run off vLLM's step (its asynchronous loads), ended: arrived, failed or given up
    probe_reads: Counter = field(default_factory=Counter)  # by tier label: probe reads of a failing tier, off the step
    probe_seconds: float = 0.0  # their time, summed
    last_failure: str | None = None
    remote_error: str | None = None
    tp: list[int] = field(default_factory=lambda: [0, 1])  # this worker's TP rank and size
    writes: bool = True  # head-sliced: this rank writes its heads (not a replica of an earlier rank's)
    groups: list[GroupStats] = field(default_factory=list)
    _loaded_blocks: Counter = field(default_factory=Counter, repr=False)  # by source Medium
    _loaded_bytes: Counter = field(default_factory=Counter, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def loaded(self, tokens: int, results: list[tuple[int, int, LoadResult]]) -> None:
        """A load whose ``tokens`` hit tokens were copied into vLLM's blocks in every group;
        ``results``: per group that moved any, (group, blocks copied, its cache's result)."""
        with self._lock:
            self.load_requests += 1
            self.loaded_tokens += tokens
            for group, blocks, result in results:
                self.restored_bytes += result.restored_bytes
                self.load_seconds += result.seconds
                self.load_paths.update(result.paths)
                stats = self.groups[group]
                stats.loaded_blocks += blocks
                stats.restored_bytes += result.restored_bytes
                stats.load_paths.update(result.paths)
                for route, n in result.paths.items():
                    self._loaded_blocks[route[0]] += n
                    self._loaded_bytes[route[0]] += n * stats.block_bytes

    def stored(self, results: list[tuple[int, StoreResult]], seconds: float) -> None:
        """A save done (``results``: per group, its cache's StoreResult) ``seconds`` after the copy began."""
        with self._lock:
            self.store_requests += 1
            self.store_seconds += seconds
            for group, result in results:
                self.stored_blocks += result.blocks
                self.new_blocks += result.new_blocks
                self.groups[group].stored_blocks += result.blocks
                self.groups[group].new_blocks += result.new_blocks

    def failed(self, blocks: int, why: str) -> None:
        with self._lock:
            self.failed_blocks += blocks
            self.last_failure = why

    def late(self) -> None:
        with self._lock:
            self.late_loads += 1

    def dropped(self, blocks: int) -> None:
        with self._lock:
            self.dropped_blocks += blocks

    def probed(self, medium: Medium, seconds: float) -> None:
        """A probe read of ``medium`` ended after ``seconds`` (arrived or not)."""
        with self._lock:
            self.probe_reads[medium.label] += 1
            self.probe_seconds += seconds

    def off_step(self) -> None:
        with self._lock:
            self.async_loads += 1

    def recomputed(self, blocks: int) -> None:
        with self._lock:
            self.recomputed_blocks += blocks

    def totals(self) -> LoadStoreTotals:
        with self._lock:
            return LoadStoreTotals(self.load_requests, self.load_seconds, dict(self._loaded_blocks),
                                   dict(self._loaded_bytes), self.store_requests, self.new_blocks, self.store_seconds,
                                   self.failed_blocks, self.recomputed_blocks, self.dropped_blocks,
                                   sum(g.stored_blocks * g.block_bytes for g in self.groups), self.async_loads)

    def to_json(self, caches: tuple[TieredCache, ...]) -> dict[str, Any]:
        with self._lock:
            data = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
            data["load_paths"] = {route_text(r): n for r, n in self.load_paths.items()}
            data["probe_reads"] = dict(self.probe_reads)
            data["groups"] = [g.to_json() for g in self.groups]
        data["stored_bytes"] = sum(g["stored_bytes"] for g in data["groups"])
        if caches:
            # a group's tiers, over its caches (head-sliced: its packs' and the pool's)
            data["media"] = [m.label for m in sorted({m for c in caches for m in c.media}, key=lambda m: m.value)]
            errors = [c.remote_error for c in caches if c.remote_error is not None]
            data["remote_error"] = errors[0] if errors else None  # now: the pool may have gone down, or come back
            unwritten: Counter = Counter()  # blocks not written down to a tier whose loads did not pay
            for cache in caches:
                unwritten.update({m.label: n for m, n in cache.manager.skipped_writes().items()})
            data["unwritten_blocks"] = dict(unwritten)
        return data

    def write(self, path: Path, caches: tuple[TieredCache, ...]) -> None:
        """Rewrite ``path`` with the counters (and the caches' media), atomically."""
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(caches), f, indent=1)
        os.replace(tmp, path)


class StatsFile:
    """The stats file, rewritten by a thread of its own when poked (coalesced: at most every
    ``every_s``: a write costs about a millisecond of CPU, which a busy host's engine feels),
    so the engine's step never spends its time on JSON; ``write_now`` on the
    caller's thread (with ``sync_save``, at the end of each step, as readers of a pass expect)."""

    def __init__(self, path: Path, stats: WorkerStats, caches: Callable[[], tuple[TieredCache, ...]],
                 every_s: float = 1.0) -> None:
        self._path, self._stats, self._caches, self._every_s = path, stats, caches, every_s
        self._lock = threading.Lock()
        self._poked = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def poke(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvstrata-stats", daemon=True)
            self._thread.start()
        self._poked.set()

    def write_now(self) -> None:
        with self._lock:
            self._stats.write(self._path, self._caches())

    def _run(self) -> None:
        io_thread_started()
        while True:
            self._poked.wait()
            if self._closed:
                return
            self._poked.clear()
            try:
                self.write_now()
            except OSError:
                pass  # a stats file that cannot be written is no reason to stop serving
            time.sleep(self._every_s)

    def close(self) -> None:
        """Stop the thread; the last write is the caller's."""
        self._closed = True
        self._poked.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


@dataclass
class PendingSave:
    """One SaveSpec's stores, one per group, recorded together when the last is done."""

    stats: WorkerStats
    start: float
    remaining: int
    settled: Callable[[], None]  # called once every group's store has ended (the backlog shrinks)
    results: list[tuple[int, StoreResult]] = field(default_factory=list)
    failed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def done(self, group: int, future: Future) -> None:
        error = future.exception()  # the store has ended (waits, with sync_save)
        with self.lock:
            if error is None:
                self.results.append((group, future.result()))
            self.failed |= error is not None
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            self.settled()
            if not self.failed:
                self.stats.stored(self.results, time.perf_counter() - self.start)
