"""What a pool and a client listen on, as ``ss`` reports it, on the host and in the pool's network.

kvstrata binds every address it configures to the pool's host (loopback for the embedded
pool): the master's RPC and metrics ports and the daemon's RPC port. Mooncake's transfer
engine binds its handshake and TCP data listeners to the wildcard address in its own code
(``transfer_metadata_plugin.cpp``, ``tcp_transport_session_impl.h``; no option moves them),
one of each in every process that joins the pool. An embedded pool started by root therefore
runs in a network namespace of its own, and its clients' threads that talk to it join that
namespace (``kvstrata.pool.network``): on the host's network nothing of the pool's or of a
client's listens, and another user can neither connect nor enter. A pool started on the host's
network (``PoolNetwork.HOST``) shows Mooncake's wildcards, pinned here so a change shows.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from kvstrata.pool import embedded
from kvstrata.pool import network as netns
from kvstrata.pool.client import PoolClient
from kvstrata.pool.config import RemoteMode
from kvstrata.pool.network import PoolNetwork

MOONCAKE_WILDCARD = 2  # per process: the transfer engine's handshake and TCP data listeners
LOOPBACK = ("127.0.0.1", "[::1]", "[::ffff:127.0.0.1]")


def listeners(namespace: str | None = None) -> dict[int, list[tuple[str, int]]]:
    """{pid: [(address, port)]} of every listening TCP socket, in the host's network or in
    ``namespace``."""
    prefix = netns.exec_prefix(namespace) if namespace else []
    out = subprocess.run([*prefix, "ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found: dict[int, list[tuple[str, int]]] = {}
    for line in out.splitlines():
        fields = line.split()
        address, _, port = fields[3].rpartition(":")
        for pid in re.findall(r"pid=(\d+)", line):
            found.setdefault(int(pid), []).append((address, int(port)))
    return found


def _needs_ss() -> None:
    if shutil.which("ss") is None:
        pytest.skip("needs ss (iproute2)")


@pytest.fixture
def pool(tmp_path):
    _needs_ss()
    if netns.unavailable():
        pytest.skip(netns.unavailable())
    state = embedded.start(64 * 1024**2, tmp_path / "pool")
    yield state
    embedded.stop(tmp_path / "pool")


@pytest.fixture
def host_pool(tmp_path):
    _needs_ss()
    state = embedded.start(64 * 1024**2, tmp_path / "host-pool", network=PoolNetwork.HOST)
    yield state
    embedded.stop(tmp_path / "host-pool")


def _cache(pool_config, name: str):
    from cache_support import LAYOUT as layout
    from cache_support import kv_for, tokens

    from kvstrata.cache import CacheConfig, TieredCache

    config = CacheConfig(layout, name, device_bytes=8 * layout.block_bytes, host_bytes=8 * layout.block_bytes,
                         device="cpu", pool=pool_config, remote_bytes=64 * layout.block_bytes)
    cache = TieredCache(config)
    toks = tokens(1, 4, layout)
    cache.store(toks, kv_for(cache, toks)).result(timeout=10)
    return cache


def test_a_pool_started_by_root_and_a_cache_using_it_listen_on_nothing_of_the_hosts_network(pool):
    assert pool.config.network == netns.name_for_user() and netns.exists(pool.config.network)
    earlier = set(listeners(pool.config.network).get(os.getpid(), []))  # earlier tests' engines, parked
    cache = _cache(pool.config, "listeners-private")
    try:
        assert cache.remote_error is None
        host = listeners()
        inside = listeners(pool.config.network)
    finally:
        cache.close()
    ours = (pool.master_pid, pool.daemon_pid, os.getpid())
    on_host = {pid: host[pid] for pid in ours if pid in host}
    assert not on_host, f"on the host's network: {on_host}"
    # Where they are: the master's configured ports, the daemon's, and the engines' wildcards,
    # the cache's own among them, all inside the pool's network.
    configured = {int(a.rpartition(":")[2]) for a in (pool.config.master, pool.config.daemon)} | {pool.metrics_port}
    assert configured <= {port for pid in ours for _, port in inside.get(pid, [])}
    wild = {(a, p) for a, p in inside.get(os.getpid(), []) if a not in LOOPBACK}
    assert wild and len(wild - earlier) <= MOONCAKE_WILDCARD, f"the cache's engine inside the pool's network: {inside}"


def test_the_cache_s_own_threads_stay_on_the_hosts_network(pool):
    # Only kvstrata's pool threads move: this (the engine's) thread still reaches the host's
    # loopback, where the pool's ports are closed.
    cache = _cache(pool.config, "listeners-threads")
    try:
        here = os.stat("/proc/thread-self/ns/net").st_ino
        assert here == os.stat("/proc/self/ns/net").st_ino != os.stat(netns.NAMESPACES / pool.config.network).st_ino
        assert not embedded.accepts(pool.config.master)  # from the host's network: nothing there
        assert embedded.answers_in(pool.config.network, pool.config.master)
    finally:
        cache.close()


_STRANGER = r"""
import encodings.idna, ctypes, json, os, pwd, socket, sys  # idna: loaded lazily, from under /root
nobody = pwd.getpwnam("nobody")
os.setgroups([]); os.setgid(nobody.pw_gid); os.setuid(nobody.pw_uid)
out = {"uid": os.getuid()}
for name, address in json.loads(sys.argv[1]).items():
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        out[name] = "connected"
    except OSError as error:
        out[name] = type(error).__name__
