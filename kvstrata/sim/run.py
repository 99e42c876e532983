"""One call to simulate several architectures on the same trace and setting."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from kvstrata.fleet.scorer import Policy
from kvstrata.plan.sharing import KVSharing
from kvstrata.sim.config import SimConfig
from kvstrata.sim.engine import Simulation
from kvstrata.sim.outcome import SimOutcome, run_label
from kvstrata.sim.model import TimeModel
from kvstrata.sim.results import GOODPUT_SLO, Summary, rank, summarise
from kvstrata.policies.write import WritePolicy
from kvstrata.sim.tiers import parse_arch
from kvstrata.sim.trace import Request
from kvstrata.slo import Slo


def offered_load(requests: Sequence[Request], config: SimConfig) -> float:
    """Prefill seconds the trace asks for with no reuse, per instance-second of the trace.

    Above 1 the instances cannot keep up without prefix hits: queues, and so TTFT, grow for as
    long as the trace lasts. A stated, cheap check to print beside simulated percentiles. A fleet
    of mixed TP sizes gives each instance an even share of the trace: its load is that of the
    slowest instance, which overloads first.

    Raises:
        ValueError: no requests, or all arrive at once (:func:`trace_span_s` is 0): no rate.
    """
    span_s = trace_span_s(requests)
    if span_s <= 0:
        raise ValueError("a trace whose requests all arrive at once (or none) has no arrival rate")
    slowest = 0.0
    for tp in dict.fromkeys(config.instance_tps):
        gpus = [g.name for g in config.profile.gpus[:tp]]
        model = TimeModel.build(config.geometry, config.profile, gpus)
        slowest = max(slowest, sum(model.prefill_s(r.input_length) for r in requests))
    return slowest / (config.instance_count * span_s)


def trace_span_s(requests: Sequence[Request]) -> float:
    """Seconds from the first arrival to the last; 0 for no request or one instant."""
    times = [r.timestamp_ms for r in requests]
    return (max(times) - min(times)) / 1000 if times else 0.0


def scale_time(requests: Sequence[Request], factor: float) -> list[Request]:
    """The trace with every arrival time multiplied by ``factor`` (2 = half the request rate)."""
    if not factor > 0:
        raise ValueError(f"time scale must be positive, got {factor}")
    return [replace(r, timestamp_ms=round(r.timestamp_ms * factor)) for r in requests]


def simulate(
    requests: Sequence[Request],
    config: SimConfig,
    archs: Sequence[str],
    progress: Callable[[str, int, int], None] | None = None,
    write: WritePolicy = WritePolicy.WRITE_THROUGH,
    sharings: Sequence[KVSharing] = (),
    policies: Sequence[Policy] = (),
    slo: Slo = GOODPUT_SLO,
) -> tuple[list[Summary], list[SimOutcome]]:
    """Run each architecture (in each of ``sharings``, labelled by it, when given; else in
    ``config.sharing``; and routed by each of ``policies``, carried as each outcome's and
    summary's ``policy``, when given; else as ``config`` routes); summaries with their goodput
    at ``slo``, ranked (see :func:`kvstrata.sim.results.rank`).

    Raises:
        ValueError: no requests (their percentiles would be undefined).
    """
    if not requests:
        raise ValueError("no requests to simulate")
    outcomes = []
    for sharing in sharings or (None,):
        shared = config if sharing is None else replace(config, sharing=sharing)
        for policy in policies or (None,):
            setting = shared if policy is None else replace(shared, policy=policy)
            for name in archs:
                spec = parse_arch(name, write)
                if sharing is not None:
                    spec = replace(spec, name=f"{spec.name} ({sharing.value})")
                cb = (lambda d, t, n=run_label(spec, policy): progress(n, d, t)) if progress else None
                outcomes.append(Simulation(requests, setting, spec, cb).run())
    return rank([summarise(o, slo) for o in outcomes]), outcomes
