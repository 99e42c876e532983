"""PCIe arithmetic against the seed's derivations: one direction, encoding, FLIT, lanes.

Expected values are computed here from the seed's own arithmetic (lane rate x lanes / 8 x
encoding), never copied from the code's output.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from kvstrata.hardware.figures import Basis
from kvstrata.hardware.pcie import FlitLayout, PcieLink, TlpOverhead, generation

# Seed: "32 Gb/s per lane x 16 lanes / 8 x 128/130 ~= 63.0 GB/s"; Gen4 is half the lane rate.
GEN5_X16 = 32 * 16 / 8 * 128 / 130
GEN4_X16 = 16 * 16 / 8 * 128 / 130
GEN3_X16 = 8 * 16 / 8 * 128 / 130
GEN6_X16_RAW = 64 * 16 / 8  # 128 GB/s raw: PAM4, no line code subtracted

# Stated overhead parameters (pcie.TlpOverhead / FlitLayout docstrings):
# Gen3-5 TLP = 4 B framing + 16 B header + 4 B LCRC around a 256 B payload;
# Gen6 FLIT = 236 TLP bytes of 256, and each TLP keeps only its 16 B header.
NON_FLIT_TLP = 256 / (256 + 4 + 16 + 4)
GEN6_PAYLOAD = GEN6_X16_RAW * 236 / 256 * 256 / (256 + 16)


def test_gen5_x16_is_63_gbps_one_way_126_both_ways():
    link = PcieLink(5, 16)
    assert link.spec_gbps == pytest.approx(GEN5_X16, rel=1e-12)
    assert round(link.spec_gbps, 1) == 63.0
    assert round(link.both_ways_gbps) == 126
    assert link.both_ways_gbps == pytest.approx(2 * GEN5_X16, rel=1e-12)
    assert link.raw_gbps == 64


def test_gen4_x16_is_half_of_gen5():
    link = PcieLink(4, 16)
    assert link.spec_gbps == pytest.approx(GEN4_X16, rel=1e-12)
    assert round(link.spec_gbps, 1) == 31.5
    assert round(link.both_ways_gbps) == 63
    assert link.spec_gbps == pytest.approx(PcieLink(5, 16).spec_gbps / 2, rel=1e-12)


def test_gen3_x16_is_half_of_gen4():
    link = PcieLink(3, 16)
    assert link.spec_gbps == pytest.approx(GEN3_X16, rel=1e-12)
    assert round(link.spec_gbps, 2) == 15.75
    assert link.both_ways_gbps == pytest.approx(2 * GEN3_X16, rel=1e-12)


def test_gen6_x16_is_128_raw_256_both_ways_payload_lower():
    link = PcieLink(6, 16)
    assert link.raw_gbps == GEN6_X16_RAW == 128
    assert link.spec_gbps == 128
    assert link.both_ways_gbps == 256
    assert link.payload_gbps < 128
    assert link.payload_gbps == pytest.approx(GEN6_PAYLOAD, rel=1e-12)


def test_gen6_payload_follows_from_flit_and_tlp_parameters():
    flit = FlitLayout()
    assert (flit.flit_bytes, flit.tlp_bytes) == (256, 236)
    assert flit.payload_fraction == Fraction(236, 256)
    tlp = generation(6).tlp_overhead()
    assert tlp.per_tlp_overhead_bytes == 16  # header only; framing and LCRC moved into the FLIT
    assert tlp.efficiency == Fraction(256, 272)
    assert PcieLink(6, 16).payload_gbps == pytest.approx(128 * 236 / 256 * 256 / 272, rel=1e-12)


@pytest.mark.parametrize("gen", [3, 4, 5])
def test_gen3_to_5_payload_subtracts_tlp_overhead_from_after_encoding(gen):
    link = PcieLink(gen, 16)
    assert generation(gen).tlp_overhead().per_tlp_overhead_bytes == 24
    assert link.payload_gbps == pytest.approx(link.after_encoding_gbps * NON_FLIT_TLP, rel=1e-12)
    assert link.payload_gbps < link.spec_gbps  # the seed: 63 GB/s is still not application throughput


@pytest.mark.parametrize(
    "gen, basis", [(3, Basis.AFTER_ENCODING), (4, Basis.AFTER_ENCODING), (5, Basis.AFTER_ENCODING), (6, Basis.RAW)]
)
def test_spec_basis_is_after_encoding_up_to_gen5_and_raw_for_gen6(gen, basis):
    link = PcieLink(gen, 16)
    assert link.spec_basis is basis
    assert link.one_way().basis is basis


@pytest.mark.parametrize("gen", [3, 4, 5, 6])
@pytest.mark.parametrize("lanes", [1, 2, 4, 8, 16])
def test_bandwidth_scales_linearly_with_lanes(gen, lanes):
    x16, link = PcieLink(gen, 16), PcieLink(gen, lanes)
    assert link.spec_gbps == pytest.approx(x16.spec_gbps * lanes / 16, rel=1e-12)
    assert link.payload_gbps == pytest.approx(x16.payload_gbps * lanes / 16, rel=1e-12)
    assert link.both_ways_gbps == pytest.approx(2 * link.spec_gbps, rel=1e-12)


@pytest.mark.parametrize("gen", [3, 4, 5, 6])
def test_one_way_bandwidth_is_spec_with_payload_efficiency(gen):
    link = PcieLink(gen, 16)
    bw = link.one_way()
    assert bw.spec_gbps == link.spec_gbps  # one direction, never the both-ways total
    assert bw.spec_gbps < link.both_ways_gbps
    assert bw.effective_gbps == pytest.approx(link.payload_gbps, rel=1e-12)
    assert 0 < bw.efficiency < 1
    assert f"Gen{gen} x16" in bw.source


def test_tlp_overhead_efficiency_follows_its_parameters():
    assert TlpOverhead().efficiency == Fraction(256, 280)
    assert TlpOverhead(max_payload_bytes=128).efficiency == Fraction(128, 152)


def test_flit_layout_rejects_parts_that_do_not_sum():
    with pytest.raises(ValueError, match="FLIT parts"):
        FlitLayout(tlp_bytes=240)


@pytest.mark.parametrize("gen", [0, 1, 2, 7])
def test_unknown_generation_is_rejected_by_name(gen):
    with pytest.raises(ValueError, match="PCIe gen"):
        PcieLink(gen, 16)


@pytest.mark.parametrize("lanes", [0, 3, 5, 32])
def test_invalid_lane_count_is_rejected_by_name(lanes):
    with pytest.raises(ValueError, match="PCIe lanes"):
        PcieLink(5, lanes)


def test_link_name_states_generation_and_width():
    assert PcieLink(5, 8).name == "PCIe Gen5 x8"
