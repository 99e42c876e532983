"""``kvstrata lab``: restores through the real cache across emulated hosts, beside the planner's prediction.

Three clusters, built one after the other (``kvstrata.lab.spec``), each with a real pool (a
Mooncake master and a daemon per pool port) on the pool host and ``kvstrata.lab.worker``
processes on the inference hosts:

1. **one link**: the inference host's port is reshaped, round by round, to each rate, and left
   unshaped once a round (the host's own paths: their fit is the calibration the predictions
   use, measured in the same rounds); each size is restored direct (pool -> device) and staged
   (pool -> host -> device). The bound the planner names is checked against the shaper's own
   counters: a link that held packets back (tbf overlimits) was the bound.
2. **two ports**: two shaped ports on two rails, a pool daemon behind each; the same restore from
   blocks kvstrata spread over both daemons, and from blocks all on one (a single port's stream).
3. **shared uplink**: two inference hosts behind one shaped uplink, restoring alone and at once.

Rounds: a warm-up round (dropped), then ``repeats`` rounds; in each, the steps run in an order
rotated from the round before (``kvstrata.rounds.rotated``). Figures are medians over rounds.
"""

from __future__ import annotations

import enum
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvstrata.rounds import rotated
from kvstrata.lab import spec as specs
from kvstrata.lab.hosts import LabPool, WorkerProcess, start_pool
from kvstrata.lab.model import Bound, LabPaths, Restore, predict
from kvstrata.lab.netns import Lab
from kvstrata.lab.report import LabReport, LinkRow, PortsRow, UplinkRow
from kvstrata.media import FetchPath
from kvstrata.plan.host import fit_path
from kvstrata.progress import NoProgress, Progress

MIB = 1 << 20
# Packets a shaper held back per MiB moved, above which the link was the bound (measured on the
# 2-vCPU VM: 25-35 per MiB at a rate under the host's paths, 0 at one far above them).
THROTTLED_PER_MIB = 1.0


class Phase(enum.Enum):
    """The clusters a lab runs (see the module text)."""

    LINK = "link"
    PORTS = "ports"
    UPLINK = "uplink"


