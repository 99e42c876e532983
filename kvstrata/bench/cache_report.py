"""What ``kvstrata bench cache`` reports: per tier ours beside its baseline and the ratio,
LMCache's figures when it ran, hash+lookup times, what was verified, and the goals judged.

Built from the rounds of :func:`kvstrata.bench.cache.run_cache_bench`; serialized by
:func:`kvstrata.report.to_json`; drawn as a table by ``kvstrata.bench.cli.tiers``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstrata.bench.goals import (
    DISK_COLD_OF_RAW_READ,
    DISK_WARM_OF_COPY,
    HOST_RESTORE_OF_COPY,
    HOST_STORE_OF_COPY,
    LOOKUP_OF_XXH3,
    CacheFigure,
    Goal,
)
from kvstrata.bench.lookup import LookupTimes
from kvstrata.calibrate.kvdata import KVSetup
from kvstrata.rounds import Compared, Environment, Rounds, Summary
from kvstrata.report import FLATTEN, OMIT_NONE, flatten

if TYPE_CHECKING:
    from kvstrata.bench.cache import CacheBenchConfig
    from kvstrata.bench.tpread_report import TPReaders

UNITS = "GB/s, 1 GB = 1e9 bytes; ratio = median over rounds of ours / baseline in the same round"


@dataclass(frozen=True)
class CacheRun:
    """The run's configuration (``CacheBenchConfig``'s fields first) and where it ran."""

    config: CacheBenchConfig = field(metadata=FLATTEN)
    kv: KVSetup = field(metadata=FLATTEN)
    environment: Environment = field(metadata=FLATTEN)
    units: str = UNITS


def _headline(step: str) -> dict[str, Any]:
    """A tier's headline figure: the step's rate under its name, the baseline and the ratio bare
    (``restore_gbps``, ``baseline_gbps``, ``ratio``: the keys the report always had)."""
    return flatten(f"{step}_", baseline_gbps="baseline_gbps", ratio="ratio")


@dataclass(frozen=True)
class HostFigures:
    store: Compared = field(metadata=flatten("store_"))
    restore: Compared = field(metadata=flatten("restore_", baseline_gbps="baseline_gbps"))
    runs_gbps: dict[str, tuple[float, ...]]
    baseline: str = "plain torch copy device<->host into a pre-faulted buffer"
    ratio: float = field(init=False)  # the restore ratio

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratio", self.restore.ratio)


@dataclass(frozen=True)
class DiskCold:
    restore: Compared = field(metadata=_headline("restore"))
    tier_read_gbps: float  # DiskTier.read_into alone, against the restore's baseline
    tier_read_ratio: float
    baseline: str = "plain readinto of one file, page cache dropped"


@dataclass(frozen=True)
class DiskWarm:
    restore: Compared = field(metadata=_headline("restore"))
    raw_read_gbps: float  # plain readinto from the page cache: the restore against it too
    raw_read_ratio: float
    tier_read_gbps: float  # DiskTier.read_into alone, against the raw read
    tier_read_ratio: float
    baseline: str = "plain torch copy host -> device (raw_read: plain readinto from the page cache)"


@dataclass(frozen=True)
class DiskFigures:
    """The top-level restore figures are the cold ones."""

    store: Compared = field(metadata=flatten("store_"))
    cold: DiskCold
    warm: DiskWarm
    runs_gbps: dict[str, tuple[float, ...]]
    note: str = ("restore = load() of blocks on disk only (disk -> host -> device); tier_read = "
                 "DiskTier.read_into alone (disk -> host); top-level restore figures are the cold ones")
    restore: Compared = field(init=False, metadata=_headline("restore"))

    def __post_init__(self) -> None:
        object.__setattr__(self, "restore", self.cold.restore)


@dataclass(frozen=True)
class DeviceFigures:
    store: Compared = field(metadata=_headline("store"))
    hit_ms: float
    runs_gbps: dict[str, tuple[float, ...]]
    note: str = "store = store() into the device tier; hit = load() of blocks already there (pins, no copy)"


@dataclass(frozen=True)
class CacheTiers:
    host: HostFigures
    disk: DiskFigures
    device: DeviceFigures


@dataclass(frozen=True)
class LMCacheFigure:
    """One LMCache step: its rate, over the same round's baseline, and ours over it."""

    rate: Summary = field(metadata=FLATTEN)
    baseline_ratio: float
    ours_over_lmcache: float


