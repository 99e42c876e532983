"""What a TieredCache holds and how it behaves: frozen, validated data (no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvstrata.index.keys import Namespace
from kvstrata.kv.layout import KVLayout
from kvstrata.manager.config import SMALL_LOAD_BYTES
from kvstrata.media import FetchPath
from kvstrata.plan.host import HostCalibration
from kvstrata.policies.eviction import Eviction
from kvstrata.policies.write import WriteRule
from kvstrata.pool.config import DEFAULT_BUDGETS, PoolConfig, RemoteMode, check_budgets


@dataclass(frozen=True)
class CacheConfig:
    """What a TieredCache holds and how it behaves. Capacities in bytes; 0 disables a tier.

    Strings from users (CLI flags, an engine's JSON config) are parsed into these types at that
    edge; a string here is refused with the type it should be.
    """

    layout: KVLayout
    model_id: str
    device_bytes: int
    host_bytes: int
    disk_bytes: int = 0
    disk_dir: Path | None = None
    write: WriteRule = field(default_factory=WriteRule)
    # Closing a write-back cache writes the blocks only its memory tiers hold down to the tier
    # below, for at most this many seconds (a graceful stop keeps them; a crash loses them).
    write_back_flush_s: float = 30.0
    eviction: Eviction = Eviction.LRU
    workers: int = 2
    tp_rank: int = 0
    tp_size: int = 1
    kv_group: str = ""  # which KV group of a hybrid model this cache holds (its blocks' namespace)
    device: str | None = None  # torch device for the device tier; None: CUDA if present, else CPU
    pool: PoolConfig | None = None  # the shared remote DRAM pool; None: no remote tier
    remote_bytes: int = 0  # this instance's view of the pool (how many blocks it tracks)
    remote_mode: RemoteMode = RemoteMode.TCP  # TCP (any host) or SHM (a pool daemon on this host)
    # Encrypt payloads in the pool (AES-GCM with the pool's secret). None: whenever the pool has a
    # secret_file (``pool_encrypted``): a pool is shared with every process that reaches it, and
    # Mooncake lets each read any object (see the README's pool security). False: sealed only
    # (the MAC; payloads readable by anyone who reaches the pool). True: refused without a secret.
    pool_encrypt: bool | None = None
    remote_path: FetchPath = FetchPath.AUTO  # how pool blocks reach the device
    disk_path: FetchPath = FetchPath.AUTO  # how disk blocks reach the device
    # This host's measured paths (kvstrata.plan.host.HostCalibration): predicted transfer times
    # for prefetch deadlines and load-or-recompute choices. None: not calibrated.
    calibration: HostCalibration | None = None
    disk_read_gbps: float | None = None  # cap disk reads at this rate (emulates slower storage)
    small_load_bytes: int = SMALL_LOAD_BYTES  # loads up to this size: one copy dispatch, layers ready together
    # Loads copied into the device one layer range at a time, each range usable as it lands.
    # None: where the device tier is a GPU, whose copy engines move bytes while its cores
    # compute. A CPU stand-in copies with the cores the engine computes with, and one copy
    # of every layer is fastest there (ranges on parallel threads only contend for them).
    layer_ranges: bool | None = None
    # Waiting on the pool (the defaults' reasons: kvstrata.pool.config). A call that runs past
    # pool_timeout_s puts the pool down: calls then fail at once while a background probe runs,
    # pool_backoff_s after the fault, doubling per failed probe up to pool_backoff_max_s.
    # pool_timeout_s: the longest one pool call (lookup, load batch, put) is waited for;
    # pool_connect_timeout_s: the longest connecting may take (building the cache waits).
    pool_timeout_s: float = DEFAULT_BUDGETS.op_timeout_s
    pool_connect_timeout_s: float = DEFAULT_BUDGETS.connect_timeout_s
    pool_backoff_s: float = DEFAULT_BUDGETS.backoff_s
    pool_backoff_max_s: float = DEFAULT_BUDGETS.backoff_max_s

    def __post_init__(self) -> None:
        block = self.layout.block_bytes if isinstance(self.layout, KVLayout) else None
        if block is None:
            raise ValueError(f"cache layout must be a KVLayout, got {self.layout!r}")
        for name in ("device_bytes", "host_bytes", "disk_bytes", "remote_bytes", "small_load_bytes", "workers",
                     "tp_rank", "tp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"cache {name} must be an integer, got {value!r}")
        for name in ("device_bytes", "host_bytes", "disk_bytes", "remote_bytes"):
            value = getattr(self, name)
            if value < 0 or (value and value < block) or (name == "device_bytes" and value < block):
                raise ValueError(f"cache {name} must be 0 (no tier) or hold at least one block of {block} bytes, "
                                 f"got {value}" if name != "device_bytes" else
                                 f"cache device_bytes must hold at least one block of {block} bytes, got {value}")
        if self.disk_bytes and not self.disk_dir:
            raise ValueError("cache disk_bytes > 0 needs a disk_dir")
        if self.workers < 1:
            raise ValueError(f"cache workers must be >= 1, got {self.workers}")
        if self.pool is not None and self.remote_bytes <= 0:
            raise ValueError("cache with a pool needs remote_bytes > 0 (how much of the pool it tracks)")
        if self.pool_encrypt is not None and not isinstance(self.pool_encrypt, bool):
            raise ValueError(f"cache pool_encrypt must be True, False or None (whenever the pool has a secret), "
                             f"got {self.pool_encrypt!r}")
        if self.pool_encrypt and (self.pool is None or self.pool.secret_file is None):
            raise ValueError("cache pool_encrypt=True needs a pool with a secret_file (payloads are encrypted with it)")
        for name, kind in (("remote_mode", RemoteMode), ("remote_path", FetchPath), ("disk_path", FetchPath),
                           ("write", WriteRule), ("eviction", Eviction)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"cache {name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        if self.disk_dir is not None and not isinstance(self.disk_dir, Path):
            raise ValueError(f"cache disk_dir must be a pathlib.Path, got {self.disk_dir!r}")
        if self.layer_ranges is not None and not isinstance(self.layer_ranges, bool):
            raise ValueError(f"cache layer_ranges must be True, False or None, got {self.layer_ranges!r}")
        if self.small_load_bytes < 0:
            raise ValueError(f"cache small_load_bytes must be >= 0, got {self.small_load_bytes}")
        if isinstance(self.write_back_flush_s, bool) or not isinstance(self.write_back_flush_s, (int, float)) \
                or not self.write_back_flush_s >= 0:
            raise ValueError(f"cache write_back_flush_s must be a number of seconds >= 0, got {self.write_back_flush_s!r}")
        if self.disk_read_gbps is not None and not self.disk_read_gbps > 0:
            raise ValueError(f"cache disk_read_gbps must be positive, got {self.disk_read_gbps}")
        check_budgets("cache", pool_timeout_s=self.pool_timeout_s, pool_connect_timeout_s=self.pool_connect_timeout_s,
                      pool_backoff_s=self.pool_backoff_s, pool_backoff_max_s=self.pool_backoff_max_s)
        self.namespace()  # a bad model_id or TP rank/size fails here, not on first use

    @property
    def pool_encrypted(self) -> bool:
        """Whether this cache encrypts its pool payloads: ``pool_encrypt``, or when None, whether
        the pool has a secret (every value is then sealed, and encrypted too)."""
        if self.pool_encrypt is not None:
            return self.pool_encrypt
        return self.pool is not None and self.pool.secret_file is not None

    def namespace(self, tenant: str = "") -> Namespace:
        return Namespace(
            model_id=self.model_id,
            kv_dtype=self.layout.dtype.name.lower(),
            kv_layout=self.layout.describe(),
            block_size=self.layout.block_tokens,
            tp_rank=None if self.layout.head_sliced else self.tp_rank,  # a slice is the same at every TP
            tp_size=None if self.layout.head_sliced else self.tp_size,
            tenant=tenant,
            kv_group=self.kv_group,
        )
