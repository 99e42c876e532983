"""Hardware profiles: a server (and the cluster around it) described in TOML, built into a Topology.

This is the loader edge: it reads TOML and validates it into frozen specs; ``build_topology``
turns a spec into the graph the planner and simulator use. Every error names the field.

A profile describes one server (sockets with DRAM, PCIe switches, GPUs, NICs, NVMe drives),
optionally a remote DRAM pool host, and per-link efficiency overrides. The builder adds an
identical peer server on the same fabric (the other end of a P/D handoff).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from pathlib import Path as FsPath
from typing import Any

from kvstrata.hardware.catalog import (
    HOP_LATENCY_S,
    DramSpec,
    GpuModel,
    NicModel,
    SocketLinkSpec,
    gpu_model,
    nic_model,
    nvme_model,
)
from kvstrata.hardware.figures import Bandwidth
from kvstrata.hardware.pcie import PcieLink
from kvstrata.hardware.topology import Link, LinkKind, Node, NodeKind, Topology

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


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


# --- parsing (the edge) -------------------------------------------------------------------


def _get(table: dict[str, Any], key: str, where: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if key not in table:
        if default is ...:
            raise ProfileError(f"{where}.{key} is missing")
        return default
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ProfileError(f"{where}.{key} must be {_kind_name(kind)}, got {value!r}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({int: "an integer", float: "a number", str: "a string", dict: "a table", list: "a list"}[k] for k in kinds)


def _positive(value: float, where: str) -> float:
    if not value > 0:
        raise ProfileError(f"{where} must be positive, got {value!r}")
    return value


def _fraction(value: float, where: str) -> float:
    if not 0 < value <= 1:
        raise ProfileError(f"{where} must be positive and at most 1 (a fraction of the spec), got {value!r}")
    return float(value)


def _slot(table: dict[str, Any], where: str, default: Slot | None = None) -> Slot:
    if "link" not in table:
        if default is None:
            raise ProfileError(f"{where}.link is missing")
        return default
    link = _get(table, "link", where, dict)
    try:
        slot = Slot(_get(link, "gen", f"{where}.link", int), _get(link, "lanes", f"{where}.link", int, 16))
        PcieLink(slot.gen, slot.lanes)
    except ValueError as exc:
        raise ProfileError(f"{where}.link: {exc}") from None
    return slot


def _model_and_slot(
    table: dict[str, Any], where: str, model_of: Callable[[str], GpuModel | NicModel]
) -> tuple[str, Slot]:
    """A PCIe device's catalog model name and its slot; the slot defaults to x16 at the model's gen."""
    model = _get(table, "model", where, str)
    try:
        default = Slot(model_of(model).host_link.gen, 16)
    except ValueError as exc:
        raise ProfileError(f"{where}.model: {exc}") from None
    return model, _slot(table, where, default)


def _dram(table: dict[str, Any], where: str) -> DramSpec:
    d = _get(table, "dram", where, dict)
    w = f"{where}.dram"
    return DramSpec(
        _positive(_get(d, "channels", w, int), f"{w}.channels"),
        _positive(_get(d, "mt_s", w, int), f"{w}.mt_s"),
        _positive(_get(d, "capacity_gb", w, (int, float)), f"{w}.capacity_gb"),
    )


def parse_profile(data: dict[str, Any], origin: str = "<dict>") -> HardwareProfile:
    """Validate a parsed TOML document into a HardwareProfile."""
    name = _get(data, "name", "profile", str)
    where = f"profile {name!r}"

    def items(key: str) -> list[dict[str, Any]]:
        value = data.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise ProfileError(f"{where}: [[{key}]] must be an array of tables")
        return value

    sockets = tuple(
        SocketSpec(_get(t, "name", f"socket[{i}]", str), _dram(t, f"socket[{i}]")) for i, t in enumerate(items("socket"))
    )
    sl = _get(data, "socket_link", where, dict, {})
    socket_link = SocketLinkSpec(
        _positive(_get(sl, "links", "socket_link", int, 4), "socket_link.links"),
        _positive(_get(sl, "gt_s", "socket_link", (int, float), 16.0), "socket_link.gt_s"),
    )
    switches = tuple(
        SwitchSpec(
            _get(t, "name", f"switch[{i}]", str),
            _get(t, "socket", f"switch[{i}]", str),
            _slot({"link": _get(t, "uplink", f"switch[{i}]", dict)}, f"switch[{i}].uplink"),
        )
        for i, t in enumerate(items("switch"))
    )
    gpus = []
    for i, t in enumerate(items("gpu")):
        w = f"gpu[{i}]"
        model, slot = _model_and_slot(t, w, gpu_model)
        gpus.append(GpuSpec(_get(t, "name", w, str), model, _get(t, "attach", w, str), slot))
    nics = []
    for i, t in enumerate(items("nic")):
        w = f"nic[{i}]"
        model, slot = _model_and_slot(t, w, nic_model)
        attach = _get(t, "attach", w, (str, list))
        attach = (attach,) if isinstance(attach, str) else tuple(attach)
        nics.append(NicSpec(_get(t, "name", w, str), model, attach, slot))
    nvmes = []
    for i, t in enumerate(items("nvme")):
        w = f"nvme[{i}]"
        nvmes.append(NvmeSpec(_get(t, "name", w, str), _get(t, "model", w, str), _get(t, "attach", w, str)))
    pool = None
    if "pool" in data:
        p = _get(data, "pool", where, dict)
        pool = PoolSpec(
            _get(p, "nic", "pool", str),
            _positive(_get(p, "nics", "pool", int, 1), "pool.nics"),
            _slot(p, "pool", Slot(5, 16)),
            _dram(p, "pool"),
            _get(p, "host_links", "pool", int, 1),
        )
    eff_table = _get(data, "efficiency", where, dict, {})
    efficiency = tuple((k, _fraction(_get(eff_table, k, "efficiency", (int, float)), f"efficiency.{k}")) for k in eff_table)
    try:
        profile = HardwareProfile(
            name=name,
            description=_get(data, "description", where, str, ""),
            sockets=sockets,
            socket_link=socket_link,
            switches=switches,
            gpus=tuple(gpus),
            nics=tuple(nics),
            nvmes=tuple(nvmes),
            pool=pool,
            efficiency=efficiency,
            origin=origin,
        )
        _ = profile.topology  # build now (and keep it), so every error surfaces at load time
    except ProfileError:
        raise
    except ValueError as exc:
        raise ProfileError(f"{where} ({origin}): {exc}") from None
    return profile


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


# --- building the graph ---------------------------------------------------------------------


@dataclass
class _Builder:
    profile: HardwareProfile
    topo: Topology
    overrides: dict[str, float] = field(default_factory=dict)
    used: set[str] = field(default_factory=set)

    def bw(self, bw: Bandwidth | None, *keys: str) -> Bandwidth | None:
        if bw is None:
            return None
        for key in keys:  # most specific first
            if key in self.overrides:
                self.used.add(key)
                return bw.with_efficiency(self.overrides[key], f"profile override efficiency.{key}")
        return bw

    def link(
        self, a: str, b: str, kind: LinkKind, fwd: Bandwidth | None, back: Bandwidth | None, latency: str | float, label: str
    ) -> None:
        # A link is named either way round; "pcie" also covers switch uplinks.
        family = ("pcie",) if kind is LinkKind.PCIE_UPLINK else ()
        keys = (f"{a}<->{b}", f"{b}<->{a}", kind.value) + family
        latency_s = HOP_LATENCY_S[latency] if isinstance(latency, str) else latency
        self.topo.add_link(Link(a, b, kind, self.bw(fwd, *keys), self.bw(back, *keys), latency_s, label))

    def memory(self, name: str, kind: NodeKind, capacity: int, bw: Bandwidth | None, socket: str | None) -> None:
        self.topo.add_node(Node(name, kind, capacity, self.bw(bw, name, kind.value), socket))

    def pcie(self, a: str, b: str, link: PcieLink, kind: LinkKind = LinkKind.PCIE) -> None:
        one_way = link.one_way()
        self.link(a, b, kind, one_way, one_way, "pcie", link.name)

    def nic_ports(self, nic: str, model_name: str) -> None:
        model = nic_model(model_name)
        for i in range(len(model.port_gbit)):
            port = f"{nic}.p{i}"
            self.topo.add_node(Node(port, NodeKind.PORT))
            self.link(nic, port, LinkKind.INTERNAL, None, None, "nic_port", "NIC to port")
            bw = model.port(i)
            self.link(port, "fabric", LinkKind.NIC_PORT, bw, bw, "network", f"{model.name} port {i} ({model.port_gbit[i]}G)")

    def server(self, prefix: str) -> None:
        p = self.profile
        n = lambda name: f"{prefix}{name}"  # noqa: E731
        for s in p.sockets:
            self.topo.add_node(Node(n(s.name), NodeKind.ROOT, socket=n(s.name)))
            self.memory(n(f"{s.name}.dram"), NodeKind.DRAM, int(s.dram.capacity_gb * 1e9), s.dram.bandwidth(), n(s.name))
            self.link(n(f"{s.name}.dram"), n(s.name), LinkKind.INTERNAL, None, None, "internal", "memory controller")
        for a, b in zip(p.sockets, p.sockets[1:]):
            bw = p.socket_link.one_way()
            self.link(n(a.name), n(b.name), LinkKind.SOCKET, bw, bw, "socket", "socket interconnect (UPI)")
        for s in p.switches:
            self.topo.add_node(Node(n(s.name), NodeKind.SWITCH, socket=n(s.socket)))
            self.pcie(n(s.socket), n(s.name), PcieLink(s.uplink.gen, s.uplink.lanes), LinkKind.PCIE_UPLINK)
        if len(p.gpus) > 1:
            self.topo.add_node(Node(n("nvswitch"), NodeKind.NVSWITCH))
        for g in p.gpus:
            model = gpu_model(g.model)
            self.memory(n(g.name), NodeKind.HBM, model.hbm_capacity_bytes, model.hbm(), n(p.socket_of(g.attach)))
            self.pcie(n(g.attach), n(g.name), g.slot.link_for(model.host_link))
            if len(p.gpus) > 1:
                nv = model.nvlink()
                self.link(n(g.name), n("nvswitch"), LinkKind.NVLINK, nv, nv, "nvlink", "NVLink")
        for c in p.nics:
            model = nic_model(c.model)
            self.topo.add_node(Node(n(c.name), NodeKind.NIC, socket=n(p.socket_of(c.attach[0]))))
            for a in c.attach:
                self.pcie(n(a), n(c.name), c.slot.link_for(model.host_link))
            self.nic_ports(n(c.name), c.model)
        for d in p.nvmes:
            model = nvme_model(d.model)
            flash, ctrl = n(d.name), n(f"{d.name}.ctrl")
            self.memory(flash, NodeKind.FLASH, int(model.capacity_tb * 1e12), None, n(p.socket_of(d.attach)))
            self.topo.add_node(Node(ctrl, NodeKind.DEVICE))
            self.link(flash, ctrl, LinkKind.NVME_MEDIA, model.read(), model.write(), model.read_latency_s, f"{model.name} media")
            self.pcie(n(d.attach), ctrl, model.link)

    def pool(self) -> None:
        pool = self.profile.pool
        if pool is None:
            return
        self.topo.add_node(Node("pool.cpu", NodeKind.ROOT, socket="pool.cpu"))
        self.memory("pool.dram", NodeKind.REMOTE_DRAM, int(pool.dram.capacity_gb * 1e9), pool.dram.bandwidth(), "pool.cpu")
        self.link("pool.dram", "pool.cpu", LinkKind.INTERNAL, None, None, "internal", "memory controller")
        model = nic_model(pool.nic_model)
        for i in range(pool.nics):
            nic = f"pool.nic{i}"
            self.topo.add_node(Node(nic, NodeKind.NIC, socket="pool.cpu"))
            link = pool.slot.link_for(model.host_link)
            # The pool is remote: its NICs' host side is counted as one aggregate link.
            one_way = link.one_way()
            if pool.host_links == 2:
                one_way = one_way.scaled(2, "Socket Direct: two x16 links")
            label = link.name if pool.host_links == 1 else f"2 x {link.name} (Socket Direct)"
            self.link("pool.cpu", nic, LinkKind.PCIE, one_way, one_way, "pcie", label)
            self.nic_ports(nic, pool.nic_model)


def build_topology(profile: HardwareProfile) -> Topology:
    """The local server, an identical peer server ("peer." names), the fabric and the pool."""
    topo = Topology(profile.name)
    builder = _Builder(profile, topo, dict(profile.efficiency))
    if profile.nics or profile.pool is not None:
        topo.add_node(Node("fabric", NodeKind.FABRIC))
    builder.server("")
    if profile.nics:
        builder.server("peer.")
    builder.pool()
    # A kind absent from this profile is fine (tables travel between profiles); a name is not.
    kinds = {k.value for k in LinkKind} | {k.value for k in NodeKind if k.is_memory}
    unused = sorted(set(builder.overrides) - builder.used - kinds)
    if unused:
        raise ProfileError(
            f"profile {profile.name!r}: efficiency.{unused[0]} matches no link (a<->b), memory or kind; "
            f"link kinds: {', '.join(k.value for k in LinkKind if k is not LinkKind.INTERNAL)}; "
            f"memory kinds: hbm, dram, remote dram"
        )
    return topo


# --- finding profiles -----------------------------------------------------------------------

_BUILTIN = "kvstrata.hardware"


def _builtin_dir() -> resources.abc.Traversable:
    return resources.files(_BUILTIN) / "profiles"


def builtin_profiles() -> list[str]:
    return sorted(p.name[: -len(".toml")] for p in _builtin_dir().iterdir() if p.name.endswith(".toml"))


def load_profile(name_or_path: str | FsPath) -> HardwareProfile:
    """A built-in profile by name, or a TOML file by path."""
    path = FsPath(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"hardware profile file {str(path)!r} does not exist")
        text, origin = path.read_text(), str(path)
    else:
        text, origin = builtin_text(str(name_or_path)), f"built-in:{name_or_path}"
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{origin}: invalid TOML: {exc}") from None
    return parse_profile(data, origin)


def builtin_text(name: str) -> str:
    """The TOML text of a built-in profile, to copy and edit."""
    if name not in builtin_profiles():
        raise ProfileError(
            f"unknown hardware profile {name!r}; built-in: {', '.join(builtin_profiles())} (or a .toml path)"
        )
    return (_builtin_dir() / f"{name}.toml").read_text()
