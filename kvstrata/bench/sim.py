"""``kvstrata bench sim``: how fast the trace-driven simulator replays a trace, beside a plain replay.

What is timed: ``Simulation(requests, config, arch).run()`` of :mod:`kvstrata.sim.engine`, once
per (trace, architecture), on the wall clock (and CPU time beside it), for the seven
architectures of :class:`kvstrata.plan.architectures.Architecture` plus ``hbm+pool+nvme``, on one
hardware profile and model (``h200-cx7-gen5``, ``llama-3-70b`` by default, in as many instances
of the fewest GPUs that hold the weights with room for KV as the profile has GPUs for, as
``kvstrata simulate`` does: :func:`kvstrata.plan.sizing.size_instances`). Reading the trace file is not timed.

Two traces: the one given (by default the Mooncake trace in the shared data folder), and a larger
one of the same kind built from it by :func:`tile_trace` (``requests_large`` requests, 12,000 by
default).

The baseline, in the same run and on the same requests: :func:`kvstrata.sim.analyze.analyze` with
an unlimited cache, a plain replay of the same arrivals through one LRU of blocks with no
hardware, queueing or transfers; median of ``baseline_repeats`` rounds (it takes milliseconds).
``overhead_x`` is the simulation's wall time over the baseline's.

The goal (the issue's): one simulation of a trace within :data:`SIM_WALL_S` seconds on one core.
The simulator is single-threaded Python; on Linux the run is also pinned to one CPU
(``sched_setaffinity``) so nothing it calls can spread over more, and the CPU it ran on is
reported.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.bench.goals import SIM_WALL_S, Goal
from kvstrata.hardware.profile import load_profile
from kvstrata.kv.presets import load_geometry
from kvstrata.plan.architectures import Architecture
from kvstrata.progress import NoProgress, Progress
from kvstrata.report import OMIT
from kvstrata.sim.analyze import analyze
from kvstrata.sim.config import SimConfig
from kvstrata.sim.engine import Simulation
from kvstrata.sim.tiers import parse_arch
from kvstrata.sim.trace import Request, sort_by_time

# <repo root>/../shared/data/traces/: the shared data folder beside the checkout.
DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
)
ARCHS = (*(a.value for a in Architecture), "hbm+pool+nvme")


@dataclass(frozen=True)
class SimBenchConfig:
    """What ``bench sim`` runs.

    Attributes:
        requests_large: requests of the tiled trace (at least 1).
        hardware: hardware profile name.
        model: model preset or config.
        archs: architectures, each as ``kvstrata simulate --arch`` takes them.
        baseline_repeats: timed rounds of the baseline per trace (at least 1).
        pin_one_core: pin the process to one CPU while timing (Linux only; elsewhere ignored).
    """

    requests_large: int = 12_000
    hardware: str = "h200-cx7-gen5"
    model: str = "llama-3-70b"
    archs: tuple[str, ...] = ARCHS
    baseline_repeats: int = 5
    pin_one_core: bool = True

    def __post_init__(self) -> None:
        if self.requests_large < 1:
            raise ValueError(f"requests_large must be at least 1, got {self.requests_large}")
        if self.baseline_repeats < 1:
            raise ValueError(f"baseline_repeats must be at least 1, got {self.baseline_repeats}")
        if not self.archs:
            raise ValueError("archs names no architecture")
        for name in self.archs:
            parse_arch(name)  # an unknown name fails here, before anything is timed


@dataclass(frozen=True)
class TiledTrace:
    """A trace built by :func:`tile_trace`; in a report, how the tiled trace was built.

    Attributes:
        requests: in arrival order (kept out of the report).
        copies: copies of the source begun (the last may be partial).
        span_ms: the source's span, last arrival minus first; copy ``k`` is shifted by ``k`` spans.
        id_stride: copy ``k``'s ids are the source's plus ``k * id_stride``.
    """

    requests: list[Request] = field(repr=False, metadata=OMIT)
    copies: int
    span_ms: int
    id_stride: int


def tile_trace(requests: Sequence[Request], total: int) -> TiledTrace:
    """A longer trace of the same kind: the source repeated until it has ``total`` requests.

    Copy ``k`` (from 0) is the source in arrival order with every timestamp shifted by ``k``
    times the source's span (last arrival minus first) and every hash id shifted by ``k`` times
    the source's id range (``max - min + 1``). The time shift puts the copies one after another
    at the source's arrival rate, so load, request sizes and prefix reuse *within* a session are
    those of the real trace; the id shift makes each copy's sessions new ones (no id of copy
    ``k`` occurs in any other copy, and the shift is one-to-one, so the chained-prefix structure
    within a copy is kept). Nothing in a copy hits on KV from an earlier copy, as new users'
    traffic would not. The last copy is cut where ``total`` is reached, so it may be partial
    (12,000 requests of the 3,993-request Mooncake trace: three whole copies and 21 requests).

    Deterministic: the same source and ``total`` give the same trace.

    Args:
        requests: the source trace (any order; ties keep their order).
        total: requests wanted (at least 1).

    Raises:
        ValueError: an empty source or ``total`` below 1.
    """
    if total < 1:
        raise ValueError(f"total must be at least 1, got {total}")
    source = sort_by_time(requests)
    if not source:
        raise ValueError("cannot tile an empty trace")
    span_ms = source[-1].timestamp_ms - source[0].timestamp_ms
    ids = [b for r in source for b in r.hash_ids]
    id_stride = max(ids) - min(ids) + 1 if ids else 0
    out: list[Request] = []
    copies = 0
    while len(out) < total:
        shift_ms, shift_id = copies * span_ms, copies * id_stride
        for r in source[: total - len(out)]:
            out.append(
                Request(
                    r.timestamp_ms + shift_ms,
                    r.input_length,
                    r.output_length,
                    tuple(b + shift_id for b in r.hash_ids),
                )
            )
        copies += 1
    return TiledTrace(out, copies, span_ms, id_stride)


@dataclass(frozen=True)
class SimRun:
    """What ran, on what (``pinned_cpu`` None: not pinned)."""

    trace: str
    hardware: str
    model: str
    instances: int
    gpus_per_instance: int
    archs: tuple[str, ...]
    requests_large: int
    baseline_repeats: int
    pinned_cpu: int | None
    goal_wall_s: float = SIM_WALL_S


@dataclass(frozen=True)
class BaselineTiming:
    """The plain replay of a trace: median wall seconds over rounds."""

    wall_s: float
    runs_s: tuple[float, ...]
    requests_per_s: float
    what: str = "kvstrata.sim.analyze.analyze, unlimited cache"


@dataclass(frozen=True)
class ArchTiming:
    """One simulation of a trace by one architecture."""

    arch: str
    wall_s: float
    cpu_s: float
    requests_per_s: float
    overhead_x: float  # wall seconds over the baseline's
    within_goal: bool
    records: int
    simulated_makespan_s: float


@dataclass(frozen=True)
class TraceTiming:
    """One trace: the baseline and a row per architecture (``tiling``: how it was built, if tiled)."""

    name: str  # "trace" (the source) or "tiled"
    requests: int
    span_ms: int
    baseline: BaselineTiming
    architectures: tuple[ArchTiming, ...]
    tiling: TiledTrace | None = None


@dataclass(frozen=True)
class SimBenchReport:
    config: SimRun
    traces: tuple[TraceTiming, TraceTiming]  # the source, then its tiling
    goals: tuple[Goal, ...]


@contextmanager
def _one_core(enabled: bool) -> Iterator[int | None]:
    """Pin this process to the lowest CPU it may run on; yields that CPU (``None``: not pinned)."""
    if not enabled or not hasattr(os, "sched_setaffinity"):
        yield None
        return
    allowed = os.sched_getaffinity(0)
    cpu = min(allowed)
    os.sched_setaffinity(0, {cpu})
    try:
        yield cpu
    finally:
        os.sched_setaffinity(0, allowed)


def _timed(fn) -> tuple[float, float, Any]:
    """(wall seconds, CPU seconds of this process, the result) of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def _bench_trace(
    label: str, requests: list[Request], config: SimBenchConfig, sim_config: SimConfig, progress: Progress,
    tiling: TiledTrace | None = None,
) -> tuple[TraceTiming, list[Goal]]:
    """One trace's timings (baseline and a row per architecture) and its goals, a row each."""
    progress.step(f"{label}: baseline (analyze)")
    base = tuple(_timed(lambda: analyze(requests, [None]))[0] for _ in range(config.baseline_repeats))
    base_s = statistics.median(base)
    rows, judged = [], []
    for name in config.archs:
        progress.step(f"{label}: {name}")
        spec = parse_arch(name)
        wall_s, cpu_s, outcome = _timed(lambda spec=spec: Simulation(requests, sim_config, spec).run())
        goal = Goal(f"{label} {name}", f"<={SIM_WALL_S:g} s", wall_s, SIM_WALL_S, at_most=True)
        rows.append(ArchTiming(name, wall_s, cpu_s, len(requests) / wall_s, wall_s / base_s, goal.passed,
                               len(outcome.records), outcome.makespan_s))
        judged.append(goal)
    span_ms = requests[-1].timestamp_ms - requests[0].timestamp_ms
    baseline = BaselineTiming(base_s, base, len(requests) / base_s)
    return TraceTiming(label, len(requests), span_ms, baseline, tuple(rows), tiling), judged