@dataclass(frozen=True)
class LMCacheHost:
    store: LMCacheFigure
    retrieve: LMCacheFigure


@dataclass(frozen=True)
class LMCacheDisk:
    store: LMCacheFigure
    retrieve_cold: LMCacheFigure
    retrieve_warm: LMCacheFigure


@dataclass(frozen=True)
class LMCacheMeasured:
    version: str
    host: LMCacheHost
    disk: LMCacheDisk
    setup: str = "standalone LMCacheEngine on CPU, chunk = one block, a CPU-tensor GPUConnectorInterface adapter"
    available: bool = field(default=True, init=False)


@dataclass(frozen=True)
class LMCacheAbsent:
    reason: str
    available: bool = field(default=False, init=False)


@dataclass(frozen=True)
class CacheVerified:
    ours_bytes: int
    lmcache_bytes: int
    bit_exact: bool = True  # a mismatch raises VerificationError: a report exists only if all matched
    what: str = "every restore (ours and LMCache's) and plain read compared byte for byte with the KV stored"


@dataclass(frozen=True)
class CacheBenchReport:
    config: CacheRun
    tiers: CacheTiers
    baselines: dict[str, Summary]
    lmcache: LMCacheMeasured | LMCacheAbsent
    lookup_128k_ms: dict[int, float]  # ours, per block size
    lookup_128k: dict[int, LookupTimes]
    verified: CacheVerified
    goals: tuple[Goal, ...]  # the tp_readers' goals too, when it ran
    tp_readers: TPReaders | None = field(default=None, metadata=OMIT_NONE)  # --tp-readers: head-sliced vs TP-matched


def cache_report(
    run: CacheRun, rounds: Rounds, lookups: dict[int, LookupTimes], verified: CacheVerified, lmcache_version: str | None,
    lmcache_note: str, tp_readers: TPReaders | None = None,
) -> CacheBenchReport:
    """The report of the rounds (``lmcache_version`` None: LMCache did not run, ``lmcache_note`` says why;
    ``tp_readers``: the head-sliced rows, when they ran)."""
    size = run.config.size_bytes

    def gbps(name: str) -> float:
        return rounds.gbps(name, size)

    def vs(ours: str, base: str) -> Compared:
        return rounds.rate_vs(ours, base, size)

    def runs(*names: str) -> dict[str, tuple[float, ...]]:
        return {name: rounds.rate(name, size).runs for name in names}

    tiers = CacheTiers(
        host=HostFigures(
            store=vs("ours.host.store", "copy.device_to_host"),
            restore=vs("ours.host.restore", "copy.host_to_device"),
            runs_gbps=runs("ours.host.store", "ours.host.restore", "copy.device_to_host", "copy.host_to_device"),
        ),
        disk=DiskFigures(
            store=vs("ours.disk.store", "raw.write"),
            cold=DiskCold(
                restore=vs("ours.disk.restore_cold", "raw.read_cold"),
                tier_read_gbps=gbps("ours.disk.tier_read_cold"),
                tier_read_ratio=rounds.ratio("ours.disk.tier_read_cold", "raw.read_cold"),
            ),
            warm=DiskWarm(
                restore=vs("ours.disk.restore_warm", "copy.host_to_device.disk_warm"),
                raw_read_gbps=gbps("raw.read_warm"),
                raw_read_ratio=rounds.ratio("ours.disk.restore_warm", "raw.read_warm"),
                tier_read_gbps=gbps("ours.disk.tier_read_warm"),
                tier_read_ratio=rounds.ratio("ours.disk.tier_read_warm", "raw.read_warm"),
            ),
            runs_gbps=runs(*(n for n in rounds.seconds if n.startswith(("ours.disk.", "raw.")))),
        ),
        device=DeviceFigures(
            store=vs("ours.device.store", "copy.device_to_device"),
            hit_ms=rounds.latency("ours.device.hit").median,
            runs_gbps=runs("ours.device.store", "copy.device_to_device"),
        ),
    )
    lmcache = _lmcache(rounds, size, lmcache_version) if lmcache_version is not None else LMCacheAbsent(lmcache_note)
    lookup_ms = {bs: t.ours_ms for bs, t in lookups.items()}
    return CacheBenchReport(
        config=run,
        tiers=tiers,
        baselines={name: rounds.rate(name, size) for name in rounds.seconds if name.startswith(("copy.", "raw."))},
        lmcache=lmcache,
        lookup_128k_ms=lookup_ms,
        lookup_128k=dict(lookups),
        verified=verified,
        goals=cache_goals(tiers, lmcache, lookups) + (tp_readers.goals if tp_readers is not None else ()),
        tp_readers=tp_readers,
    )


