"""The topology graph: what profiles build, full-duplex links, routing rules and errors."""

from __future__ import annotations

import itertools

import pytest

from kvstrata.hardware.figures import Bandwidth, Basis
from kvstrata.hardware.flows import estimate
from kvstrata.hardware.topology import Link, LinkKind, Node, NodeKind, Topology

LOCAL = lambda nodes: [n for n in nodes if not n.name.startswith(("peer.", "pool."))]  # noqa: E731


def test_h200_server_shape(h200):
    t = h200.topology
    assert len(LOCAL(t.of_kind(NodeKind.HBM))) == 8
    assert len(LOCAL(t.of_kind(NodeKind.NIC))) == 8
    assert len(LOCAL(t.of_kind(NodeKind.SWITCH))) == 4
    assert len(LOCAL(t.of_kind(NodeKind.DRAM))) == 2
    assert len(LOCAL(t.of_kind(NodeKind.FLASH))) == 2
    # An identical peer server (the P/D handoff's other end) and a pool host with 8 NICs.
    assert len(t.of_kind(NodeKind.HBM)) == 16
    assert [n.name for n in t.of_kind(NodeKind.REMOTE_DRAM)] == ["pool.dram"]
    assert len([n for n in t.of_kind(NodeKind.NIC) if n.name.startswith("pool.")]) == 8
    assert len(t.of_kind(NodeKind.FABRIC)) == 1


def test_workstation_has_no_network(workstation):
    t = workstation.topology
    assert set(t.nodes) == {"cpu0", "cpu0.dram", "gpu0", "nvme0", "nvme0.ctrl"}
    assert not t.of_kind(NodeKind.FABRIC)
    assert not t.of_kind(NodeKind.NVSWITCH)  # one GPU: nothing to NVLink to


def test_memories_carry_capacity_and_numa_placement(h200):
    t = h200.topology
    assert t.node("gpu0").capacity_bytes == 141 * 10**9
    assert t.node("cpu0.dram").capacity_bytes == 1024 * 10**9
    assert t.node("gpu0").socket == "cpu0"  # sw0 hangs off cpu0
    assert t.node("gpu4").socket == "cpu1"  # sw2 hangs off cpu1
    assert t.node("nic5").socket == "cpu1"
    assert t.node("cpu1.dram").bandwidth.spec_gbps == pytest.approx(8 * 4800 * 8 / 1000)
    assert t.node("pool.dram").bandwidth.spec_gbps == pytest.approx(16 * 4800 * 8 / 1000)


@pytest.mark.parametrize("profile", ["h200-cx7-gen5", "b200-cx8-gen6", "gen5-cx8-socket-direct"])
def test_every_constraining_link_is_full_duplex(profiles, profile):
    t = profiles[profile].topology
    duplex = {LinkKind.PCIE, LinkKind.PCIE_UPLINK, LinkKind.NIC_PORT, LinkKind.SOCKET, LinkKind.NVLINK}
    for link in t.links:
        if link.kind in duplex:
            # One capacity per direction, each the one-way figure (never the both-ways sum).
            assert link.capacity(link.a) is link.forward
            assert link.capacity(link.b) is link.backward
            assert link.forward.spec_gbps == link.backward.spec_gbps
        elif link.kind is LinkKind.INTERNAL:
            assert link.forward is None and link.backward is None


def test_gpu_link_each_direction_is_63_not_126(h200):
    (link,) = [l for l in h200.topology.links if {l.a, l.b} == {"sw0", "gpu0"}]
    for end in (link.a, link.b):
        assert link.capacity(end).spec_gbps == pytest.approx(32 * 16 / 8 * 128 / 130)
    with pytest.raises(ValueError, match="not an end"):
        link.capacity("gpu1")


@pytest.mark.parametrize("profile", ["h200-cx7-gen5", "gen5-cx8-socket-direct", "workstation"])
def test_routes_never_carry_through_a_memory(profiles, profile):
    t = profiles[profile].topology
    memories = [n.name for n in t.nodes.values() if n.kind.is_memory]
    for src, dst in itertools.permutations(memories, 2):
        path = t.route(src, dst)
        assert path.nodes[0] == src and path.nodes[-1] == dst
        assert not any(t.node(n).kind.is_memory for n in path.nodes[1:-1]), path.describe()
        # Consecutive hops join up.
        for before, after in zip(path.hops, path.hops[1:]):
            assert before.dst == after.src


def test_route_via_pins_a_nic_and_a_port(b200):
    t = b200.topology
    path = t.route("pool.dram", "gpu0", via=("pool.nic3", "nic1"))
    assert "pool.nic3" in path.nodes and "nic1" in path.nodes
    assert "nic0" not in path.nodes


def test_staging_memory_can_be_pinned_with_via(h200):
    path = h200.topology.route("pool.dram", "gpu0", via=("cpu0.dram",))
    assert "cpu0.dram" in path.nodes[1:-1]


