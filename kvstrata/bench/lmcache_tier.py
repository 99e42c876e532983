"""One tier of the LMCache end-to-end run (:mod:`kvstrata.bench.lmcache_e2e`): an LMCache
engine over one model's KV buffers ``[layers, kv, tokens, kv_heads, head_dim]``, LMCache's chunk
being the layout's block.

- host: ``local_cpu`` only; chunks are retrieved from CPU memory.
- disk: ``local_cpu`` and ``local_disk``; after a store, the engine waits until every chunk is
  on disk; before each lookup its CPU copies are cleared and (``drop_page_cache``) the files
  evicted from the page cache, so every restored chunk is read from the disk.

The engine glue (a CPU "GPU connector", the broadcast stubs) comes from
:mod:`kvstrata.bench.lmcache`; LMCache is imported when an engine is made, so this module
imports in a venv without it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

TIERS = ("host", "disk")
CPU = "LocalCPUBackend"
DISK = "LocalDiskBackend"
DISK_WAIT_S = 300.0  # a chunk not on disk by then means LMCache dropped the write


class LMCacheTier:
    """One LMCache engine (host: CPU only; disk: CPU + local disk) over KV buffers of one model."""

    def __init__(
        self, name: str, layout: Any, capacity_bytes: int, directory: Path | None, drop_pages: bool, tag: str
    ) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig

        from kvstrata.bench.lmcache import (
            _connector_class,
            _no_broadcast,
            _no_broadcast_object,
            engine_defaults,
            engine_metadata,
        )

        if name not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {name!r}")
        self.name = name
        self.directory = directory
        self.drop_pages = drop_pages
        self.chunk_tokens = layout.block_tokens
        self._builder = LMCacheEngineBuilder
        size_gib = capacity_bytes / (1 << 30)
        metadata = engine_metadata(layout, f"kvstrata-e2e-{tag}")
        common = engine_defaults(layout)
        if name == "host":
            config = LMCacheEngineConfig.from_defaults(**common, max_local_cpu_size=size_gib + 0.05)
        else:
            assert directory is not None
            directory.mkdir(parents=True, exist_ok=True)
            config = LMCacheEngineConfig.from_defaults(
                **common, max_local_cpu_size=size_gib + 0.05, local_disk=str(directory),
                max_local_disk_size=size_gib + 0.05,
            )
        self.instance_id = f"kvstrata-e2e-{name}-{tag}-{os.getpid()}"
        self.engine = LMCacheEngineBuilder.get_or_create(
            self.instance_id, config, metadata, _connector_class()(layout), _no_broadcast, _no_broadcast_object
        )
        self.engine.post_init()

    def before_lookup(self, tokens: Any) -> None:
        """Disk: only the disk holds chunks now (and, with drop_pages, not the page cache)."""
        if self.name != "disk":
            return
        from kvstrata.timing import drop_page_cache

        self.engine.clear(locations=[CPU])
        if len(tokens) >= self.chunk_tokens and self.engine.lookup(tokens, search_range=[CPU]):
            raise RuntimeError("LMCache still holds chunks in CPU memory after clearing it")
        if self.drop_pages:
            drop_page_cache(self.disk_files())

    def store(self, tokens: Any, kv: Any) -> float:
        """Store ``kv`` (``[layers, kv, len(tokens), kv_heads, head_dim]``); seconds until it is
        held (host: in CPU memory; disk: every chunk on disk)."""
        start = time.perf_counter()
        self.engine.store(tokens, kvcaches=kv)
        where = CPU if self.name == "host" else DISK
        deadline = start + DISK_WAIT_S
        while (found := self.engine.lookup(tokens, search_range=[where])) < len(tokens):
            if self.name == "host" or time.perf_counter() > deadline:
                raise RuntimeError(f"LMCache {self.name} holds {found} of {len(tokens)} stored tokens in {where}")
            time.sleep(0.0005)
        return time.perf_counter() - start

    def disk_files(self) -> list[Path]:
        if self.directory is None:
            return []
        return sorted(p for p in self.directory.rglob("*.pt") if p.is_file())

    def close(self) -> None:
        self._builder.destroy(self.instance_id)
