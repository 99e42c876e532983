"""PCIe link arithmetic: raw, after-encoding and payload bandwidth, per direction.

PCIe is full duplex: every figure here is ONE direction. A host-to-GPU copy uses one
direction only, so it is bounded by ``one_way``; ``both_ways_gbps`` is reported beside it
(vendors often quote it) and never used for a one-direction transfer.

Gen3-5 use 128b/130b line coding: Gen5 x16 = 32 Gb/s x 16 / 8 x 128/130 = 63.0 GB/s.
Gen6 uses PAM4 signalling with fixed 256-byte FLITs carrying FEC and CRC bytes; its
128 GB/s is the raw figure, and the FLIT and TLP overheads come off it for the payload.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from kvstrata.hardware.figures import Bandwidth, Basis, lookup

PCI_SIG = "PCI-SIG PCI Express Base Specification 3.0-6.0"
VALID_LANES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class TlpOverhead:
    """Per-packet overheads for the payload estimate (stated parameters, not measurements).

    Gen3-5 (non-FLIT): each TLP carries a 4-byte STP framing token (length and sequence
    number), a 16-byte header (4 DW, 64-bit address) and a 4-byte LCRC.
    Gen6 (FLIT mode): per-TLP framing and LCRC are gone (CRC and FEC live in the FLIT);
    the header stays. ACK and flow-control DLLPs are ignored, so the estimate is still an
    upper bound on what an application moves.
    """

    header_bytes: int = 16
    framing_bytes: int = 4
    lcrc_bytes: int = 4
    max_payload_bytes: int = 256  # MPS, the common setting on servers

    @property
    def per_tlp_overhead_bytes(self) -> int:
        return self.header_bytes + self.framing_bytes + self.lcrc_bytes

    @property
    def efficiency(self) -> Fraction:
        return Fraction(self.max_payload_bytes, self.max_payload_bytes + self.per_tlp_overhead_bytes)


@dataclass(frozen=True)
class FlitLayout:
    """PCIe 6.0 FLIT: 256 bytes = 236 TLP bytes + 6 DLP bytes + 8 CRC bytes + 6 FEC bytes."""

    flit_bytes: int = 256
    tlp_bytes: int = 236
    dlp_bytes: int = 6
    crc_bytes: int = 8
    fec_bytes: int = 6

    def __post_init__(self) -> None:
        parts = self.tlp_bytes + self.dlp_bytes + self.crc_bytes + self.fec_bytes
        if parts != self.flit_bytes:
            raise ValueError(f"FLIT parts sum to {parts} bytes, not flit_bytes={self.flit_bytes}")

    @property
    def payload_fraction(self) -> Fraction:
        return Fraction(self.tlp_bytes, self.flit_bytes)


@dataclass(frozen=True)
class PcieGeneration:
    gen: int
    lane_rate_gtps: int  # transfers per second per lane, one direction (1 bit per transfer NRZ;
    #                      Gen6 PAM4 carries 2 bits per symbol at 32 GBaud = 64 GT/s)
    encoding: Fraction  # line-code efficiency; 1 for Gen6 (FLIT overhead counted separately)
    encoding_name: str
    flit: FlitLayout | None = None

    def tlp_overhead(self) -> TlpOverhead:
        if self.flit is not None:
            return TlpOverhead(framing_bytes=0, lcrc_bytes=0)
        return TlpOverhead()


GENERATIONS: dict[int, PcieGeneration] = {
    3: PcieGeneration(3, 8, Fraction(128, 130), "128b/130b"),
    4: PcieGeneration(4, 16, Fraction(128, 130), "128b/130b"),
    5: PcieGeneration(5, 32, Fraction(128, 130), "128b/130b"),
    6: PcieGeneration(6, 64, Fraction(1), "PAM4 + 256-byte FLIT (FEC, CRC)", FlitLayout()),
}


def generation(gen: int) -> PcieGeneration:
    return lookup(GENERATIONS, gen, "PCIe generation")


@dataclass(frozen=True)
class PcieLink:
    """A PCIe link of one generation and width; every GB/s figure is one direction."""

    gen: int
    lanes: int

    def __post_init__(self) -> None:
        generation(self.gen)
        if self.lanes not in VALID_LANES:
            raise ValueError(f"PCIe lanes must be one of {VALID_LANES}, got {self.lanes!r}")

    @property
    def name(self) -> str:
        return f"PCIe Gen{self.gen} x{self.lanes}"

    @property
    def raw_gbps(self) -> float:
        """Lane rate x lanes / 8, before line coding or protocol overhead."""
        return generation(self.gen).lane_rate_gtps * self.lanes / 8

    @property
    def after_encoding_gbps(self) -> float:
        return self.raw_gbps * float(generation(self.gen).encoding)

    @property
    def payload_gbps(self) -> float:
        """After encoding, FLIT overhead (Gen6) and TLP overhead at the stated MPS."""
        g = generation(self.gen)
        fraction = g.tlp_overhead().efficiency
        if g.flit is not None:
            fraction *= g.flit.payload_fraction
        return self.after_encoding_gbps * float(fraction)

    @property
    def both_ways_gbps(self) -> float:
        """Both directions added: reported, never used for a one-direction transfer."""
        return 2 * self.spec_gbps

    @property
    def spec_basis(self) -> Basis:
        # Gen3-5 are quoted after encoding, Gen6 raw (FLIT overhead not taken off), as the
        # PCI-SIG's own summaries quote them.
        return Basis.RAW if generation(self.gen).flit is not None else Basis.AFTER_ENCODING

    @property
    def spec_gbps(self) -> float:
        return self.raw_gbps if self.spec_basis is Basis.RAW else self.after_encoding_gbps

    def one_way(self) -> Bandwidth:
        """One direction's capacity: the spec figure, with the payload fraction as efficiency."""
        g = generation(self.gen)
        o = g.tlp_overhead()
        tlp = f"{o.max_payload_bytes}/{o.max_payload_bytes + o.per_tlp_overhead_bytes}"
        if g.flit is not None:
            why = f"FLIT {g.flit.tlp_bytes}/{g.flit.flit_bytes} TLP bytes x TLP {tlp}"
        else:
            why = f"TLP payload {tlp} (MPS {o.max_payload_bytes}, {o.per_tlp_overhead_bytes} B overhead)"
        return Bandwidth(
            spec_gbps=self.spec_gbps,
            basis=self.spec_basis,
            source=f"{self.name}: {g.lane_rate_gtps} GT/s x {self.lanes} / 8 x {g.encoding_name}; {PCI_SIG}",
            efficiency=self.payload_gbps / self.spec_gbps,
            efficiency_basis=why,
        )
