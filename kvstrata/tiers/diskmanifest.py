"""The disk tier's manifest: what it wrote, so a restart need not read every block's header.

Why. Recovery used to open every block file and read and check its header: one small random
read per block, ~0.5 ms each with the page cache cold, so 100K blocks took ~50 s (~24 s warm)
before the first hit. A manifest lets it take a file it wrote itself as it is, with no system
call per block: ``scandir`` gives each file's name and inode, and a file whose inode is the one
the manifest holds is the file the tier wrote (a write or a copy in its place, by ``os.replace``,
is another inode).

What it holds. The tier writes it on close (atomically: a temp file renamed over it): the
layout and namespace tag of the tier, then one :class:`Stamp` per block (inode, size, mtime as
``fstat`` saw the file when the tier had just written it, or checked it at a start), in write
order: the order a start adopts the blocks in (LRU evicts the least recently written first).
Without ``fsync``, a block written in the last :data:`SETTLE_NS` before the close is left out:
its bytes may still be dirty in the page cache (the kernel writes them back within ~30 s), so a
power loss soon after the close could leave it torn under its name; left out, its header is
checked at the next start like any file the manifest does not vouch for.

What it does not do. It vouches for a file's identity, not its bytes: a file damaged in place
(truncated, a bit flipped: same inode) is taken at the start, and its first read fails, since
every read checks the header, the file size and each layer's checksum (``kvstrata.tiers.disk``)
and the cache then drops the block: no damaged block is ever served, whatever the manifest says.
A manifest of another layout or namespace, or whose own checksum fails, is ignored (every header
is read, as without one); one left by a tier that crashed is stale but safe: it vouches only for
files still of the inode it saw, and every other file is checked.

Format, little-endian: magic ``b"KVSMANI1"``, u32 count, u16 layout length, u16 tag length,
the layout text and tag (UTF-8), ``count`` keys (16 bytes each), then ``count`` each of inode
(u64), size (u64) and mtime_ns (i64), then the xxh3_64 of everything before it.
"""

from __future__ import annotations

import itertools
import os
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xxhash

from kvstrata.index.keys import KEY_BYTES, BlockKey

NAME = ".manifest"
TEMP_NAME = ".manifest.tmp"
MAGIC = b"KVSMANI1"
SETTLE_NS = 30_000_000_000  # without fsync, a block younger than this at close is not vouched for (module text)
_HEAD = struct.Struct("<8sIHH")
_CHECKSUM = struct.Struct("<Q")


class Stamp(NamedTuple):
    """A block file as ``fstat`` saw it once it was whole (a tuple: recovery makes and compares
    one per block, ~10x cheaper than a frozen dataclass)."""

    inode: int
    size_bytes: int
    mtime_ns: int

    @staticmethod
    def of(st: os.stat_result) -> Stamp:
        return Stamp(st.st_ino, st.st_size, st.st_mtime_ns)


def encode(layout: str, namespace_tag: str, stamps: dict[BlockKey, Stamp]) -> bytes:
    desc, tag = layout.encode(), namespace_tag.encode()
    values = list(stamps.values())
    body = b"".join((
        _HEAD.pack(MAGIC, len(values), len(desc), len(tag)), desc, tag, b"".join(stamps),
        np.array([s.inode for s in values], dtype="<u8").tobytes(),
        np.array([s.size_bytes for s in values], dtype="<u8").tobytes(),
        np.array([s.mtime_ns for s in values], dtype="<i8").tobytes(),
    ))
    return body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def decode(data: bytes, layout: str, namespace_tag: str) -> dict[BlockKey, Stamp] | None:
    """The stamps in ``data``; None if it is not a whole manifest of this layout and namespace."""
    if len(data) < _HEAD.size + _CHECKSUM.size:
        return None
    body = memoryview(data)[: -_CHECKSUM.size]
    if xxhash.xxh3_64_intdigest(body) != _CHECKSUM.unpack_from(data, len(body))[0]:
        return None
    magic, count, desc_len, tag_len = _HEAD.unpack_from(data)
    at = _HEAD.size
    if magic != MAGIC or len(body) != at + desc_len + tag_len + count * (KEY_BYTES + 24):
        return None
    if bytes(body[at : at + desc_len]) != layout.encode() or bytes(
            body[at + desc_len : at + desc_len + tag_len]) != namespace_tag.encode():
        return None
    at += desc_len + tag_len
    keys = bytes(body[at : at + count * KEY_BYTES])
    at += count * KEY_BYTES
    inodes = np.frombuffer(body, "<u8", count, at).tolist()
    sizes = np.frombuffer(body, "<u8", count, at + 8 * count).tolist()
    mtimes = np.frombuffer(body, "<i8", count, at + 16 * count).tolist()
    split = map(keys.__getitem__, map(slice, range(0, len(keys), KEY_BYTES), range(KEY_BYTES, len(keys) + 1, KEY_BYTES)))
    # tuple.__new__ straight (in C): Stamp(...) and Stamp._make run Python code, ~1 us a block.
    return dict(zip(split, map(tuple.__new__, itertools.repeat(Stamp), zip(inodes, sizes, mtimes))))


def read(directory: Path, layout: str, namespace_tag: str) -> dict[BlockKey, Stamp]:
    """The manifest in ``directory``, or no stamps if there is none this tier can trust."""
    try:
        data = (directory / NAME).read_bytes()
    except OSError:
        return {}
    return decode(data, layout, namespace_tag) or {}


def write(directory: Path, layout: str, namespace_tag: str, stamps: dict[BlockKey, Stamp], now_ns: int,
          fsync: bool, mode: int) -> None:
    """Replace the manifest with ``stamps`` (in write order: the order a start adopts them in),
    less those younger than :data:`SETTLE_NS` at ``now_ns`` unless ``fsync``.

    Raises:
        OSError: it could not be written (the old one, if any, stays: stale is safe).
    """
    oldest = now_ns - (0 if fsync else SETTLE_NS)  # fsynced writes are on the disk when they return
    settled = {key: s for key, s in stamps.items() if s.mtime_ns <= oldest}
    data = encode(layout, namespace_tag, settled)
    temp = directory / TEMP_NAME
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temp, directory / NAME)
