"""A bounded connection to the shared pool: no Mooncake call can hang its caller, and a pool
that stops answering costs a caller one bounded wait, once.

Every store call runs on a worker thread (daemon threads: a call that never returns holds only
its own thread, and never blocks interpreter exit) and is waited for at most ``op_timeout_s``.

A circuit breaker, two states:

* UP: calls go to the store.
* DOWN: a call timed out, the caller reported a transport failure (``mark_down``), or the pool
  could not be reached at all. Calls fail at once with PoolUnavailable (nobody waits on a pool
  known to be down). One background thread per client probes, ``backoff_s`` after the fault,
  then twice as long after each failed probe (up to ``backoff_max_s``, jittered), never on a
  caller's thread. A probe reads the pool's config file again where there is one (a restarted
  pool may have new ports), checks at the socket level that every process this client needs
  answers (the master, and the pool daemon the config names: in TCP mode the objects live in
  the daemon, and the master still answers with the daemon dead), then asks the store itself
  (health, an existence query: they need the master). It reconnects with a new store when the
  config changed or the old store does not answer, registering this client's memory again.
  Passing makes it UP; ``on_up`` then hears what happened (``Reconnected``).

The log (``kvstrata.pool``) says when and why the pool went down, and when it came back, where.

A pool in a network of its own (``PoolConfig.network``, ``kvstrata.pool.network``): every worker
enters it before each call, and the socket checks run on a thread that has entered it; the
caller's thread never moves. A process that set up a store for a pool in one network is refused
one in another, at once (Mooncake's RPC threads stay where its first store started them).

A call that timed out may still be running, and may still read or write the memory it was
given, at any later time: the caller must treat that memory as lost (never reuse it) unless it
can wait for the call itself (``on_late``).

Two ways in (``RemoteMode``): TCP joins as a Mooncake client of the master with a segment of 0
bytes, so every object lives in the pool daemons and outlives this process; transfers go over
the pool's protocol (TCP or RDMA) from memory registered with ``register``. SHM attaches to the
pool daemon on this host (Mooncake's "dummy" client): buffers are shared-memory segments the
daemon maps (``allocate``), and the daemon copies between them and the pool. Only memory from
``allocate`` can be used in SHM mode; after a reconnect to another daemon, memory the old one
mapped is not registered any more (it moves through staging).

Two Mooncake calls hold the GIL (measured with 0.3.13): ``setup`` and ``close``; every data
call releases it. So neither can be bounded by a thread, and:

* before ``setup``, the address must accept a connection and answer: a live Mooncake server
  closes a connection at once on 16 bytes that are no request, while for a stopped (hung)
  process the kernel still accepts and nothing answers. A setup against a hung master would
  freeze every thread of the process for 20 retries of 30 s. (A setup that succeeds takes
  ~0.2 s on loopback, every thread stalled: once per connection, reconnects included.)
* ``close`` takes ~1 s (it joins a heartbeat thread that sleeps 1 s: every other thread stalled
  0.9 s), and 30 s for an SHM client whose daemon is stopped. So ``close`` does not close a
  healthy store: it unregisters this client's memory and parks the store for the next client of
  the same pool and mode (at most ``PARKED_PER_POOL``). A store that is DOWN, may still be
  running a call, or was replaced by a reconnect, is kept open, unused. Mooncake tears every
  store down at process exit itself (which can take 30 s per SHM store whose daemon is stopped;
  nothing here can bound that).
"""

from __future__ import annotations

import ctypes
import logging
import random
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.errors import TierUnavailable
from kvstrata.pool.config import DEFAULT_BUDGETS, PoolConfig, RemoteMode, check_budgets, load_pool_config
from kvstrata.pool import libs, native_log, network
from kvstrata.pool.embedded import accepts, answers
from kvstrata.pool.workers import Workers
from kvstrata.transfer.placement import io_thread_started

log = logging.getLogger("kvstrata.pool")

