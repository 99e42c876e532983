"""The device catalog and the seed's table: NICs, HBM, DRAM, UPI, NVMe, and their bases."""

from __future__ import annotations

from fractions import Fraction

import pytest

from kvstrata.hardware.catalog import (
    GPUS,
    INFINIBAND,
    NICS,
    ROCE_V2,
    DramSpec,
    SocketLinkSpec,
    gpu_model,
    nic_model,
    nvme_model,
    seed_table,
)
from kvstrata.hardware.figures import Bandwidth, Basis
from kvstrata.hardware.pcie import PcieLink

# --- NICs ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, one_way, both_ways",
    [("CX-7", 400 / 8, 2 * 400 / 8), ("CX-8", 800 / 8, 2 * 800 / 8), ("CX-8-ETH", 2 * 400 / 8, 2 * 2 * 400 / 8)],
)
def test_nic_one_way_and_both_ways_from_line_rate(name, one_way, both_ways):
    nic = nic_model(name)
    assert nic.one_way_gbps == one_way
    assert nic.both_ways_gbps == both_ways


def test_seed_nic_figures():
    assert (nic_model("CX-7").one_way_gbps, nic_model("CX-7").both_ways_gbps) == (50, 100)
    assert (nic_model("CX-8").one_way_gbps, nic_model("CX-8").both_ways_gbps) == (100, 200)


def test_cx8_ethernet_is_two_ports_of_50_each():
    nic = nic_model("CX-8-ETH")
    assert nic.port_gbit == (400, 400)
    assert [nic.port(i).spec_gbps for i in range(2)] == [50, 50]
    assert nic.total_gbit == 800
    assert nic.one_way_gbps == 100  # the sum of both ports, not one port


def test_cx8_infiniband_is_one_800g_port():
    nic = nic_model("CX-8")
    assert nic.port_gbit == (800,)
    assert nic.port(0).spec_gbps == 100


def test_nic_port_is_line_rate_less_packet_headers():
    ib = nic_model("CX-7").port(0)
    assert ib.basis is Basis.LINE_RATE
    # InfiniBand: LRH 8 + BTH 12 + ICRC 4 + VCRC 2 bytes per 4096-byte MTU packet.
    assert ib.efficiency == pytest.approx(4096 / (4096 + 8 + 12 + 4 + 2), rel=1e-12)
    # RoCEv2 carries Ethernet, IP and UDP framing as well: more per packet than IB.
    eth = nic_model("CX-8-ETH").port(0)
    assert eth.efficiency == pytest.approx(4096 / (4096 + 14 + 4 + 8 + 12 + 20 + 8 + 12 + 4), rel=1e-12)
    assert eth.effective_gbps < ib.effective_gbps < ib.spec_gbps


def test_wire_overheads_match_their_header_counts():
    assert INFINIBAND.efficiency == Fraction(4096, 4122)
    assert ROCE_V2.efficiency == Fraction(4096, 4178)
    assert nic_model("CX-8").wire is INFINIBAND
    assert nic_model("CX-8-ETH").wire is ROCE_V2


def test_nic_host_links():
    assert nic_model("CX-7").host_link == PcieLink(5, 16)  # CX-7 tops out at Gen5
    assert nic_model("CX-8").host_link == PcieLink(6, 16)  # seed: "CX-8 supports PCIe 6.0 x16"
    assert nic_model("CX-8-ETH").host_link == PcieLink(6, 16)


# --- GPUs and HBM ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, gb, tb_per_s", [("H200-SXM", 141, 4.8), ("B200-SXM", 180, 8.0), ("H100-SXM", 80, 3.35)]
)
def test_gpu_hbm_capacity_and_bandwidth(name, gb, tb_per_s):
    gpu = gpu_model(name)
    assert gpu.hbm_gb == gb
    assert gpu.hbm_capacity_bytes == gb * 10**9  # decimal GB, as in the seed's table
    hbm = gpu.hbm()
    assert hbm.spec_gbps == pytest.approx(tb_per_s * 1000, rel=1e-12)
    assert hbm.basis is Basis.NOMINAL
    assert hbm.efficiency == 1.0
    assert "share" in hbm.source  # reads and writes share it


def test_gpu_host_links():
    assert gpu_model("H200-SXM").host_link == PcieLink(5, 16)
    assert gpu_model("B200-SXM").host_link == PcieLink(6, 16)


def test_nvlink_is_one_direction_of_the_datasheet_total():
    nv = gpu_model("H200-SXM").nvlink()
    assert nv.spec_gbps == 450
    assert "900" in nv.source


# --- DRAM, UPI, NVMe -------------------------------------------------------------------------


@pytest.mark.parametrize("channels, mt_s", [(8, 4800), (12, 6400), (1, 3200), (16, 4800)])
def test_dram_is_channels_times_mt_s_times_8_bytes(channels, mt_s):
    dram = DramSpec(channels, mt_s, 512)
    assert dram.peak_gbps == pytest.approx(channels * mt_s * 1e6 * 8 / 1e9, rel=1e-12)
    bw = dram.bandwidth()
    assert bw.basis is Basis.DERIVED
    assert bw.spec_gbps == dram.peak_gbps


def test_ddr5_4800_8_channels_is_307_2_gbps():
    assert DramSpec(8, 4800, 1024).peak_gbps == pytest.approx(307.2)


@pytest.mark.parametrize(
    "field, args",
    [("channels", (-8, 4800, 1)), ("channels", (0, 4800, 1)), ("mt_s", (8, -1, 1)), ("capacity_gb", (8, 4800, 0))],
)
def test_dram_rejects_non_positive_fields_by_name(field, args):
    with pytest.raises(ValueError, match=f"dram {field}"):
        DramSpec(*args)


