"""Transfers over a topology: bottlenecks, max-min fair sharing, completion times.

A flow draws on resources: each link direction it crosses, and the memories at its ends
(a memory's bandwidth is shared by its reads and writes, so a copy inside one HBM draws on
it twice). Concurrent flows share every resource max-min fairly, found by progressive
filling: raise all unfrozen flows' rates together until some resource is full, freeze the
flows through it (that resource is their bottleneck), repeat.

Time for B bytes = B / (bottleneck's effective GB/s x 1e9) + the path's per-hop latency.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.hardware.topology import Path, Topology

GB = 1e9  # bytes per decimal GB; bandwidths are decimal GB/s


@dataclass(frozen=True)
class Resource:
    """Something with a capacity that flows share: a link direction, or a memory's total."""

    key: str
    label: str
    gbps: float  # effective GB/s


@dataclass(frozen=True)
class Flow:
    """A transfer of ``size_bytes``, drawing ``weight`` bytes of each resource per byte moved."""

    name: str
    uses: tuple[tuple[Resource, int], ...]
    size_bytes: int = 0
    latency_s: float = 0.0
    path: Path | None = None

    def __post_init__(self) -> None:
        if self.size_bytes < 0:
            raise ValueError(f"flow {self.name!r}: size_bytes must be >= 0, got {self.size_bytes}")
        if not self.uses:
            raise ValueError(f"flow {self.name!r} crosses no constrained resource")


def memory_resource(topology: Topology, name: str) -> Resource | None:
    node = topology.node(name)
    if node.bandwidth is None:
        return None
    return Resource(f"mem:{name}", f"{name} {node.kind.value} (reads+writes shared)", node.bandwidth.effective_gbps)


def flow_along(topology: Topology, path: Path, size_bytes: int = 0, name: str | None = None) -> Flow:
    """A flow from ``path.src`` to ``path.dst``: the source read, each hop, the target write,
    and a write plus a read of any staging memory the path passes through."""
    weights: dict[str, int] = {}
    resources: dict[str, Resource] = {}

    def use(resource: Resource | None) -> None:
        if resource is None:
            return
        resources[resource.key] = resource
        weights[resource.key] = weights.get(resource.key, 0) + 1

    use(memory_resource(topology, path.src))
    for hop in path.hops:
        if hop.src != path.src and topology.node(hop.src).kind.is_memory:
            # A staging memory inside the path is written and read again: it draws twice.
            use(memory_resource(topology, hop.src))
            use(memory_resource(topology, hop.src))
        bw = hop.bandwidth
        if bw is not None:
            label = f"{hop.link.label or hop.link.kind.value} {hop.src}->{hop.dst}"
            use(Resource(hop.resource, label, bw.effective_gbps))
    use(memory_resource(topology, path.dst))
    uses = tuple((resources[k], weights[k]) for k in resources)
    return Flow(name or path.describe(), uses, size_bytes, path.latency_s, path)


def memory_read(topology: Topology, name: str, size_bytes: int = 0, label: str = "read") -> Flow:
    """A flow that only reads (or only writes) one memory, e.g. decode reading its KV."""
    resource = memory_resource(topology, name)
    if resource is None:
        raise ValueError(f"node {name!r} has no bandwidth to read")
    return Flow(f"{label} {name}", ((resource, 1),), size_bytes)


@dataclass(frozen=True)
class Share:
    flow: Flow
    gbps: float
    bottleneck: Resource


def max_min_share(flows: list[Flow]) -> list[Share]:
    """Rates of concurrent flows under max-min fairness (progressive filling).

    Demand per resource (the summed weights of its unfrozen flows) is kept up to date as
    flows freeze, so each round costs one pass over the resources, not over every flow.
    """
    remaining: dict[str, float] = {}
    demand: dict[str, int] = {}
    users: dict[str, list[int]] = {}
    by_key: dict[str, Resource] = {}
    for i, f in enumerate(flows):
        for r, w in f.uses:
            remaining[r.key] = r.gbps
            by_key[r.key] = r
            demand[r.key] = demand.get(r.key, 0) + w
            users.setdefault(r.key, []).append(i)
    rate: list[float | None] = [None] * len(flows)
    bottleneck: list[Resource | None] = [None] * len(flows)
    unfrozen = len(flows)
    while unfrozen:
        key = min((k for k in demand if demand[k] > 0), key=lambda k: (remaining[k] / demand[k], k))
        level = remaining[key] / demand[key]
        for i in users[key]:
            if rate[i] is not None:
                continue
            rate[i], bottleneck[i] = level, by_key[key]
            unfrozen -= 1
            for r, w in flows[i].uses:
                remaining[r.key] -= level * w
                demand[r.key] -= w
        remaining[key] = 0.0  # guard against float dust leaving it positive
    return [Share(f, rate[i], bottleneck[i]) for i, f in enumerate(flows)]


@dataclass(frozen=True)
class Completion:
    flow: Flow
    finish_s: float  # from a common start, including the path's latency
    gbps: float  # size / transfer time, excluding latency
    bottleneck: Resource  # at the start, when all flows share


def run_concurrently(flows: list[Flow]) -> list[Completion]:
    """Start ``flows`` together; rates are re-shared whenever one finishes (fluid model)."""
    initial = max_min_share(flows)
    left = {i: float(f.size_bytes) for i, f in enumerate(flows)}
    done: dict[int, float] = {i: 0.0 for i, f in enumerate(flows) if f.size_bytes == 0}
    for i in done:
        left.pop(i)
    now = 0.0
    while left:
        order = list(left)
        shares = max_min_share([flows[i] for i in order])
        step = min(left[i] / (s.gbps * GB) for i, s in zip(order, shares))
        now += step
        for i, s in zip(order, shares):
            left[i] -= s.gbps * GB * step
            if left[i] <= 1e-6 * max(1.0, flows[i].size_bytes):
                done[i] = now
                del left[i]
    out = []
    for i, f in enumerate(flows):
        t = done[i]
        gbps = f.size_bytes / t / GB if t > 0 else initial[i].gbps
        out.append(Completion(f, t + f.latency_s, gbps, initial[i].bottleneck))
    return out


@dataclass(frozen=True)
class TransferEstimate:
    """Time for one transfer alone on its path."""

    path: Path
    size_bytes: int
    gbps: float
    bottleneck: str
    latency_s: float

    @property
    def seconds(self) -> float:
        return self.size_bytes / (self.gbps * GB) + self.latency_s


def estimate(topology: Topology, path: Path, size_bytes: int) -> TransferEstimate:
    (share,) = max_min_share([flow_along(topology, path, size_bytes)])
    return TransferEstimate(path, size_bytes, share.gbps, share.bottleneck.label, path.latency_s)
