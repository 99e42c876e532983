"""The emulated cluster on this machine: network namespaces, veth pairs, bridges and tbf shapers.

The edge that builds a ``LabSpec`` (``kvstrata.lab.spec``) with ``ip`` and ``tc`` (iproute2):

- one namespace per host, and one "fabric" namespace holding a bridge per switch; nothing is
  created in the caller's namespace, so lab traffic never leaves the lab's own namespaces;
- a port is a veth pair (the host's end ``p<j>`` in the host, the other end on the switch's
  bridge), each end's egress shaped by tbf where the port is shaped; an uplink is a veth pair
  inside the fabric joining two bridges, shaped the same way;
- namespaces are named ``kvlab-<pid>-<host>`` after the process that made them: ``Lab.close``
  ends every process left in them and deletes them (deleting a namespace deletes its links and
  their qdiscs), and ``clean_stale`` removes those of a lab whose process is gone (a crash).

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN). ``unavailable()`` says in one line why a lab
cannot be built here, for callers that skip rather than fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kvstrata.lab.spec import LAB_MTU, LabSpec, LinkShape
from kvstrata.pool import network
from kvstrata.pool.embedded import process_alive

PREFIX = "kvlab-"
T = TypeVar("T")


class LabError(RuntimeError):
    """The lab could not be built (the message names the command and what it said)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check)


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["tc", *args], check)


def _run(cmd: list[str], check: bool) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise LabError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


def unavailable() -> str | None:
    """Why no lab can be built here (None: it can): not root, no iproute2, or namespaces refused."""
    if os.geteuid() != 0:
        return "the lab needs root (it creates network namespaces); run as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the lab needs `{tool}` (iproute2): apt-get install iproute2"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"network namespaces cannot be created here: {made.stderr.strip()}"
    try:
        veth = _ip("-n", probe, "link", "add", "name", "probe0", "type", "veth", "peer", "name", "probe1", check=False)
        if veth.returncode != 0:
            return f"veth pairs cannot be created here: {veth.stderr.strip()}"
        tbf = _tc("-n", probe, "qdisc", "add", "dev", "probe0", "root", "tbf", *LinkShape(1.0).tbf_args(), check=False)
        if tbf.returncode != 0:
            return f"tbf shaping is not available here: {tbf.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def netem_available() -> bool:
    """Whether this kernel has netem (added delay); tbf alone shapes rate only."""
    probe = f"{PREFIX}{os.getpid()}-netem"
    if _ip("netns", "add", probe, check=False).returncode != 0:
        return False
    try:
        _ip("-n", probe, "link", "add", "name", "probe0", "type", "dummy", check=False)
        return _tc("-n", probe, "qdisc", "add", "dev", "probe0", "root", "netem", "delay", "1ms", check=False).returncode == 0
    finally:
        _ip("netns", "del", probe, check=False)


def lab_namespaces() -> list[str]:
    """Every namespace a lab made (``kvlab-<pid>-<host>``), this process's or another's."""
    done = _ip("netns", "list", check=False)
    names = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(PREFIX)]


def clean_stale() -> list[str]:
    """Delete the namespaces of labs whose process is gone; the names deleted."""
    gone = []
    for name in lab_namespaces():
        match = re.match(rf"{PREFIX}(\d+)-", name)
        if match and not process_alive(int(match.group(1))):
            _delete_namespace(name)
            gone.append(name)
    return gone


def _delete_namespace(name: str) -> None:
    """End every process in ``name`` (SIGTERM, then SIGKILL after 3 s), then delete it."""
    for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
        pids = _pids_in(name)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if process_alive(p)]
            time.sleep(0.05)
        if not pids:
            break
    _ip("netns", "del", name, check=False)


