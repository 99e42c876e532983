"""Stores a pool client no longer uses, kept for later instead of closed: process-wide.

Closing a Mooncake store holds the interpreter's lock (measured with 0.3.13): ~1 s for a
healthy one (it joins a heartbeat thread that sleeps 1 s: every other thread stalled 0.9 s),
30 s for an SHM store whose daemon is stopped. So a client that closes does not close its
store:

* a healthy store, its memory unregistered, is *parked* for the next client of the same pool
  and mode (at most ``PARKED_PER_POOL``; one more is closed, ~1 s);
* a store that may still be running a call (a call abandoned when its caller's budget ran
  out, which may still read or write the memory it was given), whose pool is down, or that a
  reconnect replaced, is *kept* open, unused, with the memory registered with it.

Kept stores are closed only when it is safe and cheap: once there are more than ``KEPT_MOST``,
a background thread (never a caller's) closes the oldest ones whose calls have all returned
and whose pool answers again, and lets their memory go. A store still running a call stays
(its call holds a worker thread anyway). Mooncake tears down whatever is left at process exit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.pool.config import PoolConfig, RemoteMode

log = logging.getLogger("kvstrata.pool")

PARKED_PER_POOL = 2
KEPT_MOST = 8
ANSWERS_S = 1.0  # the socket checks that tell whether a kept store's pool answers

Key = tuple[PoolConfig, RemoteMode]


@dataclass(frozen=True)
class _Kept:
    store: Any
    key: Key
    memory: tuple[torch.Tensor, ...]  # registered with the store: alive as long as it is open
    busy: tuple[Future, ...]  # calls that may still run inside the store

    def settled(self) -> bool:
        return all(call.done() for call in self.busy)


_lock = threading.Lock()
_parked: dict[Key, list[Any]] = {}
_kept: list[_Kept] = []
_pruning = False


def park(key: Key, store: Any) -> None:
    """Keep a healthy store (this client's memory unregistered) for the next client of ``key``."""
    with _lock:
        parked = _parked.setdefault(key, [])
        if len(parked) < PARKED_PER_POOL:
            parked.append(store)
            return
    store.close()  # healthy: ~1 s, every thread stalled (rare: more clients than parking spots)


def unpark(key: Key) -> Any:
    """A parked store of ``key`` (the caller checks that it still answers), or None."""
    with _lock:
        parked = _parked.get(key)
        return parked.pop() if parked else None


def keep_open(store: Any, key: Key, memory: Iterable[torch.Tensor] = (), busy: Iterable[Future] = ()) -> None:
    """Keep ``store`` open, unused, with ``memory`` (registered with it) alive, until it can be
    closed cheaply once ``busy`` (the calls that may still run in it) have all returned."""
    global _pruning
    with _lock:
        _kept.append(_Kept(store, key, tuple(memory), tuple(busy)))
        start = len(_kept) > KEPT_MOST and not _pruning
        _pruning = _pruning or start
    if start:
        threading.Thread(target=_prune, name="kvstrata-pool-prune", daemon=True).start()


def kept() -> int:
    """How many stores are kept open now."""
    with _lock:
        return len(_kept)


def _prune() -> None:
    """Close the oldest kept stores that are settled and whose pool answers, down to KEPT_MOST;
    until none is left to close (a store kept meanwhile is seen on the next pass)."""
    global _pruning
    from kvstrata.pool.connect import unreachable_in  # connect parks and keeps: imported late

    tried: set[int] = set()  # stores whose pool did not answer on this run: not asked again
    while True:
        with _lock:
            excess = len(_kept) - KEPT_MOST
            entry = next((e for e in _kept if id(e) not in tried and e.settled()), None) if excess > 0 else None
            if entry is None:
                _pruning = False
                return
            tried.add(id(entry))
        try:
            if unreachable_in(entry.key[0], entry.key[1], ANSWERS_S) is not None:
                continue  # closing a store of a pool that does not answer can stall the process 30 s
            with _lock:
                _kept.remove(entry)
            entry.store.close()  # ~1 s, every thread stalled: once per store kept past KEPT_MOST
        except Exception:  # noqa: BLE001 - a daemon thread: its fault must not go unseen
            log.exception("pool: closing a kept store failed")
