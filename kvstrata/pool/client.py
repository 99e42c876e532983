"""A bounded connection to the shared pool: no Mooncake call can hang its caller.

Every store call runs on a worker thread (daemon threads: a call that never returns holds only
its own thread, and never blocks interpreter exit) and is waited for at most ``op_timeout_s``.
A call that times out, or that the caller reports as a transport failure (``mark_down``), puts
the client DOWN: calls then fail at once with PoolUnavailable, and after each ``cooloff_s`` one
caller probes the pool: its address must accept and answer at the socket level first (a
Mooncake call into a dead SHM daemon blocked until exit, and a call still inside a store when
Mooncake tears it down at exit aborted the process), then an existence query must succeed (it
needs the master; ``health_check`` said 0 with the master killed). Passing makes it UP again.

A call that timed out may still be running, and may still read or write the memory it was
given, at any later time: the caller must treat that memory as lost (never reuse it) unless it
can wait for the call itself (``on_late``).

Two ways in (``RemoteMode``): TCP joins as a Mooncake client of the master with a segment of 0
bytes, so every object lives in the pool daemons and outlives this process; transfers go over
the pool's protocol (TCP or RDMA) from memory registered with ``register``. SHM attaches to the
pool daemon on this host (Mooncake's "dummy" client): buffers are shared-memory segments the
daemon maps (``allocate``), and the daemon copies between them and the pool. Only memory from
``allocate`` can be used in SHM mode.

Two Mooncake calls hold the GIL (measured with 0.3.13): ``setup`` and ``close``; every data
call releases it. So neither can be bounded by a thread, and:

* before ``setup``, the address must accept a connection and answer: a live Mooncake server
  closes a connection at once on 16 bytes that are no request, while for a stopped (hung)
  process the kernel still accepts and nothing answers. A setup against a hung master would
  freeze every thread of the process for 20 retries of 30 s.
* ``close`` takes ~1 s (it joins a heartbeat thread that sleeps 1 s: every other thread stalled
  0.9 s), and 30 s for an SHM client whose daemon is stopped. So ``close`` does not close a
  healthy store: it unregisters this client's memory and parks the store for the next client of
  the same pool and mode (at most ``PARKED_PER_POOL``). A store that is DOWN, or may still be
  running a call, is kept open, unused. Mooncake tears every store down at process exit itself
  (which can take 30 s per SHM store whose daemon is stopped; nothing here can bound that).
"""

from __future__ import annotations

import ctypes
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from kvstrata.errors import TierUnavailable
from kvstrata.pool.config import PoolConfig, RemoteMode
from kvstrata.pool.embedded import accepts
from kvstrata.pool.workers import Workers

PROBE_OBJECT = "kvstrata/.probe"  # never written: the probe asks whether it exists
LOCAL_BUFFER_BYTES = 4 << 20  # Mooncake's own staging for copying APIs, which we do not use
PARKED_PER_POOL = 2
_NOT_A_REQUEST = bytes(16)


class PoolUnavailable(TierUnavailable):
    """The pool cannot be reached now (not running, not answering, or cooling off after a fault)."""


class CallTimedOut(PoolUnavailable):
    """A store call ran past ``op_timeout_s``. It may still be running, and touching its memory,
    until ``settled`` (the call's own future) completes."""

    def __init__(self, *args: object, settled: Future | None = None) -> None:
        super().__init__(*args)
        self.settled = settled