try:
    fd = os.open(sys.argv[2], os.O_RDONLY)
    libc = ctypes.CDLL(None, use_errno=True)
    out["setns"] = "entered" if libc.setns(fd, 0x40000000) == 0 else os.strerror(ctypes.get_errno())
except OSError as error:
    out["setns"] = type(error).__name__
print(json.dumps(out))
"""


def test_another_user_can_neither_reach_the_pool_nor_enter_its_network(pool):
    import pwd

    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody")
    cache = _cache(pool.config, "listeners-nobody")  # a client's engine runs, and listens, in there too
    try:
        inside = listeners(pool.config.network)
        targets = {"master": pool.config.master, "daemon": pool.config.daemon}
        targets |= {f"engine:{p}": f"127.0.0.1:{p}" for pid, found in inside.items() for a, p in found
                    if a not in LOOPBACK}
        done = subprocess.run([sys.executable, "-c", _STRANGER, json.dumps(targets),
                               str(netns.NAMESPACES / pool.config.network)],
                              cwd="/", capture_output=True, text=True, timeout=60,
                              env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/"})
    finally:
        cache.close()
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout)
    assert got.pop("uid") == nobody.pw_uid
    assert got.pop("setns") == "Operation not permitted"
    assert len(got) >= 3 and set(got.values()) == {"ConnectionRefusedError"}, got


def test_a_client_that_cannot_enter_the_pool_s_network_is_refused_in_one_line(pool):
    import dataclasses

    from kvstrata.pool.client import PoolUnavailable

    gone = dataclasses.replace(pool.config, network="kvstrata-gone")  # as if it had been deleted
    with pytest.raises(PoolUnavailable, match="pool network kvstrata-gone does not exist") as caught:
        PoolClient(gone, RemoteMode.TCP, connect_timeout_s=2)
    assert "\n" not in str(caught.value)


def test_a_process_that_joined_one_pool_network_is_refused_another_at_once(pool, host_pool):
    # Mooncake's RPC threads stay in the network of the process's first store: a store set up
    # for a pool elsewhere retried for 90 s, holding the interpreter lock. Refused, in one line.
    import time

    from kvstrata.pool.client import PoolUnavailable

    PoolClient(pool.config, RemoteMode.TCP).close()  # this process's Mooncake lives in the pool's network now
    start = time.monotonic()
    with pytest.raises(PoolUnavailable, match="joined a pool in .* first"):
        PoolClient(host_pool.config, RemoteMode.TCP, connect_timeout_s=2)
    assert time.monotonic() - start < 2


def test_on_the_hosts_network_kvstrata_binds_loopback_and_mooncake_adds_only_its_two_wildcards(host_pool):
    # The pool's own processes (a client here would tie this process to the host's network).
    from engine_support import segment_descriptor

    pool = host_pool
    assert pool.config.network is None
    found = listeners()
    configured = {int(a.rpartition(":")[2]) for a in (pool.config.master, pool.config.daemon)} | {pool.metrics_port}
    seen = {port for pid in (pool.master_pid, pool.daemon_pid) for _, port in found.get(pid, [])}
    assert configured <= seen, f"configured ports {configured} not all listening: {found}"
    assert all(a in LOOPBACK for a, _ in found.get(pool.master_pid, [])), "the master listens beyond loopback"
    wild = {p for a, p in found.get(pool.daemon_pid, []) if a not in LOOPBACK}
    assert not wild & configured and len(wild) == MOONCAKE_WILDCARD, f"the daemon beyond loopback: {found}"
    # Each is a transfer engine's handshake port (it answers a metadata request with its
    # segment) or the TCP data port that segment names.
    segments = [segment for segment in map(segment_descriptor, wild) if segment is not None]
    assert wild <= {port for port in wild if segment_descriptor(port)} | {s["tcp_data_port"] for s in segments}
