"""A bounded connection to the shared pool: no Mooncake call can hang its caller, and a pool
that stops answering costs a caller one bounded wait, once.

Every store call runs on a worker thread (daemon threads: a call that never returns holds only
its own thread, and never blocks interpreter exit) and is waited for at most ``op_timeout_s``.

A circuit breaker (``kvstrata.pool.breaker``): a call that times out, or a transport failure
the caller reports (``mark_down``), puts the client DOWN, and calls fail at once while a
background thread probes. A probe reads the pool's config file again where there is one (a
restarted pool may have new ports), checks at the socket level that every process this client
needs answers (the master, and the pool daemon the config names: in TCP mode the objects live
in the daemon, and the master still answers with the daemon dead), then asks the store itself
(health, an existence query: they need the master). It reconnects with a new store when the
config changed or the old store does not answer, registering this client's memory again.

The log (``kvstrata.pool``) says when and why the pool went down, and when it came back, where.

A pool in a network of its own (``PoolConfig.network``, ``kvstrata.pool.network``): every worker
enters it before each call, and the socket checks run on a thread that has entered it; the
caller's thread never moves. A process that set up a store for a pool in one network is refused
one in another, at once (Mooncake's RPC threads stay where its first store started them).

A call that timed out may still be running, and may still read or write the memory it was
given, at any later time: the caller must treat that memory as lost (never reuse it) unless it
can wait for the call itself (``on_late``; ``kvstrata.pool.calls``).

Two ways in (``RemoteMode``): TCP joins as a Mooncake client of the master with a segment of 0
bytes, so every object lives in the pool daemons and outlives this process; transfers go over
the pool's protocol (TCP or RDMA) from memory registered with ``register``. SHM attaches to the
pool daemon on this host (Mooncake's "dummy" client): buffers are shared-memory segments the
daemon maps (``allocate``), and the daemon copies between them and the pool. Only memory from
``allocate`` can be used in SHM mode; after a reconnect to another daemon, memory the old one
mapped is not registered any more (it moves through staging).

Setting up a store and closing one hold the GIL: a store is set up only once its address
answers (``kvstrata.pool.connect``), and ``close`` does not close a healthy store: it
unregisters this client's memory and parks the store for the next client of the same pool and
mode (``kvstrata.pool.parking``). A store that is DOWN, may still be running a call, or was
replaced by a reconnect, is kept open, unused, until it can be closed cheaply.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from kvstrata.pool import native_log, ops, parking
from kvstrata.pool.breaker import Breaker, Reconnected, probe_until_up
from kvstrata.pool.calls import CallTimedOut, PendingCall, PoolUnavailable, entering
from kvstrata.pool.config import DEFAULT_BUDGETS, PoolConfig, RemoteMode, check_budgets
from kvstrata.pool.connect import LOCAL_BUFFER_BYTES, Where, address, answers_calls, connect, store_class
from kvstrata.pool.connect import register_with, reread, unreachable, unreachable_in, where
from kvstrata.pool.ops import StoreOp
from kvstrata.pool.workers import Workers

__all__ = ["LOCAL_BUFFER_BYTES", "CallTimedOut", "PendingCall", "PoolClient", "PoolUnavailable", "Reconnected",
           "unreachable", "where"]

log = logging.getLogger("kvstrata.pool")


class PoolClient:
    """A bounded connection to the pool: one Mooncake store at a time (a reconnect replaces it).

    Args:
        pool: where the pool is; its ``config_file`` (if any) is read again before each
            reconnect attempt.
        mode: TCP (via the master) or SHM (via the daemon on this host; needs ``pool.daemon``).
        op_timeout_s: the longest any one call is waited for.
        connect_timeout_s: the longest connecting may take, all steps together (and the bound
            on registering memory, which RDMA pins).
        backoff_s: after a fault, the wait before the first background probe; doubled after
            each failed probe.
        backoff_max_s: the longest wait between probes.
        required: raise if the pool cannot be reached now; False: start DOWN and keep trying.
        on_up: called on the probing thread each time the client is UP again.

    Raises:
        PoolUnavailable: the Mooncake package is not installed, or (``required``) the pool
            could not be reached within ``connect_timeout_s``.
    """

    def __init__(
        self,
        pool: PoolConfig,
        mode: RemoteMode = RemoteMode.TCP,
        op_timeout_s: float = DEFAULT_BUDGETS.op_timeout_s,
        connect_timeout_s: float = DEFAULT_BUDGETS.connect_timeout_s,
        backoff_s: float = DEFAULT_BUDGETS.backoff_s,
        backoff_max_s: float = DEFAULT_BUDGETS.backoff_max_s,
        required: bool = True,
        on_up: Callable[[Reconnected], None] | None = None,
    ) -> None:
        check_budgets("pool client:", op_timeout_s=op_timeout_s, connect_timeout_s=connect_timeout_s,
                      backoff_s=backoff_s, backoff_max_s=backoff_max_s)
        if mode is RemoteMode.SHM and not pool.daemon:
            raise ValueError("pool client: SHM mode needs a pool daemon on this host (pool.daemon)")
        store_class()  # not installed: no point in retrying
        self.pool = pool
        self.mode = mode
        self.op_timeout_s = op_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._on_up = on_up
        self._lock = threading.Lock()
        self._breaker = Breaker(backoff_s, backoff_max_s)  # guarded by _lock, as the store it is checked with
        self._where = Where(pool.network)  # where the workers' calls run (kvstrata.pool.network)
        self._workers = Workers("kvstrata-pool", self._where.enter)
        self._inflight: set[Future] = set()
        self._ranges: tuple[tuple[int, int], ...] = ()  # [start, end) byte addresses registered with the store
        self._memory: list[torch.Tensor] = []  # memory kept alive as long as the client (registered, or to be)
        self._pending: list[torch.Tensor] = []  # TCP memory to register once UP
        self._store: Any = None
        self._generation = 0  # counts stores: memory registered with one is not with the next
        self._read = pool  # what the config file said last
        self._closed = False
        try:
            self._store = connect(pool, mode, self._workers, self._where, connect_timeout_s)
        except PoolUnavailable as error:
            if required:
                self._workers.close()
                raise
            self.mark_down(f"unreachable at start: {error}")

    @property
    def address(self) -> str:
        """What this client talks to: the master (TCP) or the daemon (SHM)."""
        return address(self.pool, self.mode)

    @property
    def generation(self) -> int:
        """Which store calls go to: memory set up under one (SHM segments, registrations) is
        stale under the next."""
        return self._generation

    # --- the breaker --------------------------------------------------------------------------

    def mark_down(self, reason: str, generation: int | None = None) -> None:
        """Fail calls at once from now until a background probe passes. ``generation``: the
        store the failure was seen on (ignored if the client has reconnected since)."""
        with self._lock:
            if self._closed or self._breaker.down is not None or generation not in (None, self._generation):
                return
            start = self._breaker.trip(reason, self.pool)
        native_log.forward(logging.WARNING)  # what Mooncake said about it, first
        log.warning("pool (%s) is down: %s; calls fail at once until a background probe passes",
                    where(self.pool), reason)
        if start:
            threading.Thread(target=probe_until_up, args=(weakref.ref(self), self._breaker.wake),
                             name="kvstrata-pool-probe", daemon=True).start()

    @property
    def up(self) -> bool:
        with self._lock:
            return self._breaker.down is None and self._store is not None and not self._closed

    @property
    def down_reason(self) -> str | None:
        """Why calls fail now (None: UP): why the client went down, and what the last probe found."""
        with self._lock:
            return "the pool client is closed" if self._closed else self._breaker.reason()

    def _backoff(self, failures: int) -> float:
        delay = self._breaker.backoff(failures)
        with self._lock:
            self._breaker.next_probe = time.monotonic() + delay
        return delay

    def _probe(self, failures: int) -> bool:
        """One probe of a DOWN client, on the probing thread: True once it is UP (or closed)."""
        pool = self._read = reread(self.pool, self._read)
        try:
            store, new = self._reach(pool)
            event = self._install(store, pool, new)
        except Exception as error:  # noqa: BLE001 - the probing thread must outlive any one probe
            if self._closed:  # closed under the probe (its workers refuse new calls)
                return True
            found = str(error) if isinstance(error, PoolUnavailable) else repr(error)
            with self._lock:
                self._breaker.probe_error = found
            level = logging.INFO if failures == 0 else logging.DEBUG
            native_log.forward(level)
            log.log(level, "pool (%s) still down, probe %d: %s", where(pool), failures + 1, found)
            return False
        if event is None:
            return True
        log.info("pool up again after %.1f s (%s): %s%s", event.down_s,
                 "a new connection" if new else "the same connection", where(pool),
                 f"; it was at {where(event.previous)}" if event.moved else "")
        if self._on_up is not None:
            try:
                self._on_up(event)
            except Exception:  # noqa: BLE001 - a listener's fault must not stop the client
                log.exception("pool: the listener of a reconnect failed")
        return True

    def _reach(self, pool: PoolConfig) -> tuple[Any, bool]:
        """A store that answers for ``pool``, and whether it is a new one: the current store
        if the pool is where it was and the store answers, else a new connection.

        Raises:
            PoolUnavailable: not now.
        """
        why = unreachable_in(pool, self.mode, self.op_timeout_s)
        if why is not None:
            raise PoolUnavailable(why)
        with self._lock:
            store, same = self._store, pool == self.pool
        if store is not None and same:
            try:
                if self.submit(answers_calls, store).result(timeout=self.op_timeout_s):
                    return store, False
            except FutureTimeout:
                pass
        return connect(pool, self.mode, self._workers, self._where, self.connect_timeout_s), True

    def _install(self, store: Any, pool: PoolConfig, new: bool) -> Reconnected | None:
        """UP on ``store``: this client's memory registered with it first (all of it with a
        new TCP store; what was asked for while DOWN otherwise), then calls let through.
        None if the client was closed meanwhile.

        Raises:
            PoolUnavailable: the store would not register the memory.
        """
        with self._lock:
            pending, self._pending = self._pending, []
            memory = list(self._memory)
        todo = (memory if self.mode is RemoteMode.TCP else []) if new else pending
        try:
            ranges = register_with(store, todo, self.submit, self.connect_timeout_s, self.pool)
        except PoolUnavailable:
            with self._lock:
                self._pending = pending + self._pending  # for the next probe
                inflight = list(self._inflight)
            if new:  # a register_buffer may still run in it
                parking.keep_open(store, (pool, self.mode), memory, inflight)
            raise
        with self._lock:
            closed, old, event = self._closed, None, None
            if not closed:
                if new:
                    old, self._store, self._generation, self._ranges = self._store, store, self._generation + 1, ranges
                else:
                    self._ranges += ranges
                self.pool = pool
                event = self._breaker.reset(pool, new)
            leftover, self._pending = self._pending, []
            inflight = list(self._inflight)
        if closed and new:
            parking.keep_open(store, (pool, self.mode), memory, inflight)
        if old is not None:  # a stray call may still run in it, into our memory; closing could stall every thread
            parking.keep_open(old, (pool, self.mode), list(self._memory), inflight)
        for tensor in leftover if not closed else ():  # asked for while this probe registered the rest
            self.register(tensor)
        return event

    # --- calls --------------------------------------------------------------------------------

    def call(self, what: str, op: StoreOp, *args: Any, on_late: Callable[[Any, Any], None] | None = None,
             generation: int | None = None, timeout_s: float | None = None) -> Any:
        """``op.run(store, *args)`` on a worker, waited for at most ``op_timeout_s`` (or
        ``timeout_s``).

        Args:
            what: names the operation in errors.
            op: the store call (``kvstrata.pool.ops``).
            on_late: if the call times out, ``on_late(store, result)`` runs on a worker once
                it does return, e.g. to undo a put that completed after its caller gave up.
                It may call the store directly (the store is not closed under it).
            generation: the store generation the caller's memory was set up under; a call
                under another one (the client reconnected since) is refused.

        Raises:
            PoolUnavailable: the client is DOWN, or has reconnected since ``generation``
                (nothing was submitted).
            CallTimedOut: the call ran too long; the client is DOWN now.
            RuntimeError: the client is closed.
        """
        return self.start(what, op, *args, on_late=on_late, generation=generation, timeout_s=timeout_s).result()

    def start(self, what: str, op: StoreOp, *args: Any, on_late: Callable[[Any, Any], None] | None = None,
              generation: int | None = None, timeout_s: float | None = None) -> PendingCall:
        """:meth:`call`, without waiting: the call runs on a worker while the caller does other
        work (verifying the blocks of the previous call, say); ``result()`` waits for it, up to
        ``timeout_s`` (default ``op_timeout_s``) from now, and raises as :meth:`call` does.

        Raises:
            PoolUnavailable: the client is DOWN, or has reconnected since ``generation``.
            RuntimeError: the client is closed.
        """
        if not isinstance(op, StoreOp):
            raise TypeError(f"pool client: a store call is a kvstrata.pool.ops.StoreOp, got {op!r}")
        store, current = self._ensure_up(generation)
        timeout_s = timeout_s or self.op_timeout_s
        entered = threading.Event()
        future = self.submit(entering, entered, op.run, store, *args)
        return PendingCall(self, what, future, store, current, time.monotonic() + timeout_s, timeout_s, on_late, entered)

    def _ensure_up(self, generation: int | None) -> tuple[Any, int]:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"pool client for {self.address} is closed")
            if self._breaker.down is not None:
                raise PoolUnavailable(f"pool at {self.address} is down ({self._breaker.down}); "
                                      f"next probe in {self._breaker.next_probe_in():.1f} s")
            if generation is not None and generation != self._generation:
                raise PoolUnavailable(f"pool at {self.address}: reconnected since this call's buffers were set up")
            return self._store, self._generation

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """``fn(*args)`` on a worker, tracked as in flight (closing waits for it)."""
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
        ``close``. TCP mode: ordinary memory, registered (once UP, if the client is DOWN);
        alive as long as this client.

        Raises:
            PoolUnavailable: SHM mode, and the daemon is down or would not map a segment.
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
        generation = self.generation
        address = self.call("alloc_from_mem_pool", ops.ALLOC_FROM_MEM_POOL, nbytes, timeout_s=self.connect_timeout_s)
        if not address:
            raise MemoryError(f"pool client: no shared memory segment of {nbytes} bytes")
        memory = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)
        memory.zero_()
        rc = self.call("register_buffer", ops.REGISTER_BUFFER, address, nbytes, timeout_s=self.connect_timeout_s)
        if rc != 0:
            # The daemon did not answer as a live one does (a dead daemon refuses the mapping):
            # DOWN, so a probe finds it back or follows it to new ports.
            self.mark_down(f"register_buffer of a shared segment failed with Mooncake code {rc}", generation)
            raise PoolUnavailable(f"pool daemon at {self.address} did not map a shared segment (Mooncake code {rc})")
        self._keep(memory)
        return memory

    def register(self, tensor: torch.Tensor) -> bool:
        """Register a tensor's memory so transfers from and to it are zero-copy, where possible.

        Returns:
            Whether they are now: True for contiguous CPU memory in TCP mode (and for memory
            from ``allocate``); False for CUDA memory, in SHM mode for any memory not from
            ``allocate`` (the daemon maps only those segments), and in TCP mode while the
            client is DOWN (the memory is registered as it comes UP). Transfers on memory that
            is not registered still work, through a staging copy.

        Raises:
            ValueError: a non-contiguous tensor.
            PoolUnavailable: the store refused.
        """
        if not tensor.is_contiguous():
            raise ValueError("pool client: only contiguous memory can be registered")
        if self.is_registered(tensor):
            return True
        if tensor.device.type != "cpu" or self.mode is RemoteMode.SHM:
            return False
        try:
            rc = self.call("register_buffer", ops.REGISTER_BUFFER, tensor.data_ptr(), _nbytes(tensor),
                           timeout_s=self.connect_timeout_s)
        except PoolUnavailable:
            with self._lock:  # DOWN: registered by the probe that brings the client UP
                if not any(t is tensor for t in self._pending):
                    self._memory.append(tensor)
                    self._pending.append(tensor)
            return False
        if rc != 0:
            raise PoolUnavailable(f"pool client: register_buffer of {_nbytes(tensor)} bytes failed (Mooncake code {rc})")
        self._keep(tensor)
        return True

    def is_registered(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s bytes lie within one range registered with the current store
        (zero-copy possible)."""
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
        """Stop using the pool (and stop probing): unregister this client's memory and park the
        store for reuse (an unhealthy store is kept open, unused). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            store, self._store = self._store, None
            inflight = list(self._inflight)
            healthy = self._breaker.down is None
            addresses = [start for start, _ in self._ranges]
        self._breaker.wake.set()
        reusable = False
        if store is not None and healthy and not inflight:
            try:
                reusable = self._workers.submit(_unregister, store, addresses).result(timeout=self.op_timeout_s)
            except FutureTimeout:
                pass
        self._workers.close()
        if reusable:
            parking.park((self.pool, self.mode), store)
        elif store is not None:
            # still registered: a stray call may use that memory
            parking.keep_open(store, (self.pool, self.mode), self._memory, inflight)


def _unregister(store: Any, addresses: list[int]) -> bool:
    return all(ops.UNREGISTER_BUFFER.run(store, address) == 0 for address in addresses)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
