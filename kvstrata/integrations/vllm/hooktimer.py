"""The context around a connector hook: the CPU its thread used and the time it took.

A class, not a ``contextlib`` generator: hooks run several times every step (the worker's for
every layer of a step that loads or saves), and hooks on one thread never nest, so one instance
is made once and reused.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class HookTimer:
    """``with timer:`` calls ``ended(cpu_s, wall_s)`` when the block ends (it raising or not)."""

    __slots__ = ("_ended", "_cpu", "_wall")

    def __init__(self, ended: Callable[[float, float], None]) -> None:
        self._ended = ended
        self._cpu = self._wall = 0.0

    def __enter__(self) -> None:
        self._cpu, self._wall = time.thread_time(), time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._ended(time.thread_time() - self._cpu, time.perf_counter() - self._wall)
