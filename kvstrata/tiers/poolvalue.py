"""The format of one block in the shared pool: a 64-byte checksummed header, then the payload.

A pool value is stored as one object, written from two buffers (header, payload) and read back
into two or more, so the payload moves zero-copy between the pool and the caller's memory.

Version 1, little-endian::

    offset  bytes   field
    0       8       magic b"KVSPOOL\\x00"
    8       2       format version (1)
    10      2       flags: bit 0 = the payload checksum field is set
    12      4       reserved (0)
    16      16      key
    32      8       xxh3_64 of layout.describe(): blocks of another layout are never served
    40      8       payload_bytes (= layout.block_bytes)
    48      8       xxh3_64 of the payload (0 unless flag bit 0)
    56      8       xxh3_64 of bytes [0, 56): the header protects itself
    64              payload: uint8 [num_layers, layer_bytes]

One checksum over the whole payload, not one per layer as on disk: a read from the pool always
moves the whole object (Mooncake's ranged reads refused our sizes in 0.3.13), so there is no
partial read to verify on its own. The payload checksum is optional (``verify_payload``): the
pool's own transport is already checked, and hashing costs a pass over the bytes (~30 GB/s on
one core) on both ends.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from kvstrata.errors import CorruptBlock
from kvstrata.index.keys import KEY_BYTES, BlockKey

MAGIC = b"KVSPOOL\x00"
VERSION = 1
HEADER_BYTES = 64
_HAS_PAYLOAD_CHECKSUM = 1
_BODY = struct.Struct("<8sHHI16sQQQ")  # offsets 0..55 above
_CHECKSUM = struct.Struct("<Q")
assert _BODY.size + _CHECKSUM.size == HEADER_BYTES


@dataclass(frozen=True)
class ValueHeader:
    key: BlockKey
    layout_digest: int
    payload_bytes: int
    payload_checksum: int | None  # None: the writer did not checksum the payload


def layout_digest(layout_text: str) -> int:
    """The header's layout field for ``layout.describe()``."""
    return xxhash.xxh3_64_intdigest(layout_text.encode())


def encode_header(key: BlockKey, layout_digest: int, payload_bytes: int, payload_checksum: int | None) -> bytes:
    """The 64 header bytes of a value."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"a block key is {KEY_BYTES} bytes, got {key!r}")
    flags = 0 if payload_checksum is None else _HAS_PAYLOAD_CHECKSUM
    body = _BODY.pack(MAGIC, VERSION, flags, 0, key, layout_digest, payload_bytes, payload_checksum or 0)
    return body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def decode_header(head: bytes) -> ValueHeader:
    """Parse and verify a header (magic, version, its own checksum).

    Raises:
        CorruptBlock: anything does not verify.
    """
    if len(head) < HEADER_BYTES:
        raise CorruptBlock(f"pool value header truncated: {len(head)} bytes")
    magic, version, flags, _, key, layout, payload_bytes, payload_checksum = _BODY.unpack_from(head)
    if magic != MAGIC:
        raise CorruptBlock(f"pool value has bad magic {magic!r}")
    if version != VERSION:
        raise CorruptBlock(f"pool value format version {version}, this build reads {VERSION}")
    (stored,) = _CHECKSUM.unpack_from(head, _BODY.size)
    if xxhash.xxh3_64_intdigest(memoryview(head)[: _BODY.size]) != stored:
        raise CorruptBlock("pool value header checksum mismatch")
    checksum = payload_checksum if flags & _HAS_PAYLOAD_CHECKSUM else None
    return ValueHeader(key, layout, payload_bytes, checksum)
