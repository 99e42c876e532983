"""Tenants on one pool, and another user on the host: what they read is ciphertext, what they
wipe is misses, and the owner's cache loads exactly what it stored.

Everything is real: the embedded pool (a Mooncake master and pool daemon), the caches, and the
attacker: a raw Mooncake client, in a process that runs as ``nobody`` (it becomes ``nobody``
after loading Mooncake, as the interpreter lives where ``nobody`` cannot read), with nothing but
what Mooncake offers every client: the master's HTTP port (which lists every object's name and
address to anyone), joining with no credentials, reads of any object, and ``remove_all``. A pool
started by root runs in a network of its own that ``nobody`` cannot reach
(tests/pool/test_listeners.py); the attacker is let in here, as a hostile process on a pool's
shared network would be.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import subprocess
import sys
import uuid

import pytest
from cache_support import assert_loaded_bytes, content, kv_for, raw, tokens

from kvstrata.cache import CacheConfig, TieredCache
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.media import Medium
from kvstrata.policies.write import WritePolicy, WriteRule
from kvstrata.pool.config import PoolConfig, make_secret
from kvstrata.tiers import poolvalue
from tests.pool_support import RawPool

LAYOUT = KVLayout(num_layers=2, block_tokens=16, kv_heads=2, head_dim=32, dtype=DType.BF16)  # 8 KiB a block
VALUE = poolvalue.HEADER_BYTES + LAYOUT.block_bytes
R = Medium.REMOTE
WAIT_S = 10.0


@pytest.fixture
def caches():
    made: list[TieredCache] = []

    def make(pool: PoolConfig, model: str, **settings) -> TieredCache:
        # Device and pool only, write-through: every stored block is in the pool at once.
        config = CacheConfig(LAYOUT, model, device_bytes=8 * LAYOUT.block_bytes, host_bytes=0, device="cpu",
                             write=WriteRule(WritePolicy.WRITE_THROUGH), pool=pool,
                             remote_bytes=64 * LAYOUT.block_bytes, **settings)
        made.append(TieredCache(config))
        return made[-1]

    yield make
    for cache in made:
        cache.close()


def store(cache: TieredCache, toks: list[int], tenant: str = "") -> None:
    cache.store(toks, kv_for(cache, toks, tenant), tenant).result(timeout=WAIT_S)


def plaintext(key: bytes) -> bytes:
    return raw(content(LAYOUT, key)).numpy().tobytes()


def assert_no_plaintext(value: bytes, keys: list[bytes]) -> None:
    """No 32-byte run of any of ``keys``' KV (random bytes) appears in ``value``."""
    for key in keys:
        plain = plaintext(key)
        leaked = [at for at in range(0, len(plain) - 32, 256) if plain[at : at + 32] in value]
        assert not leaked, f"plaintext KV of {key.hex()[:12]} at offsets {leaked[:4]} in a pool value"


def raw_get(pool: PoolConfig, names: list[str]) -> list[bytes]:
    """The pool's values of ``names``, read by a raw client (no secret)."""
    reader = RawPool(pool, VALUE)
    try:
        values = [reader.get(name) for name in names]
    finally:
        reader.close()
    assert all(value is not None and len(value) == VALUE for value in values)
    return values


def test_a_cache_encrypts_its_pool_values_by_default_where_the_pool_has_a_secret(tmp_path):
    secret = tmp_path / "pool.key"
    make_secret(secret)
    with_secret = PoolConfig(master="127.0.0.1:1", secret_file=str(secret))
    config = CacheConfig(LAYOUT, "m", device_bytes=LAYOUT.block_bytes, host_bytes=0, pool=with_secret,
                         remote_bytes=LAYOUT.block_bytes)
    assert config.pool_encrypt is None and config.pool_encrypted
    assert not dataclasses.replace(config, pool_encrypt=False).pool_encrypted  # the opt-out, said explicitly
    without = dataclasses.replace(config, pool=PoolConfig(master="127.0.0.1:1"))
    assert not without.pool_encrypted  # no secret: nothing to encrypt with (values checksummed only)
    assert not dataclasses.replace(config, pool=None, remote_bytes=0).pool_encrypted
    with pytest.raises(ValueError, match="pool_encrypt=True needs a pool with a secret_file"):
        dataclasses.replace(without, pool_encrypt=True)
    with pytest.raises(ValueError, match="pool_encrypt must be True, False or None"):
        dataclasses.replace(config, pool_encrypt="yes")


