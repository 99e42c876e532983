"""The seed's claims about restore paths, NICs, Socket Direct, shared switches and NUMA.

Each test is one claim of the seed (SEED-NOTES.md), run on a built-in profile (or a what-if
of one), with the expected value worked out here from the seed's figures.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest

from kvstrata.hardware.flows import estimate, flow_along, max_min_share, run_concurrently
from kvstrata.hardware.profile import builtin_text, parse_profile
from kvstrata.hardware.topology import LinkKind
from kvstrata.hardware.whatif import apply_upgrades, with_nics

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GEN5_X16 = 32 * 16 / 8 * 128 / 130  # ~63.0 one way
GEN5_PAYLOAD = GEN5_X16 * 256 / 280  # less TLP framing, header and LCRC
CX7 = 400 / 8  # 50 GB/s one way, line rate
CX8 = 800 / 8  # 100
IB = 4096 / (4096 + 26)  # InfiniBand payload per 4 KiB packet
ROCE = 4096 / (4096 + 82)  # RoCEv2 payload per 4 KiB packet
SIZE = 10 * 10**9  # a 10 GB restore: large enough that microsecond latencies don't matter


def _est(profile, src, dst, via=()):
    t = profile.topology
    return estimate(t, t.route(src, dst, via), SIZE)


def _together(profile, routes):
    """Max-min rates of concurrent flows, each given as (src, dst, via)."""
    t = profile.topology
    return [s.gbps for s in max_min_share([flow_along(t, t.route(s, d, v)) for s, d, v in routes])]


# --- the three restore paths ---------------------------------------------------------------


def test_gdr_is_bound_by_a_link_not_a_memory(h200):
    est = _est(h200, "pool.dram", "gpu0")
    assert "port" in est.bottleneck  # the CX-7 port: 50 GB/s line rate less IB headers
    assert est.gbps == pytest.approx(CX7 * IB)
    up = _est(apply_upgrades(h200, "+cx8"), "pool.dram", "gpu0")
    assert "PCIe" in up.bottleneck  # GDR keeps the NIC-to-GPU PCIe link


@pytest.mark.parametrize("profile", ["h200-cx7-gen5", "b200-cx8-gen6", "gen5-cx8-socket-direct"])
def test_two_hops_through_local_dram_are_never_faster_than_gdr(profiles, profile):
    p = profiles[profile]
    gdr = _est(p, "pool.dram", "gpu0")
    land = _est(p, "pool.dram", "cpu0.dram")  # RDMA into local DRAM ...
    copy = _est(p, "cpu0.dram", "gpu0")  # ... then a CUDA copy, after it
    assert land.seconds + copy.seconds > gdr.seconds
    # Same network hop, so the first hop alone already takes as long as the whole GDR transfer.
    assert land.gbps == pytest.approx(gdr.gbps)


# --- NIC upgrades ----------------------------------------------------------------------------


def test_cx8_into_one_gen5_gpu_gains_at_most_63_over_50(h200):
    # One GPU receiving over Gen5 x16: once the network doubles, that link is the bottleneck.
    before = _est(h200, "pool.dram", "gpu0")
    after = _est(apply_upgrades(h200, "+cx8"), "pool.dram", "gpu0")
    gain = before.seconds / after.seconds
    assert gain <= GEN5_X16 / CX7 + 1e-9  # 63 / 50 = 1.26 at spec
    assert gain == pytest.approx(GEN5_PAYLOAD / (CX7 * IB), rel=1e-4)  # ~1.16 after overheads (and latency)
    assert gain < 1.2


def test_cx8_over_cx7_on_a_gen6_b200_server_is_about_2x(b200):
    # The seed's "network was the bottleneck and both ends keep up": in b200-cx8-gen6 the pool
    # NIC and the target NIC sit on Gen6 x16 (~111 GB/s payload), the B200 receives over Gen6 x16
    # and both DRAMs read/write far faster; with CX-7 NICs (Gen5 x16, ~57.6 payload) the 50 GB/s
    # port is the slowest segment. So swapping the NICs is all that changes the bottleneck.
    cx7 = with_nics(b200, "CX-7")
    slow = _est(cx7, "pool.dram", "gpu0")
    fast = _est(b200, "pool.dram", "gpu0")
    assert "port" in slow.bottleneck and "port" in fast.bottleneck
    gain = slow.seconds / fast.seconds
    assert gain >= 1.9
    assert gain == pytest.approx(CX8 / CX7, rel=1e-3)


def test_cx8_over_cx7_for_gpus_on_separate_switches_on_gen5_stays_gen5_bound(h200):
    # Several GPUs, each restoring over its own NIC on its own switch: no shared link, but each
    # NIC and each GPU still has one Gen5 x16, so CX-8 cannot double any of them.
    routes = [("pool.dram", f"gpu{i}", (f"pool.nic{i}", f"nic{i}")) for i in (0, 2, 4, 6)]
    before = sum(_together(h200, routes))
    after = sum(_together(apply_upgrades(h200, "+cx8"), routes))
    assert after / before == pytest.approx(GEN5_PAYLOAD / (CX7 * IB), rel=1e-6)


def _b200_with_h200_gpus(b200):
    """The b200 server with Gen5-only GPUs: NICs and switches on Gen6, GPUs receive over Gen5."""
    return replace(b200, name="gen6-nics-gen5-gpus", gpus=tuple(replace(g, model="H200-SXM") for g in b200.gpus))


def test_gen6_nic_into_one_gen5_gpu_is_capped_by_the_gpu_link(b200):
    p = _b200_with_h200_gpus(b200)
    est = _est(p, "pool.dram", "gpu0")
    assert "sw0->gpu0" in est.bottleneck
    assert est.gbps == pytest.approx(GEN5_PAYLOAD)
    assert est.gbps < CX8 * IB  # the CX-8 could do more


def test_several_gen5_gpus_use_more_of_a_gen6_nic_unless_their_links_merge(b200, h200):
    # Seed: "several GPUs sharing the work can use more of the NIC, but only if their links do
    # not merge into a narrower shared link".
    two = [("pool.dram", g, ("pool.nic0", "nic0")) for g in ("gpu0", "gpu1")]
    split = sum(_together(_b200_with_h200_gpus(b200), two))  # nic0 -> sw0 is Gen6 x16
    assert split == pytest.approx(CX8 * IB)  # 2 x 57.6 > the 800G port: the NIC is used fully
    merged = sum(_together(apply_upgrades(h200, "+cx8"), two))  # nic0 -> sw0 is Gen5 x16
    assert merged == pytest.approx(GEN5_PAYLOAD)  # both GPUs squeeze through one Gen5 x16


# --- Ethernet CX-8: two 400G ports -----------------------------------------------------------


@pytest.fixture(scope="module")
def eth(b200):
    return with_nics(b200, "CX-8-ETH")


def test_one_ethernet_flow_uses_one_port(eth):
    default = _est(eth, "pool.dram", "gpu0")
    pinned = _est(eth, "pool.dram", "gpu0", via=("nic0.p0",))
    for est in (default, pinned):
        assert "nic0.p0" in est.path.nodes and "nic0.p1" not in est.path.nodes
        assert est.gbps == pytest.approx(CX7 * ROCE)  # ~49 GB/s: one 400G port, not 100
        assert est.gbps <= 50


def test_two_ethernet_flows_on_both_ports_get_about_100(eth):
    # gpu0 and gpu1 share nic0's Gen6 x16 host link (~111 GB/s payload): wide enough for both.
    rates = _together(eth, [
        ("pool.dram", "gpu0", ("pool.nic0.p0", "nic0.p0")),
        ("pool.dram", "gpu1", ("pool.nic0.p1", "nic0.p1")),
    ])  # fmt: skip
    assert rates == pytest.approx([CX7 * ROCE] * 2)
    assert sum(rates) == pytest.approx(2 * CX7 * ROCE)
    assert sum(rates) > 95


def test_ethernet_needs_both_ports_on_both_ends(eth):
    # Target ports spread, but the pool side left on its default port: its one 400G port caps both.
    rates = _together(eth, [("pool.dram", "gpu0", ("nic0.p0",)), ("pool.dram", "gpu1", ("nic0.p1",))])
    assert sum(rates) == pytest.approx(CX7 * ROCE)
    same_port = _together(eth, [("pool.dram", "gpu0", ("pool.nic0.p0", "nic0.p0"))] * 2)
    assert sum(same_port) == pytest.approx(CX7 * ROCE)


# --- Socket Direct ---------------------------------------------------------------------------


def _host_side_spec(profile, nic="nic0"):
    return sum(
        link.capacity(nic).spec_gbps
        for link in profile.topology.links
        if nic in (link.a, link.b) and link.kind is LinkKind.PCIE
    )


@pytest.mark.parametrize("spec", ["+cx8", "+cx8+socket-direct"])
def test_socket_direct_doubles_the_nic_host_side(h200, socket_direct, spec):
    one = _host_side_spec(apply_upgrades(h200, "+cx8"))
    assert one == pytest.approx(GEN5_X16)  # ~63 one way through a single Gen5 x16
    two = _host_side_spec(socket_direct if spec == "+cx8" else apply_upgrades(h200, spec))
    assert two == pytest.approx(2 * GEN5_X16)  # ~126 one way through two


def test_socket_direct_lets_two_sockets_gpus_pull_more_through_one_nic(h200, socket_direct):
    # gpu0 sits under cpu0 (sw0), gpu4 under cpu1 (sw2); both pull through nic0. With Socket
    # Direct each reaches nic0 over its own Gen5 x16; without it both squeeze through nic0->sw0.
    routes = [("pool.dram", "gpu0", ("pool.nic0", "nic0")), ("pool.dram", "gpu4", ("pool.nic0", "nic0"))]
    sd = sum(_together(socket_direct, routes))
    single = sum(_together(apply_upgrades(h200, "+cx8"), routes))
    assert single == pytest.approx(GEN5_PAYLOAD)
    assert sd == pytest.approx(min(CX8 * IB, 2 * GEN5_PAYLOAD))  # the 800G port is now the cap
    assert sd > single * 1.5


# --- shared PCIe switch uplinks ------------------------------------------------------------


def test_a_shared_switch_uplink_halves_two_restores(h200):
    alone = _est(h200, "cpu0.dram", "gpu0").gbps
    same_switch = _together(h200, [("cpu0.dram", "gpu0", ()), ("cpu0.dram", "gpu1", ())])
    assert same_switch == pytest.approx([alone / 2] * 2)
    t = h200.topology
    shares = max_min_share([flow_along(t, t.route("cpu0.dram", g)) for g in ("gpu0", "gpu1")])
    assert {s.bottleneck.key for s in shares} == {"cpu0->sw0"}


def test_gpus_on_different_switches_each_get_the_full_rate(h200):
    alone = _est(h200, "cpu0.dram", "gpu0").gbps
    assert _together(h200, [("cpu0.dram", "gpu0", ()), ("cpu0.dram", "gpu2", ())]) == pytest.approx([alone] * 2)


def test_shared_uplink_doubles_the_finish_time(h200):
    t = h200.topology
    flows = [flow_along(t, t.route("cpu0.dram", g), SIZE) for g in ("gpu0", "gpu1")]
    alone = estimate(t, flows[0].path, SIZE).seconds
    for done in run_concurrently(flows):
        assert done.finish_s == pytest.approx(2 * alone, rel=1e-4)


# --- NUMA ------------------------------------------------------------------------------------


def test_remote_socket_dram_is_slower_to_restore_from(h200):
    local = _est(h200, "cpu0.dram", "gpu0")
    remote = _est(h200, "cpu1.dram", "gpu0")
    assert remote.seconds > local.seconds
    # NOTE: in this model the difference is the 0.2 us UPI hop latency only; the rates are equal.
    assert remote.latency_s > local.latency_s


SOCKET0_GPUS = ("gpu0", "gpu1", "gpu2", "gpu3")


def test_four_gpus_pulling_from_the_other_socket_are_upi_bound(h200):
    local = sum(_together(h200, [("cpu0.dram", g, ()) for g in SOCKET0_GPUS]))
    remote = sum(_together(h200, [("cpu1.dram", g, ()) for g in SOCKET0_GPUS]))
    assert remote < local


def test_a_measured_upi_makes_cross_socket_restores_upi_bound(h200):
    # The mechanism works once UPI's effective rate is below what the GPUs can take.
    doc = tomllib.loads(builtin_text("h200-cx7-gen5"))
    doc["efficiency"] = {"socket": 0.5}
    p = parse_profile(doc)
    t = p.topology
    flows = [flow_along(t, t.route("cpu1.dram", g)) for g in SOCKET0_GPUS]
    shares = max_min_share(flows)
    upi = 4 * 16 * 20 / 8 * 64 / 80 * 0.5
    assert sum(s.gbps for s in shares) == pytest.approx(upi)
    assert {s.bottleneck.key for s in shares} == {"cpu1->cpu0"}
    local = sum(_together(p, [("cpu0.dram", g, ()) for g in SOCKET0_GPUS]))
    assert upi < local
