"""Check the restore model against real restores through the tiered cache, in one sitting.

For each size, KV of a real model's layout is stored in a ``TieredCache`` and restored to the
device tier from one tier at a time: the host, the disk with the files in the page cache
("warm"), the disk with them dropped from it before each load ("cold"), and the remote pool
when one is configured.

Shared machines change speed from one second to the next (between two calibrations the fits
moved by up to 30% here), so the prediction is calibrated in the same sitting as the restores
it predicts, interleaved with them. A row kind (host, disk warm, ...) runs in rounds; in each
round every size takes its turn (so a slow spell of the machine falls on every size alike, and
the fit across sizes is not tilted by it), and a size's turn runs, back to back:

1. the probes: each path the restore moves its bytes along (``restore_paths``), measured as
   ``calibrate`` measures it, in blocks of the cache's layout (disk blocks are read by a disk
   tier of the probe's own, with the tier's code: header and every layer's checksum verified);
2. the restore through the cache (``LoadResult.seconds``), checked byte for byte (untimed);
3. a restore of two tiny blocks from the same tier through a second cache: the tier's fixed
   cost (``RESTORE_FIXED``: planning, pins, thread hand-offs, files opened and verified).

The first round warms up and is dropped. The probes' medians are fitted per path over the sizes
and the fixed costs' medians per tier into a ``HostCalibration``; each row's prediction is its
``restore_s``: the tier's fixed cost plus each path's bytes at its fitted rate.

A row reports the error of the prediction against the median restore, the restores' spread,
and the paired error: per round, the prediction scaled by that round's probes over their
median (how fast the machine was just then) against that round's restore; its median and
half-range. With ``profile`` (a stored calibration) the row also carries that profile's
prediction.
"""

from __future__ import annotations

import platform
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvstrata.calibrate.ballast import Ballast
from kvstrata.calibrate.measure import Measurement, fit_paths
from kvstrata.calibrate.probes import Prober
from kvstrata.calibrate.restores import TINY_BLOCKS, TINY_LAYOUT, CacheRestores
from kvstrata.kv.layout import KVLayout
from kvstrata.kv.presets import load_geometry
from kvstrata.media import Medium
from kvstrata.plan.host import RESTORE_FIXED, HostCalibration, restore_paths
from kvstrata.pool.config import PoolConfig
from kvstrata.progress import NoProgress, Progress

MIB = 1 << 20
DEFAULT_SIZES = (16 * MIB, 64 * MIB, 256 * MIB)
QUICK_SIZES = (16 * MIB, 64 * MIB)
GOAL = 0.10  # |predicted - measured| / measured
GOAL_MIN_BYTES = 64 * MIB  # the goal holds for restores of this size and larger


@dataclass(frozen=True)
class ValidateConfig:
    """What to restore.

    Attributes:
        sizes: KV bytes per restore (rounded down to whole blocks, at least one).
        repeats: timed rounds per row after one warm-up (>= 1).
        workers: the cache's transfer threads.
        model: the model whose KV layout the blocks have.
        block_tokens: tokens per block.
        directory: where the disk tier's files go (None: the temp directory).
        pool: the remote pool, or None (no remote rows).
        cold: include cold disk rows.
    """

    sizes: tuple[int, ...] = DEFAULT_SIZES
    repeats: int = 9
    workers: int = 2
    model: str = "llama-3-8b"
    block_tokens: int = 64
    directory: str | None = None
    pool: PoolConfig | None = None
    cold: bool = True

    def __post_init__(self) -> None:
        if not self.sizes or any(s <= 0 for s in self.sizes):
            raise ValueError(f"validate sizes must be given and positive, got {self.sizes}")
        if self.repeats < 1:
            raise ValueError(f"validate repeats must be >= 1, got {self.repeats}")
        if self.workers < 1 or self.block_tokens < 1:
            raise ValueError("validate workers and block_tokens must be >= 1")


@dataclass(frozen=True)
class RowKind:
    """One restore path: from ``tier`` (host, disk or remote), the disk ``cold`` or not."""

    tier: Medium
    cold: bool = False

    @property
    def label(self) -> str:
        if self.tier is Medium.DISK:
            return f"disk ({'cold' if self.cold else 'page cache'}) -> device"
        return f"{self.tier.label} -> device"


def row_kinds(config: ValidateConfig) -> tuple[RowKind, ...]:
    """The rows of one size, in the order they run (each tier's blocks sink once, downwards)."""
    kinds = [RowKind(Medium.HOST), RowKind(Medium.DISK)]
    if config.cold:
        kinds.append(RowKind(Medium.DISK, cold=True))
    if config.pool is not None:
        kinds.append(RowKind(Medium.REMOTE))
    return tuple(kinds)