class PoolClient:
    """One Mooncake store client, every call bounded.

    Args:
        pool: where the pool is.
        mode: TCP (via the master) or SHM (via the daemon on this host; needs ``pool.daemon``).
        op_timeout_s: the longest any one call is waited for.
        connect_timeout_s: the longest connecting may take, all steps together.
        cooloff_s: after a fault, calls fail at once for this long before a probe.

    Raises:
        PoolUnavailable: the pool could not be reached within ``connect_timeout_s``, or the
            Mooncake package is not installed.
    """

    def __init__(
        self,
        pool: PoolConfig,
        mode: RemoteMode = RemoteMode.TCP,
        op_timeout_s: float = 10.0,
        connect_timeout_s: float = 5.0,
        cooloff_s: float = 1.0,
    ) -> None:
        for name, value in (("op_timeout_s", op_timeout_s), ("connect_timeout_s", connect_timeout_s),
                            ("cooloff_s", cooloff_s)):
            if not value > 0:
                raise ValueError(f"pool client: {name} must be > 0, got {value!r}")
        if mode is RemoteMode.SHM and not pool.daemon:
            raise ValueError("pool client: SHM mode needs a pool daemon on this host (pool.daemon)")
        self.pool = pool
        self.mode = mode
        self.op_timeout_s = op_timeout_s
        self.cooloff_s = cooloff_s
        self._lock = threading.Lock()
        self._workers = Workers("kvstrata-pool")
        self._inflight: set[Future] = set()
        self._ranges: tuple[tuple[int, int], ...] = ()  # registered [start, end) byte addresses
        self._memory: list[torch.Tensor] = []  # registered memory, alive as long as the client
        self._down: str | None = None
        self._probe_at = 0.0
        self._store: Any = None
        self._store = self._connect(connect_timeout_s)

    @property
    def address(self) -> str:
        """What this client talks to: the master (TCP) or the daemon (SHM)."""
        return self.pool.daemon if self.mode is RemoteMode.SHM else self.pool.master

    # --- connecting ---------------------------------------------------------------------------

    def _connect(self, timeout_s: float) -> Any:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as error:
            raise PoolUnavailable(
                f"the pool client is not installed ({error}): pip install mooncake-transfer-engine-non-cuda "
                "(or mooncake-transfer-engine with CUDA)"
            ) from None
        what = f"pool {'daemon' if self.mode is RemoteMode.SHM else 'master'} at {self.address}"
        deadline = time.monotonic() + timeout_s
        # Mooncake's setup retries for a minute or more, holding the GIL: look first.
        if not accepts(self.address, timeout_s):
            raise PoolUnavailable(f"{what} does not accept connections")
        if not _answers(self.address, max(0.0, deadline - time.monotonic())):
            raise PoolUnavailable(f"{what} accepts connections but does not answer within {timeout_s:g} s (hung?)")
        store = _unpark((self.pool, self.mode))
        if store is not None:
            try:
                remaining = max(0.0, deadline - time.monotonic())
                if self._workers.submit(_probe, store, self.address, remaining).result(timeout=remaining):
                    return store
            except FutureTimeout:
                pass
            _keep_open(store)  # parked, then the pool failed: closing could stall every thread
        store = MooncakeDistributedStore()
        if self.mode is RemoteMode.SHM:
            args = (0, LOCAL_BUFFER_BYTES, self.pool.daemon)
            setup = store.setup_dummy
        else:
            p = self.pool
            args = (p.local_hostname, p.metadata_server, 0, LOCAL_BUFFER_BYTES, p.protocol, p.rdma_devices, p.master)
            setup = store.setup
        future = self._workers.submit(setup, *args)
        try:
            rc = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            _keep_open(store)
            raise PoolUnavailable(f"{what}: setup did not finish within {timeout_s:g} s") from None
        if rc != 0:
            _keep_open(store)
            raise PoolUnavailable(f"{what}: setup failed (Mooncake code {rc})")
        return store

    # --- calls --------------------------------------------------------------------------------

    def call(self, what: str, method: str, *args: Any, on_late: Callable[[Any, Any], None] | None = None) -> Any:
        """``store.<method>(*args)`` on a worker, waited for at most ``op_timeout_s``.

        Args:
            what: names the operation in errors.
            on_late: if the call times out, ``on_late(store, result)`` runs on a worker once
                it does return, e.g. to undo a put that completed after its caller gave up.
                It may call the store directly (the store is not closed under it).

        Raises:
            PoolUnavailable: the client is DOWN (nothing was submitted).
            CallTimedOut: the call ran too long; the client is DOWN now.
            RuntimeError: the client is closed.
        """
        store = self._ensure_up()
        future = self._submit(getattr(store, method), *args)
        try:
            return future.result(timeout=self.op_timeout_s)
        except FutureTimeout:
            self.mark_down(f"{what} did not return within {self.op_timeout_s:g} s")
            if on_late is not None:
                try:
                    # Tracked as in flight, so closing waits for it too.
                    self._submit(_after, future, on_late, store)
                except RuntimeError:
                    pass  # closed meanwhile
            raise CallTimedOut(f"pool at {self.address}: {what} did not return within {self.op_timeout_s:g} s",
                               settled=future) from None

    def mark_down(self, reason: str) -> None:
        """Fail calls fast from now until a probe passes, ``cooloff_s`` on."""
        with self._lock:
            if self._down is None:
                self._down = reason
                self._probe_at = time.monotonic() + self.cooloff_s

    @property
    def up(self) -> bool:
        with self._lock:
            return self._down is None and self._store is not None

    def _ensure_up(self) -> Any:
        with self._lock:
            store = self._store
            if store is None:
                raise RuntimeError(f"pool client for {self.address} is closed")
            if self._down is None:
                return store
            reason = self._down
            now = time.monotonic()
            if now < self._probe_at:
                raise PoolUnavailable(f"pool at {self.address} is down ({reason}); next try in {self._probe_at - now:.1f} s")
            self._probe_at = now + self.cooloff_s  # one caller probes; the others fail fast
        try:
            healthy = self._submit(_probe, store, self.address, self.op_timeout_s).result(timeout=self.op_timeout_s)
        except FutureTimeout:
            healthy = False
        if not healthy:
            raise PoolUnavailable(f"pool at {self.address} is down ({reason}) and still fails its health check")
        with self._lock:
            self._down = None
        return store

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future = self._workers.submit(fn, *args)
        with self._lock:
            self._inflight.add(future)
        future.add_done_callback(self._settled)
        return future

    def _settled(self, future: Future) -> None:
        with self._lock:
            self._inflight.discard(future)

    # --- memory -------------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of pre-faulted CPU memory (uint8 ``[nbytes]``) registered with the store.

        SHM mode: a shared-memory segment the daemon maps, so the daemon copies straight
        between it and the pool. It stays mapped until this process exits, even after
        ``close``. TCP mode: ordinary memory, registered; alive as long as this client.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"pool client: allocate needs a byte count >= 0, got {nbytes!r}")
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        if self.mode is RemoteMode.TCP:
            memory = torch.empty(nbytes, dtype=torch.uint8)
            memory.zero_()  # pre-fault: first writes into fresh pages run several times slower
            self.register(memory)
            return memory
        address = self.call("alloc_from_mem_pool", "alloc_from_mem_pool", nbytes)
        if not address:
            raise MemoryError(f"pool client: no shared memory segment of {nbytes} bytes")
        memory = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)
        memory.zero_()
        rc = self.call("register_buffer", "register_buffer", address, nbytes)
        if rc != 0:
            raise PoolUnavailable(f"pool daemon at {self.address} did not map a shared segment (Mooncake code {rc})")
        self._keep(memory)
        return memory

    def register(self, tensor: torch.Tensor) -> bool:
        """Register a tensor's memory so transfers from and to it are zero-copy, where possible.

        Returns:
            Whether they are now: True for contiguous CPU memory in TCP mode (and for memory
            from ``allocate``); False for CUDA memory, and in SHM mode for any memory not from
            ``allocate`` (the daemon maps only those segments). Transfers on memory that is not
            registered still work, through a staging copy.

        Raises:
            ValueError: a non-contiguous tensor.
            PoolUnavailable: the store refused (or the pool is down).
        """
        if not tensor.is_contiguous():
            raise ValueError("pool client: only contiguous memory can be registered")
        if self.is_registered(tensor):
            return True
        if tensor.device.type != "cpu" or self.mode is RemoteMode.SHM:
            return False
        rc = self.call("register_buffer", "register_buffer", tensor.data_ptr(), _nbytes(tensor))
        if rc != 0:
            raise PoolUnavailable(f"pool client: register_buffer of {_nbytes(tensor)} bytes failed (Mooncake code {rc})")
        self._keep(tensor)
        return True

    def is_registered(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s bytes lie within one registered range (zero-copy possible)."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            return False
        start = tensor.data_ptr()
        end = start + _nbytes(tensor)
        return any(lo <= start and end <= hi for lo, hi in self._ranges)

    def _keep(self, tensor: torch.Tensor) -> None:
        start = tensor.data_ptr()
        with self._lock:
            self._memory.append(tensor)
            self._ranges = self._ranges + ((start, start + _nbytes(tensor)),)

    # --- closing ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop using the pool: unregister this client's memory and park the store for reuse
        (an unhealthy store is kept open, unused). Idempotent."""
        with self._lock:
            store, self._store = self._store, None
            inflight = list(self._inflight)
            healthy = self._down is None
            addresses = [start for start, _ in self._ranges]
        if store is None:
            return
        reusable = False
        if healthy and not inflight:
            try:
                reusable = self._workers.submit(_unregister, store, addresses).result(timeout=self.op_timeout_s)
            except FutureTimeout:
                pass
        self._workers.close()
        if reusable:
            _park((self.pool, self.mode), store)
        else:
            _keep_open(store, self._memory)  # still registered: a stray call may use that memory


def _answers(address: str, timeout_s: float) -> bool:
    """Whether a live process serves ``address``: it closes the connection on (or answers)
    bytes that are no request within ``timeout_s``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=max(timeout_s, 1e-3)) as conn:
            conn.sendall(_NOT_A_REQUEST)
            conn.recv(1)  # b"" (closed) or data: someone is there
            return True
    except ConnectionError:
        return True  # reset by a live peer
    except OSError:
        return False  # timed out (nobody reads), or unreachable


