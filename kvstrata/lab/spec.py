"""An emulated cluster, as data: hosts with NIC ports on switches, links shaped to a rate.

Pure (no I/O): what ``kvstrata.lab.netns`` builds out of Linux network namespaces, and what
``kvstrata.lab.model`` turns into the planner's topology, so both read the same description.

- A **switch** is a Linux bridge in the lab's fabric namespace: one L2 network (a "rail").
  Every port on a switch has an address in that switch's own subnet, so a host with ports on
  two switches reaches a peer's address on one switch through its own port on that switch only
  (no ARP answered from the wrong port: two rails, as rail-optimized clusters wire them).
- A **port** is a veth pair: one end in the host's namespace, the other on the switch. Its
  shape limits both directions, each end's egress (tbf): the host sends at the rate through its
  own end and receives at it through the switch's end, as a full-duplex NIC port.
- An **uplink** joins two switches (a veth pair, both ends in the fabric): a link that hosts
  behind one switch share to reach the other (a shared NIC or PCIe switch, a leaf's uplink).

Rates are decimal (1 Gbit/s = 1e9 bit/s, as ``tc`` reads "1gbit"); bandwidths GB/s = 1e9 B/s.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

GBIT = 1e9
# The lab's addresses: the L2 network of switch i (switches joined by uplinks are one) has subnet
# 10.77.i.0/24 (i from 1, its first switch's), and a host's port there .(10 + host index).
SUBNET_PREFIX = "10.77"
# Ethernet + IPv4 + TCP (with timestamps) around each segment, bytes: what tbf counts beyond payload.
ETH_HEADER = 14
IP_TCP_HEADERS = 20 + 32
LAB_MTU = 9000  # jumbo frames, as RDMA and storage fabrics run (and fewer packets for the 2 vCPUs to move)
# A shaped port's token bucket: at least this many bytes (one GSO super-packet and some), and at
# least this long at the rate (a kernel timer tick), so the bucket itself never caps the rate.
MIN_BURST_BYTES = 256 * 1024
BURST_S = 0.002
QUEUE_S = 0.050  # how long a packet may wait in the shaper before it is dropped (TCP backs off)
NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")


class Role(enum.Enum):
    POOL = "pool"  # runs the Mooncake master and pool daemons (one per port)
    INFERENCE = "inference"  # runs a cache that restores from the pool


@dataclass(frozen=True)
class LinkShape:
    """A link's one-way rate (per direction) and added one-way delay; None rate: unshaped."""

    rate_gbit: float | None = None
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_gbit is not None and not (isinstance(self.rate_gbit, (int, float)) and 0 < self.rate_gbit < 1000):
            raise ValueError(f"lab link rate must be a number of Gbit/s in (0, 1000), got {self.rate_gbit!r}")
        if not (isinstance(self.delay_s, (int, float)) and 0 <= self.delay_s <= 1.0):
            raise ValueError(f"lab link delay must be 0 to 1 s, got {self.delay_s!r}")

    @property
    def shaped(self) -> bool:
        return self.rate_gbit is not None or self.delay_s > 0

    def tbf_args(self) -> list[str]:
        """``tc qdisc ... tbf`` arguments for this rate: a bucket that never caps it (``BURST_S`` at
        the rate, ``MIN_BURST_BYTES`` at least) and a queue of ``QUEUE_S`` at the rate."""
        if self.rate_gbit is None:
            raise ValueError("an unshaped link has no tbf")
        rate_bytes = self.rate_gbit * GBIT / 8
        burst = max(MIN_BURST_BYTES, int(rate_bytes * BURST_S))
        limit = burst + int(rate_bytes * QUEUE_S)
        return ["rate", f"{self.rate_gbit * 1000:g}mbit", "burst", str(burst), "limit", str(limit)]

    def text(self) -> str:
        rate = "unshaped" if self.rate_gbit is None else f"{self.rate_gbit:g} Gbit/s"
        return rate + (f", +{self.delay_s * 1e6:g} us" if self.delay_s else "")


def tcp_efficiency(mtu: int = LAB_MTU) -> float:
    """TCP payload per byte the shaper counts: an MTU's segment carries ``mtu - IP/TCP headers``
    of payload in ``mtu + Ethernet header`` bytes (tbf counts every frame's bytes, GSO or not)."""
    return (mtu - IP_TCP_HEADERS) / (mtu + ETH_HEADER)


@dataclass(frozen=True)
class Port:
    switch: str
    shape: LinkShape = LinkShape()


@dataclass(frozen=True)
class Host:
    name: str
    role: Role
    ports: tuple[Port, ...]


@dataclass(frozen=True)
class Uplink:
    """A link between two switches."""

    a: str
    b: str
    shape: LinkShape = LinkShape()


