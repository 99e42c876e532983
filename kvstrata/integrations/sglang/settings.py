"""``--hicache-storage-backend-extra-config``: kvstrata's settings, parsed and validated at this edge.

SGLang hands the backend its extra config as decoded JSON (or TOML/YAML) after taking out its
own prefetch keys. Every key kvstrata reads starts with ``kvstrata_``; the rest (SGLang's
``backend_name``, ``module_path``, ``class_name``, ``interface_v1``, another tool's) is left
alone. Here the ``kvstrata_`` keys become frozen, typed :class:`StorageSettings`, and
:meth:`StorageSettings.cache_config` the :class:`~kvstrata.cache.CacheConfig` of a rank's cache.
A bad key or value stops the backend's attach with one line that names it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvstrata.cache import CacheConfig
from kvstrata.integrations.extra_config import (
    Parser, as_is, check_text, check_whole, choice, empty_is_none, path, pool_budgets, pool_of, whole,
)
from kvstrata.kv.layout import KVLayout
from kvstrata.policies.eviction import Eviction
from kvstrata.policies.write import WritePolicy, WriteRule
from kvstrata.pool.config import DEFAULT_BUDGETS, PoolConfig, RemoteMode, check_budgets

GiB = 1024**3
KEY_PREFIX = "kvstrata_"
_PREFIX = "KVStrataHiCacheStorage:"


@dataclass(frozen=True)
class StorageSettings:
    """The ``kvstrata_`` keys of SGLang's storage extra config (without the prefix). Bytes as bytes.

    Attributes:
        host_bytes: a kvstrata host DRAM tier (0: none; SGLang's own host pool is the DRAM
            tier above kvstrata).
        disk_dir, disk_bytes: a disk tier (a directory is one process's: it is locked).
        pool: a pool config file (TOML, or an embedded pool's pool.json), or "env" for
            ``$KVSTRATA_POOL``; None: no pool tier.
        remote_bytes: how much of the pool this rank's view tracks (bookkeeping, not memory: it
            grows with the pages it holds; a page the pool evicted meanwhile is a miss).
        remote_mode: how the pool is reached ("tcp" or "shm").
        tenant: a salt of the namespace: tenants never see each other's pages.
        workers: kvstrata's byte movers.
        model_id: the namespace's model; None: SGLang's storage model name (the served model's,
            with SGLang's storage format tag where its host pool has one).
        write: when a stored page goes down the tiers ("write-through": at once, the default;
            "write-back": when evicted from above; "selective": on its ``selective_hits``-th hit).
        eviction: "lru" or "lfu".
        pool_timeout_s, pool_connect_timeout_s, pool_backoff_s, pool_backoff_max_s: how long
            the cache waits on the pool (``CacheConfig``'s budgets of the same names).
    """

    host_bytes: int = 0
    disk_dir: Path | None = None
    disk_bytes: int = 0
    pool: str | None = None
    remote_bytes: int = 16 * GiB  # an L3 pool is large; the view costs memory only as it fills
    remote_mode: RemoteMode = RemoteMode.TCP
    tenant: str = ""
    workers: int = 2
    model_id: str | None = None
    write: WritePolicy = WritePolicy.WRITE_THROUGH
    selective_hits: int = 2
    eviction: Eviction = Eviction.LRU
    pool_timeout_s: float = DEFAULT_BUDGETS.op_timeout_s
    pool_connect_timeout_s: float = DEFAULT_BUDGETS.connect_timeout_s
    pool_backoff_s: float = DEFAULT_BUDGETS.backoff_s
    pool_backoff_max_s: float = DEFAULT_BUDGETS.backoff_max_s

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> StorageSettings:
        """Parse the ``kvstrata_`` keys of SGLang's ``extra_config`` (None: every default).

        Raises:
            ValueError: an unknown ``kvstrata_`` key, or a value of the wrong kind, in one line naming it.
        """
        ours = {key[len(KEY_PREFIX):]: value for key, value in (extra or {}).items() if key.startswith(KEY_PREFIX)}
        known = {f.name for f in fields(cls)}
        unknown = sorted(KEY_PREFIX + key for key in set(ours) - known)
        if unknown:
            raise ValueError(f"{_PREFIX} unknown extra config {unknown}; known: {sorted(KEY_PREFIX + k for k in known)}")
        return cls(**{name: _PARSERS.get(name, as_is)(name, value) for name, value in ours.items()})

    def __post_init__(self) -> None:
        for name in ("host_bytes", "disk_bytes", "remote_bytes"):
            check_whole(_LABEL, name, getattr(self, name), 0, "a number of bytes >= 0")
        check_whole(_LABEL, "workers", self.workers, 1, "a number of threads >= 1")
        check_whole(_LABEL, "selective_hits", self.selective_hits, 1, "a number of hits >= 1")
        if self.disk_dir is not None and not isinstance(self.disk_dir, Path):
            raise ValueError(f"{_PREFIX} {KEY_PREFIX}disk_dir must be a pathlib.Path or None, got {self.disk_dir!r}")
        if self.disk_bytes and self.disk_dir is None:
            raise ValueError(f"{_PREFIX} {KEY_PREFIX}disk_bytes > 0 needs a {KEY_PREFIX}disk_dir")
        for name in ("pool", "model_id"):
            check_text(_LABEL, name, getattr(self, name))
        if not isinstance(self.tenant, str):
            raise ValueError(f"{_PREFIX} {KEY_PREFIX}tenant must be a string, got {self.tenant!r}")
        for name, kind in (("remote_mode", RemoteMode), ("write", WritePolicy), ("eviction", Eviction)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{_PREFIX} {KEY_PREFIX}{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        check_budgets(_PREFIX, **pool_budgets(self))

    def pool_config(self) -> PoolConfig | None:
        """The pool to reach (reads the pool's file or ``$KVSTRATA_POOL``); None: no pool tier."""
        return pool_of(self.pool, _LABEL)

    def cache_config(self, layout: KVLayout, model: str, tp_rank: int, tp_size: int, kv_group: str,
                     disk_subdir: str) -> CacheConfig:
        """One rank's cache: these tiers, ``layout``, the namespace's model (``model_id``, else
        SGLang's ``model``), TP rank and size, and KV group. Its disk tier is ``disk_dir /
        disk_subdir`` (a directory is one process's). Its "device" tier is one page of host
        memory that holds nothing: pages move between SGLang's host pool and the tiers below."""
        disk_dir = self.disk_dir / disk_subdir if self.disk_dir is not None and disk_subdir else self.disk_dir
        return CacheConfig(
            layout=layout,
            model_id=self.model_id or model,
            device_bytes=layout.block_bytes,
            host_bytes=self.host_bytes,
            disk_bytes=self.disk_bytes,
            disk_dir=disk_dir if self.disk_bytes else None,
            write=WriteRule(self.write, self.selective_hits),
            eviction=self.eviction,
            workers=self.workers,
            tp_rank=tp_rank,
            tp_size=tp_size,
            kv_group=kv_group,
            device="cpu",
            pool=self.pool_config(),
            remote_bytes=self.remote_bytes if self.pool is not None else 0,
            remote_mode=self.remote_mode,
            **pool_budgets(self),
        )


_LABEL = f"{_PREFIX} {KEY_PREFIX}"
_PARSERS: dict[str, Parser] = {
    "host_bytes": whole,
    "disk_bytes": whole,
    "remote_bytes": whole,
    "workers": whole,
    "selective_hits": whole,
    "disk_dir": path(_LABEL),  # an empty string is no path: no disk tier
    "pool": empty_is_none,
    "model_id": empty_is_none,
    "remote_mode": choice(RemoteMode, _LABEL),
    "write": choice(WritePolicy, _LABEL),
    "eviction": choice(Eviction, _LABEL),
}