def test_local_restore_crosses_switch_and_gpu_link(h200):
    path = h200.topology.route("cpu0.dram", "gpu0")
    assert path.nodes == ("cpu0.dram", "cpu0", "sw0", "gpu0")
    assert [h.link.kind for h in path.hops] == [LinkKind.INTERNAL, LinkKind.PCIE_UPLINK, LinkKind.PCIE]


def test_gdr_route_crosses_both_nics_and_the_fabric(h200):
    path = h200.topology.route("pool.dram", "gpu0")
    assert path.nodes == (
        "pool.dram", "pool.cpu", "pool.nic0", "pool.nic0.p0", "fabric", "nic0.p0", "nic0", "sw0", "gpu0",
    )  # fmt: skip


def test_cross_socket_route_crosses_upi(h200):
    path = h200.topology.route("cpu1.dram", "gpu0")
    assert LinkKind.SOCKET in [h.link.kind for h in path.hops]
    assert path.latency_s > h200.topology.route("cpu0.dram", "gpu0").latency_s


def test_gpu_to_far_gpu_goes_over_nvlink(h200):
    path = h200.topology.route("gpu0", "gpu2")
    assert path.nodes == ("gpu0", "nvswitch", "gpu2")


def test_gpu_to_neighbour_gpu_goes_over_nvlink_too(h200):
    t = h200.topology
    near = estimate(t, t.route("gpu0", "gpu1"), 10**9)
    far = estimate(t, t.route("gpu0", "gpu2"), 10**9)
    assert "nvswitch" in t.route("gpu0", "gpu1").nodes
    assert near.gbps == far.gbps


def test_nvme_media_reads_and_writes_at_their_own_rates(h200):
    t = h200.topology
    read = estimate(t, t.route("nvme0", "gpu0"), 10**9)
    write = estimate(t, t.route("gpu0", "nvme0"), 10**9)
    assert read.gbps == 7.0 and "media" in read.bottleneck
    assert write.gbps == 6.0 and "media" in write.bottleneck
    assert read.latency_s >= 80e-6  # the drive's read latency is on its media hop


def test_path_latency_is_the_sum_of_its_hops(h200):
    path = h200.topology.route("pool.dram", "gpu0")
    assert path.latency_s == pytest.approx(sum(h.link.latency_s for h in path.hops))
    assert path.latency_s > 0


# --- building by hand -----------------------------------------------------------------------


def _bw(gbps: float) -> Bandwidth:
    return Bandwidth(gbps, Basis.MEASURED, "test")


def _tiny() -> Topology:
    t = Topology("tiny")
    for name, kind in [("m0", NodeKind.DRAM), ("r", NodeKind.ROOT), ("m1", NodeKind.HBM), ("lonely", NodeKind.HBM)]:
        t.add_node(Node(name, kind))
    t.add_link(Link("m0", "r", LinkKind.INTERNAL, None, None))
    t.add_link(Link("r", "m1", LinkKind.PCIE, _bw(10), _bw(5)))
    return t


def test_hand_built_topology_routes_each_direction_at_its_own_capacity():
    t = _tiny()
    there = t.route("m0", "m1")
    back = t.route("m1", "m0")
    assert [h.resource for h in there.hops] == ["m0->r", "r->m1"]
    assert there.hops[-1].bandwidth.spec_gbps == 10
    assert back.hops[0].bandwidth.spec_gbps == 5


def test_topology_errors_name_the_node():
    t = _tiny()
    with pytest.raises(ValueError, match="duplicate node name 'r'"):
        t.add_node(Node("r", NodeKind.ROOT))
    with pytest.raises(ValueError, match="unknown node 'ghost'"):
        t.add_link(Link("r", "ghost", LinkKind.PCIE, _bw(1), _bw(1)))
    with pytest.raises(ValueError, match="no node 'ghost'"):
        t.route("m0", "ghost")
    with pytest.raises(ValueError, match="no path from 'm0' to 'lonely'"):
        t.route("m0", "lonely")


def test_a_memory_between_two_nodes_is_not_a_through_route():
    t = Topology("memory-in-the-middle")
    for name, kind in [("a", NodeKind.HBM), ("r0", NodeKind.ROOT), ("mid", NodeKind.DRAM)]:
        t.add_node(Node(name, kind))
    for name, kind in [("r1", NodeKind.ROOT), ("b", NodeKind.HBM)]:
        t.add_node(Node(name, kind))
    for a, b in [("a", "r0"), ("r0", "mid"), ("mid", "r1"), ("r1", "b")]:
        t.add_link(Link(a, b, LinkKind.PCIE, _bw(1), _bw(1)))
    with pytest.raises(ValueError, match="no path"):
        t.route("a", "b")
    assert t.route("a", "b", via=("mid",)).nodes == ("a", "r0", "mid", "r1", "b")
