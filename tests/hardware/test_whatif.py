"""What-if upgrades: new profiles with NICs, PCIe generation or Socket Direct changed.

Devices keep their own limits: an H200 stays Gen5 in a Gen6 slot, a NIC stays in its slot.
"""

from __future__ import annotations

import pytest

from kvstrata.hardware.flows import estimate
from kvstrata.hardware.profile import ProfileError
from kvstrata.hardware.topology import LinkKind
from kvstrata.hardware.whatif import (
    Upgrade,
    apply_upgrades,
    describe,
    upgrade,
    with_nics,
    with_pcie_gen,
    with_socket_direct,
)

GEN5_X16 = 32 * 16 / 8 * 128 / 130
GEN6_X16 = 64 * 16 / 8


def _link(profile, x, y):
    (link,) = [l for l in profile.topology.links if {l.a, l.b} == {x, y}]
    return link


def _host_links(profile, nic):
    """The PCIe links between a NIC and the host (not its ports)."""
    return [l for l in profile.topology.links if nic in (l.a, l.b) and l.kind is LinkKind.PCIE]


def test_gen6_leaves_an_h200_at_gen5(h200):
    up = apply_upgrades(h200, "+gen6")
    gpu = _link(up, "sw0", "gpu0")
    assert gpu.label == "PCIe Gen5 x16"  # a Gen5 H200 in a Gen6 slot
    assert gpu.forward.spec_gbps == pytest.approx(GEN5_X16)
    assert _link(up, "cpu0", "sw0").forward.spec_gbps == GEN6_X16  # the switch uplink did move
    assert up.gpu("gpu0").slot.gen == 6


def test_gen6_leaves_cx7_nics_at_gen5(h200):
    up = apply_upgrades(h200, "+gen6")
    for nic in ("nic0", "pool.nic0"):
        (link,) = _host_links(up, nic)
        assert link.forward.spec_gbps == pytest.approx(GEN5_X16)


def test_gen6_on_an_h200_gives_a_lone_restore_nothing(h200):
    # The GPU's own Gen5 link caps it; the wider uplink only helps when GPUs share it.
    up = apply_upgrades(h200, "+gen6")
    before = estimate(h200.topology, h200.topology.route("cpu0.dram", "gpu0"), 10**9)
    after = estimate(up.topology, up.topology.route("cpu0.dram", "gpu0"), 10**9)
    assert after.gbps == pytest.approx(before.gbps)
    assert "sw0->gpu0" in after.bottleneck


def test_cx8_keeps_the_gen5_slot(h200):
    up = apply_upgrades(h200, "+cx8")
    assert {n.model for n in up.nics} == {"CX-8"}
    assert up.pool.nic_model == "CX-8"
    for nic in ("nic0", "nic7", "pool.nic0"):
        (link,) = _host_links(up, nic)
        assert link.forward.spec_gbps == pytest.approx(GEN5_X16)  # capped at ~63, not CX-8's Gen6 128
    port = _link(up, "nic0.p0", "fabric")
    assert port.forward.spec_gbps == 100


def test_cx8_in_a_gen6_slot_uses_gen6(b200):
    down = with_nics(b200, "CX-7")
    (link,) = _host_links(down, "nic0")
    assert link.forward.spec_gbps == pytest.approx(GEN5_X16)  # CX-7 stops at Gen5 in a Gen6 slot
    (link,) = _host_links(b200, "nic0")
    assert link.forward.spec_gbps == GEN6_X16


def test_cx8_ethernet_gives_every_nic_two_ports(b200):
    eth = apply_upgrades(b200, "+cx8-eth")
    t = eth.topology
    for nic in ("nic0", "nic7", "peer.nic0", "pool.nic0"):
        assert f"{nic}.p0" in t.nodes and f"{nic}.p1" in t.nodes
        assert f"{nic}.p2" not in t.nodes


def test_socket_direct_adds_a_link_to_the_other_socket(h200):
    up = with_socket_direct(h200)
    for n in up.nics:
        assert len(n.attach) == 2
        assert {up.socket_of(a) for a in n.attach} == {"cpu0", "cpu1"}
    assert up.pool.host_links == 2
    assert len(_host_links(up, "nic0")) == 2
    # Already two links: left as is.
    assert with_socket_direct(up).nics == up.nics


