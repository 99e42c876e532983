"""The plainest way to move the same bytes: what a figure of ours is measured against.

- ``Buffers``: the bytes under test held once on the device and once on the host, and two
  destinations (device, host) allocated and pre-faulted before any timing, so no baseline pays
  first-touch page faults (a write into fresh pages runs several times slower).
- ``copy_s``: one ``dst.copy_(src)`` of the whole size, synchronized on CUDA.
- ``RawFile``: one file written with plain ``write`` calls and read back with ``readinto``
  into the pre-faulted host buffer, sequentially, cold (page cache dropped) or warm.

Where there is no CUDA the "device" is a CPU tensor, as for the device tier.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from kvstrata.timing import VerificationError, drop_page_cache, warm_page_cache


def synchronize(*tensors: torch.Tensor) -> None:
    for device in {t.device for t in tensors if t.device.type == "cuda"}:
        torch.cuda.synchronize(device)


def _host_empty(size_bytes: int, pin: bool) -> torch.Tensor:
    buffer = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=pin)
    buffer.zero_()  # pre-fault
    return buffer


class Buffers:
    """The bytes under test and pre-faulted destinations, all flat uint8 of one size.

    Args:
        data: the bytes (any shape, uint8), on the device.
    """

    def __init__(self, data: torch.Tensor) -> None:
        if data.dtype != torch.uint8:
            raise ValueError(f"benchmark data must be uint8, got {data.dtype}")
        pin = data.device.type == "cuda"
        self.size_bytes = data.numel()
        self.device_data = data.reshape(-1)
        self.host_data = _host_empty(self.size_bytes, pin)
        self.host_data.copy_(self.device_data)
        self.device_dst = torch.zeros(self.size_bytes, dtype=torch.uint8, device=data.device)
        self.host_dst = _host_empty(self.size_bytes, pin)
        synchronize(self.device_dst)


def copy_s(dst: torch.Tensor, src: torch.Tensor) -> float:
    """Seconds for one plain ``dst.copy_(src)``, synchronized where CUDA is involved."""
    synchronize(dst, src)
    start = time.perf_counter()
    dst.copy_(src, non_blocking=True)  # asynchronous only for CUDA with a pinned host side
    synchronize(dst, src)
    return time.perf_counter() - start


class RawFile:
    """One file of the bytes under test, written and read the plain way.

    Args:
        path: the file (created by ``write_s``).
        buffers: ``host_data`` is written; reads land in ``host_dst``.
    """

    def __init__(self, path: str | os.PathLike[str], buffers: Buffers) -> None:
        self.path = Path(path)
        self._buffers = buffers

    def write_s(self) -> float:
        """Seconds to create the file and ``write`` every byte (buffered: no fsync timed).
        Afterwards, untimed, the file is fsynced and dropped from the page cache."""
        self.remove()
        view = memoryview(self._buffers.host_data.numpy())
        start = time.perf_counter()
        with open(self.path, "wb", buffering=0) as f:
            while view:
                view = view[f.write(view) :]
        seconds = time.perf_counter() - start
        drop_page_cache([self.path])
        return seconds

    def read_s(self, cold: bool) -> float:
        """Seconds to ``readinto`` the whole file into the pre-faulted host buffer; cold drops
        the page cache first, warm reads the file into it first (both untimed, as for ours).
        The bytes read are verified (untimed)."""
        dst = self._buffers.host_dst
        dst.zero_()  # a read that moved nothing must not verify
        if cold:
            drop_page_cache([self.path])
        else:
            warm_page_cache([self.path])
        view = memoryview(dst.numpy())
        start = time.perf_counter()
        with open(self.path, "rb", buffering=0) as f:
            while view:
                got = f.readinto(view)
                if not got:
                    raise VerificationError(f"{self.path} ended early")
                view = view[got:]
        seconds = time.perf_counter() - start
        if not torch.equal(dst, self._buffers.host_data):
            raise VerificationError(f"plain read of {self.path} returned other bytes than were written")
        return seconds

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
