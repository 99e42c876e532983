"""A disk tier's directory: the names of what lies in it, and the scan at start that recovers it.

Block ``key`` is the file ``<key hex>.kvb`` (``block_name``); a write goes to
``.<key hex>.<n>.tmp`` first (``temp_name``) and is renamed over it. Beside them lie the tier's
``.lock`` (``lock``: ``flock``-ed while the tier is open, so a second tier, in this process or
another, cannot delete its temp files or overrun its capacity), its ``.manifest``
(``kvstrata.tiers.diskmanifest``) and, in a directory shared by namespaces, their
sub-directories: ``scan`` touches none of those.

Recovery at start (``scan``) never reads payloads: a block the manifest of the last close vouches
for (its file still of the inode the tier wrote: ``scandir`` gives it, no system call per block)
is taken as it is, and any other block file has its header and size checked by the tier, one
small read (~0.5 ms with the page cache cold, so 100K blocks without a manifest take ~50 s; see
``kvstrata bench restart``). Temp files (of writes a crash cut short) and blocks that do not
check out are deleted.
"""

from __future__ import annotations

import fcntl
import os
import re
from collections.abc import Callable
from pathlib import Path

from kvstrata import trust
from kvstrata.errors import CorruptBlock
from kvstrata.index.keys import BlockKey
from kvstrata.tiers import diskmanifest
from kvstrata.tiers.diskio import unlink_quietly

SUFFIX = ".kvb"
FILE_MODE = 0o600  # the tier's files, as its directory (0700): the owner's only (KV is users' prompts)
LOCK_NAME = ".lock"
_BLOCK_NAME = re.compile(r"([0-9a-f]{32})\.kvb")
_TEMP_NAME = re.compile(r"\.[0-9a-f]{32}\.\d+\.tmp")


class DirectoryInUse(RuntimeError):
    """Another open disk tier (this process or another) holds the directory."""


def lock(directory: Path) -> int:
    """The open, ``flock``-ed lock file of ``directory``: the tier's while it stays open.

    Raises:
        DirectoryInUse: another open disk tier holds it.
    """
    fd = trust.open_private(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DirectoryInUse(f"disk tier: {directory} is in use by another open disk tier; close it first") from None
    return fd


def block_name(key: BlockKey) -> str:
    """The file name of block ``key``."""
    return f"{key.hex()}{SUFFIX}"


def temp_name(key: BlockKey, n: int) -> str:
    """The name of the ``n``-th temp file written for ``key`` (unique while the tier is open)."""
    return f".{key.hex()}.{n}.tmp"


def scan(directory: Path, vouched: dict[BlockKey, diskmanifest.Stamp],
         verified_stamp: Callable[[str, BlockKey], diskmanifest.Stamp]) -> dict[BlockKey, diskmanifest.Stamp]:
    """The blocks of ``directory`` and their stamps, in write order; temp files and blocks that
    do not check out deleted.

    Args:
        directory: the tier's directory.
        vouched: the manifest's blocks, in write order (``diskmanifest.read``).
        verified_stamp: the stamp of the block file at a path once its header checks out for a
            key; raises CorruptBlock or OSError if it does not (the file is then deleted).
    """
    present: set[BlockKey] = set()  # vouched for, and there
    checked: dict[BlockKey, diskmanifest.Stamp] = {}  # not vouched for, and its header checks out
    with os.scandir(directory) as entries:
        for entry in entries:
            match = _BLOCK_NAME.fullmatch(entry.name)
            if match is None:
                if _TEMP_NAME.fullmatch(entry.name) or entry.name == diskmanifest.TEMP_NAME:
                    unlink_quietly(entry.path)
                continue  # not ours (.lock, .manifest, sub-directories of other namespaces, ...)
            if not entry.is_file(follow_symlinks=False):
                continue
            key = bytes.fromhex(match[1])
            stamp = vouched.get(key)
            if stamp is not None and stamp.inode == entry.inode():
                present.add(key)
                continue
            try:
                checked[key] = verified_stamp(entry.path, key)
            except (CorruptBlock, OSError):
                unlink_quietly(entry.path)
    # In the manifest's order (write order); with nothing gone, the manifest's own dict.
    stamps = vouched if len(present) == len(vouched) else {k: s for k, s in vouched.items() if k in present}
    if checked:
        stamps.update(checked)
        stamps = {key: stamps[key] for key in sorted(stamps, key=lambda key: (stamps[key].mtime_ns, key))}
    return stamps
