"""The disk tier: one file per block in a local directory, written atomically, verified on read.

Where blocks live. A tier owns one directory: ``directory``, or ``directory/<namespace_tag>``
when a tag is given, so tiers of different namespaces never scan, count or evict each other's
blocks (their keys could not collide anyway: keys are chained from the namespace digest). Block
``key`` is the file ``<key hex>.kvb`` in the format of ``kvstrata.tiers.blockfile``; the block
manager's slot is bookkeeping only. A ``.lock`` file, ``flock``-ed while the tier is open, keeps a second
tier (in this process or another) out of the directory, since each would delete the other's
temp files and overrun the capacity. Both directories must be this user's, 0700, and no symlink
(``kvstrata.trust``): the owner of one could plant blocks that verify (the checksums are no
secret), delete the tier's, or point a namespace at another place for the writes.

Why a file per block rather than slab files (measured in ``benchmarks/disk_layout.py``, whose
docstring has the numbers): at >= 1 MiB per block, cold reads in the order a restore asks for
blocks run level with a slab (1 MiB, 4 threads: 1.8-2.2 vs 2.0-2.2 GB/s); atomic writes come from
``os.replace``, recovery from the file name, and slots stay the block manager's to assign (a slab
would need the manager to re-adopt a key at its old slot on recovery). The price is one create + rename
per write and one unlink per eviction (~100-500 us each on the VM measured), which makes writes
of blocks below ~1 MiB several times slower than a slab's: keep disk blocks big.

Why buffered reads rather than ``O_DIRECT`` (tried in this tier's history, commit "disk tier:
read a block from the page cache when it holds it ..."): on the VM of the benchmark the disk's
readahead (``read_ahead_kb`` 8192) keeps I/O in flight while a reader waits for a CPU, and
synchronous ``O_DIRECT`` pieces leave the disk idle between them. Cold, 16 blocks of 32 MiB,
median of 8 interleaved rounds against one plain ``readinto`` of the same bytes (the VM loaded
by other work): one reader 1.08x buffered, 0.65x / 0.72x ``O_DIRECT`` in 8 / 32 MiB pieces;
two readers 1.93x buffered, 0.93x / 0.98x ``O_DIRECT``. Measure again on a disk without that
readahead (NVMe, ``read_ahead_kb`` 128) before deciding otherwise.

Why four readers (``readers``: the transfer worker reads a load's blocks on four threads of
the tier's own, whatever its byte movers): a reader of a cold block spends most of its time
waiting for the device, not on a CPU, so more readers than the two movers keep more of the disk
busy. Cold, 16 blocks of 32 MiB, median of 12 interleaved rounds against one plain ``readinto``
of the same bytes, each read given freshly freed memory first (``kvstrata.calibrate.ballast``): two
readers 0.89x, three 1.06x, four 1.02x, six 1.06x; warm (from the page cache, CPU-bound) two
and four read alike (0.69x and 0.67x of a plain memory copy). ``POSIX_FADV_WILLNEED`` on each
block as it opens lost (0.44x one reader, 0.40x two), ``POSIX_FADV_SEQUENTIAL`` did nothing
(0.85x against 0.82x), and 4 MiB pieces instead of 1 MiB read alike (0.87x, two readers).

Atomic writes. A block is written to ``.<key hex>.<n>.tmp`` in the same directory, fsynced if
``fsync``, then renamed over its final name, so a torn write is never visible under that name and
a crash leaves at most a temp file, which the next start deletes. With ``fsync=True`` the
directory is fsynced after the rename too, so a block ``write`` returned for survives power
loss; without it a block survives a process crash (the page cache holds it), and a power loss
can leave a file that fails verification, which is then never served.

Verification. Every read checks the header (magic, version, its own checksum, key, layout,
namespace tag, sizes), the file size (header + payload: catches truncation) and the xxh3_64 of
every layer it read, piece by piece as it reads (``READ_CHUNK_BYTES``); a partial read verifies
just its layers. Recovery at start never reads payloads (``kvstrata.tiers.diskdir``: a block the
manifest of the last close vouches for costs no system call of its own, any other has its header
and size checked). Every read checks header, size and layers anyway, so a block damaged in place
(truncated, a bit flipped, its payload rotted) raises CorruptBlock on its first read and the
caller drops it: it is never served.

Pieces. ``write_pieces`` and ``read_pieces`` move a block from and into a caller's pieces as
they lie, with vectored I/O (``writev``, ``preadv``) of the same file as ``write`` and
``read_into``, through the same code (a whole block is one piece); a layer's checksum covers its
row of the payload wherever the pieces cut it.

Read cap. ``read_gbps`` emulates slower storage: every read is paced on one virtual clock shared
by all threads (``kvstrata.tiers.diskio.ReadPacer``). Recovery's header reads at start are not paced.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from kvstrata import trust
from kvstrata.errors import CorruptBlock, TierUnavailable
from kvstrata.index.keys import KEY_BYTES, BlockKey
from kvstrata.kv.layout import KVLayout
from kvstrata.media import Medium
from kvstrata.tiers import blockfile, diskdir, diskmanifest
from kvstrata.tiers.base import Pieces, Tier, TierCapabilities, outcome
from kvstrata.tiers.diskdir import FILE_MODE
from kvstrata.tiers.diskio import ReadPacer, read_exact, unlink_quietly, write_all

_log = logging.getLogger("kvstrata.tiers")
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# A read goes this many bytes (whole layers, at least one) at a time and checksums each piece
# right after it lands, while it is still in the CPU's cache. Reading a 32 MiB block whole and
# checksumming it after made the checksum re-read it from DRAM: warm reads ran at 10.4 GB/s
# against 13.1 GB/s in 1 MiB pieces, cold at 2.7 against 3.2 (VM of the benchmark, 16 x 32 MiB
# blocks; no checksum at all: 15.7 and 3.1). See ``kvstrata bench cache``.
READ_CHUNK_BYTES = 1 << 20


class DiskTier(Tier):
    """Blocks as files in a directory on local disk.

    Args:
        layout: what every block holds; blocks written under another layout are never served.
        capacity_bytes: payload bytes to hold (each file adds a header of 4 KiB or more); a
            tier reopened smaller than the blocks it holds keeps them all (``recover``) until
            the block manager evicts the excess.
        directory: created (0700) if missing; one of this user's is tightened to 0700, and one
            of another user's, or a symlink, is refused (``kvstrata.trust.Untrusted``, a
            ValueError): its owner could plant blocks, delete them or redirect the writes.
        namespace_tag: a sub-directory for this namespace (e.g. ``Namespace.tag``), trusted as
            ``directory`` is.
        fsync: make each write durable against power loss (fsync file and directory).
        read_gbps: cap reads at this many decimal GB/s in aggregate (emulates slower storage);
            None: no cap.
    """

    medium = Medium.DISK
    capabilities = TierCapabilities(readers=4)  # cold reads wait on the device: four in flight beat two (module docstring)

    def __init__(
        self,
        layout: KVLayout,
        capacity_bytes: int,
        directory: str | os.PathLike[str],
        namespace_tag: str | None = None,
        fsync: bool = False,
        read_gbps: float | None = None,
    ) -> None:
        super().__init__(layout, capacity_bytes)
        self._pacer = ReadPacer(read_gbps) if read_gbps is not None else None
        if namespace_tag is not None and not _TAG.fullmatch(namespace_tag):
            raise ValueError(f"disk tier: namespace_tag must match {_TAG.pattern}, got {namespace_tag!r}")
        self.namespace_tag = namespace_tag or ""
        self.directory = Path(directory) / namespace_tag if namespace_tag else Path(directory)
        self.fsync = fsync
        self._layout_text = layout.describe()
        self._lock = threading.Lock()  # orders renames (write) against deletes (discard)
        self._temp_ids = itertools.count()
        self._removed: str | None = None  # why the tier takes no more blocks (its directory is gone)
        # Each block's file as the tier last saw it whole (written, or checked at start), in write
        # order: the manifest written on close, which lets the next start skip reading its header.
        self._stamps: dict[BlockKey, diskmanifest.Stamp] | None = None  # None until recovery is done
        trust.private_dir(directory, "disk tier directory")
        if namespace_tag:
            trust.private_dir(self.directory, "disk tier directory")
        self._lock_fd = diskdir.lock(self.directory)
        self._dir_fd: int | None = None
        try:
            self._dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            self._recovered = self._recover_from_disk()
        except BaseException:
            self.close()
            raise

    # --- the Tier interface ------------------------------------------------------------------

    def write(self, slot: int, key: BlockKey, src: torch.Tensor) -> None:
        """Store ``src`` (uint8 ``[layers, layer_bytes]``, any device) as the file of ``key``.

        ``slot`` is not used: the file name comes from the key.

        Raises:
            OSError: the file system refused (e.g. ENOSPC); no file is left behind.
            TierUnavailable: the tier's directory was removed under it (it takes no more blocks).
        """
        self._check_open()
        self._write_file(key, [self._host_array(src).reshape(-1)])  # shares src's memory when it can

    def write_pieces(self, slots: list[int], keys: list[BlockKey], blocks: Sequence[Pieces]) -> list[BaseException | None]:
        """Each block's file written from its pieces as they lie (one vectored write each), as
        ``write`` writes one block."""
        self._check_pieces(blocks)
        self._check_open()
        return [outcome(self._write_file, key, [p.numpy() for p in pieces])
                for _, key, pieces in zip(slots, keys, blocks, strict=True)]

    def read_into(self, slot: int, key: BlockKey, dst: torch.Tensor, layers: slice = slice(None)) -> None:
        """Read layers ``layers`` of ``key`` into ``dst`` (uint8 ``[n_layers, layer_bytes]``).

        A contiguous CPU ``dst`` (e.g. a slice of a host pool) is read into directly; any other
        goes through a bounce buffer. Verified before returning.

        Raises:
            CorruptBlock: the file is missing, truncated, or does not verify; ``dst`` may hold
                some of its bytes and must be discarded.
        """
        self._check_open()
        start, stop = self._layer_range(layers)
        shape = (stop - start, self.layout.layer_bytes)
        if dst.dtype != torch.uint8 or tuple(dst.shape) != shape:
            raise ValueError(f"disk tier: dst must be uint8 {list(shape)}, got {dst.dtype} {list(dst.shape)}")
        direct = dst.device.type == "cpu" and dst.is_contiguous()
        buffer = dst.numpy() if direct else np.empty(shape, dtype=np.uint8)
        self._read_file(key, start, stop, [buffer.reshape(-1)])
        if not direct:
            dst.copy_(torch.from_numpy(buffer))

    def read_pieces(self, slots: list[int], keys: list[BlockKey], blocks: Sequence[Pieces]) -> list[BaseException | None]:
        """Each block's file read into its pieces as they lie (vectored reads), verified, as
        ``read_into`` reads one whole block."""
        self._check_pieces(blocks)
        self._check_open()
        layers = self.layout.num_layers
        return [outcome(self._read_file, key, 0, layers, [p.numpy() for p in pieces])
                for _, key, pieces in zip(slots, keys, blocks, strict=True)]

    def discard(self, slot: int, key: BlockKey) -> None:
        """Delete the file of a block leaving the tier. The block manager calls this while the
        block is EVICTING, before it forgets the key, so no new write of the key can be under way."""
        with self._lock:
            self._check_open()
            unlink_quietly(self._path(key))
            self._stamps.pop(key, None)

    def recover(self) -> list[BlockKey]:
        """The blocks the constructor found intact, oldest write first (all of them: more than
        ``capacity_blocks`` where the tier was reopened smaller).

        Recovery runs once, in the constructor: rescanning later could delete the temp file of
        a write in flight.
        """
        return list(self._recovered)

    def close(self) -> None:
        """Write the manifest, release the directory (its lock); the files stay for the next
        tier to recover.

        Idempotent; afterwards ``write``, ``read_into`` and ``discard`` raise RuntimeError,
        since another tier may own the directory by then.
        """
        with self._lock:
            if self._lock_fd is not None and self._stamps is not None and self._removed is None:
                self._write_manifest()
            for name in ("_dir_fd", "_lock_fd"):
                fd = getattr(self, name)
                if fd is not None:
                    setattr(self, name, None)
                    os.close(fd)

    def _check_open(self) -> None:
        if self._lock_fd is None:
            raise RuntimeError(f"disk tier on {self.directory} is closed")

    # --- files -------------------------------------------------------------------------------

    def _path(self, key: BlockKey) -> Path:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise ValueError(f"disk tier: a block key is {KEY_BYTES} bytes, got {key!r}")
        return self.directory / diskdir.block_name(key)

    def _open_block(self, key: BlockKey) -> int:
        """The open file of ``key``: a regular file, never followed through a link, never a
        FIFO or device that could block the reader.

        Raises:
            CorruptBlock: no such file, or not one that can hold a block (a miss: dropped).
        """
        name = key.hex()[:12]
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            raise CorruptBlock(f"disk tier: block {name} has no file") from None
        except OSError as error:  # a directory or a link in its place, no permission, ...
            raise CorruptBlock(f"disk tier: block {name} cannot be opened: {error}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CorruptBlock(f"disk tier: block {name} is not a regular file")
        return fd

    def _write_file(self, key: BlockKey, parts: list[np.ndarray]) -> None:
        """Write the file of ``key`` from its payload given as ``parts`` (flat uint8, in order),
        atomically (module docstring). Raises as ``write``."""
        if self._removed is not None:
            raise TierUnavailable(self._removed)
        header = blockfile.encode_header(key, self._layout_text, self.namespace_tag, parts, self.layout.layer_bytes)
        final = self._path(key)
        temp = self.directory / diskdir.temp_name(key, next(self._temp_ids))
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
            try:
                write_all(fd, [memoryview(header), *(memoryview(part) for part in parts)])
                if self.fsync:
                    os.fsync(fd)
                stamp = diskmanifest.Stamp.of(os.fstat(fd))  # whole: the manifest vouches for this
            finally:
                os.close(fd)
            with self._lock:
                self._check_open()  # closed mid-write: the directory may be another tier's now
                os.replace(temp, final)
                if self.fsync:
                    try:
                        os.fsync(self._dir_fd)  # the rename itself survives power loss
                    except BaseException:
                        unlink_quietly(final)  # write raises, so the caller frees the slot
                        raise
                self._stamps.pop(key, None)  # then last: the dict stays in write order, the manifest's
                self._stamps[key] = stamp
        except FileNotFoundError:
            if os.fstat(self._dir_fd).st_nlink == 0:  # the directory itself was removed
                self._removed = f"disk tier: its directory {self.directory} was removed while open; it takes no more blocks"
                _log.error("%s", self._removed)
                raise TierUnavailable(self._removed) from None
            raise
        except BaseException:
            unlink_quietly(temp)
            raise

    def _read_file(self, key: BlockKey, start: int, stop: int, parts: list[np.ndarray]) -> None:
        """Read layers ``[start, stop)`` of ``key`` into ``parts`` (flat uint8, in order, as many
        bytes in all), verified. Raises as ``read_into``."""
        layer_bytes = self.layout.layer_bytes
        fd = self._open_block(key)
        try:
            header = self._verified_header(fd, key)
            if self._pacer is not None:
                finish = self._pacer.book(header.header_bytes + (stop - start) * layer_bytes)
            # Whole layers, about READ_CHUNK_BYTES at a time, each checked as soon as it lands.
            step = max(1, READ_CHUNK_BYTES // layer_bytes) * layer_bytes
            size = (stop - start) * layer_bytes
            for first in range(0, size, step):
                rows = blockfile.span(parts, first, min(size, first + step))  # <= step bytes of whole layers
                offset = header.header_bytes + start * layer_bytes + first
                if not read_exact(fd, [memoryview(r) for r in rows], offset):
                    raise CorruptBlock(f"disk tier: block {key.hex()[:12]} truncated while reading")
                blockfile.verify_layers(header, rows, start + first // layer_bytes)
        except OSError as error:  # an I/O error mid-read: the block cannot be had, a miss
            raise CorruptBlock(f"disk tier: block {key.hex()[:12]} unreadable: {error}") from None
        finally:
            os.close(fd)
        if self._pacer is not None:
            self._pacer.wait(finish)

    def _verified_header(self, fd: int, key: BlockKey) -> blockfile.BlockHeader:
        """The header of the open block file ``fd``, checked against ``key`` and this tier.

        Raises:
            CorruptBlock: bad header, another key/layout/namespace, or a file of the wrong size.
        """
        head = os.pread(fd, blockfile.PAGE_BYTES, 0)
        need = blockfile.header_length(head)
        if need > len(head):
            head += os.pread(fd, need - len(head), len(head))
        header = blockfile.decode_header(head)
        name = key.hex()[:12]
        if header.key != key:
            raise CorruptBlock(f"disk tier: file of {name} holds block {header.key.hex()[:12]}")
        if header.layout != self._layout_text:
            raise CorruptBlock(f"disk tier: block {name} has layout {header.layout!r}, tier has {self._layout_text!r}")
        if header.namespace_tag != self.namespace_tag:
            raise CorruptBlock(f"disk tier: block {name} has namespace {header.namespace_tag!r}")
        if (header.num_layers, header.layer_bytes) != (self.layout.num_layers, self.layout.layer_bytes):
            raise CorruptBlock(f"disk tier: block {name} has {header.num_layers} x {header.layer_bytes} bytes")
        size = os.fstat(fd).st_size
        if size != header.file_bytes:
            raise CorruptBlock(f"disk tier: block {name} file is {size} bytes, header says {header.file_bytes}")
        return header

    def _recover_from_disk(self) -> list[BlockKey]:
        """Delete temp files and blocks that do not verify; return the rest, oldest first.

        The blocks are listed in write order (adopted in that order, LRU after a restart evicts
        the least recently *written*), all of them, even beyond the capacity (a tier reopened
        smaller): deleting the excess here made a start slow (47,570 of 67,570 blocks: 40 s) and
        threw away blocks a restart could serve; the block manager adopts them all and evicts
        the excess by its policy as new blocks need room.
        """
        vouched = diskmanifest.read(self.directory, self._layout_text, self.namespace_tag)  # in write order
        stamps = diskdir.scan(self.directory, vouched, self._verified_stamp)
        found = list(stamps)
        excess = len(found) - self.capacity_blocks
        if excess > 0:
            _log.warning("disk tier %s: %d blocks found, %d fit its capacity (%d bytes): all kept and served; "
                         "the %d in excess (%d bytes) leave by the eviction policy as new blocks need room",
                         self.directory, len(found), self.capacity_blocks, self.capacity_bytes, excess,
                         excess * self.layout.block_bytes)
        self._stamps = stamps
        return found

    def _verified_stamp(self, path: str, key: BlockKey) -> diskmanifest.Stamp:
        """The stamp of the block file at ``path`` once its header checks out for ``key``.

        Raises:
            CorruptBlock, OSError: it does not (the caller deletes it).
        """
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._verified_header(fd, key)
            return diskmanifest.Stamp.of(os.fstat(fd))
        finally:
            os.close(fd)

    def _write_manifest(self) -> None:
        """The manifest of the blocks here now (under the lock, at close); a failure is logged:
        the next start then reads the headers a stale or missing manifest does not vouch for."""
        try:
            diskmanifest.write(self.directory, self._layout_text, self.namespace_tag, self._stamps, time.time_ns(),
                               self.fsync, FILE_MODE)
        except OSError as error:
            _log.warning("disk tier %s: no manifest written (%s); the next start reads every header it does not vouch for", self.directory,
                         error)

    # --- helpers ------------------------------------------------------------------------------

    def _host_array(self, src: torch.Tensor) -> np.ndarray:
        shape = (self.layout.num_layers, self.layout.layer_bytes)
        if src.dtype != torch.uint8 or tuple(src.shape) != shape:
            raise ValueError(f"disk tier: src must be uint8 {list(shape)}, got {src.dtype} {list(src.shape)}")
        return src.detach().cpu().contiguous().numpy()  # no copy for a contiguous CPU tensor
