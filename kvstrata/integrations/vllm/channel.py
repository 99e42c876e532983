"""The scheduler's one question to the worker's caches, on a channel only this user can reach.

The worker owns its process's TieredCaches, one per KV cache group; the scheduler decides what to
load from how long a prompt's usable cached prefix is (the longest every group serves), so it
asks the worker. On CPU vLLM always runs the worker in its own process (only
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps them together); on a GPU with TP=1 they share the
engine core's. So the answer comes two ways:

* in one process, from the per-process registry (engine id -> the worker's answer);
* across processes, over a Unix stream socket the worker serves.

What crosses is plain numbers, never a pickle: a request is ``b"KVL1"``, a little-endian u32
count and that many u32 token ids; the answer a u32 count and one byte per block, the
:class:`~kvstrata.media.Medium` it loads from. Nothing else is read.

Who can reach it. The socket lives in ``$XDG_RUNTIME_DIR`` (else the temporary directory) under
``kvstrata-<uid>``, a directory kvstrata made, owned by this user and mode 0700
(:mod:`kvstrata.trust`: another user's directory, or a symlink, is refused in one line). Both
ends check the other's credentials (``SO_PEERCRED``): the worker answers only a process of its
own user, and the scheduler talks only to one; a socket file of another owner is never used.

Bounded in time. The scheduler waits at most ``budget_s`` for an answer (connecting included);
a worker that is slow, hung or gone costs that budget once and a miss (no blocks), never a
stall of the scheduler loop; the connection is then dropped, so a late answer is never read as
the next one's.

Only TP rank 0 answers: every rank caches the same token blocks.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys
import tempfile
import threading
import time
from array import array
from collections.abc import Callable
from pathlib import Path

from kvstrata.media import Medium
from kvstrata.transfer.placement import io_thread_started
from kvstrata.trust import Untrusted, check_private_dir, owner_name, private_dir

Answer = Callable[[list[int]], tuple[Medium, ...]]  # tokens -> the tier of each block of their usable cached prefix

MAGIC = b"KVL1"
MAX_TOKENS = 1 << 24  # a request longer than any model's context is refused, not allocated
LOOKUP_BUDGET_S = 0.5  # how long the scheduler waits for one answer (a miss after that): a busy 2-core host stays well inside it

_log = logging.getLogger("kvstrata.integrations.vllm")
_COUNT = struct.Struct("<I")
_MEDIA = {m.value: m for m in Medium}

_REGISTRY: dict[str, Answer] = {}  # engine_id -> the worker's (TP rank 0) answer
_REGISTRY_LOCK = threading.Lock()


class ChannelError(Exception):
    """The channel broke a rule (a foreign peer, a malformed message): the connection is dropped."""


def channel_dir() -> Path:
    """This user's private directory for the engines' sockets (made 0700 if absent)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return private_dir(Path(base) / f"kvstrata-{os.geteuid()}", "kvstrata socket directory")


def socket_path(engine_id: str) -> Path:
    if not engine_id or "/" in engine_id or engine_id.startswith("."):
        raise ValueError(f"KVStrataConnector: engine id {engine_id!r} cannot name a socket")
    return channel_dir() / f"{engine_id}.sock"


