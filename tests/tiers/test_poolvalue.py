"""A pool value sealed and opened in memory (no pool): encryption streamed into place, names keyed."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvstrata.errors import CorruptBlock
from kvstrata.tiers import poolvalue

SECRET = bytes(range(32))
KEY = bytes(range(16))


def seal_of(encrypt: bool, payload_bytes: int, tag: str = "ns") -> poolvalue.ValueSeal:
    return poolvalue.ValueSeal("layout", payload_bytes, tag, SECRET, encrypt)


@pytest.mark.parametrize("sizes", [(20,), (7, 13), (1 << 20, 3, (1 << 18) + 5)], ids=["tiny", "two small", "big"])
def test_a_payload_in_parts_is_encrypted_into_a_buffer_of_its_own_and_opens_to_the_same_bytes(sizes):
    parts = [np.frombuffer(os.urandom(n), dtype=np.uint8) for n in sizes]
    plain = np.concatenate(parts)
    seal = seal_of(True, plain.size)
    into = np.zeros(plain.size, dtype=np.uint8)
    header, ciphertext = seal.seal(KEY, parts, 1, into=into)
    assert ciphertext is into
    assert not np.array_equal(into, plain)  # ciphertext, not the KV
    assert poolvalue.decode_header(header).encrypted
    seal.open(KEY, header, [into])  # decrypted in place, in chunks
    assert np.array_equal(into, plain)


def test_a_ciphertext_buffer_of_another_size_is_refused_in_one_line():
    seal = seal_of(True, 64)
    with pytest.raises(ValueError, match="ciphertext buffer of 32 bytes for 64 payload bytes"):
        seal.seal(KEY, [np.zeros(64, dtype=np.uint8)], 1, into=np.zeros(32, dtype=np.uint8))


def test_a_ciphertext_altered_in_its_last_chunk_is_refused():
    size = 2 * poolvalue.CIPHER_CHUNK + 100
    seal = seal_of(True, size)
    header, ciphertext = seal.seal(KEY, [np.frombuffer(os.urandom(size), dtype=np.uint8)], 1)
    ciphertext[-1] ^= 1
    with pytest.raises(CorruptBlock, match="fails authentication"):
        seal.open(KEY, header, [ciphertext])


def test_keyed_names_say_nothing_of_the_namespace_and_differ_per_namespace():
    # A listing of the pool (the master's HTTP port answers anyone) shows names: with a secret,
    # neither part of a name is the public namespace tag or block key.
    alice, bob = seal_of(True, 64, "0123456789abcdef"), seal_of(True, 64, "fedcba9876543210")
    name = alice.object_name(KEY)
    assert "0123456789abcdef" not in name and KEY.hex() not in name
    assert name != bob.object_name(KEY)
    assert name.rsplit("/", 1)[0] != bob.object_name(KEY).rsplit("/", 1)[0]  # namespaces apart, still
    assert name == seal_of(False, 64, "0123456789abcdef").object_name(KEY)  # encryption does not rename
    unsealed = poolvalue.ValueSeal("layout", 64, "0123456789abcdef", None)
    assert unsealed.object_name(KEY) == f"kvstrata/0123456789abcdef/{KEY.hex()}"  # no secret: public names


@pytest.mark.parametrize(("writer", "reader"), [(True, False), (False, True)], ids=["encrypted", "sealed"])
def test_a_value_opens_as_it_was_sealed_whatever_the_reader_writes(writer, reader):
    # Caches of one deployment that encrypt and that do not (pool_encrypt=False) share blocks.
    plain = np.frombuffer(os.urandom(1000), dtype=np.uint8)
    header, ciphertext = seal_of(writer, plain.size).seal(KEY, [plain.copy()], 1)
    stored = ciphertext if ciphertext is not None else plain.copy()
    seal_of(reader, plain.size).open(KEY, header, [stored])
    assert np.array_equal(stored, plain)


def test_a_value_whose_encrypted_flag_is_flipped_is_refused():
    plain = np.frombuffer(os.urandom(1000), dtype=np.uint8)
    header = bytearray(seal_of(False, plain.size).seal(KEY, [plain], 1)[0])
    header[10] |= 4  # flags: encrypted; the header's own accident check made consistent, as an attacker would
    header[96:104] = poolvalue.xxhash.xxh3_64_intdigest(bytes(header[:96])).to_bytes(8, "little")
    with pytest.raises(CorruptBlock, match="fails authentication"):
        seal_of(True, plain.size).open(KEY, bytes(header), [plain.copy()])