def _pids_in(name: str) -> list[int]:
    done = _ip("netns", "pids", name, check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


@dataclass(frozen=True)
class ShaperCounts:
    """A shaped link end's tbf counters since it was made."""

    sent_bytes: int
    overlimits: int  # packets the bucket held back: the rate limited this link
    dropped: int


class Lab:
    """A ``LabSpec`` built in namespaces; a context manager that tears it all down on exit.

    Args:
        spec: the cluster.
    """

    def __init__(self, spec: LabSpec) -> None:
        self.spec = spec
        self._made: list[str] = []
        self._closed = False

    # --- names -----------------------------------------------------------------------------

    def namespace(self, host: str) -> str:
        """The namespace of ``host`` (a host of the spec, or "fabric": the switches')."""
        if host != "fabric":
            self.spec.host(host)  # ValueError naming an unknown host
        return f"{PREFIX}{os.getpid()}-{host}"

    def exec_prefix(self, host: str) -> list[str]:
        """A command prefix that runs a program in ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def port_device(self, host: str, index: int) -> str:
        return f"p{index}"

    def _switch_end(self, host: str, index: int) -> str:
        return f"h{self.spec.hosts.index(self.spec.host(host))}p{index}"

    def link_ends(self, host: str, index: int) -> tuple[tuple[str, str], tuple[str, str]]:
        """(namespace, device) of port ``index`` of ``host``: the host's end, the switch's end."""
        return (self.namespace(host), self.port_device(host, index)), (self.namespace("fabric"), self._switch_end(host, index))

    def uplink_ends(self, index: int) -> tuple[tuple[str, str], tuple[str, str]]:
        fabric = self.namespace("fabric")
        return (fabric, f"u{index}a"), (fabric, f"u{index}b")

    # --- building ----------------------------------------------------------------------------

    def start(self) -> "Lab":
        clean_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        fabric = self._add_namespace("fabric")
        for switch in self.spec.switches:
            _ip("-n", fabric, "link", "add", f"br-{switch}", "type", "bridge")
            _ip("-n", fabric, "link", "set", f"br-{switch}", "mtu", str(LAB_MTU), "up")
        for host in self.spec.hosts:
            ns = self._add_namespace(host.name)
            _run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0"], check=False)
            for j, port in enumerate(host.ports):
                (_, mine), (_, theirs) = self.link_ends(host.name, j)
                self._veth(ns, mine, fabric, theirs, port.switch, port.shape)
                _ip("-n", ns, "addr", "add", f"{self.spec.address(host.name, port.switch)}/24", "dev", mine)
        for k, up in enumerate(self.spec.uplinks):
            (_, a), (_, b) = self.uplink_ends(k)
            _ip("-n", fabric, "link", "add", a, "type", "veth", "peer", "name", b)
            for end, switch in ((a, up.a), (b, up.b)):
                self._attach(fabric, end, switch, up.shape)

    def _add_namespace(self, host: str) -> str:
        name = self.namespace(host)
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        return name

    def _veth(self, ns: str, mine: str, fabric: str, theirs: str, switch: str, shape: LinkShape) -> None:
        _ip("-n", ns, "link", "add", mine, "mtu", str(LAB_MTU), "type", "veth", "peer", "name", theirs, "netns", fabric)
        _ip("-n", ns, "link", "set", mine, "up")
        self._shape(ns, mine, shape)
        self._attach(fabric, theirs, switch, shape)

    def _attach(self, fabric: str, device: str, switch: str, shape: LinkShape) -> None:
        _ip("-n", fabric, "link", "set", device, "mtu", str(LAB_MTU), "master", f"br-{switch}", "up")
        self._shape(fabric, device, shape)

    def _shape(self, ns: str, device: str, shape: LinkShape) -> None:
        """tbf at the rate on ``device``'s egress; netem delay above it where asked (and where
        the kernel has netem: ``LabError`` naming it otherwise)."""
        if shape.delay_s > 0:
            done = _tc("-n", ns, "qdisc", "add", "dev", device, "root", "handle", "1:", "netem",
                       "delay", f"{shape.delay_s * 1e6:g}us", "limit", "100000", check=False)
            if done.returncode != 0:
                raise LabError(f"link delay needs netem, which this kernel lacks ({done.stderr.strip()}); "
                               "run the lab with a delay of 0")
            if shape.rate_gbit is not None:
                _tc("-n", ns, "qdisc", "add", "dev", device, "parent", "1:1", "handle", "2:", "tbf", *shape.tbf_args())
        elif shape.rate_gbit is not None:
            _tc("-n", ns, "qdisc", "add", "dev", device, "root", "handle", "2:", "tbf", *shape.tbf_args())

    # --- using it ----------------------------------------------------------------------------

    def reshape_port(self, host: str, index: int, shape: LinkShape) -> None:
        """Shape port ``index`` of ``host`` (both ends) to ``shape`` now, in place of its shape."""
        for ns, device in self.link_ends(host, index):
            self._reshape(ns, device, shape)

    def reshape_uplink(self, index: int, shape: LinkShape) -> None:
        for ns, device in self.uplink_ends(index):
            self._reshape(ns, device, shape)

    def _reshape(self, ns: str, device: str, shape: LinkShape) -> None:
        _tc("-n", ns, "qdisc", "del", "dev", device, "root", check=False)  # none there: fine
        self._shape(ns, device, shape)

    def run_in(self, host: str, fn: Callable[[], T]) -> T:
        """``fn()`` on a thread that has entered ``host``'s network namespace (sockets it opens
        live there); the thread ends with it, so the caller's namespace is untouched."""
        return run_in_namespace(self.namespace(host), fn)

    def shaper_counts(self, ns: str, device: str) -> ShaperCounts | None:
        """The tbf counters of a link end (None: that end is not rate-shaped)."""
        done = _tc("-s", "-j", "-n", ns, "qdisc", "show", "dev", device)
        for q in json.loads(done.stdout or "[]"):
            if q.get("kind") == "tbf":
                return ShaperCounts(int(q.get("bytes", 0)), int(q.get("overlimits", 0)), int(q.get("drops", 0)))
        return None

    def close(self) -> None:
        """End every process in the lab's namespaces and delete them; idempotent."""
        if self._closed:
            return
        self._closed = True
        for name in reversed(self._made):
            _delete_namespace(name)
        self._made.clear()

    def __enter__(self) -> "Lab":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_in_namespace(ns: str, fn: Callable[[], T]) -> T:
    """``fn()`` on a new thread inside network namespace ``ns`` (``setns`` moves only the calling
    thread; the thread is discarded after)."""
    try:
        return network.run_in(ns, fn)
    except network.NetworkError as error:
        raise LabError(f"cannot enter namespace {ns}: {error}") from None
