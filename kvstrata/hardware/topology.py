"""A topology: memories and switching points joined by links with per-direction capacity.

Memories (HBM per GPU, DRAM per socket, an SSD's flash, a remote pool's DRAM) are the ends of
every path and never carried through: a path only transits root complexes, PCIe switches,
NICs and ports, the fabric, and the NVLink switch. A memory's bandwidth is one total shared
by its reads and writes; a full-duplex link has one capacity per direction.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from dataclasses import dataclass, field

from kvstrata.hardware.figures import Bandwidth


class NodeKind(enum.Enum):
    HBM = "hbm"
    DRAM = "dram"
    REMOTE_DRAM = "remote dram"
    FLASH = "flash"
    ROOT = "root complex"
    SWITCH = "pcie switch"
    NIC = "nic"
    PORT = "nic port"
    FABRIC = "fabric"
    NVSWITCH = "nvswitch"
    DEVICE = "device"  # an endpoint's controller (NVMe controller)

    @property
    def is_memory(self) -> bool:
        return self in (NodeKind.HBM, NodeKind.DRAM, NodeKind.REMOTE_DRAM, NodeKind.FLASH)


class LinkKind(enum.Enum):
    PCIE = "pcie"
    PCIE_UPLINK = "pcie uplink"
    NIC_PORT = "nic port"
    SOCKET = "socket"
    NVLINK = "nvlink"
    NVME_MEDIA = "nvme media"
    INTERNAL = "internal"  # unconstrained attachment (memory to its controller)


@dataclass(frozen=True)
class Node:
    name: str
    kind: NodeKind
    capacity_bytes: int | None = None
    bandwidth: Bandwidth | None = None  # memories: one total shared by reads and writes
    socket: str | None = None  # NUMA placement, where it has one


@dataclass(frozen=True)
class Link:
    """A link between nodes ``a`` and ``b``.

    ``forward`` is the a->b capacity, ``backward`` the b->a one; full duplex means each
    direction has its own, so a one-direction transfer never sees both. ``None`` means
    the direction is not a constraint (an internal attachment).
    """

    a: str
    b: str
    kind: LinkKind
    forward: Bandwidth | None
    backward: Bandwidth | None
    latency_s: float = 0.0
    label: str = ""

    @property
    def name(self) -> str:
        return f"{self.a}<->{self.b}"

    def capacity(self, src: str) -> Bandwidth | None:
        if src == self.a:
            return self.forward
        if src == self.b:
            return self.backward
        raise ValueError(f"{src!r} is not an end of link {self.name}")


@dataclass(frozen=True)
class Hop:
    """One link crossed in one direction."""

    link: Link
    src: str
    dst: str

    @property
    def resource(self) -> str:
        return f"{self.src}->{self.dst}"

    @property
    def bandwidth(self) -> Bandwidth | None:
        return self.link.capacity(self.src)


@dataclass(frozen=True)
class Path:
    src: str
    dst: str
    hops: tuple[Hop, ...]

    @property
    def nodes(self) -> tuple[str, ...]:
        return (self.src,) + tuple(h.dst for h in self.hops)

    @property
    def latency_s(self) -> float:
        return sum(h.link.latency_s for h in self.hops)

    @property
    def width_gbps(self) -> float:
        """The narrowest link direction's effective GB/s (inf when nothing constrains it)."""
        widths = [h.bandwidth.effective_gbps for h in self.hops if h.bandwidth is not None]
        return min(widths, default=math.inf)

    def describe(self) -> str:
        return " -> ".join(self.nodes)