PROBE_OBJECT = "kvstrata/.probe"  # never written: the probe asks whether it exists
LOCAL_BUFFER_BYTES = 4 << 20  # Mooncake's own staging for copying APIs, which we do not use
PARKED_PER_POOL = 2


class PoolUnavailable(TierUnavailable):
    """The pool cannot be reached now (not running, not answering, or down after a fault)."""


class CallTimedOut(PoolUnavailable):
    """A store call ran past its timeout. It may still be running, and touching its memory,
    until ``settled`` (the call's own future) completes."""

    def __init__(self, *args: object, settled: Future | None = None) -> None:
        super().__init__(*args)
        self.settled = settled


# How long a caller that overlaps work with a started call waits for the call to be inside the
# pool engine first (``PendingCall.handed_over``): a worker takes a call in microseconds, unless
# every worker is busy; then the caller goes on rather than wait for one.
HAND_OVER_S = 0.05


class PendingCall:
    """A store call started by :meth:`PoolClient.start`: ``result()`` once, on the caller's
    thread. Its deadline runs from the start, so a call overlapped with other work is bounded
    as one waited for at once."""

    def __init__(self, client: PoolClient, what: str, future: Future, store: Any, generation: int, deadline: float,
                 timeout_s: float, on_late: Callable[[Any, Any], None] | None, entered: threading.Event) -> None:
        self._client, self._what, self._future, self._store = client, what, future, store
        self._generation, self._deadline, self._timeout_s, self._on_late = generation, deadline, timeout_s, on_late
        self._entered = entered

    def handed_over(self, timeout_s: float = HAND_OVER_S) -> bool:
        """Wait (at most ``timeout_s``) until a worker has taken the call into the pool engine,
        which releases the interpreter's lock while it moves bytes; whether it has.

        Call before CPU-bound work that holds that lock (a MAC over a block, in C, does): a
        worker that still needs the lock to start the call waits a switch interval (5 ms) for
        each of the few times it takes it, and the transfer does not begin until the work ends.
        Measured in the lab (256 MiB from the pool over a 2.5 Gbit/s link, gets pipelined in
        calls of 48, 12 and 4 blocks): each call waited out the previous call's checks (43 ms,
        then 12 ms) before its first byte moved; 0.92 s against 0.87 s for raw Mooncake."""
        return self._entered.wait(timeout_s)

    def result(self) -> Any:
        """The call's result.

        Raises:
            CallTimedOut: it ran past its deadline; the client is DOWN now.
            Exception: what the store call raised.
        """
        try:
            return self._future.result(timeout=max(0.0, self._deadline - time.monotonic()))
        except FutureTimeout:
            client, timeout_s = self._client, self._timeout_s
            client.mark_down(f"{self._what} did not return within {timeout_s:g} s", self._generation)
            if self._on_late is not None:
                try:
                    # Tracked as in flight, so closing waits for it too.
                    client._submit(_after, self._future, self._on_late, self._store)
                except RuntimeError:
                    pass  # closed meanwhile
            raise CallTimedOut(f"pool at {client.address}: {self._what} did not return within {timeout_s:g} s",
                               settled=self._future) from None


@dataclass(frozen=True)
class Reconnected:
    """A client is UP again, after a fault or after starting without the pool.

    Attributes:
        pool: where the pool is now.
        previous: where it was when the client went down.
        new_store: a new connection (the pool came back elsewhere, restarted, or was never
            reached: its objects may be other ones); False: the old one answers again.
        reason: why the client was down.
        down_s: how long it was down.
    """

    pool: PoolConfig
    previous: PoolConfig
    new_store: bool
    reason: str
    down_s: float

    @property
    def moved(self) -> bool:
        """The pool is reached at other addresses (or settings) than before."""
        return self.pool != self.previous


