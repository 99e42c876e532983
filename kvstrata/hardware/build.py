"""Building a hardware profile's graph: its server, an identical peer on the same fabric (the
other end of a P/D handoff) and the pool, as a :class:`~kvstrata.hardware.topology.Topology` of
nodes and links with bandwidths from the catalog (and the profile's efficiency overrides).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from kvstrata.hardware.catalog import (
    HOP_LATENCY_S,
    gpu_model,
    nic_model,
    nvme_model,
)
from kvstrata.hardware.figures import Bandwidth
from kvstrata.hardware.pcie import PcieLink
from kvstrata.hardware.topology import Link, LinkKind, Node, NodeKind, Topology
from kvstrata.hardware.specs import HardwareProfile, ProfileError


@dataclass
class _Builder:
    profile: HardwareProfile
    topo: Topology
    overrides: dict[str, float] = field(default_factory=dict)
    used: set[str] = field(default_factory=set)

    def bw(self, bw: Bandwidth | None, *keys: str) -> Bandwidth | None:
        if bw is None:
            return None
        for key in keys:  # most specific first
            if key in self.overrides:
                self.used.add(key)
                return bw.with_efficiency(self.overrides[key], f"profile override efficiency.{key}")
        return bw

    def link(
        self, a: str, b: str, kind: LinkKind, fwd: Bandwidth | None, back: Bandwidth | None, latency: str | float, label: str
    ) -> None:
        # A link is named either way round; "pcie" also covers switch uplinks.
        family = ("pcie",) if kind is LinkKind.PCIE_UPLINK else ()
        keys = (f"{a}<->{b}", f"{b}<->{a}", kind.value) + family
        latency_s = HOP_LATENCY_S[latency] if isinstance(latency, str) else latency
        self.topo.add_link(Link(a, b, kind, self.bw(fwd, *keys), self.bw(back, *keys), latency_s, label))

    def memory(self, name: str, kind: NodeKind, capacity: int, bw: Bandwidth | None, socket: str | None) -> None:
        self.topo.add_node(Node(name, kind, capacity, self.bw(bw, name, kind.value), socket))

    def pcie(self, a: str, b: str, link: PcieLink, kind: LinkKind = LinkKind.PCIE) -> None:
        one_way = link.one_way()
        self.link(a, b, kind, one_way, one_way, "pcie", link.name)

    def nic_ports(self, nic: str, model_name: str) -> None:
        model = nic_model(model_name)
        for i in range(len(model.port_gbit)):
            port = f"{nic}.p{i}"
            self.topo.add_node(Node(port, NodeKind.PORT))
            self.link(nic, port, LinkKind.INTERNAL, None, None, "nic_port", "NIC to port")
            bw = model.port(i)
            self.link(port, "fabric", LinkKind.NIC_PORT, bw, bw, "network", f"{model.name} port {i} ({model.port_gbit[i]}G)")

    def server(self, prefix: str) -> None:
        p = self.profile
        n = lambda name: f"{prefix}{name}"  # noqa: E731
        for s in p.sockets:
            self.topo.add_node(Node(n(s.name), NodeKind.ROOT, socket=n(s.name)))
            self.memory(n(f"{s.name}.dram"), NodeKind.DRAM, int(s.dram.capacity_gb * 1e9), s.dram.bandwidth(), n(s.name))
            self.link(n(f"{s.name}.dram"), n(s.name), LinkKind.INTERNAL, None, None, "internal", "memory controller")
        for a, b in zip(p.sockets, p.sockets[1:]):
            bw = p.socket_link.one_way()
            self.link(n(a.name), n(b.name), LinkKind.SOCKET, bw, bw, "socket", "socket interconnect (UPI)")
        for s in p.switches:
            self.topo.add_node(Node(n(s.name), NodeKind.SWITCH, socket=n(s.socket)))
            self.pcie(n(s.socket), n(s.name), PcieLink(s.uplink.gen, s.uplink.lanes), LinkKind.PCIE_UPLINK)
        if len(p.gpus) > 1:
            self.topo.add_node(Node(n("nvswitch"), NodeKind.NVSWITCH))
        for g in p.gpus:
            model = gpu_model(g.model)
            self.memory(n(g.name), NodeKind.HBM, model.hbm_capacity_bytes, model.hbm(), n(p.socket_of(g.attach)))
            self.pcie(n(g.attach), n(g.name), g.slot.link_for(model.host_link))
            if len(p.gpus) > 1:
                nv = model.nvlink()
                self.link(n(g.name), n("nvswitch"), LinkKind.NVLINK, nv, nv, "nvlink", "NVLink")
        for c in p.nics:
            model = nic_model(c.model)
            self.topo.add_node(Node(n(c.name), NodeKind.NIC, socket=n(p.socket_of(c.attach[0]))))
            for a in c.attach:
                self.pcie(n(a), n(c.name), c.slot.link_for(model.host_link))
            self.nic_ports(n(c.name), c.model)
        for d in p.nvmes:
            model = nvme_model(d.model)
            flash, ctrl = n(d.name), n(f"{d.name}.ctrl")
            self.memory(flash, NodeKind.FLASH, int(model.capacity_tb * 1e12), None, n(p.socket_of(d.attach)))
            self.topo.add_node(Node(ctrl, NodeKind.DEVICE))
            self.link(flash, ctrl, LinkKind.NVME_MEDIA, model.read(), model.write(), model.read_latency_s, f"{model.name} media")
            self.pcie(n(d.attach), ctrl, model.link)

    def pool(self) -> None:
        pool = self.profile.pool
        if pool is None:
            return
        self.topo.add_node(Node("pool.cpu", NodeKind.ROOT, socket="pool.cpu"))
        self.memory("pool.dram", NodeKind.REMOTE_DRAM, int(pool.dram.capacity_gb * 1e9), pool.dram.bandwidth(), "pool.cpu")
        self.link("pool.dram", "pool.cpu", LinkKind.INTERNAL, None, None, "internal", "memory controller")
        model = nic_model(pool.nic_model)
        for i in range(pool.nics):
            nic = f"pool.nic{i}"
            self.topo.add_node(Node(nic, NodeKind.NIC, socket="pool.cpu"))
            link = pool.slot.link_for(model.host_link)
            # The pool is remote: its NICs' host side is counted as one aggregate link.
            one_way = link.one_way()
            if pool.host_links == 2:
                one_way = one_way.scaled(2, "Socket Direct: two x16 links")
            label = link.name if pool.host_links == 1 else f"2 x {link.name} (Socket Direct)"
            self.link("pool.cpu", nic, LinkKind.PCIE, one_way, one_way, "pcie", label)
            self.nic_ports(nic, pool.nic_model)


def build_topology(profile: HardwareProfile) -> Topology:
    """The local server, an identical peer server ("peer." names), the fabric and the pool."""
    topo = Topology(profile.name)
    builder = _Builder(profile, topo, dict(profile.efficiency))
    if profile.nics or profile.pool is not None:
        topo.add_node(Node("fabric", NodeKind.FABRIC))
    builder.server("")
    if profile.nics:
        builder.server("peer.")
    builder.pool()
    # A kind absent from this profile is fine (tables travel between profiles); a name is not.
    kinds = {k.value for k in LinkKind} | {k.value for k in NodeKind if k.is_memory}
    unused = sorted(set(builder.overrides) - builder.used - kinds)
    if unused:
        raise ProfileError(
            f"profile {profile.name!r}: efficiency.{unused[0]} matches no link (a<->b), memory or kind; "
            f"link kinds: {', '.join(k.value for k in LinkKind if k is not LinkKind.INTERNAL)}; "
            f"memory kinds: hbm, dram, remote dram"
        )
    return topo


# --- finding profiles -----------------------------------------------------------------------