def _lmcache(rounds: Rounds, size: int, version: str) -> LMCacheMeasured:
    def figure(name: str, baseline: str, ours: str) -> LMCacheFigure:
        return LMCacheFigure(rounds.rate(name, size), rounds.ratio(name, baseline), rounds.ratio(ours, name))

    return LMCacheMeasured(
        version=version,
        host=LMCacheHost(
            store=figure("lmcache.host.store", "copy.device_to_host", "ours.host.store"),
            retrieve=figure("lmcache.host.retrieve", "copy.host_to_device", "ours.host.restore"),
        ),
        disk=LMCacheDisk(
            store=figure("lmcache.disk.store", "raw.write", "ours.disk.store"),
            retrieve_cold=figure("lmcache.disk.retrieve_cold", "raw.read_cold", "ours.disk.restore_cold"),
            retrieve_warm=figure("lmcache.disk.retrieve_warm", "copy.host_to_device.disk_warm", "ours.disk.restore_warm"),
        ),
    )


def cache_goals(
    tiers: CacheTiers, lmcache: LMCacheMeasured | LMCacheAbsent, lookups: dict[int, LookupTimes]
) -> tuple[Goal, ...]:
    """Each tier against its baseline, LMCache when it ran, lookup time."""
    host, disk = tiers.host, tiers.disk
    out = [
        Goal(CacheFigure.HOST_STORE, f">={HOST_STORE_OF_COPY}x copy", host.store.ratio, HOST_STORE_OF_COPY),
        Goal(CacheFigure.HOST_RESTORE, f">={HOST_RESTORE_OF_COPY}x copy", host.restore.ratio, HOST_RESTORE_OF_COPY),
        Goal(CacheFigure.DISK_COLD, f">={DISK_COLD_OF_RAW_READ}x cold read", disk.cold.restore.ratio,
             DISK_COLD_OF_RAW_READ),
        Goal(CacheFigure.DISK_WARM, f">={DISK_WARM_OF_COPY}x copy", disk.warm.restore.ratio, DISK_WARM_OF_COPY),
    ]
    if isinstance(lmcache, LMCacheMeasured):
        for figure, theirs in (
            (CacheFigure.HOST_STORE, lmcache.host.store),
            (CacheFigure.HOST_RESTORE, lmcache.host.retrieve),
            (CacheFigure.DISK_STORE, lmcache.disk.store),
            (CacheFigure.DISK_COLD, lmcache.disk.retrieve_cold),
            (CacheFigure.DISK_WARM, lmcache.disk.retrieve_warm),
        ):
            out.append(Goal(figure, ">=LMCache", theirs.ours_over_lmcache, 1.0))
    out.extend(lookup_goals(lookups))
    return tuple(out)


def lookup_goals(lookups: dict[int, LookupTimes]) -> list[Goal]:
    """Hash + lookup of each block size against the bare xxh3 loop (the paired time ratio)."""
    return [Goal(CacheFigure.lookup(bs), f"<={LOOKUP_OF_XXH3}x xxh3 loop", t.ours_of_xxh3.median, LOOKUP_OF_XXH3,
                 at_most=True) for bs, t in lookups.items()]
