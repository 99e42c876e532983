"""kvstrata as SGLang's HiCache L3 storage: a ``HiCacheStorage`` over one rank's TieredCache.

SGLang's HiCache keeps KV in GPU memory (L1), in a host pool (L2) and in a pluggable storage
(L3). Its controller backs pages up from the host pool (``batch_set_v1``, or ``batch_set`` with
flat pages on the generic interface), asks how long a prefix's leading run in storage is
(``batch_exists``) and prefetches that run into host pages (``batch_get_v1`` / ``batch_get``),
on three threads at once. Keys are SGLang's page hashes, each already a chained hash of the
whole prefix up to its page.

Here one SGLang page is one kvstrata block (:mod:`kvstrata.integrations.sglang.pages`), keyed
``xxh3_128(namespace digest + SGLang's key)``. The namespace is kvstrata's (the model,
SGLang's ``model_name`` unless ``kvstrata_model_id``; the KV dtype; the block layout, which is
kvstrata's whatever SGLang's host layout; the page size; the tenant), with:

* MHA: the TP rank and size (a rank holds its own heads);
* MLA: TP rank 0 of 1 for every rank, whatever the TP size: the latent is the same on every
  rank, so one copy serves all. Only SGLang's storage writer (rank 0) backs pages up (its
  controller skips the others; called anyway, they answer True: the writer stores the page);
  every rank looks up and loads that copy, which other ranks reach through the pool. So MLA at
  TP > 1 needs ``kvstrata_pool`` and is refused without it (a disk directory is one process's,
  and non-writers would never hit);
* pipeline stages (``pp_size`` > 1): the stage as the KV group (stages hold different layers).

The data-parallel rank is not in the namespace (replicas of one attention-TP rank hold the same
heads and share the pool); each keeps its own disk directory (``disk_dir/dp<r>``).

Tiers. A page moves between SGLang's host pool and kvstrata's tiers in place: its bytes, in
the order of SGLang's flat page for the pool's layout (the order is in the namespace), are a few
runs of the host pool's memory, which the disk tier writes and reads with vectored file I/O and
the pool tier puts and gets through its own staging buffers (one copy each way: the host pool's
memory is never registered with the pool's transfer engine, which exposes registered memory to
anyone who reaches its port) (:meth:`kvstrata.cache.TieredCache.put`, ``get_into``). The cache's "device" tier holds nothing: SGLang's host pool plays its part. Below
it an optional host DRAM tier, a disk tier and the pool, under the write policy (write-through
by default: a backup returns once its pages are in every tier). Integrity is kvstrata's: a page
that fails verification, or that the pool lost, is a miss and ends the leading run, never wrong
bytes; a pool that is down costs one bounded wait, then answers from the local tiers while it
is probed in the background.

Prefetching is SGLang's: its controller runs ``batch_exists`` then ``batch_get_v1`` ahead of
the request on its own threads under its prefetch policy, so kvstrata's own prefetch is not used.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvstrata.cache import TieredCache
from kvstrata.index.keys import BlockKey
from kvstrata.integrations.sglang.pages import HostPages
from kvstrata.integrations.sglang.settings import StorageSettings
from kvstrata.media import Medium

_log = logging.getLogger("kvstrata.integrations.sglang")
_PREFIX = "KVStrataHiCacheStorage:"


class KVStrataHiCacheStorage(HiCacheStorage):
    """SGLang's HiCache L3 storage backed by kvstrata (see the module docstring).

    Built by SGLang's dynamic backend factory as ``cls(storage_config, kwargs)``; the cache is
    built when SGLang registers its host pool (``register_mem_pool_host``), which fixes the
    page's shape.

    Raises:
        ValueError: a configuration kvstrata does not serve, or a bad ``kvstrata_`` option, in
            one line naming it.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        self.storage_config = storage_config
        self.settings = StorageSettings.from_extra(storage_config.extra_config)
        reason = _refusal(storage_config, self.settings)
        if reason is not None:
            raise ValueError(f"{_PREFIX} {reason}")
        self._cache: TieredCache | None = None
        self._pages: HostPages | None = None
        self._digest = b""
        self._throughput = _Throughput() if storage_config.enable_storage_metrics else None

    # --- attach ----------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Build the cache for the pages of SGLang's host KV pool (its anchor pool)."""
        pages = HostPages(mem_pool_host)
        config = self.storage_config
        if pages.geometry.mla != config.is_mla_model:
            raise ValueError(f"{_PREFIX} the storage config says is_mla_model={config.is_mla_model} but the host "
                             f"pool is {type(mem_pool_host).__name__}")
        super().register_mem_pool_host(mem_pool_host)
        self.close()  # a pool registered again: a cache of its own
        mla = config.is_mla_model
        cache_config = self.settings.cache_config(
            pages.geometry.kv_layout(), config.model_name or "",
            tp_rank=0 if mla else config.tp_rank, tp_size=1 if mla else config.tp_size,  # MLA: one copy for all
            kv_group=f"pp{config.pp_rank}of{config.pp_size}" if config.pp_size > 1 else "",
            disk_subdir=_disk_subdir(config))
        self._cache = TieredCache(cache_config)
        self._pages = pages
        self._digest = cache_config.namespace(self.settings.tenant).digest

    @property
    def cache(self) -> TieredCache:
        """This rank's cache (once a host pool is registered)."""
        if self._cache is None or self._cache.closed:
            raise RuntimeError(f"{_PREFIX} no host pool registered, or closed (call register_mem_pool_host)")
        return self._cache

    def block_keys(self, keys: Sequence[str]) -> list[BlockKey]:
        """kvstrata's keys of SGLang's page keys: the namespace's digest and the page hash, hashed."""
        digest, ns = xxhash.xxh3_128_digest, self._digest
        return [digest(ns + key.encode()) for key in keys]

    # --- the zero-copy interface (interface_v1) -------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, are stored (pages other ranks or instances put in
        the pool included)."""
        return self.cache.match(self.block_keys(keys)).blocks

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Load the stored leading run of ``keys`` into the host pool's pages at ``host_indices``:
        True for each page loaded, then False from the first page that is not."""
        pages = self._pages_of()
        slots = pages.first_slots(host_indices, len(keys))
        loaded = self._load(self.block_keys(keys), [pages.pieces(slot) for slot in slots])
        return [True] * loaded + [False] * (len(keys) - loaded)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` under ``keys`` (pages already stored are
        left as they are): per page, whether it is stored. A non-writer MLA rank stores nothing."""
        pages = self._pages_of()
        slots = pages.first_slots(host_indices, len(keys))
        if not self.storage_config.is_storage_writer:
            return [True] * len(keys)
        return self._store(self.block_keys(keys), [pages.pieces(slot) for slot in slots])

    # --- the generic interface: flat pages in the host layout's order ---------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """The page stored under ``key``, copied into ``target_location`` (a flat page; None: a new
        one) and returned; None if it is not stored."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """The stored leading run of ``keys``, each read into its flat page of
        ``target_locations`` (None: new ones), then None from the first page not stored."""
        pages = self._pages_of()
        targets = list(target_locations) if target_locations is not None else [pages.empty_flat() for _ in keys]
        if len(targets) != len(keys):
            raise ValueError(f"{_PREFIX} {len(keys)} keys but {len(targets)} target pages")
        loaded = self._load(self.block_keys(keys), [pages.flat(target, writable=True) for target in targets])
        return targets[:loaded] + [None] * (len(keys) - loaded)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store the flat page ``value`` under ``key`` (True if it was stored already)."""
        if value is None:
            raise ValueError(f"{_PREFIX} set needs the flat page to store (value)")
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat pages ``values`` under ``keys``: True if every page is stored."""
        if values is None or len(values) != len(keys):
            raise ValueError(f"{_PREFIX} batch_set needs one flat page per key, got "
                             f"{'none' if values is None else len(values)} for {len(keys)} keys")
        pages = self._pages_of()
        blocks = [pages.flat(value) for value in values]
        if not self.storage_config.is_storage_writer:
            return True
        return all(self._store(self.block_keys(keys), blocks))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # --- housekeeping ----------------------------------------------------------------------------

    def clear(self) -> None:
        """Drop every page this rank's tiers hold: its host and disk copies, and the pool
        objects of its view of the pool (pages being loaded right now stay)."""
        cache = self.cache
        for medium in cache.media:
            if medium is not Medium.REMOTE:
                cache.evict(medium, cache.tier(medium).capacity_blocks)
        if Medium.REMOTE in cache.media:
            cache.tier(Medium.REMOTE).remove_from_pool(cache.manager.ready_keys(Medium.REMOTE), force=True)
            cache.evict(Medium.REMOTE, cache.tier(Medium.REMOTE).capacity_blocks)

    def get_stats(self) -> Any:
        """With ``--enable-hicache-storage-metrics``: SGLang's ``StorageMetrics`` of the batch calls
        since the last call (pages and GB/s of each prefetch and backup); else None."""
        return None if self._throughput is None else self._throughput.take()

    def close(self) -> None:
        """Close the cache (finishing what is under way). Idempotent."""
        if self._cache is not None:
            self._cache.close()

    # --- the two data paths ----------------------------------------------------------------------

    def _pages_of(self) -> HostPages:
        """The registered pool's pages (raising as ``cache`` does before a pool is registered, or once closed)."""
        _ = self.cache
        return self._pages

    def _load(self, keys: list[BlockKey], blocks: list[list[torch.Tensor]]) -> int:
        """Read the stored leading run of ``keys``, block i into the pieces ``blocks[i]``: the
        pages in place and verified (a page that failed verification or went missing ends the
        run; a tier's unexpected error is logged and ends it where it began)."""
        start = time.perf_counter()
        try:
            loaded = self.cache.get_into(keys, blocks)
        except Exception as error:  # noqa: BLE001 - a miss for SGLang, which recomputes
            _log.warning("kvstrata: loading %d pages failed: %s", len(keys), error)
            loaded = 0
        self._record(True, loaded, start)
        return loaded

    def _store(self, keys: list[BlockKey], blocks: list[list[torch.Tensor]]) -> list[bool]:
        """Store block i of ``keys`` from the pieces ``blocks[i]`` in every tier that lacks it:
        per page, whether it is stored (False: every tier it went to failed or had no room)."""
        start = time.perf_counter()
        try:
            result = self.cache.put(keys, blocks)
        except Exception as error:  # noqa: BLE001 - not stored; SGLang stops this backup
            _log.warning("kvstrata: storing %d pages failed: %s", len(keys), error)
            return [False] * len(keys)
        self._record(False, result.written, start)
        return list(result.stored)

    def _record(self, prefetch: bool, pages: int, start: float) -> None:
        if self._throughput is not None and pages:
            seconds = time.perf_counter() - start
            self._throughput.record(prefetch, pages, pages * self.cache.layout.block_bytes, seconds)


def _disk_subdir(config: HiCacheStorageConfig) -> str:
    """This process's directory within ``kvstrata_disk_dir`` (a disk directory is one process's):
    MHA ranks' namespaces differ and so do their tiers' directories; MLA ranks share a namespace,
    so each rank but 0 has its own, and so does each data-parallel replica but 0."""
    parts = [f"dp{config.dp_rank}"] if config.dp_rank > 0 else []
    if config.is_mla_model and config.tp_rank > 0:
        parts.append(f"rank{config.tp_rank}")
    return "/".join(parts)


def _refusal(config: HiCacheStorageConfig, settings: StorageSettings) -> str | None:
    """Why kvstrata cannot serve ``config``, in one line; None: it can."""
    if config.should_split_heads:
        return "heterogeneous TP head splitting (should_split_heads) is not supported"
    if config.dcp_size > 1:
        return f"decode context parallel (dcp_size={config.dcp_size}) is not supported"
    if config.attn_cp_size > 1:
        return f"attention context parallel (attn_cp_size={config.attn_cp_size}) is not supported"
    if config.is_mla_model and config.tp_size > 1 and settings.pool is None:
        return (f"MLA at TP={config.tp_size} needs kvstrata_pool: rank 0 writes the one copy every rank reads, "
                "and a disk directory is one process's")
    if not (settings.model_id or config.model_name):
        return "SGLang gave no model name: set kvstrata_model_id"
    return None


class _Throughput:
    """Pages and GB/s of each prefetch and backup since SGLang last read them (``get_stats``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[bool, list[tuple[int, float]]] = {True: [], False: []}  # prefetch? -> (pages, GB/s)

    def record(self, prefetch: bool, pages: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._calls[prefetch].append((pages, nbytes / seconds / 1e9 if seconds > 0 else 0.0))

    def take(self) -> Any:
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            calls, self._calls = self._calls, {True: [], False: []}
        return StorageMetrics(prefetch_pgs=[p for p, _ in calls[True]], backup_pgs=[p for p, _ in calls[False]],
                              prefetch_bandwidth=[g for _, g in calls[True]],
                              backup_bandwidth=[g for _, g in calls[False]])