@dataclass(frozen=True)
class Row:
    """One restore path at one size: predicted against measured, round by round.

    Attributes:
        path: the row's label (``RowKind.label``).
        tier, cold: which restore.
        bytes, blocks: what each restore moved.
        predicted_s: the sitting's calibration's ``restore_s``.
        measured_s: the median restore.
        runs_s: per round, the restore.
        probe_runs_s: per round, the probes of the row's paths (summed).
        fixed_runs_s: per round, the tiny restore from the same tier.
        profile_s: a stored profile's prediction (None: no profile given, or it lacks a path).
    """

    path: str
    tier: Medium
    cold: bool
    bytes: int
    blocks: int
    predicted_s: float
    measured_s: float
    runs_s: tuple[float, ...]
    probe_runs_s: tuple[float, ...]
    fixed_runs_s: tuple[float, ...]
    profile_s: float | None = None

    @property
    def error(self) -> float:
        """(predicted - measured) / measured: positive when the prediction is too slow."""
        return (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def paired_errors(self) -> tuple[float, ...]:
        """Per round: the prediction scaled by that round's probes over their median, against
        that round's restore."""
        probe = statistics.median(self.probe_runs_s)
        return tuple((self.predicted_s * p / probe - r) / r for p, r in zip(self.probe_runs_s, self.runs_s))

    @property
    def paired_error(self) -> float:
        return statistics.median(self.paired_errors)

    @property
    def paired_spread(self) -> float:
        """Half-range of the paired errors."""
        return (max(self.paired_errors) - min(self.paired_errors)) / 2

    @property
    def profile_error(self) -> float | None:
        return None if self.profile_s is None else (self.profile_s - self.measured_s) / self.measured_s

    @property
    def in_goal_range(self) -> bool:
        return self.bytes >= GOAL_MIN_BYTES

    @property
    def meets_goal(self) -> bool | None:
        """Within ``GOAL``; None below ``GOAL_MIN_BYTES`` (no goal there)."""
        return abs(self.error) <= GOAL if self.in_goal_range else None

    @property
    def spread(self) -> float:
        """(max - min) / 2 / median of the restores."""
        return (max(self.runs_s) - min(self.runs_s)) / 2 / self.measured_s

    @property
    def probe_spread(self) -> float:
        probe = statistics.median(self.probe_runs_s)
        return (max(self.probe_runs_s) - min(self.probe_runs_s)) / 2 / probe

    def to_json(self) -> dict:
        return {"path": self.path, "tier": self.tier.label, "cold": self.cold, "bytes": self.bytes, "blocks": self.blocks,
                "predicted_s": self.predicted_s, "measured_s": self.measured_s, "runs_s": list(self.runs_s),
                "probe_runs_s": list(self.probe_runs_s), "fixed_runs_s": list(self.fixed_runs_s),
                "error": self.error, "spread": self.spread, "probe_spread": self.probe_spread,
                "paired_error": self.paired_error, "paired_spread": self.paired_spread,
                "profile_s": self.profile_s, "profile_error": self.profile_error, "meets_goal": self.meets_goal}


@dataclass(frozen=True)
class ValidateRun:
    """What ``validate`` produced: the rows, and the calibration fitted in the same sitting
    (its ``measurements``: the probes and fixed costs, per size)."""

    rows: tuple[Row, ...]
    calibration: HostCalibration
    measurements: tuple[Measurement, ...] = field(default=())

    @property
    def graded(self) -> tuple[Row, ...]:
        return tuple(r for r in self.rows if r.meets_goal is not None)

    @property
    def within_goal(self) -> float | None:
        """The fraction of graded rows within ``GOAL`` (None: no row of ``GOAL_MIN_BYTES``)."""
        graded = self.graded
        return sum(1 for r in graded if r.meets_goal) / len(graded) if graded else None


def layout_for(config: ValidateConfig) -> KVLayout:
    return KVLayout.from_geometry(load_geometry(config.model), config.block_tokens)


@dataclass
class _Rounds:
    """One row's rounds as they are measured (the warm-up dropped)."""

    restores: list[float] = field(default_factory=list)
    probes: dict[str, list[float]] = field(default_factory=dict)
    fixed: list[float] = field(default_factory=list)


def validate(config: ValidateConfig, progress: Progress | None = None,
             profile: HostCalibration | None = None) -> ValidateRun:
    """Probe, restore and measure the fixed cost, interleaved, for every row at every size;
    fit the sitting's calibration; one Row per (row kind, size)."""
    progress = progress or NoProgress()
    layout = layout_for(config)
    kinds = row_kinds(config)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    steps_per_round = {k: len(restore_paths(k.tier, k.cold, cuda, config.workers)) + 2 for k in kinds}
    progress.start(len(config.sizes) * (1 + config.repeats) * sum(steps_per_round.values()))
    measured: list[tuple[RowKind, int, int, _Rounds]] = []
    with tempfile.TemporaryDirectory(prefix="kvstrata-validate-", dir=config.directory) as scratch:
        root = Path(scratch)
        (root / "probe").mkdir()
        prober = Prober(root / "probe", config.workers, device, layout, config.pool)
        # Cold steps read into fresh page cache: each gets memory freed a moment before
        # (kvstrata.calibrate.ballast), or the restore, always after its probe, reads slower.
        ballast = Ballast(root / "ballast.bin", max(config.sizes)) if any(k.cold for k in kinds) else None
        tiny: dict[Medium, CacheRestores] = {}
        sized: dict[tuple[bool, int], CacheRestores] = {}  # (remote, size) -> its cache
        try:
            # One tiny cache per tier: a restore leaves its blocks in the tier it came from.
            for tier in {k.tier for k in kinds}:
                tiny[tier] = CacheRestores(TINY_LAYOUT, TINY_BLOCKS, config.workers, root / f"tiny-{tier.label}",
                                           pool=config.pool if tier is Medium.REMOTE else None, small_load_bytes=0)
            for remote in sorted({k.tier is Medium.REMOTE for k in kinds}):
                for size in config.sizes:
                    blocks = max(1, size // layout.block_bytes)
                    sized[remote, size] = CacheRestores(layout, blocks, config.workers, root / f"cache-{size}",
                                                        pool=config.pool if remote else None)
            for kind in kinds:
                benches = [sized[kind.tier is Medium.REMOTE, size] for size in config.sizes]
                for bench, rounds in zip(benches, _row(kind, benches, tiny[kind.tier], prober, ballast, cuda, config,
                                                       progress), strict=True):
                    measured.append((kind, bench.size, bench.blocks, rounds))
        finally:
            for bench in [*tiny.values(), *sized.values()]:
                bench.close()
            prober.close()
    measured.sort(key=lambda m: (m[1], kinds.index(m[0])))  # rows by size, then kind
    return _result(config, layout, cuda, device, measured, profile)


def _row(kind: RowKind, benches: list[CacheRestores], tiny: CacheRestores, prober: Prober, ballast: Ballast | None,
         cuda: bool, config: ValidateConfig, progress: Progress) -> list[_Rounds]:
    """One row kind at every size, round by round: per round each size in turn runs its
    probes, its restore and the tier's tiny restore, back to back (the sizes take turns, so a
    slow spell of the machine falls on all of them and the fit across sizes stays level). A
    cold row's probe and restore each start after the ballast is released (untimed)."""
    fresh = ballast.release if kind.cold and ballast is not None else (lambda: None)
    paths = restore_paths(kind.tier, kind.cold, cuda, config.workers)
    out = [_Rounds(probes={p: [] for p in paths}) for _ in benches]
    for i in range(1 + config.repeats):
        for bench, rounds in zip(benches, out):
            size_mib = f"{bench.size / MIB:g} MiB"
            probes = {}
            for path in paths:
                progress.step(f"probe {path}, {size_mib}")
                step = prober.step(path, bench.size)
                fresh()
                probes[path] = step()
            progress.step(f"restore {kind.label}, {size_mib}")
            fresh()
            restore = bench.restore(kind.tier, cold=kind.cold)
            progress.step(f"fixed cost {kind.tier.label}")
            fixed = tiny.restore(kind.tier)
            if i:  # the first round warms up
                rounds.restores.append(restore)
                rounds.fixed.append(fixed)
                for path, seconds in probes.items():
                    rounds.probes[path].append(seconds)
    return out


def _result(config: ValidateConfig, layout: KVLayout, cuda: bool, device: torch.device,
            measured: list[tuple[RowKind, int, int, _Rounds]], profile: HostCalibration | None) -> ValidateRun:
    probe_runs: dict[tuple[str, int], list[float]] = {}
    fixed_runs: dict[str, list[float]] = {}
    for kind, _, blocks, rounds in measured:
        for path, runs in rounds.probes.items():
            probe_runs.setdefault((path, blocks * layout.block_bytes), []).extend(runs)
        fixed_runs.setdefault(RESTORE_FIXED[kind.tier], []).extend(rounds.fixed)
    tiny_bytes = TINY_BLOCKS * TINY_LAYOUT.block_bytes
    measurements = [Measurement(path, size, tuple(runs)) for (path, size), runs in probe_runs.items()]
    measurements += [Measurement(path, tiny_bytes, tuple(runs)) for path, runs in fixed_runs.items()]
    calibration = HostCalibration(platform.node() or "unknown", str(device), config.workers, fit_paths(measurements))
    rows = []
    for kind, _, blocks, rounds in measured:
        nbytes = blocks * layout.block_bytes
        probe_sums = tuple(sum(runs) for runs in zip(*rounds.probes.values()))
        rows.append(Row(kind.label, kind.tier, kind.cold, nbytes, blocks,
                        calibration.restore_s(kind.tier, nbytes, blocks, config.workers, cold=kind.cold),
                        statistics.median(rounds.restores), tuple(rounds.restores), probe_sums, tuple(rounds.fixed),
                        _profile_s(profile, kind, nbytes, blocks, config.workers)))
    return ValidateRun(tuple(rows), calibration, tuple(measurements))


def _profile_s(profile: HostCalibration | None, kind: RowKind, nbytes: int, blocks: int, workers: int) -> float | None:
    if profile is None:
        return None
    try:
        return profile.restore_s(kind.tier, nbytes, blocks, workers, cold=kind.cold)
    except KeyError:  # the profile lacks a path this row needs
        return None
