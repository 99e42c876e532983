"""The on-disk format of one block: a self-describing, checksummed header, then the payload.

Version 1, little-endian::

    offset  bytes   field
    0       8       magic b"KVSTRATA"
    8       2       format version (1)
    10      2       reserved (0)
    12      4       header_bytes: where the payload starts (a multiple of 4096, so the payload is
                    page-aligned in the file and O_DIRECT / GPUDirect Storage reads stay possible)
    16      4       body_bytes: the header bytes covered by the header checksum
    20      16      key
    36      8       payload_bytes (= layout.block_bytes)
    44      4       num_layers
    48      8       layer_bytes
    56      2       length of the layout description
    58      2       length of the namespace tag
    60      ...     layout.describe() (UTF-8), then the namespace tag (UTF-8, may be empty)
    ...     8 * L   xxh3_64 of each layer's payload bytes, layer 0 first
    body    8       xxh3_64 of header bytes [0, body_bytes): the header protects itself
    ...             zeros up to header_bytes
    header_bytes    payload: uint8 [num_layers, layer_bytes]

Per-layer checksums (rather than one over the payload) let a partial read verify exactly the
layers it read, so a restore can hand out layer 0 before the rest has arrived; a full read
verifies every layer, which covers the whole payload. xxh3_64 runs at ~30 GB/s on one core here,
far above the disk, so verifying every read costs little.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvstrata.errors import CorruptBlock
from kvstrata.index.keys import KEY_BYTES, BlockKey

MAGIC = b"KVSTRATA"
VERSION = 1
PAGE_BYTES = 4096
MAX_HEADER_BYTES = 1 << 20  # a sanity bound before trusting a length read from disk
_PREFIX = struct.Struct("<8sHHII16sQIQHH")  # fields at offsets 0..59 above
_CHECKSUM = struct.Struct("<Q")


@dataclass(frozen=True)
class BlockHeader:
    key: BlockKey
    layout: str  # layout.describe() of the writer
    namespace_tag: str
    payload_bytes: int
    num_layers: int
    layer_bytes: int
    header_bytes: int
    layer_checksums: tuple[int, ...]

    @property
    def file_bytes(self) -> int:
        return self.header_bytes + self.payload_bytes


def rows(parts: Sequence[np.ndarray], row_bytes: int) -> Iterator[list[np.ndarray]]:
    """Each ``row_bytes`` row of the concatenation of ``parts`` (uint8, C-contiguous, taken
    flat, in order), as the slices of ``parts`` that hold it: one slice, or several where the
    row spans parts. No copies.

    Raises:
        ValueError: the parts end inside a row, or ``row_bytes`` is not positive.
    """
    if row_bytes <= 0:
        raise ValueError(f"rows need a positive row_bytes, got {row_bytes}")
    row: list[np.ndarray] = []
    need = row_bytes
    for part in parts:
        flat, at = part.reshape(-1), 0
        while at < flat.size:
            take = min(need, flat.size - at)
            row.append(flat[at : at + take])
            at, need = at + take, need - take
            if need == 0:
                yield row
                row, need = [], row_bytes
    if row:
        raise ValueError(f"payload parts end {row_bytes - need} bytes into a row of {row_bytes}")


def span(parts: Sequence[np.ndarray], start: int, stop: int) -> list[np.ndarray]:
    """Bytes ``[start, stop)`` of the concatenation of ``parts`` (flat uint8), as slices of them."""
    out: list[np.ndarray] = []
    at = 0  # where the current part starts in the concatenation
    for part in parts:
        lo, hi = max(start - at, 0), min(stop - at, part.size)
        if lo < hi:
            out.append(part[lo:hi])
        at += part.size
        if at >= stop:
            break
    return out


def xxh3_of(parts: Sequence[np.ndarray]) -> int:
    """xxh3_64 of the parts' bytes joined (streamed: no join); the disk's rows and the pool's
    payload checksums both."""
    if len(parts) == 1:
        return xxhash.xxh3_64_intdigest(parts[0])
    hasher = xxhash.xxh3_64()
    for part in parts:
        hasher.update(part)
    return hasher.intdigest()


def layer_checksums(parts: Sequence[np.ndarray], layer_bytes: int) -> tuple[int, ...]:
    """xxh3_64 of each ``layer_bytes`` row of the payload given as ``parts`` (see ``rows``).
    Parts of whole rows (the usual case: a page's K and V) are hashed row by row as one array's
    rows, the per-row Python of ``rows`` spared (a quarter of a warm 2 MiB read's time)."""
    if all(part.size % layer_bytes == 0 for part in parts):
        digest = xxhash.xxh3_64_intdigest
        return tuple(digest(row) for part in parts for row in part.reshape(-1, layer_bytes))
    return tuple(xxh3_of(row) for row in rows(parts, layer_bytes))


def encode_header(key: BlockKey, layout: str, namespace_tag: str, parts: Sequence[np.ndarray], layer_bytes: int) -> bytes:
    """The header for the payload given as ``parts`` (flat uint8, in order; rows of
    ``layer_bytes``, which may span parts), padded to whole pages."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"a block key is {KEY_BYTES} bytes, got {key!r}")
    checksums = layer_checksums(parts, layer_bytes)
    num_layers = len(checksums)
    desc, tag = layout.encode(), namespace_tag.encode()
    body_bytes = _PREFIX.size + len(desc) + len(tag) + _CHECKSUM.size * num_layers
    header_bytes = -(-(body_bytes + _CHECKSUM.size) // PAGE_BYTES) * PAGE_BYTES
    prefix = _PREFIX.pack(
        MAGIC, VERSION, 0, header_bytes, body_bytes, key, num_layers * layer_bytes, num_layers, layer_bytes, len(desc),
        len(tag)
    )
    body = prefix + desc + tag + struct.pack(f"<{num_layers}Q", *checksums)
    padding = bytes(header_bytes - body_bytes - _CHECKSUM.size)
    return body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body)) + padding


def header_length(head: bytes) -> int:
    """Bytes of a header that ``decode_header`` needs, from its first page (or what there is).

    Raises:
        CorruptBlock: not a block file of this version, or implausible lengths.
    """
    if len(head) < _PREFIX.size:
        raise CorruptBlock(f"header truncated: {len(head)} bytes")
    magic, version, _, header_bytes, body_bytes, *_ = _PREFIX.unpack_from(head)
    if magic != MAGIC:
        raise CorruptBlock(f"bad magic {magic!r}")
    if version != VERSION:
        raise CorruptBlock(f"format version {version}, this build reads {VERSION}")
    if not (header_bytes % PAGE_BYTES == 0 and 0 < header_bytes <= MAX_HEADER_BYTES):
        raise CorruptBlock(f"implausible header_bytes {header_bytes}")
    if not _PREFIX.size <= body_bytes <= header_bytes - _CHECKSUM.size:
        raise CorruptBlock(f"implausible body_bytes {body_bytes} for header_bytes {header_bytes}")
    return body_bytes + _CHECKSUM.size


def decode_header(head: bytes) -> BlockHeader:
    """Parse and verify a header (its own checksum and internal consistency).

    Raises:
        CorruptBlock: anything does not verify.
    """
    need = header_length(head)
    if len(head) < need:
        raise CorruptBlock(f"header truncated: {len(head)} of {need} bytes")
    body_bytes = need - _CHECKSUM.size
    (stored,) = _CHECKSUM.unpack_from(head, body_bytes)
    if xxhash.xxh3_64_intdigest(memoryview(head)[:body_bytes]) != stored:
        raise CorruptBlock("header checksum mismatch")
    fields = _PREFIX.unpack_from(head)
    header_bytes, key, payload_bytes, num_layers, layer_bytes, desc_len, tag_len = fields[3], *fields[5:]
    if body_bytes != _PREFIX.size + desc_len + tag_len + _CHECKSUM.size * num_layers:
        raise CorruptBlock("header lengths do not add up")
    if payload_bytes != num_layers * layer_bytes:
        raise CorruptBlock(f"payload_bytes {payload_bytes} != {num_layers} layers x {layer_bytes}")
    at = _PREFIX.size
    try:
        layout = head[at : at + desc_len].decode()
        namespace_tag = head[at + desc_len : at + desc_len + tag_len].decode()
    except UnicodeDecodeError as e:
        raise CorruptBlock(f"header text is not UTF-8: {e}") from None
    checksums = struct.unpack_from(f"<{num_layers}Q", head, at + desc_len + tag_len)
    return BlockHeader(key, layout, namespace_tag, payload_bytes, num_layers, layer_bytes, header_bytes, checksums)


def verify_layers(header: BlockHeader, parts: Sequence[np.ndarray], first_layer: int) -> None:
    """Check the rows of the bytes given as ``parts`` (flat uint8 of whole rows, in order:
    layers ``first_layer``, ``first_layer + 1``, ...) against the header.

    Raises:
        CorruptBlock: a layer's checksum does not match.
    """
    got = layer_checksums(parts, header.layer_bytes)
    expected = header.layer_checksums[first_layer : first_layer + len(got)]
    for offset, (have, want) in enumerate(zip(got, expected)):
        if have != want:
            raise CorruptBlock(f"layer {first_layer + offset} checksum mismatch")