def where(pool: PoolConfig) -> str:
    """``master HOST:PORT, daemon HOST:PORT`` for logs and errors."""
    return f"master {pool.master}" + (f", daemon {pool.daemon}" if pool.daemon else "")


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
        _store_class()  # not installed: no point in retrying
        self.pool = pool
        self.mode = mode
        self.op_timeout_s = op_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self._on_up = on_up
        self._lock = threading.Lock()
        self._where = _Where(pool.network)  # where the workers' calls run (kvstrata.pool.network)
        self._workers = Workers("kvstrata-pool", self._where.enter)
        self._inflight: set[Future] = set()
        self._ranges: tuple[tuple[int, int], ...] = ()  # [start, end) byte addresses registered with the store
        self._memory: list[torch.Tensor] = []  # memory kept alive as long as the client (registered, or to be)
        self._pending: list[torch.Tensor] = []  # TCP memory to register once UP
        self._store: Any = None
        self._generation = 0  # counts stores: memory registered with one is not with the next
        self._down: str | None = None
        self._probe_error: str | None = None  # what the last probe of a DOWN client found
        self._down_at = 0.0
        self._down_pool = pool
        self._read = pool  # what the config file said last
        self._next_probe = 0.0
        self._probing = False
        self._closed = False
        self._wake = threading.Event()
        try:
            self._store = self._connect(pool, connect_timeout_s)
        except PoolUnavailable as error:
            if required:
                self._workers.close()
                raise
            self.mark_down(f"unreachable at start: {error}")

    @property
    def address(self) -> str:
        """What this client talks to: the master (TCP) or the daemon (SHM)."""
        pool = self.pool
        return pool.daemon if self.mode is RemoteMode.SHM else pool.master

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
            if self._closed or self._down is not None or generation not in (None, self._generation):
                return
            self._down, self._down_at, self._down_pool = reason, time.monotonic(), self.pool
            self._probe_error = None
            start, self._probing = not self._probing, True
        native_log.forward(logging.WARNING)  # what Mooncake said about it, first
        log.warning("pool (%s) is down: %s; calls fail at once until a background probe passes",
                    where(self.pool), reason)
        if start:
            threading.Thread(target=_probe_until_up, args=(weakref.ref(self), self._wake),
                             name="kvstrata-pool-probe", daemon=True).start()

    @property
    def up(self) -> bool:
        with self._lock:
            return self._down is None and self._store is not None and not self._closed

    @property
    def down_reason(self) -> str | None:
        """Why calls fail now (None: UP): why the client went down, and what the last probe found."""
        with self._lock:
            if self._closed:
                return "the pool client is closed"
            if self._down is None or self._probe_error is None:
                return self._down
            return f"{self._down}; last probe: {self._probe_error}"

    def _backoff(self, failures: int) -> float:
        delay = min(self.backoff_max_s, self.backoff_s * 2 ** min(failures, 32))
        delay *= random.uniform(0.5, 1.0)  # clients that lost the pool together do not probe together
        with self._lock:
            self._next_probe = time.monotonic() + delay
        return delay

    def _probe(self, failures: int) -> bool:
        """One probe of a DOWN client, on the probing thread: True once it is UP (or closed)."""
        pool = self._reread()
        try:
            store, new = self._reach(pool)
            event = self._install(store, pool, new)
        except Exception as error:  # noqa: BLE001 - the probing thread must outlive any one probe
            if self._closed:  # closed under the probe (its workers refuse new calls)
                return True
            found = str(error) if isinstance(error, PoolUnavailable) else repr(error)
            with self._lock:
                self._probe_error = found
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

    def _reread(self) -> PoolConfig:
        """The pool's config as its file says now (the current one without a file, or when the
        file cannot be read: a pool that is stopped has no state file)."""
        current = self.pool
        if current.config_file is None:
            return current
        try:
            fresh = load_pool_config(current.config_file)
        except (OSError, ValueError) as error:
            log.debug("pool config %s unreadable (%s); trying %s", current.config_file, error, where(current))
            return current
        if fresh != current and fresh != self._read:  # said once per new content, not per probe
            log.info("pool config %s now says %s (was %s)", current.config_file, where(fresh), where(current))
        self._read = fresh
        return fresh

    def _reach(self, pool: PoolConfig) -> tuple[Any, bool]:
        """A store that answers for ``pool``, and whether it is a new one: the current store
        if the pool is where it was and the store answers, else a new connection.

        Raises:
            PoolUnavailable: not now.
        """
        why = self._unreachable(pool, self.op_timeout_s)
        if why is not None:
            raise PoolUnavailable(why)
        with self._lock:
            store, same = self._store, pool == self.pool
        if store is not None and same and self._answers_calls(store):
            return store, False
        return self._connect(pool, self.connect_timeout_s), True

    def _unreachable(self, pool: PoolConfig, timeout_s: float) -> str | None:
        """``unreachable``, asked from inside ``pool``'s network."""
        try:
            return network.run_in(pool.network, unreachable, pool, self.mode, timeout_s)
        except network.NetworkError as error:
            return str(error)

    def _answers_calls(self, store: Any) -> bool:
        try:
            return self._submit(_answers_calls, store).result(timeout=self.op_timeout_s)
        except FutureTimeout:
            return False

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
            ranges = self._register_with(store, todo)
        except PoolUnavailable:
            with self._lock:
                self._pending = pending + self._pending  # for the next probe
            if new:
                _keep_open(store)
            raise
        with self._lock:
            closed, old, event = self._closed, None, None
            if not closed:
                if new:
                    old, self._store, self._generation, self._ranges = self._store, store, self._generation + 1, ranges
                else:
                    self._ranges += ranges
                self.pool = pool
                event = Reconnected(pool, self._down_pool, new, self._down or "", time.monotonic() - self._down_at)
                self._down, self._probing = None, False
            leftover, self._pending = self._pending, []
        if closed and new:
            _keep_open(store)
        if old is not None:  # a stray call may still run in it, into our memory; closing could stall every thread
            _keep_open(old, list(self._memory))
        for tensor in leftover if not closed else ():  # asked for while this probe registered the rest
            self.register(tensor)
        return event

    def _register_with(self, store: Any, tensors: list[torch.Tensor]) -> tuple[tuple[int, int], ...]:
        """The ranges of ``tensors`` that ``store`` registered. One it refuses is left out (it
        moves through staging): a refusal must not keep the pool down.

        Raises:
            PoolUnavailable: the store did not answer in time.
        """
        ranges: list[tuple[int, int]] = []
        for tensor in tensors:
            start, nbytes = tensor.data_ptr(), _nbytes(tensor)
            if (start, start + nbytes) in ranges:
                continue
            try:
                rc = self._submit(store.register_buffer, start, nbytes).result(timeout=self.connect_timeout_s)
            except FutureTimeout:
                raise PoolUnavailable(f"register_buffer of {nbytes} bytes did not return within "
                                      f"{self.connect_timeout_s:g} s") from None
            if rc == 0:
                ranges.append((start, start + nbytes))
            else:
                log.warning("pool (%s): register_buffer of %d bytes failed (Mooncake code %d): that memory "
                            "moves through staging", where(self.pool), nbytes, rc)
        return tuple(ranges)

    # --- connecting ---------------------------------------------------------------------------

    def _connect(self, pool: PoolConfig, timeout_s: float) -> Any:
        """A store set up for ``pool`` (a parked one that still answers, or a new one).

        Raises:
            PoolUnavailable: not reachable within ``timeout_s``.
        """
        store_class = _store_class()
        what = f"pool {'daemon' if self.mode is RemoteMode.SHM else 'master'} at {self._address(pool)}"
        deadline = time.monotonic() + timeout_s
        # Mooncake's setup retries for a minute or more, holding the GIL: look first.
        why = self._unreachable(pool, timeout_s)
        if why is not None:
            raise PoolUnavailable(why)
        self._where.network = pool.network  # a pool restarted elsewhere: its store is set up, and used, there
        store = _unpark((pool, self.mode))
        if store is not None:
            try:
                if self._workers.submit(_answers_calls, store).result(timeout=max(0.0, deadline - time.monotonic())):
                    return store
            except FutureTimeout:
                pass
            _keep_open(store)  # parked, then the pool failed: closing could stall every thread
        why = network.joined(pool.network)  # a store set up elsewhere would retry for 90 s, holding the GIL
        if why is not None:
            raise PoolUnavailable(why)
        store = store_class()
        if self.mode is RemoteMode.SHM:
            args = (0, LOCAL_BUFFER_BYTES, pool.daemon)
            setup = store.setup_dummy
        else:
            args = (pool.local_hostname, pool.metadata_server, 0, LOCAL_BUFFER_BYTES, pool.protocol,
                    pool.rdma_devices, pool.master)
            setup = store.setup
        future = self._workers.submit(setup, *args)
        try:
            rc = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            _keep_open(store)
            raise PoolUnavailable(f"{what}: setup did not finish within {timeout_s:g} s") from None
        if rc != 0:
            _keep_open(store)
            said = native_log.forward(logging.WARNING)
            raise PoolUnavailable(f"{what}: setup failed (Mooncake code {rc}"
                                  + (f": {said[-1]})" if said else ")"))
        return store

    def _address(self, pool: PoolConfig) -> str:
        return pool.daemon if self.mode is RemoteMode.SHM else pool.master

    # --- calls --------------------------------------------------------------------------------

    def call(self, what: str, method: str, *args: Any, on_late: Callable[[Any, Any], None] | None = None,
             generation: int | None = None, timeout_s: float | None = None) -> Any:
        """``store.<method>(*args)`` on a worker, waited for at most ``op_timeout_s`` (or
        ``timeout_s``).

        Args:
            what: names the operation in errors.
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
        return self.start(what, method, *args, on_late=on_late, generation=generation, timeout_s=timeout_s).result()

    def start(self, what: str, method: str, *args: Any, on_late: Callable[[Any, Any], None] | None = None,
              generation: int | None = None, timeout_s: float | None = None) -> PendingCall:
        """:meth:`call`, without waiting: the call runs on a worker while the caller does other
        work (verifying the blocks of the previous call, say); ``result()`` waits for it, up to
        ``timeout_s`` (default ``op_timeout_s``) from now, and raises as :meth:`call` does.

        Raises:
            PoolUnavailable: the client is DOWN, or has reconnected since ``generation``.
            RuntimeError: the client is closed.
        """
        store, current = self._ensure_up(generation)
        timeout_s = timeout_s or self.op_timeout_s
        entered = threading.Event()
        future = self._submit(_entering, entered, getattr(store, method), *args)
        return PendingCall(self, what, future, store, current, time.monotonic() + timeout_s, timeout_s, on_late, entered)

    def _ensure_up(self, generation: int | None) -> tuple[Any, int]:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"pool client for {self.address} is closed")
            if self._down is not None:
                wait_s = max(0.0, self._next_probe - time.monotonic())
                raise PoolUnavailable(f"pool at {self.address} is down ({self._down}); next probe in {wait_s:.1f} s")
            if generation is not None and generation != self._generation:
                raise PoolUnavailable(f"pool at {self.address}: reconnected since this call's buffers were set up")
            return self._store, self._generation

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
        address = self.call("alloc_from_mem_pool", "alloc_from_mem_pool", nbytes, timeout_s=self.connect_timeout_s)
        if not address:
            raise MemoryError(f"pool client: no shared memory segment of {nbytes} bytes")
        memory = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)
        memory.zero_()
        rc = self.call("register_buffer", "register_buffer", address, nbytes, timeout_s=self.connect_timeout_s)
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
            rc = self.call("register_buffer", "register_buffer", tensor.data_ptr(), _nbytes(tensor),
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
            healthy = self._down is None
            addresses = [start for start, _ in self._ranges]
        self._wake.set()
        reusable = False
        if store is not None and healthy and not inflight:
            try:
                reusable = self._workers.submit(_unregister, store, addresses).result(timeout=self.op_timeout_s)
            except FutureTimeout:
                pass
        self._workers.close()
        if reusable:
            _park((self.pool, self.mode), store)
        elif store is not None:
            _keep_open(store, self._memory)  # still registered: a stray call may use that memory


def unreachable(pool: PoolConfig, mode: RemoteMode, timeout_s: float) -> str | None:
    """Why a client in ``mode`` cannot use ``pool`` now, seen at the socket level; None when
    every process it needs accepts and answers within ``timeout_s`` (all together): in SHM
    mode the daemon; in TCP mode the master, and the daemon the config names (the objects live
    in the daemons; the master answers with the daemon dead). Checked before any Mooncake call:
    one into a dead SHM daemon blocked until exit, a setup against a hung master would freeze
    every thread, and a call still inside a store when Mooncake tears it down at exit aborted
    the process."""
    if mode is RemoteMode.SHM:
        needed = [("daemon", pool.daemon)]
    else:
        needed = [("master", pool.master)] + ([("daemon", pool.daemon)] if pool.daemon else [])
    deadline = time.monotonic() + timeout_s
    for name, address in needed:
        if address is None:
            return f"the pool config names no {name}"
        if not accepts(address, max(1e-3, deadline - time.monotonic())):
            return f"pool {name} at {address} does not accept connections"
        if not answers(address, max(1e-3, deadline - time.monotonic())):
            return f"pool {name} at {address} accepts connections but does not answer within {timeout_s:g} s (hung?)"
    return None


class _Where:
    """The network a client's workers run their calls in (held apart from the client: its
    daemon workers must not keep the client alive)."""

    def __init__(self, name: str | None) -> None:
        self.network = name

    def enter(self) -> None:
        try:
            network.enter(self.network)
        except network.NetworkError as error:
            raise PoolUnavailable(str(error)) from None


def _probe_until_up(ref: weakref.ref, wake: threading.Event) -> None:
    """The probing thread of a DOWN client: probe, back off, until it is UP, closed or gone.
    It holds the client only while probing: a daemon thread that drops the last reference to
    the client's registered memory as the interpreter finalizes aborts the process."""
    io_thread_started()
    failures = 0
    while True:
        client = ref()
        delay = None if client is None else client._backoff(failures)
        del client
        if delay is None or wake.wait(delay):
            return
        client = ref()
        if client is None or client._probe(failures):
            return
        del client
        failures += 1


def _entering(entered: threading.Event, fn: Callable[..., Any], *args: Any) -> Any:
    entered.set()  # the next line calls into the engine, which releases the lock while it moves bytes
    return fn(*args)


def _store_class() -> type:
    try:
        return native_log.store_class()
    except ImportError as error:
        missing = libs.loader_error(str(error))
        if missing:  # installed, but a system library is not (the loader names only the first)
            raise PoolUnavailable(f"the pool client cannot load ({error}): "
                                  f"{libs.describe(libs.missing_libraries() or (missing,))}") from None
        raise PoolUnavailable(
            f"the pool client is not installed ({error}): pip install mooncake-transfer-engine-non-cuda "
            "(or mooncake-transfer-engine with CUDA)"
        ) from None


def _after(stray: Future, on_late: Callable[[Any, Any], None], store: Any) -> None:
    if stray.exception() is None:  # waits (on this worker) until the stray call returns
        on_late(store, stray.result())


def _answers_calls(store: Any) -> bool:
    # Both need the master: health_check said 0 with the master killed.
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
