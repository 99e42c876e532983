"""Hardware profiles: a server (and the cluster around it) described in TOML, built into a Topology.

This is the loader edge: it reads TOML (a built-in profile or a file) and validates it into the
frozen specs of :mod:`kvstrata.hardware.specs`; :func:`~kvstrata.hardware.build.build_topology`
turns a spec into the graph the planner and simulator use. Every error names the field.

A profile describes one server (sockets with DRAM, PCIe switches, GPUs, NICs, NVMe drives),
optionally a remote DRAM pool host, and per-link efficiency overrides. The builder adds an
identical peer server on the same fabric (the other end of a P/D handoff).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib import resources
from pathlib import Path as FsPath
from typing import Any

from kvstrata.hardware.catalog import (
    DramSpec,
    GpuModel,
    NicModel,
    SocketLinkSpec,
    gpu_model,
    nic_model,
)
from kvstrata.hardware.pcie import PcieLink
from kvstrata.hardware.specs import (
    DeviceSpec,
    GpuSpec,
    HardwareProfile,
    NicSpec,
    NvmeSpec,
    PoolSpec,
    ProfileError,
    Slot,
    SocketSpec,
    SwitchSpec,
)

__all__ = [
    "DeviceSpec", "GpuSpec", "HardwareProfile", "NicSpec", "NvmeSpec", "PoolSpec", "ProfileError", "Slot",
    "SocketSpec", "SwitchSpec", "builtin_profiles", "builtin_text", "load_profile", "parse_profile",
]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


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
