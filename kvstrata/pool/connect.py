"""Reaching the pool: socket checks first, then a Mooncake store set up (or a parked one reused).

Two Mooncake calls hold the GIL (measured with 0.3.13): ``setup`` and ``close``; every data
call releases it. So neither can be bounded by a thread, and before ``setup`` the address must
accept a connection and answer: a live Mooncake server closes a connection at once on 16 bytes
that are no request, while for a stopped (hung) process the kernel still accepts and nothing
answers. A setup against a hung master would freeze every thread of the process for 20 retries
of 30 s. (A setup that succeeds takes ~0.2 s on loopback, every thread stalled: once per
connection, reconnects included.) ``close``: see ``kvstrata.pool.parking``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from kvstrata.extras import pip_command
from kvstrata.pool import libs, native_log, network, ops, parking
from kvstrata.pool.calls import PoolUnavailable
from kvstrata.pool.config import PoolConfig, RemoteMode, load_pool_config
from kvstrata.pool.sockets import accepts, answers
from kvstrata.pool.workers import Workers

log = logging.getLogger("kvstrata.pool")

PROBE_OBJECT = "kvstrata/.probe"  # never written: the probe asks whether it exists
LOCAL_BUFFER_BYTES = 4 << 20  # Mooncake's own staging for copying APIs, which we do not use


def where(pool: PoolConfig) -> str:
    """``master HOST:PORT, daemon HOST:PORT`` for logs and errors."""
    return f"master {pool.master}" + (f", daemon {pool.daemon}" if pool.daemon else "")


def address(pool: PoolConfig, mode: RemoteMode) -> str:
    """What a client in ``mode`` talks to: the master (TCP) or the daemon (SHM)."""
    return pool.daemon if mode is RemoteMode.SHM else pool.master


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
    for name, at in needed:
        if at is None:
            return f"the pool config names no {name}"
        if not accepts(at, max(1e-3, deadline - time.monotonic())):
            return f"pool {name} at {at} does not accept connections"
        if not answers(at, max(1e-3, deadline - time.monotonic())):
            return f"pool {name} at {at} accepts connections but does not answer within {timeout_s:g} s (hung?)"
    return None


def unreachable_in(pool: PoolConfig, mode: RemoteMode, timeout_s: float) -> str | None:
    """:func:`unreachable`, asked from inside ``pool``'s network."""
    try:
        return network.run_in(pool.network, unreachable, pool, mode, timeout_s)
    except network.NetworkError as error:
        return str(error)


class Where:
    """The network a client's workers run their calls in (held apart from the client: its
    daemon workers must not keep the client alive)."""

    def __init__(self, name: str | None) -> None:
        self.network = name

    def enter(self) -> None:
        try:
            network.enter(self.network)
        except network.NetworkError as error:
            raise PoolUnavailable(str(error)) from None


def store_class() -> type:
    """Mooncake's store class.

    Raises:
        PoolUnavailable: not installed, or a system library it needs is missing.
    """
    try:
        return native_log.store_class()
    except ImportError as error:
        missing = libs.loader_error(str(error))
        if missing:  # installed, but a system library is not (the loader names only the first)
            raise PoolUnavailable(f"the pool client cannot load ({error}): "
                                  f"{libs.describe(libs.missing_libraries() or (missing,))}") from None
        raise PoolUnavailable(
            f"the pool client is not installed ({error}): {pip_command('mooncake')}"
        ) from None


def answers_calls(store: Any) -> bool:
    """Whether ``store`` answers: both need the master (health_check said 0 with the master killed)."""
    return ops.HEALTH_CHECK.run(store) == 0 and all(r >= 0 for r in ops.BATCH_IS_EXIST.run(store, [PROBE_OBJECT]))


