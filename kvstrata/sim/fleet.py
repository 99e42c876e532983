"""A simulated fleet routed by the router's own policies (:mod:`kvstrata.fleet.scorer`) (pure).

Each instance of a :class:`~kvstrata.sim.engine.Simulation` is a server of the fleet: its
caches publish what they store and drop as the servers' KV events would
(:class:`~kvstrata.fleet.events.Stored` / :class:`~kvstrata.fleet.events.Removed` per tier,
applied to a :class:`~kvstrata.fleet.index.FleetIndex` at once: no event is lost or late here),
and each arrival goes where the policy chooses from that index, the instances' queues and
their costs, as ``kvstrata route`` chooses among real servers.

An instance's costs (:class:`~kvstrata.fleet.cost.ServerCost`) are the simulator's own:

* per prefill token, its time model's prefill of :data:`REFERENCE_TOKENS` over that many (the
  attention term makes a token of a long prompt dearer: one reference length, stated);
* per tier it restores from, a line through the planner's uncontended restore of one and two
  blocks along the tier's path (what the simulator's network then shares among restores);
* its queue, the prefill tokens of requests routed to it and not yet prefilled (their hits
  taken off: the compute still waiting on it).

Block ids stand for vLLM's block hashes: a trace's ids are chained as vLLM's hashes are.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvstrata.fleet.cost import RestoreLine, ServerCost
from kvstrata.fleet.events import Batch, Removed, Stored
from kvstrata.fleet.index import FleetIndex
from kvstrata.fleet.scorer import Policy, Request, ServerState
from kvstrata.kv.geometry import KVGeometry
from kvstrata.media import Medium
from kvstrata.plan.footprint import restore_bytes
from kvstrata.plan.restore import RestorePlanner
from kvstrata.sim.model import TimeModel
from kvstrata.sim.tiers import ArchSpec
from kvstrata.sim.trace import BLOCK_TOKENS
from kvstrata.sim.trace import Request as TraceRequest
from kvstrata.slo import Slo

REFERENCE_TOKENS = 16 * BLOCK_TOKENS  # the prompt length a per-token prefill cost is taken at (8,192 tokens)


def instance_cost(geometry: KVGeometry, model: TimeModel, planner: RestorePlanner, arch: ArchSpec) -> ServerCost:
    """One instance's costs, as the module text says (a tier whose path this hardware lacks has no line)."""
    lines = {}
    tp = len(planner.gpus)
    for tier in arch.tiers:
        if tier is Medium.DEVICE:
            continue
        path = arch.restore_path(tier)
        if path is None:  # nothing moves (a streaming architecture's DRAM): free as the device
            lines[tier] = RestoreLine(0.0, 0.0)
            continue
        one, two = (planner.restore(path, [restore_bytes(geometry, n * BLOCK_TOKENS, tp).size_bytes] * tp)
                    for n in (1, 2))
        if not (one.available and two.available):
            continue
        lines[tier] = RestoreLine.through(one.seconds, two.seconds)
    per_token_s = model.prefill_s(REFERENCE_TOKENS) / REFERENCE_TOKENS
    return ServerCost(BLOCK_TOKENS, per_token_s, lines)


class FleetRouting:
    """A policy choosing among a simulation's instances, fed by their caches' stores and drops.

    Args:
        policy: which policy (a new instance of it: a round robin's turn is the run's own).
        costs: each instance's costs, in instance order.
        slo: the targets the policy routes to meet, where it takes them.
    """

    def __init__(self, policy: Policy, costs: Sequence[ServerCost], slo: Slo | None = None) -> None:
        self.policy = policy.make(slo)
        self.costs = tuple(costs)
        self.names = tuple(f"instance-{i}" for i in range(len(costs)))
        self.index = FleetIndex(self.names)

    def choose(self, request: TraceRequest, queued_tokens: Sequence[int], tpot_s: Sequence[float | None]) -> int:
        """The instance ``request`` goes to, given each instance's queued prefill tokens and the
        pace of its decode (None: nothing decoding)."""
        states = [ServerState(n, c, q, t) for n, c, q, t in zip(self.names, self.costs, queued_tokens, tpot_s)]
        routed = Request(tuple(request.hash_ids), max(1, request.input_length))
        return self.names.index(self.policy.choose(routed, states, self.index).server)

    def changed(self, instance: int, tier: Medium, stored: Iterable[int], removed: Iterable[int], now_s: float) -> None:
        """Instance ``instance``'s ``tier`` now holds ``stored`` and no longer ``removed``."""
        events = tuple(e for e in (Stored(tuple(stored), tier), Removed(tuple(removed), tier)) if e.hashes)
        if events:
            self.index.apply(self.names[instance], Batch(now_s, events))