@dataclass(frozen=True)
class LabConfig:
    """What ``kvstrata lab`` runs.

    Attributes:
        rates_gbit: the one-link phase's shaped rates (Gbit/s); the host's paths are measured
            unshaped in the same rounds.
        sizes: KV bytes per restore (whole blocks).
        paths: the restore paths of the one-link phase.
        ports_rate_gbit, ports_sizes: each port's rate and the restores of the two-port phase.
        uplink_rate_gbit, uplink_size: the shared uplink's rate and each host's restore.
        repeats: timed rounds after a warm-up round.
        model, block_tokens: the KV's geometry and blocks.
        phases: which clusters to run.
    """

    rates_gbit: tuple[float, ...] = (1.0, 2.5, 5.0, 40.0)
    sizes: tuple[int, ...] = (16 * MIB, 64 * MIB, 256 * MIB, 1024 * MIB)
    paths: tuple[FetchPath, ...] = (FetchPath.DIRECT, FetchPath.STAGED)
    ports_rate_gbit: float = 1.0
    ports_sizes: tuple[int, ...] = (64 * MIB, 256 * MIB)
    uplink_rate_gbit: float = 1.0
    uplink_size: int = 256 * MIB
    repeats: int = 3
    model: str = "llama-3-8b"
    block_tokens: int = 32
    phases: tuple[Phase, ...] = tuple(Phase)

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"lab: repeats must be >= 1, got {self.repeats}")
        if not self.sizes or any(s <= 0 for s in self.sizes):
            raise ValueError(f"lab: sizes must be positive byte counts, got {self.sizes}")
        if len(set(self.sizes)) < 2 and Phase.LINK in self.phases:
            raise ValueError("lab: the one-link phase needs two sizes at least (the host's paths are fitted over them)")
        for rate in (*self.rates_gbit, self.ports_rate_gbit, self.uplink_rate_gbit):
            specs.LinkShape(rate)  # one line naming a bad rate
        if not self.phases or not all(isinstance(p, Phase) for p in self.phases):
            raise ValueError(f"lab: phases must be some of {', '.join(p.value for p in Phase)}, got {self.phases!r}")

    def blocks(self, nbytes: int, block_bytes: int) -> int:
        return max(1, nbytes // block_bytes)


def run_lab(config: LabConfig, progress: Progress | None = None) -> LabReport:
    """Build each cluster, measure, predict, tear it down; the report (goals judged)."""
    progress = progress or NoProgress()
    rounds = config.repeats + 1
    steps = {Phase.LINK: rounds * (1 + len(config.rates_gbit)), Phase.PORTS: rounds, Phase.UPLINK: rounds}
    progress.start(sum(steps[p] + 1 for p in config.phases))
    link_rows: list[LinkRow] = []
    paths: LabPaths | None = None
    with tempfile.TemporaryDirectory(prefix="kvstrata-lab-") as tmp:
        run_dir = Path(tmp)
        if Phase.LINK in config.phases:
            link_rows, paths = _one_link(config, run_dir, progress)
        if paths is None:  # the other phases need the host's paths: measure them quickly
            paths = _paths_only(config, run_dir, progress)
        ports = _two_ports(config, paths, run_dir, progress) if Phase.PORTS in config.phases else []
        uplink = _shared_uplink(config, paths, run_dir, progress) if Phase.UPLINK in config.phases else []
    return LabReport(config, paths, tuple(link_rows), tuple(ports), tuple(uplink))


@contextmanager
def _cluster(spec: specs.LabSpec, run_dir: Path, segment_bytes: int) -> Iterator[tuple[Lab, LabPool]]:
    with Lab(spec) as lab:
        yield lab, start_pool(lab, run_dir, segment_bytes)


def _worker(lab: Lab, pool: LabPool, host: str, config: LabConfig, nbytes: int, run_dir: Path, tag: str,
            segments: tuple[str, ...] | None = None) -> WorkerProcess:
    from kvstrata.kv import load_geometry
    from kvstrata.kv.layout import KVLayout

    block_bytes = KVLayout.from_geometry(load_geometry(config.model), config.block_tokens).block_bytes
    setup = {"pool": pool.config(host, segments).to_json(), "model": config.model,
             "block_tokens": config.block_tokens, "blocks": config.blocks(nbytes, block_bytes), "tag": tag}
    return WorkerProcess(lab, host, setup, run_dir / f"worker-{tag}.log")


def _segment_bytes(total: int) -> int:
    """A daemon's segment: every object a phase stores, sealed, with room (the master evicts near 0.9 full)."""
    return int(total * 1.4) + 256 * MIB


# --- phase 1: one link -------------------------------------------------------------------------


def _one_link(config: LabConfig, run_dir: Path, progress: Progress) -> tuple[list[LinkRow], LabPaths]:
    spec = specs.one_link(None)
    largest = max(config.sizes)
    times: dict[tuple[float | None, int, FetchPath], list[float]] = defaultdict(list)
    throttled: dict[tuple[float | None, int, FetchPath], list[float]] = defaultdict(list)
    copies: dict[int, list[float]] = defaultdict(list)
    with _cluster(spec, run_dir, _segment_bytes(largest)) as (lab, pool):
        worker = _worker(lab, pool, "inf", config, largest, run_dir, "link")
        try:
            progress.step("one link: pool and worker ready")
            toward_host = lab.link_ends("inf", 0)[1]  # the switch's end sends to the host: restores cross it
            for r in range(config.repeats + 1):
                keep = r > 0
                for rate in rotated([None, *config.rates_gbit], r):
                    lab.reshape_port("inf", 0, specs.LinkShape(rate))
                    for size in rotated(list(config.sizes), r):
                        blocks = config.blocks(size, worker.block_bytes)
                        for path in rotated(list(config.paths), r):
                            before = lab.shaper_counts(*toward_host)
                            seconds = worker.ask({"op": "restore", "path": path.value, "blocks": blocks})
                            after = lab.shaper_counts(*toward_host)
                            if keep:
                                times[(rate, size, path)].append(seconds)
                                held = 0 if before is None or after is None else after.overlimits - before.overlimits
                                throttled[(rate, size, path)].append(held / (blocks * worker.block_bytes / MIB))
                        if rate is None and keep:
                            copies[size].append(worker.ask({"op": "copy", "bytes": blocks * worker.block_bytes}))
                    progress.step(f"one link: round {r}/{config.repeats}: {specs.LinkShape(rate).text()}")
        finally:
            worker.close()
    moved = {size: config.blocks(size, worker.block_bytes) * worker.block_bytes for size in config.sizes}
    paths = _fit_paths(config, moved, times, copies)
    rows = []
    for (rate, size, path), runs in sorted(times.items(), key=lambda kv: (kv[0][0] or 1e9, kv[0][1], kv[0][2].value)):
        (predicted,) = predict(specs.one_link(rate), paths, [Restore("inf", moved[size], path)])
        held = statistics.median(throttled[(rate, size, path)])
        observed = Bound.LINK if held > THROTTLED_PER_MIB else Bound.MEMORY
        rows.append(LinkRow(rate, path, moved[size], predicted.seconds, tuple(runs), predicted.bound, observed,
                            predicted.bottleneck, held))
    return rows, paths


def _fit_paths(config: LabConfig, moved: dict[int, int], times: dict, copies: dict[int, list[float]]) -> LabPaths:
    """The host's paths from the unshaped rounds: the direct restore's fixed cost and rate over
    the sizes, and the copy's rate."""
    sizes = sorted(moved)
    direct = [statistics.median(times[(None, s, FetchPath.DIRECT)]) for s in sizes]
    transport = fit_path([moved[s] for s in sizes], direct, relative=True)  # every size to the same relative error
    copy = fit_path([moved[s] for s in sizes], [statistics.median(copies[s]) for s in sizes], origin=True)
    return LabPaths(transport, copy)


def _paths_only(config: LabConfig, run_dir: Path, progress: Progress) -> LabPaths:
    """The host's paths alone (when the one-link phase is not run): unshaped rounds only."""
    quick = LabConfig(rates_gbit=(), sizes=config.sizes if len(set(config.sizes)) > 1 else (16 * MIB, 64 * MIB),
                      paths=(FetchPath.DIRECT,), repeats=config.repeats, model=config.model,
                      block_tokens=config.block_tokens, phases=(Phase.LINK,))
    _, paths = _one_link(quick, run_dir, progress)
    return paths


# --- phase 2: two ports --------------------------------------------------------------------------


def _two_ports(config: LabConfig, paths: LabPaths, run_dir: Path, progress: Progress) -> list[PortsRow]:
    rate = config.ports_rate_gbit
    spec = specs.two_ports(rate)
    largest = max(config.ports_sizes)
    times: dict[tuple[str, int], list[float]] = defaultdict(list)
    with _cluster(spec, run_dir, _segment_bytes(largest)) as (lab, pool):
        both = _worker(lab, pool, "inf", config, largest, run_dir, "striped")
        one = _worker(lab, pool, "inf", config, largest, run_dir, "oneport", segments=pool.segments[:1])
        try:
            progress.step("two ports: pool and workers ready")
            sides: list[tuple[str, WorkerProcess]] = [("striped", both), ("one port", one)]
            for r in range(config.repeats + 1):
                for size in rotated(list(config.ports_sizes), r):
                    for name, worker in rotated(sides, r):
                        blocks = config.blocks(size, worker.block_bytes)
                        seconds = worker.ask({"op": "restore", "path": FetchPath.DIRECT.value, "blocks": blocks})
                        if r:
                            times[(name, size)].append(seconds)
                progress.step(f"two ports: round {r}/{config.repeats}")
        finally:
            both.close()
            one.close()
        block_bytes = both.block_bytes
    rows = []
    for size in config.ports_sizes:
        nbytes = config.blocks(size, block_bytes) * block_bytes
        (striped,) = predict(spec, paths, [Restore("inf", nbytes, FetchPath.DIRECT, (0, 1))])
        (single,) = predict(spec, paths, [Restore("inf", nbytes, FetchPath.DIRECT, (0,))])
        rows.append(PortsRow(rate, nbytes, tuple(times[("one port", size)]), tuple(times[("striped", size)]),
                             single.seconds, striped.seconds, striped.bottleneck))
    return rows


# --- phase 3: a shared uplink --------------------------------------------------------------------


def _shared_uplink(config: LabConfig, paths: LabPaths, run_dir: Path, progress: Progress) -> list[UplinkRow]:
    rate = config.uplink_rate_gbit
    spec = specs.shared_uplink(rate)
    hosts = [h.name for h in spec.inference]
    alone: dict[str, list[float]] = defaultdict(list)
    together: dict[str, list[float]] = defaultdict(list)
    with _cluster(spec, run_dir, _segment_bytes(len(hosts) * config.uplink_size)) as (lab, pool):
        workers = {}
        try:
            for h in hosts:
                workers[h] = _worker(lab, pool, h, config, config.uplink_size, run_dir, f"uplink-{h}")
            progress.step("shared uplink: pool and workers ready")
            blocks = config.blocks(config.uplink_size, workers[hosts[0]].block_bytes)
            command = {"op": "restore", "path": FetchPath.DIRECT.value, "blocks": blocks}
            for r in range(config.repeats + 1):
                steps: list[tuple[str, Callable[[], None]]] = [
                    *((f"alone {h}", lambda h=h: _keep(alone[h], workers[h].ask(command), r)) for h in hosts),
                    ("together", lambda: _at_once(workers, command, together, r)),
                ]
                for _, step in rotated(steps, r):
                    step()
                progress.step(f"shared uplink: round {r}/{config.repeats}")
        finally:
            for w in workers.values():
                w.close()
        nbytes = blocks * workers[hosts[0]].block_bytes
    both = predict(spec, paths, [Restore(h, nbytes, FetchPath.DIRECT) for h in hosts])
    rows = []
    for h, shared in zip(hosts, both):
        (solo,) = predict(spec, paths, [Restore(h, nbytes, FetchPath.DIRECT)])
        rows.append(UplinkRow(h, rate, nbytes, tuple(alone[h]), tuple(together[h]), solo.seconds, shared.seconds,
                              shared.bottleneck))
    return rows


def _keep(into: list[float], seconds: float, r: int) -> None:
    if r:
        into.append(seconds)


def _at_once(workers: dict[str, WorkerProcess], command: dict, into: dict[str, list[float]], r: int) -> None:
    """The same restore on every host at once: the commands go out together, then the answers are read."""
    for w in workers.values():
        w.send(command)
    for h, w in workers.items():
        _keep(into[h], float(w.receive()["seconds"]), r)
