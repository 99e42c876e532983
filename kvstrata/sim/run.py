"""One call to simulate several architectures on the same trace and setting."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstrata.sim.engine import SimConfig, SimOutcome, Simulation
from kvstrata.sim.results import Summary, rank, summarise
from kvstrata.sim.tiers import parse_arch
from kvstrata.sim.trace import Request


def simulate(
    requests: Sequence[Request],
    config: SimConfig,
    archs: Sequence[str],
    progress: Callable[[str, int, int], None] | None = None,
) -> tuple[list[Summary], list[SimOutcome]]:
    """Run each architecture; summaries ranked (see :func:`kvstrata.sim.results.rank`)."""
    outcomes = []
    for name in archs:
        spec = parse_arch(name)
        cb = (lambda d, t, n=name: progress(n, d, t)) if progress else None
        outcomes.append(Simulation(requests, config, spec, cb).run())
    return rank([summarise(o) for o in outcomes]), outcomes