def test_cx8_plus_socket_direct_matches_the_socket_direct_profile(h200, socket_direct):
    up = apply_upgrades(h200, "+cx8+socket-direct")
    assert [(n.model, n.attach) for n in up.nics] == [(n.model, n.attach) for n in socket_direct.nics]
    for nic in ("nic0", "nic5", "pool.nic0"):
        mine = sorted(l.forward.effective_gbps for l in _host_links(up, nic))
        theirs = sorted(l.forward.effective_gbps for l in _host_links(socket_direct, nic))
        assert mine == pytest.approx(theirs)


def test_socket_direct_needs_two_sockets(workstation):
    with pytest.raises(ProfileError, match="two sockets"):
        apply_upgrades(workstation, "+socket-direct")


def test_upgrades_return_new_profiles(h200):
    up = apply_upgrades(h200, "+cx8+gen6")
    assert {n.model for n in h200.nics} == {"CX-7"}
    assert h200.switches[0].uplink.gen == 5
    assert up is not h200 and up.name.startswith("h200-cx7-gen5+")
    assert apply_upgrades(h200, "") is h200


def test_upgrade_order_does_not_matter_here(h200):
    a = apply_upgrades(h200, "+cx8+gen6")
    b = apply_upgrades(h200, "+gen6+cx8")
    assert (a.nics, a.gpus, a.switches, a.pool) == (b.nics, b.gpus, b.switches, b.pool)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("+cx8", Upgrade.CX8),
        ("CX8", Upgrade.CX8),
        (" +gen6 ", Upgrade.GEN6),
        ("socket-direct", Upgrade.SOCKET_DIRECT),
        ("+cx8-eth", Upgrade.CX8_ETH),
    ],
)
def test_upgrade_parse(text, expected):
    assert Upgrade.parse(text) is expected


@pytest.mark.parametrize("text", ["cx9", "+gen7", "", "+"])
def test_upgrade_parse_rejects_unknown(text):
    with pytest.raises(ProfileError, match="unknown upgrade") as info:
        Upgrade.parse(text)
    for u in Upgrade:
        assert f"+{u.value}" in str(info.value)


def test_apply_upgrades_rejects_unknown(h200):
    with pytest.raises(ProfileError, match="cx9"):
        apply_upgrades(h200, "+cx8+cx9")


def test_with_nics_rejects_unknown_model(h200):
    with pytest.raises(ValueError, match="unknown NIC model 'CX-9'"):
        with_nics(h200, "CX-9")


def test_upgrade_dispatch_matches_the_helpers(h200):
    assert upgrade(h200, Upgrade.GEN6).switches == with_pcie_gen(h200, 6).switches
    assert upgrade(h200, Upgrade.CX8).nics == with_nics(h200, "CX-8").nics


# --- an upgraded profile describes itself, not the profile it came from ------------------------


def test_an_upgraded_profile_is_described_by_its_own_devices(h200):
    up = apply_upgrades(h200, "+cx8+gen6")
    assert "CX-7" in h200.description and "CX-7" not in up.description
    assert up.description == (
        "8x H200-SXM on PCIe Gen5 x16, 8x CX-8 800G InfiniBand on PCIe Gen6 x16, 4x PCIe Gen6 switch, "
        "2x gen4-x4 NVMe, 2 sockets, pool: 8x CX-8 on PCIe Gen6 x16"
    )  # the H200s stay at Gen5 (their own limit), everything else moved
    assert up.description == describe(up)


def test_every_step_of_an_upgrade_is_described(h200):
    assert "8x CX-8 800G InfiniBand on PCIe Gen5 x16" in apply_upgrades(h200, "+cx8").description
    assert "4x PCIe Gen6 switch" in apply_upgrades(h200, "+gen6").description
    eth = apply_upgrades(h200, "+cx8-eth+socket-direct").description
    assert "8x CX-8-ETH 400G + 400G Ethernet on 2 x PCIe Gen5 x16 (Socket Direct)" in eth
    assert "pool: 8x CX-8-ETH on 2 x PCIe Gen5 x16 (Socket Direct)" in eth


def test_cx8_plus_socket_direct_is_described_as_the_socket_direct_profile(h200, socket_direct):
    assert apply_upgrades(h200, "+cx8+socket-direct").description == describe(socket_direct)


def test_a_profile_without_upgrades_keeps_its_written_description(h200):
    assert apply_upgrades(h200, "").description == h200.description != describe(h200)
