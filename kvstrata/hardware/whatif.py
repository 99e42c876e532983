"""What-if upgrades: a profile with its NICs, PCIe generation or NIC host links changed.

Each upgrade returns a new profile; nothing is edited in place. Devices keep their own
limits: an H200 stays at Gen5 in a Gen6 slot, a CX-7 stays at Gen5 however new the slot.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import replace

from kvstrata.hardware.catalog import gpu_model, nic_model
from kvstrata.hardware.specs import HardwareProfile, ProfileError, Slot


class Upgrade(enum.Enum):
    CX8 = "cx8"  # every NIC (local, peer and pool) to CX-8 800G InfiniBand, same slots
    CX8_ETH = "cx8-eth"  # every NIC to CX-8 2x400GbE, same slots
    GEN6 = "gen6"  # every slot and switch uplink to PCIe Gen6 (devices keep their limits)
    SOCKET_DIRECT = "socket-direct"  # every NIC gets a second x16 link to the other socket

    @classmethod
    def parse(cls, text: str) -> "Upgrade":
        try:
            return cls(text.strip().lower().lstrip("+"))
        except ValueError:
            known = ", ".join(f"+{u.value}" for u in cls)
            raise ProfileError(f"unknown upgrade {text!r}; known: {known}") from None


def describe(profile: HardwareProfile) -> str:
    """A one-line description made from the profile's devices and links (an upgraded profile's:
    its own NICs and PCIe generations, never the description of the one it came from)."""
    def counted(items: list[str]) -> list[str]:
        return [f"{n}x {what}" for what, n in Counter(items).items()]

    gpus = [f"{g.model} on {g.slot.link_for(gpu_model(g.model).host_link).name}" for g in profile.gpus]
    nics = []
    for n in profile.nics:
        model = nic_model(n.model)
        link = n.slot.link_for(model.host_link).name
        ports = " + ".join(f"{g}G" for g in model.port_gbit)
        nics.append(f"{n.model} {ports} {model.protocol} on "
                    + (f"2 x {link} (Socket Direct)" if len(n.attach) == 2 else link))
    switches = [f"PCIe Gen{s.uplink.gen} switch" for s in profile.switches]
    nvmes = [f"{d.model} NVMe" for d in profile.nvmes]
    parts = counted(gpus) + counted(nics) + counted(switches) + counted(nvmes)
    parts.append(f"{len(profile.sockets)} socket{'s' if len(profile.sockets) != 1 else ''}")
    if profile.pool is not None:
        link = profile.pool.slot.link_for(nic_model(profile.pool.nic_model).host_link).name
        link = f"2 x {link} (Socket Direct)" if profile.pool.host_links == 2 else link
        parts.append(f"pool: {profile.pool.nics}x {profile.pool.nic_model} on {link}")
    return ", ".join(parts)


def _upgraded(profile: HardwareProfile, tag: str, **changes) -> HardwareProfile:
    """``profile`` with ``changes``, named ``name+tag`` and described anew."""
    upgraded = replace(profile, name=f"{profile.name}+{tag}", **changes)
    return replace(upgraded, description=describe(upgraded))


def with_nics(profile: HardwareProfile, model: str, tag: str | None = None) -> HardwareProfile:
    nic_model(model)
    nics = tuple(replace(n, model=model) for n in profile.nics)
    pool = replace(profile.pool, nic_model=model) if profile.pool else None
    return _upgraded(profile, tag or model.lower(), nics=nics, pool=pool)


def with_pcie_gen(profile: HardwareProfile, gen: int) -> HardwareProfile:
    def slot(s: Slot) -> Slot:
        return replace(s, gen=gen)

    return _upgraded(
        profile,
        f"gen{gen}",
        switches=tuple(replace(s, uplink=slot(s.uplink)) for s in profile.switches),
        gpus=tuple(replace(g, slot=slot(g.slot)) for g in profile.gpus),
        nics=tuple(replace(n, slot=slot(n.slot)) for n in profile.nics),
        pool=replace(profile.pool, slot=slot(profile.pool.slot)) if profile.pool else None,
    )


def with_socket_direct(profile: HardwareProfile) -> HardwareProfile:
    """Each single-link NIC gains a second link to a socket other than its own."""
    if len(profile.sockets) < 2:
        raise ProfileError(f"profile {profile.name!r}: Socket Direct needs two sockets")
    nics = []
    for n in profile.nics:
        if len(n.attach) == 2:
            nics.append(n)
            continue
        home = profile.socket_of(n.attach[0])
        other = next(s.name for s in profile.sockets if s.name != home)
        nics.append(replace(n, attach=(n.attach[0], other)))
    pool = replace(profile.pool, host_links=2) if profile.pool else None
    return _upgraded(profile, "socket-direct", nics=tuple(nics), pool=pool)


def upgrade(profile: HardwareProfile, what: Upgrade) -> HardwareProfile:
    if what is Upgrade.CX8:
        return with_nics(profile, "CX-8", what.value)
    if what is Upgrade.CX8_ETH:
        return with_nics(profile, "CX-8-ETH", what.value)
    if what is Upgrade.GEN6:
        return with_pcie_gen(profile, 6)
    return with_socket_direct(profile)


def apply_upgrades(profile: HardwareProfile, spec: str) -> HardwareProfile:
    """``"+cx8+gen6"`` -> the profile with both upgrades, in order."""
    for part in filter(None, spec.split("+")):
        profile = upgrade(profile, Upgrade.parse(part))
    return profile
