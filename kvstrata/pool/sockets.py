"""Asking a pool process at the socket level whether it is there: accepting connections, and
answering (a stopped process's kernel still accepts), from the host or inside the pool's network.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from kvstrata.pool import network as netns


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accepts(address: str, timeout_s: float = 0.5) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


_NOT_A_REQUEST = bytes(16)


def answers(address: str, timeout_s: float = 0.5) -> bool:
    """Whether a live process serves ``address``: it closes the connection on (or answers)
    bytes that are no request within ``timeout_s``. For a stopped (hung) process the kernel
    still accepts the connection, and nothing answers."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=max(timeout_s, 1e-3)) as conn:
            conn.sendall(_NOT_A_REQUEST)
            conn.recv(1)  # b"" (closed) or data: someone is there
            return True
    except ConnectionRefusedError:
        return False  # nobody listens
    except ConnectionError:
        return True  # reset by a live peer
    except OSError:
        return False  # timed out (nobody reads), or unreachable


def answers_in(network: str | None, address: str, timeout_s: float = 0.5) -> bool:
    """``answers(address)`` asked from inside the pool's network (False: it cannot be entered)."""
    try:
        return netns.run_in(network, answers, address, timeout_s)
    except netns.NetworkError:
        return False


def accepts_in(network: str | None) -> Callable[[str, float], bool]:
    """``accepts``, asked from inside the pool's network (for ``wait_for``)."""
    return lambda address, timeout_s: netns.run_in(network, accepts, address, timeout_s)
