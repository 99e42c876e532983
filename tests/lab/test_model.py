"""The planner's view of a lab: which link bounds a restore, and the shares max-min fairness gives."""

from __future__ import annotations

import pytest

from kvstrata.lab.model import Bound, LabPaths, Restore, lab_topology, predict
from kvstrata.lab.spec import one_link, shared_uplink, tcp_efficiency, two_ports
from kvstrata.media import FetchPath
from kvstrata.plan.host import PathFit

MIB = 1 << 20
PATHS = LabPaths(transport=PathFit(0.002, 1.0), copy=PathFit(0.0, 8.0))  # 1 GB/s + 2 ms; copies at 8 GB/s
EFF = tcp_efficiency()


def test_a_link_below_the_memory_path_bounds_the_restore_at_its_payload_rate():
    (p,) = predict(one_link(2.5), PATHS, [Restore("inf", 256 * MIB, FetchPath.DIRECT)])
    assert p.bound is Bound.LINK and p.bottleneck.startswith("inf port 0")
    assert p.seconds == pytest.approx(0.002 + 256 * MIB / (2.5e9 / 8 * EFF), rel=1e-9)


def test_a_link_above_the_memory_path_leaves_the_memory_path_as_the_bound():
    (p,) = predict(one_link(40.0), PATHS, [Restore("inf", 256 * MIB, FetchPath.DIRECT)])
    assert p.bound is Bound.MEMORY
    assert p.seconds == pytest.approx(0.002 + 256 * MIB / 1e9, rel=1e-9)
    (unshaped,) = predict(one_link(None), PATHS, [Restore("inf", 256 * MIB, FetchPath.DIRECT)])
    assert unshaped.seconds == pytest.approx(p.seconds)


def test_a_staged_restore_adds_the_host_to_device_copy():
    direct, staged = predict(one_link(2.5), PATHS, [Restore("inf", 64 * MIB, FetchPath.DIRECT)]) + \
        predict(one_link(2.5), PATHS, [Restore("inf", 64 * MIB, FetchPath.STAGED)])
    assert staged.seconds - direct.seconds == pytest.approx(64 * MIB / 8e9, rel=1e-9)


def test_two_ports_double_a_link_bound_restore_only_when_it_reads_from_both():
    spec = two_ports(1.0)
    (one,) = predict(spec, PATHS, [Restore("inf", 256 * MIB, FetchPath.DIRECT, (0,))])
    (both,) = predict(spec, PATHS, [Restore("inf", 256 * MIB, FetchPath.DIRECT, (0, 1))])
    moved = lambda p: p.seconds - 0.002  # noqa: E731
    assert moved(one) / moved(both) == pytest.approx(2.0, rel=1e-9)
    # At a rate where two ports together outrun the memory path, the second port buys less.
    fast = two_ports(6.0)
    (one, both) = [predict(fast, PATHS, [Restore("inf", 256 * MIB, FetchPath.DIRECT, s)])[0] for s in ((0,), (0, 1))]
    assert one.bound is Bound.LINK and both.bound is Bound.MEMORY
    assert moved(one) / moved(both) == pytest.approx(1e9 / (6e9 / 8 * EFF), rel=1e-9)  # 1.34x, not 2x


def test_two_hosts_behind_one_uplink_each_get_half_while_both_restore():
    spec = shared_uplink(1.0)
    alone = predict(spec, PATHS, [Restore("inf0", 128 * MIB, FetchPath.DIRECT)])[0]
    together = predict(spec, PATHS, [Restore(h, 128 * MIB, FetchPath.DIRECT) for h in ("inf0", "inf1")])
    for p in together:
        assert p.bottleneck.startswith("uplink leaf-spine")
        assert (p.seconds - 0.002) == pytest.approx(2 * (alone.seconds - 0.002), rel=1e-9)


def test_the_topology_puts_the_pool_transport_and_every_port_on_the_graph():
    topo = lab_topology(two_ports(1.0), PATHS)
    assert {"pool.dram", "pool.cpu", "pool.p0", "pool.p1", "inf.p0", "inf.p1", "inf.device", "sw.rail0"} <= set(topo.nodes)
    route = topo.route("pool.dram", "inf.device", via=("pool.p1", "sw.rail1"))
    assert route.nodes == ("pool.dram", "pool.cpu", "pool.p1", "sw.rail1", "inf.p1", "inf.cpu", "inf.device")