def connect(pool: PoolConfig, mode: RemoteMode, workers: Workers, at: Where, timeout_s: float) -> Any:
    """A store set up for ``pool`` in ``mode`` (a parked one that still answers, or a new one),
    set up on one of ``workers``, which run in ``at`` (set to the pool's network here).

    Raises:
        PoolUnavailable: not reachable within ``timeout_s``.
    """
    cls = store_class()
    what = f"pool {'daemon' if mode is RemoteMode.SHM else 'master'} at {address(pool, mode)}"
    deadline = time.monotonic() + timeout_s
    # Mooncake's setup retries for a minute or more, holding the GIL: look first.
    why = unreachable_in(pool, mode, timeout_s)
    if why is not None:
        raise PoolUnavailable(why)
    at.network = pool.network  # a pool restarted elsewhere: its store is set up, and used, there
    key = (pool, mode)
    store = parking.unpark(key)
    if store is not None:
        check = workers.submit(answers_calls, store)
        try:
            if check.result(timeout=max(0.0, deadline - time.monotonic())):
                return store
        except FutureTimeout:
            pass
        parking.keep_open(store, key, busy=[check])  # parked, then the pool failed: closing could stall every thread
    why = network.joined(pool.network)  # a store set up elsewhere would retry for 90 s, holding the GIL
    if why is not None:
        raise PoolUnavailable(why)
    store = cls()
    if mode is RemoteMode.SHM:
        args = (0, LOCAL_BUFFER_BYTES, pool.daemon)
        setup = store.setup_dummy
    else:
        args = (pool.local_hostname, pool.metadata_server, 0, LOCAL_BUFFER_BYTES, pool.protocol,
                pool.rdma_devices, pool.master)
        setup = store.setup
    future = workers.submit(setup, *args)
    try:
        rc = future.result(timeout=max(0.0, deadline - time.monotonic()))
    except FutureTimeout:
        parking.keep_open(store, key, busy=[future])
        raise PoolUnavailable(f"{what}: setup did not finish within {timeout_s:g} s") from None
    if rc != 0:
        parking.keep_open(store, key)
        said = native_log.forward(logging.WARNING)
        raise PoolUnavailable(f"{what}: setup failed (Mooncake code {rc}" + (f": {said[-1]})" if said else ")"))
    return store


def reread(current: PoolConfig, last_read: PoolConfig) -> PoolConfig:
    """The pool's config as its file says now (``current`` without a file, or when the file
    cannot be read: a pool that is stopped has no state file). ``last_read``: what it said at
    the last probe (a change is logged once, not per probe)."""
    if current.config_file is None:
        return current
    try:
        fresh = load_pool_config(current.config_file)
    except (OSError, ValueError) as error:
        log.debug("pool config %s unreadable (%s); trying %s", current.config_file, error, where(current))
        return current
    if fresh != current and fresh != last_read:
        log.info("pool config %s now says %s (was %s)", current.config_file, where(fresh), where(current))
    return fresh


def register_with(store: Any, tensors: list[torch.Tensor], submit: Callable[..., Future], timeout_s: float,
                  pool: PoolConfig) -> tuple[tuple[int, int], ...]:
    """The [start, end) ranges of ``tensors`` that ``store`` registered, each asked for on a
    worker (``submit``). One it refuses is left out (it moves through staging): a refusal must
    not keep the pool down.

    Raises:
        PoolUnavailable: the store did not answer within ``timeout_s``.
    """
    ranges: list[tuple[int, int]] = []
    for tensor in tensors:
        start, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if (start, start + nbytes) in ranges:
            continue
        try:
            rc = submit(ops.REGISTER_BUFFER.run, store, start, nbytes).result(timeout=timeout_s)
        except FutureTimeout:
            raise PoolUnavailable(f"register_buffer of {nbytes} bytes did not return within {timeout_s:g} s") from None
        if rc == 0:
            ranges.append((start, start + nbytes))
        else:
            log.warning("pool (%s): register_buffer of %d bytes failed (Mooncake code %d): that memory "
                        "moves through staging", where(pool), nbytes, rc)
    return tuple(ranges)
