"""The device catalog: every figure with its basis and its public source.

Derived figures are computed from their parts (lane rates, line rates, channels x MT/s);
only vendor peaks and datasheet figures are typed in, each beside the public document it
comes from (vendor datasheets and user manuals, PCI-SIG and IBTA specifications). These are
the figures of the hardware table in the project's founding notes, checked against them in
tests/hardware/test_seed_claims.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from kvstrata.hardware.figures import Bandwidth, Basis, Figure, lookup, require_positive
from kvstrata.hardware.pcie import PCI_SIG, PcieLink

CX7_MANUAL = "NVIDIA ConnectX-7 adapter cards user manual"
CX8_MANUAL = "NVIDIA ConnectX-8 SuperNIC user manual"
IBTA = "IBTA InfiniBand Architecture Specification Vol. 1"


# --- NICs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class WireOverhead:
    """Bytes on the wire per RDMA packet besides payload (for the payload estimate).

    InfiniBand: LRH 8 + BTH 12 + ICRC 4 + VCRC 2 = 26 bytes per packet.
    RoCEv2: Ethernet 14 + FCS 4 + preamble/SFD 8 + inter-frame gap 12 + IPv4 20 + UDP 8
    + BTH 12 + ICRC 4 = 82 bytes per packet. MTU 4096 payload bytes for both.
    """

    header_bytes: int
    source: str  # the specifications that define the headers
    mtu_bytes: int = 4096

    @property
    def efficiency(self) -> Fraction:
        return Fraction(self.mtu_bytes, self.mtu_bytes + self.header_bytes)


INFINIBAND = WireOverhead(header_bytes=26, source=IBTA)
ROCE_V2 = WireOverhead(header_bytes=82, source=f"{IBTA}, RoCEv2 annex A17; IEEE 802.3")


@dataclass(frozen=True)
class NicModel:
    """A NIC: its ports (each with a line rate) and its default host link(s)."""

    name: str
    protocol: str  # "InfiniBand" or "Ethernet"
    port_gbit: tuple[int, ...]  # line rate of each port, Gb/s
    host_link: PcieLink  # default host link; Socket Direct adds a second one
    source: str
    basis: Basis = Basis.LINE_RATE  # of the whole-card figure; CX-8's 800G total is "nominal"

    @property
    def wire(self) -> WireOverhead:
        return INFINIBAND if self.protocol == "InfiniBand" else ROCE_V2

    def port(self, index: int) -> Bandwidth:
        """One port's one-way capacity: line rate / 8, minus packet headers."""
        gbit = self.port_gbit[index]
        return Bandwidth(
            spec_gbps=gbit / 8,
            basis=Basis.LINE_RATE,
            source=f"{self.name} port {index}: {gbit} Gb/s / 8; {self.source}",
            efficiency=float(self.wire.efficiency),
            efficiency_basis=(
                f"{self.protocol} payload {self.wire.mtu_bytes}/"
                f"{self.wire.mtu_bytes + self.wire.header_bytes} per packet ({self.wire.source})"
            ),
        )

    @property
    def one_way_gbps(self) -> float:
        """Whole card, one direction: the sum of its ports (needs traffic on every port)."""
        return sum(g / 8 for g in self.port_gbit)

    @property
    def both_ways_gbps(self) -> float:
        return 2 * self.one_way_gbps

    @property
    def total_gbit(self) -> int:
        return sum(self.port_gbit)


NICS: dict[str, NicModel] = {
    m.name: m
    for m in (
        NicModel(
            "CX-7", "InfiniBand", (400,), PcieLink(5, 16), f"{CX7_MANUAL}: one NDR 400 Gb/s InfiniBand port, PCIe Gen5 x16"
        ),
        NicModel(
            "CX-7-ETH", "Ethernet", (400,), PcieLink(5, 16), f"{CX7_MANUAL}: one 400GbE port (RoCEv2), PCIe Gen5 x16"
        ),
        NicModel(
            "CX-8",
            "InfiniBand",
            (800,),
            PcieLink(6, 16),
            f"{CX8_MANUAL}: C8180, one 800G XDR InfiniBand port, PCIe Gen6 x16",
            Basis.NOMINAL,
        ),
        NicModel(
            "CX-8-ETH",
            "Ethernet",
            (400, 400),
            PcieLink(6, 16),
            f"{CX8_MANUAL}: Ethernet 2 x 400GbE (the C8240's default), PCIe Gen6 x16",
            Basis.NOMINAL,
        ),
    )
}


def nic_model(name: str) -> NicModel:
    return lookup(NICS, name, "NIC model")


