"""The planner's view of a lab: its hardware profile as a topology, and the restores it predicts.

Pure (no torch, no I/O). The profile is the lab's spec (``kvstrata.lab.spec``: ports and uplinks
at their shaped rates, payload after TCP/IP and Ethernet headers) plus this host's software and
memory paths, measured in the same sitting over an unshaped lab link (``LabPaths``). Restores are
predicted the way the planner predicts any transfer (``kvstrata.hardware.flows``): each is one
flow per pool daemon it reads from, along the topology's route through that daemon's port;
concurrent flows share every link max-min fairly; a restore ends when its last flow does.

    seconds = transport fixed cost + the flows' fluid completion (+ the host -> device copy, staged)
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvstrata.hardware.figures import Basis, Bandwidth
from kvstrata.hardware.flows import Flow, flow_along, run_concurrently
from kvstrata.hardware.topology import Link, LinkKind, Node, NodeKind, Topology
from kvstrata.lab.spec import LAB_MTU, LabSpec, LinkShape, Role, tcp_efficiency
from kvstrata.media import FetchPath
from kvstrata.plan.host import PathFit

POOL_MEMORY, POOL_CPU = "pool.dram", "pool.cpu"


class Bound(enum.Enum):
    """What limits a restore."""

    LINK = "link"  # a shaped port or uplink: the network
    MEMORY = "memory path"  # the host's own path: the pool's transport and kvstrata's checks, on its CPUs


@dataclass(frozen=True)
class LabPaths:
    """This host's paths as the lab measured them, with no shaper on the way.

    Attributes:
        transport: a restore pool -> device tier through the cache over an unshaped lab link
            (kvstrata's fixed cost, Mooncake's TCP transport, the seal's checks), fitted
            ``latency_s + bytes / gbps`` over sizes.
        copy: one torch copy host -> device tier (the staged restore's second hop).
    """

    transport: PathFit
    copy: PathFit


@dataclass(frozen=True)
class Restore:
    """A restore to predict: ``nbytes`` to ``host``'s device tier by ``path``, read from the pool
    daemons ``segments`` (indexes of the pool host's ports) in equal shares."""

    host: str
    nbytes: int
    path: FetchPath
    segments: tuple[int, ...] = (0,)


@dataclass(frozen=True)
class Predicted:
    """A restore's predicted time and what bounds it (its slowest flow's bottleneck)."""

    restore: Restore
    seconds: float
    bound: Bound
    bottleneck: str  # the resource's label


def link_bandwidth(shape: LinkShape, what: str) -> Bandwidth | None:
    """A shaped link's one-way capacity (None: unshaped, no constraint): the tbf rate / 8, of
    which TCP payload is the jumbo frame's share (``tcp_efficiency``)."""
    if shape.rate_gbit is None:
        return None
    return Bandwidth(
        spec_gbps=shape.rate_gbit / 8,
        basis=Basis.LINE_RATE,
        source=f"{what}: tbf at {shape.rate_gbit:g} Gbit/s on the lab's veth",
        efficiency=tcp_efficiency(),
        efficiency_basis=f"TCP payload per {LAB_MTU}-byte frame plus Ethernet header",
    )


def lab_topology(spec: LabSpec, paths: LabPaths) -> Topology:
    """The lab as the planner's graph: ``<host>.cpu`` roots with ports ``<host>.p<j>`` on switches
    ``sw.<name>``; the pool's DRAM behind its measured transport; each inference host's DRAM
    and device tier (a CPU stand-in) on its root, which the pool writes directly."""
    topo = Topology(f"lab: {spec.name}")
    for switch in spec.switches:
        topo.add_node(Node(f"sw.{switch}", NodeKind.FABRIC))
    for k, up in enumerate(spec.uplinks):
        bw = link_bandwidth(up.shape, f"uplink {up.a}-{up.b}")
        topo.add_link(Link(f"sw.{up.a}", f"sw.{up.b}", LinkKind.NIC_PORT, bw, bw, up.shape.delay_s,
                           f"uplink {up.a}-{up.b} ({up.shape.text()})"))
    for host in spec.hosts:
        cpu = f"{host.name}.cpu"
        topo.add_node(Node(cpu, NodeKind.ROOT, socket=cpu))
        if host.role is Role.POOL:
            transport = Bandwidth(paths.transport.gbps, Basis.MEASURED,
                                  "restore over an unshaped lab link (Mooncake TCP, kvstrata's checks, this host's CPUs)")
            topo.add_node(Node(POOL_MEMORY, NodeKind.REMOTE_DRAM, socket=cpu))
            topo.add_link(Link(POOL_MEMORY, cpu, LinkKind.INTERNAL, transport, transport, 0.0,
                               "memory path: pool transport (measured, unshaped)"))
        else:
            for memory, kind in (("dram", NodeKind.DRAM), ("device", NodeKind.HBM)):
                topo.add_node(Node(f"{host.name}.{memory}", kind, socket=cpu))
                topo.add_link(Link(f"{host.name}.{memory}", cpu, LinkKind.INTERNAL, None, None, 0.0, "registered memory"))
        for j, port in enumerate(host.ports):
            node = f"{host.name}.p{j}"
            topo.add_node(Node(node, NodeKind.PORT, socket=cpu))
            topo.add_link(Link(cpu, node, LinkKind.INTERNAL, None, None, 0.0, "NIC"))
            bw = link_bandwidth(port.shape, f"{host.name} port {j}")
            topo.add_link(Link(node, f"sw.{port.switch}", LinkKind.NIC_PORT, bw, bw, port.shape.delay_s,
                               f"{host.name} port {j} ({port.shape.text()})"))
    return topo


def predict(spec: LabSpec, paths: LabPaths, restores: Sequence[Restore]) -> list[Predicted]:
    """Predicted seconds of ``restores`` started together (alone: a list of one)."""
    topo = lab_topology(spec, paths)
    flows: list[Flow] = []
    owner: list[int] = []
    for r, restore in enumerate(restores):
        dst = f"{restore.host}.{'device' if restore.path is FetchPath.DIRECT else 'dram'}"
        share = restore.nbytes // len(restore.segments)
        for j in restore.segments:
            switch = spec.pool.ports[j].switch
            route = topo.route(POOL_MEMORY, dst, via=(f"{spec.pool.name}.p{j}", f"sw.{switch}"))
            flows.append(flow_along(topo, route, share, f"{restore.host} from daemon {j}"))
            owner.append(r)
    done = run_concurrently(flows)
    out = []
    for r, restore in enumerate(restores):
        mine = [c for c, o in zip(done, owner) if o == r]
        last = max(mine, key=lambda c: c.finish_s)
        seconds = paths.transport.latency_s + last.finish_s
        if restore.path is FetchPath.STAGED:
            seconds += paths.copy.seconds(restore.nbytes)
        bound = Bound.MEMORY if last.bottleneck.label.startswith("memory path") else Bound.LINK
        out.append(Predicted(restore, seconds, bound, last.bottleneck.label))
    return out
