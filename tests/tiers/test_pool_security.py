"""The pool cannot be forged: an attacker's raw Mooncake client against values sealed with a secret.

The attacker here is a real client of the real pool with the raw store API (``batch_put_from``,
``batch_get_into``, ``batch_is_exist``, ``remove``) and everything public: the layout, the
namespace tag, the block keys (the chained key scheme is public) and the value format. It does
not have the deployment's secret. Whatever it puts under a sealed block's name must read as a
miss (CorruptBlock), never as KV.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from kvstrata.errors import CorruptBlock
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.pool.config import PoolConfig, read_secret
from kvstrata.tiers import poolvalue
from kvstrata.tiers.remote import RemoteMode, RemoteTier, fresh_tag
from tests.pool_support import RawPool

LAYOUT = KVLayout(num_layers=4, block_tokens=16, kv_heads=2, head_dim=8, dtype=DType.BF16)  # 4 x 1 KiB
VALUE = poolvalue.HEADER_BYTES + LAYOUT.block_bytes


def key_of(i: int) -> bytes:
    return xxhash.xxh3_128_digest(f"kvstrata-test-security:{i}".encode())


def content(key: bytes) -> torch.Tensor:
    data = np.random.default_rng(int.from_bytes(key, "little")).bytes(LAYOUT.block_bytes)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(LAYOUT.num_layers, LAYOUT.layer_bytes)


@pytest.fixture
def tiers(pool, secret):
    made = []

    def make(encrypt: bool = False, tag: str | None = None, with_secret: bool = True) -> RemoteTier:
        tier = RemoteTier(LAYOUT, 16 * LAYOUT.block_bytes, pool, RemoteMode.TCP, namespace_tag=tag or fresh_tag(),
                          secret=secret if with_secret else None, encrypt=encrypt)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


@pytest.fixture(scope="module")
def attacker(pool):
    """A raw client of the pool (no secret) and a registered buffer of two values."""
    attacker = RawPool(pool, 2 * VALUE)
    yield attacker
    attacker.close()


def store(tier: RemoteTier, key: bytes) -> None:
    tier.write(0, key, content(key))


def read(tier: RemoteTier, key: bytes) -> torch.Tensor:
    dst = torch.zeros(LAYOUT.num_layers, LAYOUT.layer_bytes, dtype=torch.uint8)
    tier.read_into(0, key, dst)
    return dst


@pytest.mark.parametrize("encrypt", [False, True], ids=["sealed", "encrypted"])
def test_sealed_values_round_trip_whole_and_in_part(tiers, encrypt):
    tier = tiers(encrypt=encrypt)
    key = key_of(1)
    store(tier, key)
    assert torch.equal(read(tier, key), content(key))
    part = torch.zeros(2, LAYOUT.layer_bytes, dtype=torch.uint8)
    tier.read_into(0, key, part, slice(1, 3))
    assert torch.equal(part, content(key)[1:3])
    other = key_of(11)
    store(tier, other)
    registered = torch.zeros(2 * LAYOUT.block_bytes, dtype=torch.uint8).view(2, LAYOUT.num_layers, LAYOUT.layer_bytes)
    assert tier.read_many_into([0, 0], [key, other], [registered[0], registered[1]]) == [None, None]  # one batch get
    assert torch.equal(registered[0], content(key)) and torch.equal(registered[1], content(other))


def test_names_are_not_derivable_from_the_public_key_scheme(tiers, attacker):
    tier = tiers()
    key = key_of(2)
    store(tier, key)
    public_name = f"kvstrata/{tier.namespace_tag}/{key.hex()}"  # what an unkeyed tier would use
    assert tier.object_name(key) != public_name
    assert attacker.get(public_name) is None
    assert tier.exists([key]) == [True]


def test_a_forged_value_with_a_valid_header_and_checksum_is_a_miss(tiers, attacker):
    tier = tiers()
    key = key_of(3)
    store(tier, key)
    forged = torch.full((LAYOUT.num_layers, LAYOUT.layer_bytes), 0x5A, dtype=torch.uint8)
    checksum = xxhash.xxh3_64_intdigest(forged.numpy())
    header = poolvalue.encode_header(key, poolvalue.layout_digest(LAYOUT.describe()), forged.numel(), checksum)
    attacker.put(tier.object_name(key), header + forged.numpy().tobytes())  # an upsert over the real one
    with pytest.raises(CorruptBlock, match="not sealed"):
        read(tier, key)


@pytest.mark.parametrize("encrypt", [False, True], ids=["sealed", "encrypted"])
@pytest.mark.parametrize("where", ["payload", "nonce", "key field", "last byte"])
def test_a_sealed_value_altered_anywhere_is_a_miss(tiers, attacker, where, encrypt):
    tier = tiers(encrypt=encrypt)
    key = key_of(4)
    store(tier, key)
    value = bytearray(attacker.get(tier.object_name(key)))
    offset = {"payload": poolvalue.HEADER_BYTES + 100, "nonce": 60, "key field": 20, "last byte": len(value) - 1}[where]
    value[offset] ^= 0x01
    if where != "payload":  # keep the header's own accident check consistent, as an attacker would
        body = bytes(value[:96])  # the header's body, then its own checksum (tiers/poolvalue.py)
        value[96:104] = xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")
    attacker.put(tier.object_name(key), bytes(value))
    with pytest.raises(CorruptBlock):
        read(tier, key)


def test_a_replayed_value_under_another_blocks_name_is_a_miss(tiers, attacker):
    tier = tiers()
    a, b = key_of(5), key_of(6)
    store(tier, a)
    store(tier, b)
    attacker.put(tier.object_name(b), attacker.get(tier.object_name(a)))
    with pytest.raises(CorruptBlock, match="holds block"):
        read(tier, b)
    assert torch.equal(read(tier, a), content(a))


@pytest.mark.parametrize("with_secret", [True, False], ids=["sealed", "unsealed"])
def test_an_older_value_of_the_same_block_put_back_after_a_newer_one_is_a_miss(tiers, attacker, with_secret):
    # A replay: the value of block A as first stored, kept by whoever read it, put back after
    # the tier stored A anew (the pool had lost it) with other bytes. Sealed and intact, it
    # passed every check before values carried their write time.
    tier = tiers(with_secret=with_secret)
    key = key_of(8)
    store(tier, key)
    old = attacker.get(tier.object_name(key))
    assert tier.remove_from_pool([key], force=True) == [True]
    newer = content(key) ^ 0xFF
    tier.write(0, key, newer)
    assert torch.equal(read(tier, key), newer)
    attacker.put(tier.object_name(key), old)
    with pytest.raises(CorruptBlock, match="replay"):
        read(tier, key)
    batch = torch.zeros(LAYOUT.block_bytes, dtype=torch.uint8).view(1, LAYOUT.num_layers, LAYOUT.layer_bytes)
    (error,) = tier.read_many_into([0], [key], list(batch))  # batched reads refuse it too
    assert isinstance(error, CorruptBlock) and "replay" in str(error)


def test_without_the_secret_sealed_values_are_refused_and_the_payload_hidden_when_encrypted(tiers, attacker):
    tag = fresh_tag()
    sealed, blind = tiers(encrypt=True, tag=tag), tiers(tag=tag, with_secret=False)
    key = key_of(7)
    store(sealed, key)
    stored = attacker.get(sealed.object_name(key))
    plain = content(key).numpy().tobytes()
    assert stored is not None and plain[:64] not in stored and plain[-64:] not in stored  # ciphertext only
    blind_name = blind.object_name(key)  # an unkeyed tier's name: a different object
    assert blind_name != sealed.object_name(key) and attacker.get(blind_name) is None


@pytest.mark.parametrize(("text", "mode", "message"), [
    ("00" * 32, 0o644, "readable by others"),
    ("abc", 0o600, "64 hex digits"),
])
def test_a_weak_secret_file_is_refused(tmp_path, text, mode, message):
    path = tmp_path / "secret"
    path.write_text(text)
    path.chmod(mode)
    with pytest.raises(ValueError, match=message):
        read_secret(PoolConfig(master="127.0.0.1:1", secret_file=str(path)))
