"""Restore time along each of the seed's paths (``RestorePlanner`` and ``make_plan``).

Expected values are worked out here from the seed's figures and the stated overhead models,
never read back from the code:

* PCIe Gen5 x16, one way: 32 GT/s x 16 lanes / 8 x 128/130 = 63.0 GB/s after encoding, times
  the TLP payload fraction 256 / (256 + 24) at MPS 256 (16 B header, 4 B framing, 4 B LCRC).
* PCIe Gen6 x16, one way: 64 GT/s x 16 / 8 = 128 GB/s raw, times the FLIT's 236/256 TLP bytes,
  times 256 / (256 + 16) (a FLIT-mode TLP keeps only its header).
* A ConnectX port: line rate / 8 x 4096 / (4096 + 26) (InfiniBand headers per 4 KiB MTU).
* llama-3-70b (bf16): 2 (K and V) x 80 layers x 8 KV heads x 128 x 2 bytes = 327,680 B/token.
"""

from __future__ import annotations

import pytest

from kvstrata.hardware.catalog import HOP_LATENCY_S, NVMES
from kvstrata.hardware.profile import load_profile
from kvstrata.hardware.whatif import apply_upgrades
from kvstrata.kv.presets import load_geometry
from kvstrata.plan.planner import make_plan
from kvstrata.plan.restore import RestorePath, RestorePlanner

GB = 1e9

GEN5_AFTER_ENCODING = 32 * 16 / 8 * 128 / 130  # ~63.0 GB/s, the seed's figure
TLP_PAYLOAD = 256 / (256 + 24)
GEN5_PAYLOAD = GEN5_AFTER_ENCODING * TLP_PAYLOAD  # ~57.6 GB/s
GEN6_PAYLOAD = 64 * 16 / 8 * 236 / 256 * 256 / (256 + 16)  # ~111.1 GB/s
IB_PAYLOAD = 4096 / (4096 + 26)
CX7_PORT = 400 / 8 * IB_PAYLOAD  # ~49.7 GB/s
CX8_PORT = 800 / 8 * IB_PAYLOAD  # ~99.4 GB/s
ETH_PAYLOAD = 4096 / (4096 + 82)  # RoCEv2 headers per 4 KiB MTU
BPT_70B = 2 * 80 * 8 * 128 * 2  # 327,680


@pytest.fixture(scope="module")
def llama70b():
    g = load_geometry("llama-3-70b")
    assert g.bytes_per_token == BPT_70B
    return g


# --- workstation: 1 GPU on Gen5 x16 straight off the CPU, no NIC ---------------------------


@pytest.mark.parametrize("tokens", [1, 1000, 32768, 131072])
def test_workstation_local_dram_restore_is_bytes_over_one_gen5_direction(llama70b, ws, tokens):
    plan = make_plan(llama70b, ws, tokens, gpus=1)
    local = plan.restore_for(RestorePath.LOCAL_DRAM)
    size = tokens * BPT_70B
    # One PCIe hop (DRAM -> root complex is an unconstrained attachment).
    expected = size / (GEN5_PAYLOAD * GB) + HOP_LATENCY_S["pcie"]
    assert local.available
    assert local.size_bytes == size
    assert len(local.stages) == 1
    assert local.seconds == pytest.approx(expected, rel=1e-9)
    assert "PCIe Gen5 x16" in local.bottleneck
    # One direction only: never the 126 GB/s both-ways total, nor even the 63 GB/s spec.
    assert local.gbps < GEN5_AFTER_ENCODING


def test_workstation_has_no_remote_paths_and_says_why(llama70b, ws):
    plan = make_plan(llama70b, ws, 4096, gpus=1)
    for path in (RestorePath.REMOTE_GDR, RestorePath.REMOTE_TWO_HOP):
        r = plan.restore_for(path)
        assert not r.available
        assert r.stages == ()
        assert "NIC" in r.unavailable and "pool" in r.unavailable
    handoff = RestorePlanner(ws, ["gpu0"]).restore(RestorePath.PD_HANDOFF, [4096 * BPT_70B])
    assert not handoff.available and "NIC" in handoff.unavailable


