"""The plainest way to move the same bytes to and from the pool: bare Mooncake store calls.

The remote tier is measured against this (``kvstrata bench remote``), and ``kvstrata calibrate``
times the pool's get and put paths with it. ``RawPool`` joins the pool as its own client (a
``MooncakeDistributedStore`` set up here, with no kvstrata code in the data path: no worker
thread, no timeout, no header handling) with a segment of 0 bytes, so, like the tier, it keeps
no object in this process: every byte crosses into the pool daemon's process and back.

Its objects hold exactly the bytes the tier's objects hold (the tier's 128-byte value header,
then the block), under names of their own, and move in one batched call for all of them:
``batch_put_from`` from, and ``batch_get_into`` into, pre-faulted memory registered with the
store (in SHM mode, shared memory the daemon maps, from ``alloc_from_mem_pool``).
"""

from __future__ import annotations

import ctypes
import time

import torch

from kvstrata.pool.client import LOCAL_BUFFER_BYTES
from kvstrata.pool.config import PoolConfig, RemoteMode
from kvstrata.pool.network import Runner, joined
from kvstrata.pool.codes import Code
from kvstrata.timing import VerificationError


class RawPool:
    """Objects of ``values`` under ``names``, put and got with one batched store call each.

    Args:
        pool: where the pool is (the caller has already reached it, e.g. with a RemoteTier:
            the store's own setup cannot be bounded and holds the GIL while it retries).
        mode: TCP (a client of the master) or SHM (a client of the pool daemon on this host).
        names: one object name per value.
        values: uint8 ``[objects, value_bytes]``, each an object's whole value.

    Raises:
        RuntimeError: the store could not be set up or would not register memory.
    """

    def __init__(self, pool: PoolConfig, mode: RemoteMode, names: list[str], values: torch.Tensor) -> None:
        from kvstrata.pool.native_log import store_class

        if values.dtype != torch.uint8 or values.dim() != 2 or values.shape[0] != len(names):
            raise ValueError(f"raw pool: values must be uint8 [{len(names)}, value_bytes], got {values.dtype} {list(values.shape)}")
        self.mode = mode
        self.names = names
        self.value_bytes = values.shape[1]
        self._net = Runner(pool.network)  # a pool in a network of its own: every call from a thread there
        self._store = store_class()()
        try:
            self._net.run(self._setup, pool, values)
        except BaseException:
            self._net.close()
            raise
        self.verified_bytes = 0

    def _setup(self, pool: PoolConfig, values: torch.Tensor) -> None:
        why = joined(pool.network)
        if why is not None:
            raise RuntimeError(f"raw pool: {why}")
        if self.mode is RemoteMode.SHM:
            rc = self._store.setup_dummy(0, LOCAL_BUFFER_BYTES, pool.daemon)
        else:
            rc = self._store.setup(
                pool.local_hostname, pool.metadata_server, 0, LOCAL_BUFFER_BYTES, pool.protocol,
                pool.rdma_devices, pool.master,
            )
        if rc != 0:
            raise RuntimeError(f"raw pool: Mooncake setup in {self.mode.value} mode failed (code {rc})")
        self.src = self._allocate(values.numel()).view(values.shape)  # [objects, value_bytes]
        self.src.copy_(values)
        self.dst = self._allocate(values.numel()).view(values.shape)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        """Pre-faulted memory registered with the store (shared memory in SHM mode)."""
        if self.mode is RemoteMode.SHM:
            address = self._store.alloc_from_mem_pool(nbytes)
            if not address:
                raise RuntimeError(f"raw pool: no shared memory segment of {nbytes} bytes")
            memory = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)
        else:
            memory = torch.empty(nbytes, dtype=torch.uint8)
        memory.zero_()  # pre-fault: first writes into fresh pages run several times slower
        rc = self._store.register_buffer(memory.data_ptr(), nbytes)
        if rc != 0:
            raise RuntimeError(f"raw pool: register_buffer of {nbytes} bytes failed (code {rc})")
        return memory

    def _ptrs(self, buffer: torch.Tensor, count: int) -> list[int]:
        return [buffer[i].data_ptr() for i in range(count)]

    # --- steps: each returns the seconds its timed part took -----------------------------------

    def put_s(self) -> float:
        """``batch_put_from`` of every object (removed first, untimed: a put of a name that
        exists is refused at once and would time nothing)."""
        return self._net.run(self._put_s)

    def _put_s(self) -> float:
        self._remove()
        count = len(self.names)
        ptrs, sizes = self._ptrs(self.src, count), [self.value_bytes] * count
        start = time.perf_counter()
        codes = self._store.batch_put_from(self.names, ptrs, sizes)
        seconds = time.perf_counter() - start
        if list(codes) != [0] * count:
            raise RuntimeError(f"raw pool: batch_put_from answered {sorted(set(codes))} (0 = stored)")
        return seconds

    def get_s(self, count: int | None = None) -> float:
        """``batch_get_into`` of the first ``count`` objects (all by default) into registered
        memory zeroed first (untimed); the bytes are then compared with the values put."""
        return self._net.run(self._get_s, count)

    def _get_s(self, count: int | None) -> float:
        count = len(self.names) if count is None else count
        dst = self.dst[:count]
        dst.zero_()  # a get that moved nothing must not verify
        ptrs, sizes = self._ptrs(self.dst, count), [self.value_bytes] * count
        start = time.perf_counter()
        got = self._store.batch_get_into(self.names[:count], ptrs, sizes)
        seconds = time.perf_counter() - start
        if list(got) != sizes:
            raise VerificationError(f"raw pool: batch_get_into moved {list(got)} bytes, expected {sizes}")
        if not torch.equal(dst, self.src[:count]):
            raise VerificationError("raw pool: batch_get_into returned other bytes than were put")
        self.verified_bytes += dst.numel()
        return seconds

    def exists_s(self) -> float:
        """``batch_is_exist`` of every object (each must exist)."""
        return self._net.run(self._exists_s)

    def _exists_s(self) -> float:
        start = time.perf_counter()
        answers = self._store.batch_is_exist(self.names)
        seconds = time.perf_counter() - start
        if list(answers) != [1] * len(self.names):
            raise RuntimeError(f"raw pool: batch_is_exist answered {sorted(set(answers))}, expected every object")
        return seconds

    def prefault(self, total_bytes: int) -> int:
        """Fault in up to ``total_bytes`` of the pool's segment: put filler objects until
        they add up to it (or the pool refuses one), then remove them. Returns the bytes put.

        Why: the pool daemon's segment is mapped lazily, and its allocator does not reuse
        the same offsets for the objects of the next round, so without this a store lands on
        fresh pages now and then and runs several times slower (measured: 110 ms instead of
        14 ms for a 32 MiB put over loopback TCP), whichever side happens to get them.
        """
        return self._net.run(self._prefault, total_bytes)

    def _prefault(self, total_bytes: int) -> int:
        count = total_bytes // self.value_bytes
        names = [f"{self.names[0]}.fill/{i}" for i in range(count)]
        put: list[str] = []
        for name in names:
            (rc,) = self._store.batch_put_from([name], [self.src[0].data_ptr()], [self.value_bytes])
            if rc != 0:
                break
            put.append(name)
        if put:
            self._store.batch_remove(put, True)
        return len(put) * self.value_bytes

    def remove(self) -> None:
        """Delete every object from the pool (those absent are fine)."""
        self._net.run(self._remove)

    def _remove(self) -> None:
        codes = self._store.batch_remove(self.names, True)
        if any(rc not in (0, Code.OBJECT_NOT_FOUND) for rc in codes):
            raise RuntimeError(f"raw pool: batch_remove answered {sorted(set(codes))}")

    def close(self) -> None:
        """Remove the objects and leave the pool (Mooncake's close takes about a second)."""
        store, self._store = self._store, None
        if store is None:
            return
        try:
            self._net.run(_leave, store, self.names)
        finally:
            self._net.close()


def _leave(store: object, names: list[str]) -> None:
    try:
        store.batch_remove(names, True)
    finally:
        store.close()
