"""What a pool and a client listen on, as ``ss`` reports it.

kvstrata binds every address it configures to the pool's host (loopback for the embedded
pool): the master's RPC and metrics ports and the daemon's RPC port. Mooncake's transfer
engine binds its handshake and TCP data listeners to the wildcard address in its own code
(``transfer_metadata_plugin.cpp``, ``tcp_transport_session_impl.h``; no option moves them),
one of each in every process that joins the pool. What those expose is registered memory:
pool values there are sealed (a forged one is a miss) and, with ``pool_encrypt``, unreadable
(tests/tiers/test_pool_security.py). This test pins both facts, so a change to either shows.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from kvstrata.pool import embedded
from kvstrata.pool.client import PoolClient
from kvstrata.pool.config import RemoteMode

MOONCAKE_WILDCARD = 2  # per process: the transfer engine's handshake and TCP data listeners
LOOPBACK = ("127.0.0.1", "[::1]", "[::ffff:127.0.0.1]")


def listeners() -> dict[int, list[tuple[str, int]]]:
    """{pid: [(address, port)]} of every listening TCP socket."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found: dict[int, list[tuple[str, int]]] = {}
    for line in out.splitlines():
        fields = line.split()
        address, _, port = fields[3].rpartition(":")
        for pid in re.findall(r"pid=(\d+)", line):
            found.setdefault(int(pid), []).append((address, int(port)))
    return found


@pytest.fixture
def pool(tmp_path):
    if shutil.which("ss") is None:
        pytest.skip("needs ss (iproute2)")
    state = embedded.start(64 * 1024**2, tmp_path / "pool")
    yield state
    embedded.stop(tmp_path / "pool")


@pytest.mark.parametrize("mode", list(RemoteMode))
def test_every_address_kvstrata_configures_is_loopback_and_mooncake_adds_only_its_two_wildcards(pool, mode):
    earlier = set(listeners().get(os.getpid(), []))  # clients of earlier tests' pools, kept by Mooncake
    client = PoolClient(pool.config, mode)
    try:
        client.call("probe", "is_exist", "nothing")
        found = listeners()
    finally:
        client.close()
    configured = {int(a.rpartition(":")[2]) for a in (pool.config.master, pool.config.daemon)} | {pool.metrics_port}
    seen = {port for pid in (pool.master_pid, pool.daemon_pid) for _, port in found.get(pid, [])}
    assert configured <= seen, f"configured ports {configured} not all listening: {found}"
    for pid, name in ((pool.master_pid, "master"), (pool.daemon_pid, "daemon"), (os.getpid(), "client")):
        wild = [(a, p) for a, p in found.get(pid, []) if a not in LOOPBACK and (a, p) not in earlier]
        assert not [p for _, p in wild if p in configured], f"{name} listens on a configured port beyond loopback: {wild}"
        assert len(wild) <= MOONCAKE_WILDCARD, f"{name} listens beyond loopback on more than Mooncake's own: {wild}"
    assert all(a in LOOPBACK for a, _ in found.get(pool.master_pid, [])), "the master listens beyond loopback"


def test_a_cache_and_its_pool_listen_beyond_loopback_only_on_the_transfer_engines_own_ports(pool):
    # The wildcard listeners, named exactly: each is a transfer engine's handshake port (it
    # answers a metadata request with its segment) or the TCP data port that segment names.
    from cache_support import LAYOUT as layout
    from cache_support import kv_for, tokens
    from engine_support import listening, segment_descriptor

    from kvstrata.cache import CacheConfig, TieredCache

    config = CacheConfig(layout, "listeners", device_bytes=8 * layout.block_bytes, host_bytes=8 * layout.block_bytes,
                         device="cpu", pool=pool.config, remote_bytes=64 * layout.block_bytes)
    cache = TieredCache(config)
    try:
        toks = tokens(1, 4, layout)
        cache.store(toks, kv_for(cache, toks)).result(timeout=10)
        for pid, name in ((pool.master_pid, "master"), (pool.daemon_pid, "daemon"), (os.getpid(), "cache")):
            wild = {listener.port for listener in listening(pid) if listener.wildcard}
            engines = {port: segment_descriptor(port) for port in wild}
            engine_ports = {port for port, segment in engines.items() if segment is not None}
            engine_ports |= {segment["tcp_data_port"] for segment in engines.values() if segment is not None}
            assert wild <= engine_ports, f"{name} (pid {pid}) listens beyond loopback on {sorted(wild - engine_ports)}"
            assert name != "master" or not wild, f"the master listens beyond loopback on {sorted(wild)}"
    finally:
        cache.close()