@dataclass(frozen=True)
class LabSpec:
    """A cluster: switches, hosts with ports on them, and uplinks between switches.

    Exactly one pool host; at least one inference host. Names are short lowercase words (they
    become parts of namespace and interface names, which Linux limits to 15 characters).
    """

    name: str
    switches: tuple[str, ...]
    hosts: tuple[Host, ...]
    uplinks: tuple[Uplink, ...] = ()

    def __post_init__(self) -> None:
        for what, names in (("switch", self.switches), ("host", [h.name for h in self.hosts])):
            for n in names:
                if not NAME.match(n):
                    raise ValueError(f"lab {what} name {n!r} must be 1-8 lowercase letters or digits, a letter first")
            if len(set(names)) != len(names):
                raise ValueError(f"lab {what} names must be distinct, got {list(names)}")
        if not 1 <= len(self.switches) <= 200:
            raise ValueError(f"a lab has 1 to 200 switches, got {len(self.switches)}")
        roles = [h.role for h in self.hosts]
        if roles.count(Role.POOL) != 1 or Role.INFERENCE not in roles:
            raise ValueError("a lab has exactly one pool host and at least one inference host")
        if len(self.hosts) > 200:
            raise ValueError(f"a lab has at most 200 hosts, got {len(self.hosts)}")
        for h in self.hosts:
            if not h.ports:
                raise ValueError(f"lab host {h.name!r} has no port")
            switches = [p.switch for p in h.ports]
            if len(set(switches)) != len(switches):
                raise ValueError(f"lab host {h.name!r} has two ports on one switch; give each port its own switch")
            for s in switches:
                self._known(s, f"host {h.name!r}")
        for u in self.uplinks:
            self._known(u.a, "uplink")
            self._known(u.b, "uplink")
            if u.a == u.b:
                raise ValueError(f"lab uplink joins switch {u.a!r} to itself")

    def _known(self, switch: str, where: str) -> None:
        if switch not in self.switches:
            raise ValueError(f"lab {where}: switch {switch!r} is not one of {list(self.switches)}")

    @property
    def pool(self) -> Host:
        return next(h for h in self.hosts if h.role is Role.POOL)

    @property
    def inference(self) -> tuple[Host, ...]:
        return tuple(h for h in self.hosts if h.role is Role.INFERENCE)

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise ValueError(f"lab {self.name!r} has no host {name!r}")

    def address(self, host: str, switch: str) -> str:
        """The host's address on ``switch`` (its port there)."""
        h = self.host(host)
        if all(p.switch != switch for p in h.ports):
            raise ValueError(f"lab host {host!r} has no port on switch {switch!r}")
        return f"{self.subnet(switch)}.{10 + self.hosts.index(h)}"

    def common_switches(self, a: str, b: str) -> tuple[str, ...]:
        """Switches on which both hosts have a port, in ``a``'s port order."""
        theirs = {p.switch for p in self.host(b).ports}
        return tuple(p.switch for p in self.host(a).ports if p.switch in theirs)

    def reachable_switch(self, host: str, target: str) -> str:
        """The switch of ``host``'s port that reaches ``target``'s first port: the same switch, or
        one joined to it by uplinks. (Switches joined by uplinks form one L2 network.)"""
        goal = self.host(target).ports[0].switch
        for p in self.host(host).ports:
            if goal in self.bridged(p.switch):
                return p.switch
        raise ValueError(f"lab host {host!r} cannot reach {target!r}: no switch of its joins theirs")

    def bridged(self, switch: str) -> frozenset[str]:
        """``switch`` and every switch joined to it by uplinks (one L2 network)."""
        seen, todo = {switch}, [switch]
        while todo:
            s = todo.pop()
            for u in self.uplinks:
                for x, y in ((u.a, u.b), (u.b, u.a)):
                    if x == s and y not in seen:
                        seen.add(y)
                        todo.append(y)
        return frozenset(seen)

    def subnet(self, switch: str) -> str:
        """The subnet of ``switch``'s L2 network: that of the first switch in it (by order)."""
        first = min(self.bridged(switch), key=self.switches.index)
        return f"{SUBNET_PREFIX}.{self.switches.index(first) + 1}"


# --- the clusters the lab command runs ----------------------------------------------------------


def one_link(rate_gbit: float | None, delay_s: float = 0.0) -> LabSpec:
    """An inference host and the pool host, one port each on one switch; the inference host's
    port shaped (the pool's is not: the inference host's NIC is the link under test)."""
    return LabSpec(
        "one link",
        ("sw",),
        (Host("pool", Role.POOL, (Port("sw"),)), Host("inf", Role.INFERENCE, (Port("sw", LinkShape(rate_gbit, delay_s)),))),
    )


def two_ports(rate_gbit: float, delay_s: float = 0.0) -> LabSpec:
    """Two rails; the inference host has a port on each, shaped; the pool host one on each,
    unshaped, with a pool daemon behind each (so a restore can draw on both of the host's ports)."""
    shape = LinkShape(rate_gbit, delay_s)
    return LabSpec(
        "two ports",
        ("rail0", "rail1"),
        (
            Host("pool", Role.POOL, (Port("rail0"), Port("rail1"))),
            Host("inf", Role.INFERENCE, (Port("rail0", shape), Port("rail1", shape))),
        ),
    )


def shared_uplink(rate_gbit: float, delay_s: float = 0.0) -> LabSpec:
    """Two inference hosts on a leaf switch, unshaped, whose one shaped uplink reaches the pool's switch."""
    return LabSpec(
        "shared uplink",
        ("leaf", "spine"),
        (
            Host("pool", Role.POOL, (Port("spine"),)),
            Host("inf0", Role.INFERENCE, (Port("leaf"),)),
            Host("inf1", Role.INFERENCE, (Port("leaf"),)),
        ),
        (Uplink("leaf", "spine", LinkShape(rate_gbit, delay_s)),),
    )