def _after(stray: Future, on_late: Callable[[Any, Any], None], store: Any) -> None:
    if stray.exception() is None:  # waits (on this worker) until the stray call returns
        on_late(store, stray.result())


def _probe(store: Any, address: str, timeout_s: float) -> bool:
    # Sockets first: a Mooncake call into a dead SHM daemon blocked until exit, and a call
    # still inside a store when Mooncake tears it down at exit aborted the process.
    if not (accepts(address, timeout_s) and _answers(address, timeout_s)):
        return False
    return store.health_check() == 0 and all(r >= 0 for r in store.batch_is_exist([PROBE_OBJECT]))


def _unregister(store: Any, addresses: list[int]) -> bool:
    return all(store.unregister_buffer(address) == 0 for address in addresses)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# Process-wide: stores parked for reuse, and stores kept open unused (closing one holds the GIL
# for 1 to 30 s, and a call may still be running inside it).
_parked_lock = threading.Lock()
_parked: dict[tuple[PoolConfig, RemoteMode], list[Any]] = {}
_kept: list[tuple[Any, list[torch.Tensor] | None]] = []


def _park(key: tuple[PoolConfig, RemoteMode], store: Any) -> None:
    with _parked_lock:
        parked = _parked.setdefault(key, [])
        if len(parked) < PARKED_PER_POOL:
            parked.append(store)
            return
    store.close()  # healthy: ~1 s, every thread stalled (rare: more clients than parking spots)


def _unpark(key: tuple[PoolConfig, RemoteMode]) -> Any:
    with _parked_lock:
        parked = _parked.get(key)
        return parked.pop() if parked else None


def _keep_open(store: Any, memory: list[torch.Tensor] | None = None) -> None:
    with _parked_lock:
        _kept.append((store, memory))
