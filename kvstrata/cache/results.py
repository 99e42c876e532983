"""What the cache's operations hand back: results, and the handle of a load in flight."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstrata.index.keys import BlockKey
from kvstrata.index.prefix import Match
from kvstrata.kv.layout import KVLayout
from kvstrata.manager.plans import LoadPlan, StopReason
from kvstrata.media import Medium, Route
from kvstrata.policies.prefetch import PrefetchTiming
from kvstrata.transfer.worker import TransferResult


@dataclass(frozen=True)
class LoadResult:
    blocks: int
    tokens: int
    bytes_from: dict[Medium, int]  # per source medium of every leg (disk -> host -> device: both)
    seconds: float  # the load's own time: planning and moving (waiting for a worker thread excluded)
    stopped: StopReason | None  # why fewer blocks than matched were loaded, if so
    restored_bytes: int = 0  # bytes that arrived on the device (blocks not already there)
    paths: dict[Route, int] = field(default_factory=dict)  # blocks per route, e.g. (REMOTE, HOST, DEVICE)
    stopped_at: Medium | None = None  # the tier of the block the load stopped at, if one did

    @property
    def gbps(self) -> float:
        """Restored bytes per second, end to end."""
        return self.restored_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @classmethod
    def of(cls, plan: LoadPlan, moves: Sequence[TransferResult], seconds: float, layout: KVLayout) -> LoadResult:
        """A completed plan's result: ``moves`` are its own legs' transfers (not its room's)."""
        bytes_from: dict[Medium, int] = {}
        for result in moves:
            bytes_from[result.src] = bytes_from.get(result.src, 0) + result.bytes
        restored = sum(1 for _ in plan.moving()) * layout.block_bytes
        paths = dict(Counter(b.route for b in plan.blocks))
        return cls(len(plan.blocks), len(plan.blocks) * layout.block_tokens, bytes_from, seconds, plan.stopped,
                   restored, paths, plan.stopped_at)


@dataclass(frozen=True)
class StoreResult:
    blocks: int  # full blocks of the sequence
    new_blocks: int  # blocks this store wrote to the device tier
    seconds: float
    refused_blocks: int = 0  # blocks not stored: the device tier was full of pinned blocks


@dataclass(frozen=True)
class PutResult:
    """A put from a caller's memory: per block whether a tier holds it (written now, or there
    already), and how many blocks it wrote into some tier."""

    stored: tuple[bool, ...]
    written: int
    seconds: float
    new: int = 0  # blocks no tier held before, written now


class LoadHandle:
    """A load in flight: completion, error, and per-layer readiness of the device copies.

    Args:
        match: what was asked for.
        num_layers: layers per block (one readiness event each).
        block: the device copy of a device slot, shaped ``layout.block_shape``.
        unpin: drops the device pins of the given keys (on release).
    """

    def __init__(self, match: Match, num_layers: int, block: Callable[[int], torch.Tensor],
                 unpin: Callable[[Sequence[BlockKey]], None]) -> None:
        self.match = match
        self._block = block
        self._unpin = unpin
        self._layers = [threading.Event() for _ in range(num_layers)]
        self._done = threading.Event()
        self._result: LoadResult | None = None
        self._error: BaseException | None = None
        self._slots: tuple[int, ...] = ()
        self._keys: tuple[BlockKey, ...] = ()
        self._released = False
        self._release_lock = threading.Lock()
        self._cancelled = threading.Event()

    # --- filled by the cache ---
    def _plan(self, keys: tuple[BlockKey, ...], slots: tuple[int, ...]) -> None:
        self._keys, self._slots = keys, slots

    def _layers_done(self, layers: range) -> None:
        for layer in layers:
            self._layers[layer].set()

    def _finish(self, result: LoadResult | None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        if error is not None:
            self._keys, self._slots = (), ()  # the pins went with the plan
        for event in self._layers:
            event.set()
        self._done.set()

    # --- for the caller ---
    def wait(self, timeout: float | None = None) -> LoadResult:
        if not self._done.wait(timeout):
            raise TimeoutError(f"load of {self.match.blocks} blocks not done after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Block until ``layer`` of every loaded block is on the device."""
        if not self._layers[layer].wait(timeout):
            raise TimeoutError(f"layer {layer} not loaded after {timeout} s")
        if self._error is not None:
            raise self._error

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Give the load up: blocks not yet being read are not read (the load ends stopped, at
        the first of them); what is in flight lands. ``release`` still waits for its end."""
        self._cancelled.set()

    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def blocks(self) -> int:
        """Blocks being loaded (known once the first layer is ready)."""
        return len(self._slots)

    @property
    def keys(self) -> tuple[BlockKey, ...]:
        """Keys of the blocks being loaded (their device pins are this handle's until release)."""
        return self._keys

    def block(self, i: int) -> torch.Tensor:
        """The device copy of the i-th loaded block, shaped ``layout.block_shape``."""
        return self._block(self._slots[i])

    def pieces(self) -> list[tuple[int, int, torch.Tensor]]:
        """``(block, first head, device block)`` of every loaded block: the whole block's heads,
        as a head-sliced load (:class:`~kvstrata.cache.sliced.SlicedLoad`) gives its slices."""
        return [(i, 0, self.block(i)) for i in range(self.blocks)]

    def release(self) -> None:
        """Unpin the loaded device blocks; they may be evicted from now on. Waits for a load
        still in flight (its pins are taken as it goes). Idempotent."""
        self._done.wait()
        with self._release_lock:
            if self._released:
                return
            self._released = True
        self._unpin(self._keys)

    def __enter__(self) -> "LoadHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.wait()
        finally:
            self.release()


class PrefetchFuture(Future):
    """A prefetch's Future (its result: blocks promoted), with the deadline schedule it ran
    on (``timing``; None unless the DEADLINE policy had a calibration to schedule from)."""

    def __init__(self, timing: PrefetchTiming | None) -> None:
        super().__init__()
        self.timing = timing

    def begin(self, submit: Callable[[], Future], at: Callable[[float, Callable[[], None], Callable[[], None]], None]) -> None:
        """Start the promotion (``submit()`` runs it and gives its future) now, or at
        ``timing.start_s`` on the timer ``at`` (which cancels it if the cache closes first)."""

        def start() -> None:
            try:
                inner = submit()
            except RuntimeError as exc:  # the cache closed meanwhile
                self.set_exception(exc)
                return
            inner.add_done_callback(self.follow)

        timing = self.timing
        if timing is not None and timing.start_s > time.monotonic():
            cancelled = RuntimeError("the cache closed before this prefetch began")
            at(timing.start_s, start, lambda: self.set_exception(cancelled))
        else:
            start()

    def follow(self, inner: Future) -> None:
        """Resolve as ``inner`` did (the promotion's own future, once it ran)."""
        if inner.exception() is not None:
            self.set_exception(inner.exception())
        else:
            self.set_result(inner.result())