@dataclass
class Topology:
    """A graph of nodes and links. Built once by the profile builder, then read-only."""

    name: str
    nodes: dict[str, Node] = field(default_factory=dict)
    links: list[Link] = field(default_factory=list)
    _adjacent: dict[str, list[tuple[str, Link]]] = field(default_factory=dict, repr=False)
    _routes: dict[tuple, "Path"] = field(default_factory=dict, repr=False)  # the graph is read-only once built
    _widths: list[float] = field(default_factory=list, repr=False)

    def add_node(self, node: Node) -> Node:
        if node.name in self.nodes:
            raise ValueError(f"duplicate node name {node.name!r} in topology {self.name!r}")
        self.nodes[node.name] = node
        self._adjacent[node.name] = []
        return node

    def add_link(self, link: Link) -> Link:
        self._routes.clear()
        self._widths.clear()
        for end in (link.a, link.b):
            if end not in self.nodes:
                raise ValueError(f"link {link.name} names unknown node {end!r}")
        self.links.append(link)
        self._adjacent[link.a].append((link.b, link))
        self._adjacent[link.b].append((link.a, link))
        return link

    def node(self, name: str) -> Node:
        try:
            return self.nodes[name]
        except KeyError:
            raise ValueError(f"topology {self.name!r} has no node {name!r}") from None

    def of_kind(self, kind: NodeKind) -> list[Node]:
        return [n for n in self.nodes.values() if n.kind is kind]

    def route(self, src: str, dst: str, via: tuple[str, ...] = (), size_bytes: int | None = None) -> Path:
        """A path from ``src`` to ``dst`` through ``via`` in order.

        Without ``size_bytes``: the widest path (largest bottleneck in the direction of
        travel), then the lowest latency, then the fewest hops, then the neighbour added
        first, so routes are deterministic and GPU to GPU takes NVLink, not a PCIe switch.
        With ``size_bytes``: the quickest path for that many bytes (size / width + latency),
        so a wider link or a higher efficiency never makes a transfer slower.
        Memories are never transited unless named in ``via`` (a staging buffer).
        """
        key = (src, dst, tuple(via), size_bytes)
        if key not in self._routes:
            self._routes[key] = self._route(src, dst, tuple(via), size_bytes)
        return self._routes[key]

    def _route(self, src: str, dst: str, via: tuple[str, ...], size_bytes: int | None) -> Path:
        stops = (src,) + via + (dst,)
        for stop in stops:
            self.node(stop)
        # Quickest-path by thresholds: for each capacity c, the lowest-latency path using only
        # link directions of at least c; the best over all c is exact for size / width + latency.
        best: tuple[float, float, Path] | None = None
        for threshold in self._thresholds():
            if best is not None and (size_bytes is None or size_bytes / (threshold * 1e9) >= best[0]):
                break
            legs = [self._lowest_latency(a, b, threshold) for a, b in zip(stops, stops[1:])]
            if any(leg is None for leg in legs):
                continue
            path = Path(src, dst, tuple(hop for leg in legs for hop in leg))
            width = path.width_gbps
            seconds = (size_bytes or 0) / (width * 1e9) + path.latency_s
            if best is None or (seconds, -width) < (best[0], -best[1]):
                best = (seconds, width, path)
        if best is None:
            raise ValueError(f"no path from {src!r} to {dst!r} via {list(via)} in topology {self.name!r}")
        return best[2]

    def _thresholds(self) -> list[float]:
        """Distinct effective capacities of all link directions, widest first (inf for none)."""
        if not self._widths:
            widths = {math.inf}
            for link in self.links:
                for bw in (link.forward, link.backward):
                    widths.add(bw.effective_gbps if bw is not None else math.inf)
            self._widths.extend(sorted(widths, reverse=True))
        return self._widths

    def _lowest_latency(self, src: str, dst: str, min_gbps: float) -> list[Hop] | None:
        """Dijkstra on (latency, hops, insertion order) over link directions >= ``min_gbps``."""
        best: dict[str, tuple[float, int]] = {src: (0.0, 0)}
        previous: dict[str, tuple[str, Link]] = {}
        order = itertools.count()
        heap = [(0.0, 0, next(order), src)]
        settled: set[str] = set()
        while heap:
            latency, hops, _, here = heapq.heappop(heap)
            if here in settled:
                continue
            settled.add(here)
            if here == dst:
                break
            if here != src and self.nodes[here].kind.is_memory:
                continue  # memories are ends, never carried through
            for there, link in self._adjacent[here]:
                bw = link.capacity(here)
                if there in settled or (bw is not None and bw.effective_gbps < min_gbps):
                    continue
                label = (latency + link.latency_s, hops + 1)
                if there not in best or label < best[there]:
                    best[there] = label
                    previous[there] = (here, link)
                    heapq.heappush(heap, (label[0], label[1], next(order), there))
        if dst not in settled:
            return None
        path: list[Hop] = []
        here = dst
        while here != src:
            before, link = previous[here]
            path.append(Hop(link, before, here))
            here = before
        return path[::-1]
