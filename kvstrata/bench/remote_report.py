"""What ``kvstrata bench remote`` reports: per way into the pool, ours beside raw Mooncake
calls (restore, store, first byte, lookup) and the ratios, the whole cache's restores by each
path, what was verified, where the pool was, and the goals judged.

Built from the rounds of :func:`kvstrata.bench.remote.run_remote_bench`; serialized by
:func:`kvstrata.report.to_json`; drawn as a table by ``kvstrata.bench.cli.tiers``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstrata.bench.goals import LOOKUP_OF_EXISTS, REMOTE_OF_RAW, SEALED_OF_UNSEALED, Goal, RemoteFigure
from kvstrata.calibrate.poolcache import ROUTES
from kvstrata.calibrate.kvdata import KVSetup
from kvstrata.rounds import Compared, Environment, Rounds, Skipped, Summary
from kvstrata.media import FetchPath, Route
from kvstrata.pool.config import RemoteMode
from kvstrata.pool.scoped import PoolSource
from kvstrata.report import FLATTEN, flatten

if TYPE_CHECKING:
    from kvstrata.bench.remote import RemoteBenchConfig

UNITS = ("GB/s, 1 GB = 1e9 bytes; ratio = median over rounds of ours / raw in the same round "
         "(rates; *_time_ratio: times, < 1 is faster)")
MODE_TEXT = {
    RemoteMode.TCP: "cross-process over the pool's transport (via the master)",
    RemoteMode.SHM: "same host, shared memory (the pool daemon copies between its segment and our mapped memory)",
}


@dataclass(frozen=True)
class RemoteRun:
    """The run's configuration (``RemoteBenchConfig``'s fields first), the pool, where it ran."""

    config: RemoteBenchConfig = field(metadata=FLATTEN)
    kv: KVSetup = field(metadata=FLATTEN)
    pool: PoolSource
    environment: Environment = field(metadata=FLATTEN)
    units: str = UNITS


@dataclass(frozen=True)
class PathRestore:
    """``TieredCache.load`` of blocks in the pool only, by one path, against the raw get."""

    route: Route
    restore_gbps: float
    raw_gbps: float
    ratio: float
    ratio_min: float
    ratio_max: float


@dataclass(frozen=True)
class ModeMethod:
    """What each figure of a mode times, in words."""

    restore: str
    store: str
    ttfb: str = "one-block restore through the tier (engine, read_into) vs one-object batch_get_into"
    lookup: str = ("TieredCache.lookup of blocks in the pool only that the cache does not know (asks the pool "
                   "exists, adopts) vs batch_is_exist of every object")
    cache: str = ("TieredCache.load of blocks in the pool only, to the device tier, by each path; ratio vs the "
                  "raw batch_get_into of the same round")

    @staticmethod
    def of(workers: int) -> ModeMethod:
        return ModeMethod(
            restore=f"RemoteTier.read_many_into (batched gets, pipelined with the checks) on the engine ({workers} workers), pool -> the tier's "
            "registered staging -> host memory (never registered); raw: one batch_get_into of every object",
            store=f"RemoteTier.write_many (batched puts, pipelined with sealing) on the engine ({workers} workers), host memory (never registered) -> "
            "the tier's registered staging -> pool, as new objects; raw: one batch_put_from of every object",
        )


@dataclass(frozen=True)
class SealCost:
    """What authenticating the pool's values costs: ours (sealed with the pool's secret, as the
    cache is) and the tier encrypted, each over the same tier unsealed, in the same rounds."""

    sealed: bool  # the pool has a secret, so ours is sealed (else restore and store compare alike)
    restore: Compared
    store: Compared
    encrypted_restore: Compared
    encrypted_store: Compared
    what: str = "RemoteTier sealed (Poly1305 MAC) or encrypted (AES-GCM) over the same tier without a secret"


@dataclass(frozen=True)
class ModeFigures:
    """One way into the pool, measured."""

    restore: Compared = field(metadata=flatten("restore_", baseline_gbps="raw_gbps", ratio="ratio"))
    store: Compared = field(metadata=flatten("store_", baseline_gbps="raw_store_gbps"))
    ttfb: Compared = field(metadata=flatten("ttfb_", baseline_ms="raw_ttfb_ms", ratio="ttfb_time_ratio"))
    ttfb_block_bytes: int
    lookup: Compared = field(metadata=flatten("lookup_", baseline_ms="raw_exists_ms", ratio="lookup_time_ratio"))
    seal: SealCost
    cache: dict[FetchPath, PathRestore]
    gbps: dict[str, Summary]  # every timed transfer step
    latency_ms: dict[str, Summary]  # every timed latency step
    verified_bytes: int
    what: ModeMethod
    mode: str  # how the mode reaches the pool, in words
    prefaulted_bytes: int  # of the pool's segment, before this mode's warm-up
    loopback_bytes: dict[str, int]  # received on the loopback interface per warm-up step


@dataclass(frozen=True)
class RemoteVerified:
    bytes: int
    bit_exact: bool = True  # a mismatch raises VerificationError: a report exists only if all matched
    what: str = ("every restore (ours, raw, the cache's, one-block ones too) compared byte for byte with the "
                 "bytes stored")


@dataclass(frozen=True)
class RemoteBenchReport:
    config: RemoteRun
    modes: dict[RemoteMode, ModeFigures | Skipped]
    verified: RemoteVerified
    goals: tuple[Goal, ...]

    def measured(self) -> dict[RemoteMode, ModeFigures]:
        return {mode: m for mode, m in self.modes.items() if isinstance(m, ModeFigures)}


def mode_figures(
    rounds: Rounds, verified: int, config: RemoteBenchConfig, mode: RemoteMode, prefaulted: int, loopback: dict[str, int],
    sealed: bool,
) -> ModeFigures:
    size = config.size_bytes

    def path_restore(path: FetchPath, route: Route) -> PathRestore:
        figure = rounds.rate_vs(f"cache.{path.value}", "raw.restore", size)
        return PathRestore(route, figure.ours, figure.baseline, figure.ratio, figure.ratio_min, figure.ratio_max)

    return ModeFigures(
        restore=rounds.rate_vs("ours.restore", "raw.restore", size),
        store=rounds.rate_vs("ours.store", "raw.store", size),
        ttfb=rounds.time_vs("ours.ttfb", "raw.ttfb"),
        ttfb_block_bytes=size // config.blocks,
        lookup=rounds.time_vs("cache.lookup", "raw.exists"),
        seal=SealCost(sealed, *(rounds.rate_vs(f"{side}.{step}", f"plain.{step}", size)
                                for side, step in (("ours", "restore"), ("ours", "store"), ("encrypted", "restore"),
                                                   ("encrypted", "store")))),
        cache={path: path_restore(path, route) for path, route in ROUTES.items()},
        gbps={name: rounds.rate(name, size) for name in ("ours.store", "raw.store", "ours.restore", "raw.restore",
                                                          "plain.store", "plain.restore", "encrypted.store",
                                                          "encrypted.restore", "cache.direct", "cache.staged")},
        latency_ms={name: rounds.latency(name) for name in ("ours.ttfb", "raw.ttfb", "cache.lookup", "raw.exists")},
        verified_bytes=verified,
        what=ModeMethod.of(config.workers),
        mode=MODE_TEXT[mode],
        prefaulted_bytes=prefaulted,
        loopback_bytes=loopback,
    )


def remote_report(run: RemoteRun, modes: dict[RemoteMode, ModeFigures | Skipped]) -> RemoteBenchReport:
    measured = [m for m in modes.values() if isinstance(m, ModeFigures)]
    return RemoteBenchReport(run, modes, RemoteVerified(sum(m.verified_bytes for m in measured)), remote_goals(modes))


def remote_goals(modes: dict[RemoteMode, ModeFigures | Skipped]) -> tuple[Goal, ...]:
    """Per measured pool mode: restore and store through the tier at >= 0.9x the raw calls, a
    lookup that asks the pool within 1.5x the raw existence query, and sealed restores at
    >= 0.9x unsealed ones (authentication costs at most 10%)."""
    out = []
    for mode, figures in modes.items():
        if isinstance(figures, ModeFigures):
            for store, figure in ((False, figures.restore), (True, figures.store)):
                out.append(Goal(RemoteFigure.of(mode, store=store), f">={REMOTE_OF_RAW}x raw", figure.ratio, REMOTE_OF_RAW))
            lookup = RemoteFigure(f"{mode.value} lookup")
            out.append(Goal(lookup, f"<={LOOKUP_OF_EXISTS}x exists", figures.lookup.ratio, LOOKUP_OF_EXISTS, at_most=True))
            sealed = RemoteFigure(f"{mode.value} sealed restore")
            out.append(Goal(sealed, f">={SEALED_OF_UNSEALED}x unsealed", figures.seal.restore.ratio, SEALED_OF_UNSEALED))
    return tuple(out)