def peer_uid(sock: socket.socket) -> int:
    """The effective uid of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise EOFError("the peer closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def encode_request(tokens: list[int]) -> bytes:
    ids = array("I", tokens)  # OverflowError for a negative or > u32 id
    if ids.itemsize != 4:
        raise RuntimeError("array('I') is not 32-bit on this platform")
    if sys.byteorder != "little":
        ids.byteswap()
    return MAGIC + _COUNT.pack(len(ids)) + ids.tobytes()


def read_request(sock: socket.socket) -> list[int]:
    if _recv_exact(sock, len(MAGIC)) != MAGIC:
        raise ChannelError("not a kvstrata lookup")
    (n,) = _COUNT.unpack(_recv_exact(sock, _COUNT.size))
    if n > MAX_TOKENS:
        raise ChannelError(f"a lookup of {n} tokens is longer than any context")
    ids = array("I")
    ids.frombytes(_recv_exact(sock, 4 * n))
    if sys.byteorder != "little":
        ids.byteswap()
    return ids.tolist()


def encode_answer(tiers: tuple[Medium, ...]) -> bytes:
    return _COUNT.pack(len(tiers)) + bytes(m.value for m in tiers)


def read_answer(sock: socket.socket, asked_blocks: int) -> tuple[Medium, ...]:
    (n,) = _COUNT.unpack(_recv_exact(sock, _COUNT.size))
    if n > asked_blocks:
        raise ChannelError(f"an answer of {n} blocks to a lookup of {asked_blocks}")
    codes = _recv_exact(sock, n)
    try:
        return tuple(_MEDIA[c] for c in codes)
    except KeyError as error:
        raise ChannelError(f"an answer names no tier: {error}") from None


class LookupServer:
    """The worker's answers to its scheduler's lookups: registers ``answer`` in this process and
    serves it on the engine's socket, until :meth:`close`."""

    def __init__(self, engine_id: str, answer: Answer) -> None:
        self._engine_id = engine_id
        self._answer = answer
        self._closed = threading.Event()
        self._path = socket_path(engine_id)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _unlink_own_socket(self._path)
            old = os.umask(0o177)  # the socket file is 0600 from the start
            try:
                self._sock.bind(str(self._path))
            finally:
                os.umask(old)
            self._sock.listen(8)
        except BaseException:
            self._sock.close()
            raise
        with _REGISTRY_LOCK:
            _REGISTRY[engine_id] = answer
        threading.Thread(target=self._accept, name="kvstrata-lookup", daemon=True).start()

    def _accept(self) -> None:
        io_thread_started()
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            if peer_uid(conn) != os.geteuid():  # another user's process: not a word
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kvstrata-lookup-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        io_thread_started()
        with conn:
            while not self._closed.is_set():
                try:
                    tokens = read_request(conn)
                except (EOFError, OSError, ChannelError):
                    return
                try:
                    reply = encode_answer(self._answer(tokens))
                except Exception:  # noqa: BLE001 - a lookup that fails is a miss, not a dead channel
                    reply = encode_answer(())
                try:
                    conn.sendall(reply)
                except OSError:
                    return

    def close(self) -> None:
        """Stop serving: the socket is removed, then the registry entry (if still this answer)."""
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        _unlink_own_socket(self._path)
        with _REGISTRY_LOCK:
            if _REGISTRY.get(self._engine_id) is self._answer:
                del _REGISTRY[self._engine_id]


class WorkerLookup:
    """The scheduler side's view of its worker's caches: the registry's when the worker lives in
    this process (checked on every call: the worker may register after the scheduler starts),
    else the socket's (connected on first use), each answer within ``budget_s``.

    Attributes:
        timeouts: lookups that ran out of budget (counted as misses).
        refused: connections refused for a foreign owner or peer (counted as misses).
    """

    def __init__(self, engine_id: str, budget_s: float = LOOKUP_BUDGET_S) -> None:
        self._engine_id = engine_id
        self._budget_s = budget_s
        self._sock: socket.socket | None = None
        self.timeouts = 0
        self.refused = 0
        self.last_error: str | None = None

    def hit_tiers(self, tokens: list[int], block_size: int) -> tuple[Medium, ...]:
        """The tier of each block of ``tokens`` the worker's caches serve in every group (the
        usable prefix); none when there is no worker to ask in time (a miss)."""
        with _REGISTRY_LOCK:
            answer = _REGISTRY.get(self._engine_id)
        if answer is not None:  # the worker lives in this process
            return answer(tokens)
        deadline = time.monotonic() + self._budget_s
        try:
            sock = self._connected(deadline)
            if sock is None:
                return ()
            sock.settimeout(max(1e-3, deadline - time.monotonic()))
            sock.sendall(encode_request(tokens))
            return read_answer(sock, len(tokens) // block_size)
        except (TimeoutError, socket.timeout):
            self.timeouts += 1
            self._drop("the worker did not answer a lookup in time")
        except (OSError, EOFError, ChannelError, Untrusted) as error:
            self._drop(str(error))
        return ()

    def _connected(self, deadline: float) -> socket.socket | None:
        if self._sock is not None:
            return self._sock
        path = socket_path(self._engine_id)
        check_private_dir(path.parent, "kvstrata socket directory")
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None  # not up yet (or gone): a miss
        if st.st_uid != os.geteuid():
            self.refused += 1
            raise Untrusted(f"lookup socket {path} is owned by {owner_name(st.st_uid)}: refusing to use it")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(1e-3, deadline - time.monotonic()))
            sock.connect(str(path))
            if peer_uid(sock) != os.geteuid():
                self.refused += 1
                raise Untrusted(f"lookup socket {path} is served by {owner_name(peer_uid(sock))}'s process: "
                                "refusing to use it")
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        return sock

    def _drop(self, why: str) -> None:
        if why != self.last_error and why != "closed":  # each new reason once, not every lookup
            _log.warning("kvstrata lookup: %s (counted as a miss)", why)
        self.last_error = why
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        self._drop("closed")


def _unlink_own_socket(path: Path) -> None:
    """Remove a stale socket of this user's at ``path`` (never another user's file)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if st.st_uid != os.geteuid():
        raise Untrusted(f"lookup socket {path} is owned by {owner_name(st.st_uid)}: refusing to replace it")
    os.unlink(path)
