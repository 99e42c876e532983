"""``kv_connector_extra_config``: the connector's settings, parsed and validated at this edge.

vLLM hands the connector its extra config as decoded JSON (strings, numbers, booleans). Here it
becomes frozen, typed :class:`ConnectorSettings` (directories as :class:`pathlib.Path`, the pool
mode as :class:`~kvstrata.pool.config.RemoteMode`), and :meth:`ConnectorSettings.cache_config`
the :class:`~kvstrata.cache.CacheConfig` of the worker's cache. A bad key or value stops the
engine's start with one line that names it, in the scheduler and the worker alike.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from fractions import Fraction
from pathlib import Path
from typing import Any

from kvstrata.cache import CacheConfig
from kvstrata.integrations.extra_config import (
    Parser, as_is, check_text, check_whole, choice, empty_is_none, path, pool_budgets, pool_of, whole,
)
from kvstrata.kv.heads import KVSharing
from kvstrata.kv.layout import KVLayout
from kvstrata.policies.payoff import BUDGET_FACTOR
from kvstrata.policies.write import WritePolicy, WriteRule
from kvstrata.transfer.placement import parse_cpu_list
from kvstrata.pool.config import DEFAULT_BUDGETS, PoolConfig, RemoteMode, check_budgets

MiB = 1024**2
_PREFIX = "KVStrataConnector:"


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config``: which tiers the cache has. Capacities in bytes.

    Attributes:
        device_bytes: kvstrata's device tier (where loads from disk or the pool, and a GPU's,
            land before the copy into vLLM's paged blocks; on a CPU, blocks in memory are
            copied into vLLM's from where they are).
        host_bytes: host DRAM tier, per process.
        disk_dir, disk_bytes: a disk tier (one process per directory; it is locked).
        pool: a pool config file (TOML, or an embedded pool's pool.json), or "env" for
            ``$KVSTRATA_POOL``; None: no remote tier.
        remote_bytes: how much of the pool this instance tracks.
        remote_mode: how the pool is reached ("tcp" or "shm" in the extra config).
        model_id: namespace of the blocks; None: vLLM's model name or path.
        stats_path: a JSON file the worker rewrites with its load/store counters.
        sync_save: wait in ``wait_for_save`` until a step's blocks are stored (and written
            down the tiers), so a finished request's KV is in kvstrata when its output is out.
            Off by default: stores run on the cache's threads after the step, never stalling it.
        save_backlog_bytes: a step's save is dropped (and counted) while the saves still in
            flight hold this many bytes: tiers that cannot keep up are never waited for.
        io_cpus: CPUs kvstrata's threads run on in a worker: ``"none"`` (the default: where
            vLLM's worker puts them, its compute's), ``"auto"`` (the CPUs vLLM's compute is not
            bound to, from ``VLLM_CPU_OMP_THREADS_BIND``, if any are left), or a CPU list such as
            ``"6-7"``. On a 2-core host whose other core runs the engine core and the API server,
            ``auto`` made decode steps slower (TPOT 1.14-1.38x vLLM alone against 0.92-1.04x):
            name CPUs that nothing on the serving path needs.
        pool_timeout_s, pool_connect_timeout_s, pool_backoff_s, pool_backoff_max_s: how long
            the cache waits on the pool (``CacheConfig``'s budgets of the same names).
        kv_sharing: head-sliced blocks (any TP size reads them) or TP-matched ones
            (``"head-sliced"`` or ``"tp-matched"`` in the extra config).
        disk_read_gbps: cap the disk tier's reads at this many GB/s (emulates a slower drive);
            None: no cap.
        load_budget: a granted load may hold a step up this many times the prefill of its tokens
            (:data:`~kvstrata.policies.payoff.BUDGET_FACTOR` by default), then it is given up and
            its blocks are computed; None: no budget (every granted load is waited for).
        write: when a stored block goes below the host tier (``"write-back"``, ``"write-through"``
            or ``"selective"`` in the extra config). None, the default: write-back, except for a
            TP-matched cache with a pool (write-through: other instances read the pool at once).
            Write-back writes a block to disk only when the host tier evicts it, so a block
            served from the host, the usual hit, never costs a disk write; on a CPU server a
            write is CPU taken from the forward. A graceful stop writes the host's blocks down
            (``write_back_flush_s``); a crash loses them. Head-sliced slices go to the pool at
            once whatever this says.
        write_back_flush_s: how long a graceful stop may spend writing the host tier's blocks
            down to disk (write-back).
    """

    device_bytes: int = 64 * MiB
    host_bytes: int = 512 * MiB
    disk_dir: Path | None = None
    disk_bytes: int = 0
    pool: str | None = None
    remote_bytes: int = 256 * MiB
    remote_mode: RemoteMode = RemoteMode.TCP
    model_id: str | None = None
    stats_path: Path | None = None
    sync_save: bool = False
    save_backlog_bytes: int = 256 * MiB
    io_cpus: str = "none"
    pool_timeout_s: float = DEFAULT_BUDGETS.op_timeout_s
    pool_connect_timeout_s: float = DEFAULT_BUDGETS.connect_timeout_s
    pool_backoff_s: float = DEFAULT_BUDGETS.backoff_s
    pool_backoff_max_s: float = DEFAULT_BUDGETS.backoff_max_s
    kv_sharing: KVSharing = KVSharing.SLICED
    disk_read_gbps: float | None = None
    load_budget: float | None = BUDGET_FACTOR
    write: WritePolicy | None = None
    write_back_flush_s: float = 30.0

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """Parse vLLM's ``kv_connector_extra_config`` (None: every default).

        Raises:
            ValueError: an unknown key, or a value of the wrong kind, in one line naming it.
        """
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = set(extra) - known
        if unknown:
            raise ValueError(f"{_PREFIX} unknown extra config {sorted(unknown)}; known: {sorted(known)}")
        return cls(**{name: _PARSERS.get(name, as_is)(name, value) for name, value in extra.items()})

    def __post_init__(self) -> None:
        for name in ("device_bytes", "host_bytes", "disk_bytes", "remote_bytes", "save_backlog_bytes"):
            check_whole(f"{_PREFIX} ", name, getattr(self, name), 0, "a number of bytes >= 0")
        for name in ("disk_dir", "stats_path"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), Path):
                raise ValueError(f"{_PREFIX} {name} must be a pathlib.Path or None, got {getattr(self, name)!r}")
        for name in ("pool", "model_id"):
            check_text(f"{_PREFIX} ", name, getattr(self, name))
        if not isinstance(self.remote_mode, RemoteMode):
            raise ValueError(f"{_PREFIX} remote_mode must be a RemoteMode, got {self.remote_mode!r}")
        if not isinstance(self.kv_sharing, KVSharing):
            raise ValueError(f"{_PREFIX} kv_sharing must be a KVSharing, got {self.kv_sharing!r}")
        if self.load_budget is not None and (isinstance(self.load_budget, bool) or not isinstance(
                self.load_budget, (int, float)) or not self.load_budget > 0):
            raise ValueError(f"{_PREFIX} load_budget must be a number > 0 (times the prefill) or null, "
                             f"got {self.load_budget!r}")
        if self.write is not None and not isinstance(self.write, WritePolicy):
            raise ValueError(f"{_PREFIX} write must be a WritePolicy or None, got {self.write!r}")
        if isinstance(self.write_back_flush_s, bool) or not isinstance(self.write_back_flush_s, (int, float)) \
                or not self.write_back_flush_s >= 0:
            raise ValueError(f"{_PREFIX} write_back_flush_s must be a number of seconds >= 0, "
                             f"got {self.write_back_flush_s!r}")
        if not isinstance(self.sync_save, bool):
            raise ValueError(f"{_PREFIX} sync_save must be true or false, got {self.sync_save!r}")
        if self.disk_read_gbps is not None and (isinstance(self.disk_read_gbps, bool)
                                                or not isinstance(self.disk_read_gbps, (int, float))
                                                or not self.disk_read_gbps > 0):
            raise ValueError(f"{_PREFIX} disk_read_gbps must be a positive number of GB/s, got {self.disk_read_gbps!r}")
        check_budgets(_PREFIX, **pool_budgets(self))
        if not isinstance(self.io_cpus, str) or (self.io_cpus not in ("auto", "none") and not _cpu_list(self.io_cpus)):
            raise ValueError(f"{_PREFIX} io_cpus must be \"auto\", \"none\" or a CPU list such as \"6-7\", "
                             f"got {self.io_cpus!r}")

    @property
    def write_policy(self) -> WritePolicy:
        """``write``, or where it is None, what it defaults to (see the class)."""
        if self.write is not None:
            return self.write
        shared = self.pool is not None and self.kv_sharing is not KVSharing.SLICED
        return WritePolicy.WRITE_THROUGH if shared else WritePolicy.WRITE_BACK

    def stop_loses_host(self, shutdown_timeout_s: float) -> str | None:
        """Why a stop under vLLM's ``--shutdown-timeout`` (``shutdown_timeout_s``) loses the
        blocks only the host tier holds (None: it does not). At 0, vLLM's default, vLLM kills
        its workers on SIGTERM before the connector can write a write-back host tier down."""
        if shutdown_timeout_s > 0 or self.disk_dir is None or self.disk_bytes <= 0 \
                or self.write_policy is not WritePolicy.WRITE_BACK:
            return None
        return ("vLLM's --shutdown-timeout is 0, so a stop kills this server's workers before "
                "kvstrata writes its host tier down to disk (a restart finds only what the host evicted); "
                "start vllm serve with --shutdown-timeout 10 to keep it")

    def held_blocks(self, block_bytes: int) -> int:
        """How many blocks of ``block_bytes`` the tiers (device, host, disk) hold at most."""
        return (self.device_bytes + self.host_bytes + self.disk_bytes) // block_bytes if block_bytes > 0 else 0

    def pool_config(self) -> PoolConfig | None:
        """The pool to reach (reads the pool's file or ``$KVSTRATA_POOL``); None: no remote tier."""
        return pool_of(self.pool, f"{_PREFIX} ")

    def cache_config(self, layout: KVLayout, model: str, device: str, tp_rank: int, tp_size: int,
                     kv_group: str = "", share: Fraction = Fraction(1)) -> CacheConfig:
        """The worker's cache of one KV group: these tiers, ``layout`` on ``device``, the
        namespace ``model_id`` (else vLLM's ``model``), the TP rank and the group.

        A hybrid model's groups split each tier's bytes: ``share`` of them is this group's
        (its part of a block's bytes over every group, so each group holds as many blocks).
        Its disk tier is a directory of its own (``disk_dir/kv_group``: a directory is one
        tier's, locked); a one-group model's (``kv_group`` "") is ``disk_dir`` itself. TP rank
        0's is that directory, rank r's (each rank is a process) ``.../rank{r}`` within it:
        across TP sizes, rank 0's slices are on disk; every rank's are in the pool.
        """
        if not 0 < share <= 1:
            raise ValueError(f"{_PREFIX} a KV group's share of the tiers must be in (0, 1], got {share}")
        disk_dir = self.disk_dir / kv_group if self.disk_dir is not None and kv_group else self.disk_dir
        if disk_dir is not None and tp_rank > 0:
            disk_dir = disk_dir / f"rank{tp_rank}"
        return CacheConfig(
            layout=layout,
            model_id=self.model_id or model,
            device_bytes=int(self.device_bytes * share),
            host_bytes=int(self.host_bytes * share),
            disk_bytes=int(self.disk_bytes * share),
            disk_dir=disk_dir,
            disk_read_gbps=self.disk_read_gbps,
            kv_group=kv_group,
            device=device,
            pool=self.pool_config(),
            remote_bytes=int(self.remote_bytes * share),
            remote_mode=self.remote_mode,
            tp_rank=tp_rank,
            tp_size=tp_size,
            write=WriteRule(self.write_policy),
            write_back_flush_s=self.write_back_flush_s,
            **pool_budgets(self),
        )


def _cpu_list(text: str) -> frozenset[int] | None:
    try:
        return parse_cpu_list(text) or None
    except ValueError:
        return None


_PARSERS: dict[str, Parser] = {
    "device_bytes": whole,
    "save_backlog_bytes": whole,
    "host_bytes": whole,
    "disk_bytes": whole,
    "remote_bytes": whole,
    "disk_dir": path(f"{_PREFIX} "),  # an empty string is no path: no disk tier, no stats file
    "stats_path": path(f"{_PREFIX} "),
    "remote_mode": choice(RemoteMode, f"{_PREFIX} "),
    "kv_sharing": choice(KVSharing, f"{_PREFIX} "),
    "write": choice(WritePolicy, f"{_PREFIX} "),
    "model_id": empty_is_none,  # empty: vLLM's model name, as when it is not given
}
