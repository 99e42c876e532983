"""A topology: memories and switching points joined by links with per-direction capacity.

Memories (HBM per GPU, DRAM per socket, an SSD's flash, a remote pool's DRAM) are the ends of
every path and never carried through: a path only transits root complexes, PCIe switches,
NICs and ports, the fabric, and the NVLink switch. A memory's bandwidth is one total shared
by its reads and writes; a full-duplex link has one capacity per direction.
"""

from __future__ import annotations

import enum
from collections import deque
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

    def describe(self) -> str:
        return " -> ".join(self.nodes)


@dataclass
class Topology:
    """A graph of nodes and links. Built once by the profile builder, then read-only."""

    name: str
    nodes: dict[str, Node] = field(default_factory=dict)
    links: list[Link] = field(default_factory=list)
    _adjacent: dict[str, list[tuple[str, Link]]] = field(default_factory=dict, repr=False)

    def add_node(self, node: Node) -> Node:
        if node.name in self.nodes:
            raise ValueError(f"duplicate node name {node.name!r} in topology {self.name!r}")
        self.nodes[node.name] = node
        self._adjacent[node.name] = []
        return node

    def add_link(self, link: Link) -> Link:
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

    def neighbours(self, name: str) -> list[tuple[str, Link]]:
        return list(self._adjacent[self.node(name).name])

    def route(self, src: str, dst: str, via: tuple[str, ...] = ()) -> Path:
        """The fewest-hop path from ``src`` to ``dst`` through ``via`` in order.

        Memories are never transited. Ties go to the neighbour added first, so routes are
        deterministic; pass ``via`` to pin a NIC, a port or a staging memory.
        """
        stops = (src,) + tuple(via) + (dst,)
        hops: list[Hop] = []
        for a, b in zip(stops, stops[1:]):
            hops.extend(self._shortest(a, b))
        return Path(src, dst, tuple(hops))

    def _shortest(self, src: str, dst: str) -> list[Hop]:
        self.node(src), self.node(dst)
        previous: dict[str, tuple[str, Link]] = {}
        seen = {src}
        queue = deque([src])
        while queue:
            here = queue.popleft()
            if here == dst:
                break
            if here != src and self.nodes[here].kind.is_memory:
                continue  # memories are ends, never carried through
            for there, link in self._adjacent[here]:
                if there not in seen:
                    seen.add(there)
                    previous[there] = (here, link)
                    queue.append(there)
        if dst not in seen:
            raise ValueError(f"no path from {src!r} to {dst!r} in topology {self.name!r}")
        hops: list[Hop] = []
        here = dst
        while here != src:
            before, link = previous[here]
            hops.append(Hop(link, before, here))
            here = before
        return hops[::-1]