# --- GPUs and HBM ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuModel:
    """A GPU: HBM capacity and bandwidth (reads and writes share it), host link, compute."""

    name: str
    hbm_gb: float
    hbm_tbps: float
    host_link: PcieLink
    nvlink_gbps_one_way: float  # per GPU to the NVSwitch fabric, one direction
    bf16_dense_tflops: float
    source: str

    @property
    def hbm_capacity_bytes(self) -> int:
        return int(self.hbm_gb * 1e9)

    def hbm(self) -> Bandwidth:
        """All channels of one GPU, SHARED by reads and writes (not read + write each)."""
        return Bandwidth(
            spec_gbps=self.hbm_tbps * 1000,
            basis=Basis.NOMINAL,
            source=f"{self.name} HBM {self.hbm_tbps} TB/s peak, reads and writes share it; {self.source}",
        )

    def nvlink(self) -> Bandwidth:
        return Bandwidth(
            spec_gbps=self.nvlink_gbps_one_way,
            basis=Basis.NOMINAL,
            source=f"{self.name} NVLink {2 * self.nvlink_gbps_one_way:g} GB/s both ways, vendor datasheet",
        )


GPUS: dict[str, GpuModel] = {
    m.name: m
    for m in (
        GpuModel("H100-SXM", 80, 3.35, PcieLink(5, 16), 450, 989, "NVIDIA H100 SXM datasheet"),
        GpuModel("H100-PCIE", 80, 2.0, PcieLink(5, 16), 300, 756, "NVIDIA H100 PCIe datasheet"),
        GpuModel("H200-SXM", 141, 4.8, PcieLink(5, 16), 450, 989, "NVIDIA H200 Tensor Core GPU datasheet"),
        GpuModel("B200-SXM", 180, 8.0, PcieLink(6, 16), 900, 2250, "NVIDIA HGX B200 datasheet"),
    )
}


def gpu_model(name: str) -> GpuModel:
    return lookup(GPUS, name, "GPU model")


# --- Host DRAM and the socket interconnect ---------------------------------------------------


@dataclass(frozen=True)
class DramSpec:
    """DRAM of one socket: channels x MT/s x 8 bytes per transfer, shared by reads and writes."""

    channels: int
    mt_s: int
    capacity_gb: float

    def __post_init__(self) -> None:
        require_positive(self, "dram", "channels", "mt_s", "capacity_gb")

    @property
    def peak_gbps(self) -> float:
        return self.channels * self.mt_s * 8 / 1000

    def bandwidth(self) -> Bandwidth:
        return Bandwidth(
            spec_gbps=self.peak_gbps,
            basis=Basis.DERIVED,
            source=(f"{self.channels} channels x {self.mt_s} MT/s x 8 bytes, reads and writes share it; "
                    "JEDEC DDR4/DDR5 standards (64-bit channels)"),
        )


@dataclass(frozen=True)
class SocketLinkSpec:
    """Cross-socket interconnect (Intel UPI): links x GT/s x 20 lanes / 8 x 64/80 data bits."""

    links: int = 4
    gt_s: float = 16.0
    lanes: int = 20
    data_bits_per_flit: int = 64
    flit_bits: int = 80

    def __post_init__(self) -> None:
        require_positive(self, "socket_link", "links", "gt_s", "lanes")

    @property
    def one_way_gbps(self) -> float:
        return self.links * self.gt_s * self.lanes / 8 * self.data_bits_per_flit / self.flit_bits

    def one_way(self) -> Bandwidth:
        return Bandwidth(
            spec_gbps=self.one_way_gbps,
            basis=Basis.DERIVED,
            source=(
                f"UPI: {self.links} links x {self.gt_s:g} GT/s x {self.lanes} lanes / 8 x "
                f"{self.data_bits_per_flit}/{self.flit_bits} data bits per flit; Intel Xeon Scalable datasheets"
            ),
            efficiency=UPI_REMOTE_READ_EFFICIENCY,
            efficiency_basis=(
                f"measured elsewhere: remote-socket reads reach ~{UPI_MEASURED_REMOTE_READ_GBPS:g} of "
                f"{UPI_MEASURED_REMOTE_READ_GBPS / UPI_REMOTE_READ_EFFICIENCY:.1f} GB/s on a 2-link "
                "Xeon Platinum 8160 (coherence traffic shares the links); calibrate to replace"
            ),
        )


# The one measurement behind UPI's default efficiency: remote-socket reads on a Xeon Platinum
# 8160 pair (2 UPI links at 10.4 GT/s) reach about 34 GB/s of the link rate the same formula gives.
UPI_MEASURED_REMOTE_READ_GBPS = 34.0
UPI_REMOTE_READ_EFFICIENCY = UPI_MEASURED_REMOTE_READ_GBPS / SocketLinkSpec(links=2, gt_s=10.4).one_way_gbps