def test_workstation_nvme_restore_is_drive_read_then_pcie_copy_in_sequence(llama70b, ws):
    tokens = 32768
    size = tokens * BPT_70B
    plan = make_plan(llama70b, ws, tokens, gpus=1)
    nvme = plan.restore_for(RestorePath.NVME)
    drive = NVMES["gen4-x4"]  # datasheet 7.0 GB/s sequential read; its Gen4 x4 link carries ~7.2
    read_s = size / (7.0 * GB) + drive.read_latency_s + HOP_LATENCY_S["pcie"]
    copy_s = size / (GEN5_PAYLOAD * GB) + HOP_LATENCY_S["pcie"]
    assert [s.seconds for s in nvme.stages] == pytest.approx([read_s, copy_s], rel=1e-9)
    assert nvme.seconds == pytest.approx(read_s + copy_s, rel=1e-9)
    # The slower stage is the drive, and the bottleneck says so.
    assert "nvme0" in nvme.bottleneck
    assert "nvme0" in nvme.stages[0].bottleneck
    assert nvme.gbps == pytest.approx(size / (read_s + copy_s) / GB, rel=1e-9)
    assert nvme.seconds > plan.restore_for(RestorePath.LOCAL_DRAM).seconds


# --- h200-cx7-gen5: GDR, two hops, shared switches -----------------------------------------


