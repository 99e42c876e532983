"""The scheduler's one question to the worker's caches: how many blocks of these tokens they serve, from which tiers.

The worker owns its process's TieredCaches, one per KV cache group; the scheduler side decides
what to load from how long a prompt's usable cached prefix is (the longest every group serves),
so it asks the worker. On CPU vLLM always runs the
worker in its own process (the platform turns the uniprocess executor into the multiprocess
one; only ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps them together), on a GPU with TP=1 they
share the engine core process. So the answer comes two ways:

* in one process, from the per-process registry (engine id -> the worker's cache);
* across processes, over a Unix socket the worker serves (in a private per-user directory,
  with an authkey of the engine id), one connection per scheduler, tokens in, the tier of each
  block of the usable prefix out (how many blocks, and where from: vLLM's per-tier cache stats).

Only TP rank 0 answers: every rank caches the same token blocks. A scheduler whose worker's
socket has not appeared within ``LOOKUP_WAIT_S`` counts a miss (no blocks), never a guess.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from multiprocessing.connection import Client, Listener
from collections.abc import Callable
from typing import Any

from kvstrata.media import Medium

Answer = Callable[[list[int]], tuple[Medium, ...]]  # tokens -> the tier of each block of their usable cached prefix

LOOKUP_WAIT_S = 10.0  # how long the scheduler waits for its worker's lookup socket to appear

_REGISTRY: dict[str, Answer] = {}  # engine_id -> the worker's (TP rank 0) answer
_REGISTRY_LOCK = threading.Lock()


def socket_path(engine_id: str) -> str:
    """The engine's lookup socket, in a directory only this user can enter."""
    directory = os.path.join(tempfile.gettempdir(), f"kvstrata-{os.getuid()}")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    return os.path.join(directory, f"{engine_id}.sock")


def _authkey(engine_id: str) -> bytes:
    return f"kvstrata:{engine_id}".encode()


class LookupServer:
    """The worker's answers to its scheduler's lookups: registers ``answer`` in this process
    and serves it on the engine's socket, until :meth:`close`."""

    def __init__(self, engine_id: str, answer: Answer) -> None:
        self._engine_id = engine_id
        self._answer = answer
        with _REGISTRY_LOCK:
            _REGISTRY[engine_id] = answer
        self._path = socket_path(engine_id)
        if os.path.exists(self._path):
            os.unlink(self._path)
        self._listener = Listener(self._path, family="AF_UNIX", authkey=_authkey(engine_id))
        threading.Thread(target=self._accept, name="kvstrata-lookup", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError):
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="kvstrata-lookup-conn", daemon=True).start()

    def _serve(self, conn: Any) -> None:
        with conn:
            while True:
                try:
                    tokens = conn.recv()
                except (EOFError, OSError):
                    return
                conn.send(self._answer(tokens))

    def close(self) -> None:
        """Stop serving: the socket is removed, then the registry entry (if still these caches')."""
        self._listener.close()
        if os.path.exists(self._path):
            os.unlink(self._path)
        with _REGISTRY_LOCK:
            if _REGISTRY.get(self._engine_id) is self._answer:
                del _REGISTRY[self._engine_id]


class WorkerLookup:
    """The scheduler side's view of its worker's caches: the registry's when the worker lives in
    this process (checked on every call: the worker may register after the scheduler starts),
    else the socket's (connected on first use)."""

    def __init__(self, engine_id: str) -> None:
        self._engine_id = engine_id
        self._client: _LookupClient | None = None

    def hit_tiers(self, tokens: list[int]) -> tuple[Medium, ...]:
        """The tier of each block of ``tokens`` the worker's caches serve in every group (the
        usable prefix); none when there is no worker cache to ask (a miss)."""
        with _REGISTRY_LOCK:
            answer = _REGISTRY.get(self._engine_id)
        if answer is not None:  # the worker lives in this process
            return answer(tokens)
        if self._client is None:
            self._client = _LookupClient(socket_path(self._engine_id), _authkey(self._engine_id))
        return self._client.lookup(tokens)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class _LookupClient:
    def __init__(self, path: str, authkey: bytes) -> None:
        self._path, self._authkey = path, authkey
        self._conn: Any = None
        self._lock = threading.Lock()

    def lookup(self, tokens: list[int]) -> tuple[Medium, ...]:
        with self._lock:
            if self._conn is None:
                deadline = time.monotonic() + LOOKUP_WAIT_S
                while not os.path.exists(self._path):
                    if time.monotonic() > deadline:
                        return ()  # no worker cache to ask: a miss, never a guess
                    time.sleep(0.05)
                self._conn = Client(self._path, family="AF_UNIX", authkey=self._authkey)
            self._conn.send(tokens)
            return self._conn.recv()

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