def run_sim_bench(
    requests: Sequence[Request], trace_path: str, config: SimBenchConfig, progress: Progress | None = None
) -> SimBenchReport:
    """Time the simulator on ``requests`` and on their tiling to ``config.requests_large``.

    Args:
        requests: the source trace, as read from ``trace_path``.
        trace_path: where it came from (for the report only).
        config: what to run.
        progress: where to report each step (default: nowhere).

    Returns:
        The report: what ran, per trace the baseline and per architecture ``wall_s``,
        ``cpu_s``, ``requests_per_s``, ``overhead_x``, ``within_goal``; and the goals.
    """
    progress = progress or NoProgress()
    source = sort_by_time(requests)
    if not source:
        raise ValueError(f"trace {trace_path!r} has no requests")
    tiled = tile_trace(source, config.requests_large)
    sim_config = SimConfig(load_geometry(config.model), load_profile(config.hardware))
    progress.start(2 * (len(config.archs) + 1))
    with _one_core(config.pin_one_core) as cpu:
        real, real_goals = _bench_trace("trace", source, config, sim_config, progress)
        large, large_goals = _bench_trace("tiled", tiled.requests, config, sim_config, progress, tiled)
    run = SimRun(trace_path, config.hardware, config.model, sim_config.instance_count, sim_config.gpus_per_instance,
                 config.archs, config.requests_large, config.baseline_repeats, cpu)
    return SimBenchReport(run, (real, large), tuple(real_goals + large_goals))