def test_h200_single_gpu_gdr_is_capped_by_the_cx7_port(h200):
    size = 32768 * BPT_70B
    r = RestorePlanner(h200, ["gpu0"]).restore(RestorePath.REMOTE_GDR, [size])
    assert len(r.stages) == 1
    assert "CX-7 port" in r.bottleneck
    # 50 GB/s line rate less IB headers; the microseconds of hop latency are noise here.
    assert r.seconds == pytest.approx(size / (CX7_PORT * GB), rel=1e-3)
    assert r.seconds > size / (CX7_PORT * GB)


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
@pytest.mark.parametrize("upgrade", ["", "+cx8"])
def test_gdr_bottleneck_is_a_pcie_or_nic_link(llama70b, h200, gpus, upgrade):
    profile = apply_upgrades(h200, upgrade) if upgrade else h200
    gdr = make_plan(llama70b, profile, 16384, gpus=gpus).restore_for(RestorePath.REMOTE_GDR)
    assert gdr.available
    assert "PCIe" in gdr.bottleneck or "port" in gdr.bottleneck
    # With a CX-8 (~99 GB/s port) the Gen5 x16 PCIe link (~57.6) is the slowest segment.
    assert ("PCIe Gen5 x16" if upgrade else "CX-7 port") in gdr.bottleneck


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_a_restore_over_k_gpus_counts_the_links_that_bound_it_side_by_side(llama70b, h200, gpus):
    # Each H200 receives through its own CX-7 port: K ports at ~49.7 GB/s each, so the GB/s
    # shown is K ports' worth. From DRAM, two GPUs share each switch's Gen5 x16 uplink.
    plan = make_plan(llama70b, h200, 32768, gpus=gpus)
    gdr = plan.restore_for(RestorePath.REMOTE_GDR)
    assert gdr.bottlenecks == gpus
    assert gdr.gbps == pytest.approx(gpus * CX7_PORT, rel=1e-3)
    local = plan.restore_for(RestorePath.LOCAL_DRAM)
    assert local.bottlenecks == -(-gpus // 2)
    assert local.gbps == pytest.approx(-(-gpus // 2) * GEN5_PAYLOAD, rel=1e-3)


@pytest.mark.parametrize("name", ["h200-cx7-gen5", "b200-cx8-gen6", "gen5-cx8-socket-direct"])
@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_two_hop_is_never_faster_than_gdr_and_is_its_two_stages_in_sequence(llama70b, name, gpus):
    profile = load_profile(name)
    plan = make_plan(llama70b, profile, 32768, gpus=gpus)
    gdr = plan.restore_for(RestorePath.REMOTE_GDR)
    two_hop = plan.restore_for(RestorePath.REMOTE_TWO_HOP)
    local = plan.restore_for(RestorePath.LOCAL_DRAM)
    assert two_hop.seconds >= gdr.seconds
    assert len(two_hop.stages) == 2
    assert two_hop.seconds == pytest.approx(sum(s.seconds for s in two_hop.stages), rel=1e-12)
    # The second hop is exactly the local DRAM -> HBM copy of the same shards.
    assert two_hop.stages[1].seconds == pytest.approx(local.seconds, rel=1e-12)
    assert two_hop.size_bytes == gdr.size_bytes == local.size_bytes == 32768 * plan.geometry.bytes_per_token


def test_h200_single_gpu_two_hop_stages_from_first_principles(h200):
    size = 32768 * BPT_70B
    r = RestorePlanner(h200, ["gpu0"]).restore(RestorePath.REMOTE_TWO_HOP, [size])
    first, second = r.stages
    assert "CX-7 port" in first.bottleneck  # network -> host DRAM: the NIC port is slowest
    assert first.seconds == pytest.approx(size / (CX7_PORT * GB), rel=1e-3)
    assert "PCIe Gen5 x16" in second.bottleneck
    assert second.seconds == pytest.approx(size / (GEN5_PAYLOAD * GB), rel=1e-3)
    assert "CX-7 port" in r.bottleneck  # the slower of the two stages


def test_two_gpus_behind_one_switch_share_its_uplink_for_local_dram(h200):
    shard = 4096 * 81920  # 4096 tokens of llama-3-70b's per-GPU KV at TP 4; any equal shards do
    same = RestorePlanner(h200, ["gpu0", "gpu1"]).restore(RestorePath.LOCAL_DRAM, [shard, shard])
    apart = RestorePlanner(h200, ["gpu0", "gpu2"]).restore(RestorePath.LOCAL_DRAM, [shard, shard])
    # gpu0 and gpu1 both hang off sw0: the aggregate is one Gen5 x16 uplink, not two.
    assert same.gbps == pytest.approx(GEN5_PAYLOAD, rel=1e-3)
    assert "cpu0->sw0" in same.bottleneck
    # gpu0 (sw0) and gpu2 (sw1) each have their own uplink: twice the aggregate.
    assert apart.gbps == pytest.approx(2 * GEN5_PAYLOAD, rel=1e-3)
    assert apart.gbps > same.gbps * 1.9
    assert same.seconds == pytest.approx(2 * shard / (GEN5_PAYLOAD * GB), rel=1e-3)
    assert apart.seconds == pytest.approx(shard / (GEN5_PAYLOAD * GB), rel=1e-3)


def test_gdr_to_gpus_behind_one_switch_does_not_cross_the_uplink(h200):
    # Each GPU receives through the NIC beside it, so two GPUs on sw0 get two NIC ports' worth.
    shard = 4096 * 81920
    same = RestorePlanner(h200, ["gpu0", "gpu1"]).restore(RestorePath.REMOTE_GDR, [shard, shard])
    assert same.stages[0].gbps == pytest.approx(2 * CX7_PORT, rel=1e-3)
    assert "CX-7 port" in same.bottleneck


def test_each_gpu_restores_from_its_own_sockets_dram(h200):
    r = RestorePlanner(h200, ["gpu4"]).restore(RestorePath.LOCAL_DRAM, [10**9])
    assert r.stages[0].route.startswith("cpu1.dram")
    assert "socket" not in r.bottleneck.lower()  # no cross-socket hop on the way


def test_shards_split_unevenly_finish_with_the_largest(h200):
    small, big = 10**9, 3 * 10**9
    r = RestorePlanner(h200, ["gpu0", "gpu2"]).restore(RestorePath.LOCAL_DRAM, [small, big])
    assert r.size_bytes == small + big
    # Separate uplinks: the big shard alone on its link sets the time.
    assert r.seconds == pytest.approx(big / (GEN5_PAYLOAD * GB), rel=1e-3)


# --- NICs with two ports: the transfer must use both ----------------------------------------


def test_cx8_ethernet_uses_both_400g_ports(b200):
    size = 32768 * BPT_70B
    eth = apply_upgrades(b200, "+cx8-eth")
    r = RestorePlanner(eth, ["gpu0"]).restore(RestorePath.REMOTE_GDR, [size])
    two_ports = 2 * 400 / 8 * ETH_PAYLOAD  # ~98 GB/s: 100 one way is the SUM of two ports
    assert r.stages[0].gbps == pytest.approx(two_ports, rel=1e-3)
    assert r.stages[0].gbps > 400 / 8  # more than one port could carry


def test_b200_single_gpu_gdr_with_cx8_reaches_the_port_rate(b200):
    size = 32768 * BPT_70B
    r = RestorePlanner(b200, ["gpu0"]).restore(RestorePath.REMOTE_GDR, [size])
    # Gen6 NIC and GPU links (~111 GB/s payload) keep up; the 800G port (~99.4) is slowest.
    assert CX8_PORT < GEN6_PAYLOAD
    assert "CX-8 port" in r.bottleneck
    assert r.stages[0].gbps == pytest.approx(CX8_PORT, rel=1e-3)