# --- NVMe -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class NvmeModel:
    """An NVMe SSD: datasheet sequential read/write, behind its own PCIe x4 link."""

    name: str
    read_gbps: float
    write_gbps: float
    capacity_tb: float
    link: PcieLink
    read_latency_s: float
    source: str

    def read(self) -> Bandwidth:
        return Bandwidth(self.read_gbps, Basis.VENDOR_TYPICAL, f"{self.name} sequential read; {self.source}")

    def write(self) -> Bandwidth:
        return Bandwidth(self.write_gbps, Basis.VENDOR_TYPICAL, f"{self.name} sequential write; {self.source}")


NVMES: dict[str, NvmeModel] = {
    m.name: m
    for m in (
        NvmeModel(
            "gen4-x4", 7.0, 6.0, 7.68, PcieLink(4, 4), 80e-6, "typical enterprise Gen4 x4 datasheets (e.g. Kioxia CM6, Samsung PM9A3)"
        ),
        NvmeModel(
            "gen5-x4", 14.0, 10.0, 7.68, PcieLink(5, 4), 60e-6, "typical enterprise Gen5 x4 datasheets (e.g. Micron 9550, Kioxia CM7)"
        ),
    )
}


def nvme_model(name: str) -> NvmeModel:
    return lookup(NVMES, name, "NVMe model")


# --- Per-hop latencies (stated assumptions; calibrate replaces them) --------------------------

HOP_LATENCY_S = {
    "pcie": 1e-6,  # one PCIe hop incl. switch traversal, order of a microsecond
    "socket": 0.2e-6,  # UPI crossing
    "nic_port": 1e-6,  # NIC processing per side
    "network": 2e-6,  # one switch hop in the fabric
    "nvlink": 1e-6,
    "internal": 0.0,
}


# --- The hardware table, as figures --------------------------------------------------------------


@dataclass(frozen=True)
class TableRow:
    """A row of ``kvstrata hardware links``: one resource, one way and both ways."""

    resource: str
    capacity: Figure | None
    one_way: Figure
    both_ways: Figure | None  # None for shared memories: reads and writes share one total
    duplex_rule: str
    efficiency: float
    effective_gbps: float
    cites: str  # the public document(s) the figures come from


def seed_table() -> list[TableRow]:
    """Every bandwidth of the hardware table (NICs, PCIe x16 by generation, HBM), computed."""
    rows: list[TableRow] = []

    def gbps(value: float, basis: Basis, source: str) -> Figure:
        return Figure(round(value, 3), "GB/s", basis, source)

    for key in ("CX-7", "CX-8", "CX-8-ETH"):
        nic = NICS[key]
        ports = " + ".join(f"{g}G" for g in nic.port_gbit)
        eff = float(nic.wire.efficiency)
        rule = "full duplex: each direction at once"
        if len(nic.port_gbit) > 1:
            rule += f"; {nic.one_way_gbps:g} one way needs all {len(nic.port_gbit)} ports used at once"
        rows.append(
            TableRow(
                f"{nic.name} ({nic.protocol}, {ports})",
                None,
                gbps(nic.one_way_gbps, nic.basis, nic.source),
                gbps(nic.both_ways_gbps, nic.basis, nic.source),
                rule,
                eff,
                nic.one_way_gbps * eff,
                nic.source,
            )
        )
    for gen in (3, 4, 5, 6):
        link = PcieLink(gen, 16)
        bw = link.one_way()
        rule = "full duplex: each direction separately; host->GPU uses one direction"
        if gen == 6:
            rule += "; payload lower than raw (FLIT, FEC)"
        rows.append(
            TableRow(
                link.name,
                None,
                gbps(link.spec_gbps, link.spec_basis, bw.source),
                gbps(link.both_ways_gbps, link.spec_basis, bw.source),
                rule,
                bw.efficiency,
                bw.effective_gbps,
                PCI_SIG,
            )
        )
    for key in ("H100-SXM", "H200-SXM", "B200-SXM"):
        gpu = GPUS[key]
        hbm = gpu.hbm()
        rows.append(
            TableRow(
                f"{gpu.name} HBM",
                Figure(gpu.hbm_gb, "GB", Basis.NOMINAL, gpu.source),
                gbps(hbm.spec_gbps, Basis.NOMINAL, hbm.source),
                None,
                "pure reads may use all of it; reads and writes share it (not as much again each way)",
                hbm.efficiency,
                hbm.effective_gbps,
                gpu.source,
            )
        )
    return rows
