"""A hardware profile as frozen specs: one server's sockets, PCIe switches, GPUs, NICs and NVMe
drives, optionally a remote DRAM pool, and per-link efficiency overrides; validated on construction.

Parsed from TOML by :mod:`kvstrata.hardware.profile` (the loader edge); built into the graph the
planner and simulator use by :mod:`kvstrata.hardware.build`. Every error names the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from kvstrata.hardware.catalog import DramSpec, SocketLinkSpec, gpu_model, nic_model, nvme_model
from kvstrata.hardware.pcie import PcieLink
from kvstrata.hardware.topology import Topology


class ProfileError(ValueError):
    """A profile that cannot be built; the message names the field."""


@dataclass(frozen=True)
class Slot:
    """A PCIe slot (or switch port) a device sits in; the link runs at min(slot, device) gen."""

    gen: int
    lanes: int = 16

    def link_for(self, device_max: PcieLink) -> PcieLink:
        return PcieLink(min(self.gen, device_max.gen), min(self.lanes, device_max.lanes))


@dataclass(frozen=True)
class SocketSpec:
    name: str
    dram: DramSpec


@dataclass(frozen=True)
class SwitchSpec:
    name: str
    socket: str
    uplink: Slot


@dataclass(frozen=True)
class DeviceSpec:
    """A device of the catalog in this server: its name here and its catalog model."""

    name: str
    model: str


@dataclass(frozen=True)
class GpuSpec(DeviceSpec):
    attach: str
    slot: Slot


@dataclass(frozen=True)
class NicSpec(DeviceSpec):
    attach: tuple[str, ...]  # two entries = Socket Direct (a second x16 link via an aux card)
    slot: Slot


@dataclass(frozen=True)
class NvmeSpec(DeviceSpec):
    attach: str


@dataclass(frozen=True)
class PoolSpec:
    """A remote host whose DRAM is the shared KV pool, reached over the fabric."""

    nic_model: str
    nics: int
    slot: Slot
    dram: DramSpec
    host_links: int = 1  # 2 = Socket Direct: each pool NIC has two x16 links, counted together


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    sockets: tuple[SocketSpec, ...]
    socket_link: SocketLinkSpec
    switches: tuple[SwitchSpec, ...]
    gpus: tuple[GpuSpec, ...]
    nics: tuple[NicSpec, ...]
    nvmes: tuple[NvmeSpec, ...]
    pool: PoolSpec | None
    efficiency: tuple[tuple[str, float], ...] = ()  # (link kind, link name or node name, value)
    origin: str = "<built>"

    def __post_init__(self) -> None:
        _validate(self)

    @cached_property
    def topology(self) -> Topology:
        from kvstrata.hardware.build import build_topology  # build reads these specs: imported when first used

        return build_topology(self)

    def gpu(self, name: str) -> GpuSpec:
        for g in self.gpus:
            if g.name == name:
                return g
        raise ProfileError(f"profile {self.name!r} has no GPU {name!r}")

    def socket_of(self, attach: str) -> str:
        for s in self.switches:
            if s.name == attach:
                return s.socket
        return attach


def _validate(p: HardwareProfile) -> None:
    if not p.sockets:
        raise ProfileError("at least one [[socket]] is required")
    names: set[str] = set()
    for group, specs in (("socket", p.sockets), ("switch", p.switches), ("gpu", p.gpus), ("nic", p.nics), ("nvme", p.nvmes)):
        for s in specs:
            if s.name in names or s.name in ("fabric", "nvswitch") or s.name.startswith(("pool", "peer")):
                raise ProfileError(f"{group} name {s.name!r} is duplicated or reserved")
            names.add(s.name)
    socket_names = {s.name for s in p.sockets}
    attachable = socket_names | {s.name for s in p.switches}
    for s in p.switches:
        if s.socket not in socket_names:
            raise ProfileError(f"switch {s.name!r}: socket {s.socket!r} is not a [[socket]]")
    for group, devices, model_of in (("gpu", p.gpus, gpu_model), ("nvme", p.nvmes, nvme_model)):
        for d in devices:
            model_of(d.model)
            if d.attach not in attachable:
                raise ProfileError(f"{group} {d.name!r}: attach {d.attach!r} is not a socket or switch")
    for n in p.nics:
        nic_model(n.model)
        if not 1 <= len(n.attach) <= 2 or any(a not in attachable for a in n.attach):
            raise ProfileError(f"nic {n.name!r}: attach must name one or two sockets/switches, got {list(n.attach)}")
    if p.pool is not None:
        nic_model(p.pool.nic_model)
        if p.pool.host_links not in (1, 2):
            raise ProfileError(f"pool.host_links must be 1 or 2 (Socket Direct), got {p.pool.host_links!r}")