def test_another_tenants_client_reads_only_ciphertext_and_the_owner_its_own_bytes(pool, caches, tmp_path):
    # Tenants that must not read each other's blocks have secrets of their own: bob's cache is
    # on the same pool with his. (Tenants of one secret are apart by namespace only: whoever
    # holds the secret and knows a tenant's name and prompt can derive its blocks' names.)
    if pool.secret_file is None:
        pytest.skip("the configured pool has no secret_file")
    bob_secret = tmp_path / "bob.key"
    make_secret(bob_secret)
    model = f"tenants-{uuid.uuid4().hex[:12]}"
    alice, bob = caches(pool, model), caches(dataclasses.replace(pool, secret_file=str(bob_secret)), model)
    assert alice.config.pool_encrypted and bob.config.pool_encrypted  # the default: nobody set pool_encrypt
    toks = tokens(1, 4, LAYOUT)
    store(alice, toks, "alice")
    keys = alice.keys(toks, "alice")
    names = [alice.tier(R).object_name(key) for key in keys]
    for value in raw_get(pool, names):  # any client of the pool reads any object it can name
        assert poolvalue.decode_header(value).encrypted
        assert_no_plaintext(value, keys)
    assert len(bob.lookup(toks, "alice").media) == 0  # naming alice's tenant: his names are keyed apart
    reader = caches(pool, model)  # alice again, in another process's place: her bytes, exactly
    match = reader.lookup(toks, "alice")
    assert match.media == (R,) * 4
    handle = reader.load(match)
    assert handle.wait(timeout=WAIT_S).blocks == 4
    assert_loaded_bytes(reader, handle, keys)
    handle.release()


def test_opting_out_leaves_payloads_readable_by_any_client_sealed(pool, caches):
    if pool.secret_file is None:
        pytest.skip("the configured pool has no secret_file")
    cache = caches(pool, f"tenants-plain-{uuid.uuid4().hex[:12]}", pool_encrypt=False)
    toks = tokens(2, 1, LAYOUT)
    store(cache, toks)
    (key,) = cache.keys(toks)
    (value,) = raw_get(pool, [cache.tier(R).object_name(key)])
    assert not poolvalue.decode_header(value).encrypted
    assert value[poolvalue.HEADER_BYTES :] == plaintext(key)  # what pool_encrypt=False means


# Runs as root until Mooncake is loaded, then as the uid and gid given; prints one JSON line.
ATTACKER = r"""
import ctypes, encodings.idna, json, os, sys, urllib.request  # every module loaded while root (see the docstring)
from mooncake.store import MooncakeDistributedStore
uid, gid, master, admin, network = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
if network:  # into the pool's network while root: a hostile process that can reach the pool
    fd = os.open("/run/netns/" + network, os.O_RDONLY)
    assert ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) == 0
os.setgroups([]); os.setgid(gid); os.setuid(uid)
def listing():
    return urllib.request.urlopen(f"http://{admin}/get_all_keys", timeout=5).read().decode().split()
out = {"uid": os.getuid(), "names": listing()}
store = MooncakeDistributedStore()
out["setup"] = store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master)
out["values"] = {name: store.get(name).hex() for name in out["names"]}
out["removed"] = store.remove_all(True)
out["left"] = listing()
print(json.dumps(out), flush=True)
os._exit(0)  # Mooncake's close can stall; nothing is left to do
"""


def attack_as_nobody(state) -> dict:
    if os.geteuid() != 0:
        pytest.skip("becoming another user needs root")
    nobody = pwd.getpwnam("nobody")
    env = os.environ | {"MC_LOG_DIR": "/tmp", "HOME": "/tmp"}
    run = subprocess.run([sys.executable, "-c", ATTACKER, str(nobody.pw_uid), str(nobody.pw_gid), state.config.master,
                          f"127.0.0.1:{state.metrics_port}", state.config.network or ""], capture_output=True, text=True, timeout=60, env=env,
                         cwd="/tmp", check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["uid"] == nobody.pw_uid
    return got


def test_nobody_lists_reads_and_wipes_the_pool_and_gets_ciphertext_the_cache_misses_and_serves_on(private_pool, caches):
    # What Mooncake cannot refuse (no client authentication, an admin port that answers anyone
    # who reaches it): a deployment isolates the pool's ports (see the README). What kvstrata
    # makes of it: names that say nothing, payloads that are ciphertext, a wipe that is misses.
    model = f"tenants-nobody-{uuid.uuid4().hex[:12]}"
    writer, reader = caches(private_pool.config, model), caches(private_pool.config, model)
    toks = tokens(3, 4, LAYOUT)
    store(writer, toks, "alice")
    keys = writer.keys(toks, "alice")
    assert reader.lookup(toks, "alice").media == (R,) * 4  # in the reader's view: only the pool has them
    got = attack_as_nobody(private_pool)
    assert got["setup"] == 0  # joined with no credentials: Mooncake has none to ask for
    names = {writer.tier(R).object_name(key) for key in keys}
    assert names <= set(got["names"])  # the admin port lists them to anyone ...
    listing = " ".join(got["names"])
    tag = writer.config.namespace("alice").tag
    assert tag not in listing and not any(key.hex() in listing for key in keys)  # ... saying nothing of them
    for name in names:
        assert_no_plaintext(bytes.fromhex(got["values"][name]), keys)  # read: ciphertext only
    assert got["removed"] >= 4 and got["left"] == []  # the wipe is not refused
    assert len(reader.lookup(toks, "alice").media) == 0  # misses, found at lookup, counted
    assert reader.metrics.pool_dropped_blocks == 4
    store(reader, toks, "alice")  # recomputed and stored again: the cache serves on
    third = caches(private_pool.config, model)
    match = third.lookup(toks, "alice")
    assert match.media == (R,) * 4
    handle = third.load(match)
    assert handle.wait(timeout=WAIT_S).blocks == 4
    assert_loaded_bytes(third, handle, keys)  # 0 wrong bytes
    handle.release()