def test_upi_is_links_x_rate_x_lanes_over_8_times_data_bits():
    assert SocketLinkSpec().one_way_gbps == pytest.approx(4 * 16 * 20 / 8 * 64 / 80)
    assert SocketLinkSpec(links=6, gt_s=24).one_way_gbps == pytest.approx(6 * 24 * 20 / 8 * 64 / 80)
    with pytest.raises(ValueError, match="socket_link links"):
        SocketLinkSpec(links=0)


def test_nvme_figures_are_vendor_typical_behind_x4():
    drive = nvme_model("gen4-x4")
    assert drive.read().basis is Basis.VENDOR_TYPICAL
    assert drive.read().spec_gbps > drive.write().spec_gbps
    # The drive's media, not its link, limits it.
    assert drive.read().spec_gbps < drive.link.payload_gbps
    assert drive.link == PcieLink(4, 4)


@pytest.mark.parametrize(
    "lookup, kind, bad",
    [(nic_model, "NIC", "CX-9"), (gpu_model, "GPU", "A100"), (nvme_model, "NVMe", "gen7-x4")],
)
def test_unknown_models_are_rejected_by_name(lookup, kind, bad):
    with pytest.raises(ValueError, match=f"unknown {kind} model {bad!r}") as info:
        lookup(bad)
    assert "known:" in str(info.value)


# --- Bandwidth -------------------------------------------------------------------------------


def test_bandwidth_effective_is_spec_times_efficiency():
    bw = Bandwidth(100.0, Basis.LINE_RATE, "test", efficiency=0.9)
    assert bw.effective_gbps == pytest.approx(90.0)
    measured = bw.with_efficiency(0.5)
    assert measured.effective_gbps == pytest.approx(50.0)
    assert measured.efficiency_basis == "measured"
    double = bw.scaled(2, "two links")
    assert double.spec_gbps == 200.0 and double.efficiency == 0.9
    assert "two links" in double.source


@pytest.mark.parametrize("spec, eff", [(0.0, 1.0), (-1.0, 1.0), (10.0, 0.0), (10.0, 1.01)])
def test_bandwidth_rejects_impossible_values(spec, eff):
    with pytest.raises(ValueError):
        Bandwidth(spec, Basis.MEASURED, "test", efficiency=eff)


# --- The seed's table ------------------------------------------------------------------------


def _rows():
    return {row.resource.split(" (")[0].removesuffix(" HBM"): row for row in seed_table()}


def test_seed_table_has_every_row():
    rows = _rows()
    assert set(rows) == {
        "CX-7", "CX-8", "CX-8-ETH",
        "PCIe Gen3 x16", "PCIe Gen4 x16", "PCIe Gen5 x16", "PCIe Gen6 x16",
        "H100-SXM", "H200-SXM", "B200-SXM",
    }  # fmt: skip


@pytest.mark.parametrize(
    "row, one_way, both_ways",
    [
        ("CX-7", 50, 100),
        ("CX-8", 100, 200),
        ("CX-8-ETH", 100, 200),
        ("PCIe Gen4 x16", 31.5, 63),
        ("PCIe Gen5 x16", 63.0, 126),
        ("PCIe Gen6 x16", 128, 256),
    ],
)
def test_seed_table_one_way_and_both_ways(row, one_way, both_ways):
    r = _rows()[row]
    assert r.one_way.value == pytest.approx(one_way, abs=0.05)
    assert r.both_ways.value == pytest.approx(both_ways, abs=0.1)
    assert r.both_ways.value == pytest.approx(2 * r.one_way.value, abs=2e-3)  # each rounded to 3 places
    assert r.one_way.unit == "GB/s"
    assert r.capacity is None
    assert r.effective_gbps < r.one_way.value  # every link loses something to headers


@pytest.mark.parametrize("row, gb, gbps", [("H100-SXM", 80, 3350), ("H200-SXM", 141, 4800), ("B200-SXM", 180, 8000)])
def test_seed_table_hbm_rows_have_no_both_ways(row, gb, gbps):
    r = _rows()[row]
    assert r.both_ways is None  # reads and writes share one total
    assert r.capacity.value == gb and r.capacity.unit == "GB"
    assert r.one_way.value == pytest.approx(gbps)
    assert "share" in r.duplex_rule


@pytest.mark.parametrize(
    "row, basis",
    [
        ("CX-7", Basis.LINE_RATE),
        ("PCIe Gen4 x16", Basis.AFTER_ENCODING),
        ("PCIe Gen5 x16", Basis.AFTER_ENCODING),
        ("PCIe Gen6 x16", Basis.RAW),
        ("H200-SXM", Basis.NOMINAL),
        ("B200-SXM", Basis.NOMINAL),
        ("CX-8-ETH", Basis.NOMINAL),
    ],
)
def test_seed_table_bases(row, basis):
    assert _rows()[row].one_way.basis is basis


def test_seed_table_cx8_basis_is_whole_card_nominal():
    assert _rows()["CX-8"].one_way.basis is Basis.NOMINAL


def test_seed_table_ethernet_rule_says_both_ports():
    assert "2 ports" in _rows()["CX-8-ETH"].duplex_rule
    assert "payload lower" in _rows()["PCIe Gen6 x16"].duplex_rule
    assert "one direction" in _rows()["PCIe Gen5 x16"].duplex_rule


def test_every_catalog_figure_has_a_source():
    for row in seed_table():
        assert row.one_way.source
    for gpu in GPUS.values():
        assert gpu.source
    for nic in NICS.values():
        assert nic.source
