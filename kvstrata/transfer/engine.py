"""The transfer engine: moves one block (or some of its layers) between two tiers.

A handler is chosen by the ``(source medium, destination medium)`` pair. Memory tiers (device,
host) expose their slots in place through ``view()``, so a transfer that touches one of them
needs no staging copy; only a move between two tiers without views (disk, remote) goes
through a bounce buffer.

The engine moves bytes and nothing else: the caller owns both block tables. It pins the
source and reserves the destination (``prepare_store``) before submitting, and completes the
store (ok or not) and unpins when the future resolves, whether with a result or an exception.

Threads: a bounded ``ThreadPoolExecutor`` (torch copies and file I/O release the GIL). On
CUDA each thread issues its copies on its own stream, which first waits for the work the
submitting thread had queued on its current stream, and is synchronized before the future
completes, so a completed transfer's bytes are in place.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from kvstrata.index.keys import BlockKey
from kvstrata.media import Medium
from kvstrata.tiers.base import Tier

T = TypeVar("T")

Handler = Callable[[Tier, int, Tier, int, BlockKey, slice], int]
"""(src tier, src slot, dst tier, dst slot, key, layers) -> bytes moved."""


@dataclass(frozen=True)
class TransferResult:
    """One finished transfer. ``seconds`` is the handler's own time, queueing excluded."""

    src: Medium
    dst: Medium
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Decimal GB/s (1 GB = 1e9 bytes)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def _view(tier: Tier, slot: int) -> torch.Tensor:
    view = tier.view(slot)
    if view is None:
        raise TypeError(f"{type(tier).__name__} ({tier.medium.label}) has no view() for its slots")
    return view


def read_into_view(src: Tier, src_slot: int, dst: Tier, dst_slot: int, key: BlockKey, layers: slice) -> int:
    """Any tier -> a memory tier: the source reads straight into the destination's slot."""
    target = _view(dst, dst_slot)[layers]  # [n_layers, layer_bytes]
    src.read_into(src_slot, key, target, layers)
    return target.numel()


def write_from_view(src: Tier, src_slot: int, dst: Tier, dst_slot: int, key: BlockKey, layers: slice) -> int:
    """A memory tier -> a tier without views: the destination writes from the source's slot."""
    block = _view(src, src_slot)  # [layers, layer_bytes]
    _require_whole(block.shape[0], layers, dst)
    dst.write(dst_slot, key, block)
    return block.numel()


_bounce = threading.local()  # per thread: {(layers, layer_bytes): uint8 tensor}


def bounce(src: Tier, src_slot: int, dst: Tier, dst_slot: int, key: BlockKey, layers: slice) -> int:
    """Between two tiers without views (disk, remote): through a per-thread host buffer."""
    shape = (src.layout.num_layers, src.layout.layer_bytes)
    _require_whole(shape[0], layers, dst)
    buffers = _bounce.__dict__.setdefault("buffers", {})
    buffer = buffers.get(shape)
    if buffer is None:
        buffer = buffers[shape] = torch.empty(shape, dtype=torch.uint8)
    src.read_into(src_slot, key, buffer)
    dst.write(dst_slot, key, buffer)
    return buffer.numel()


def _require_whole(num_layers: int, layers: slice, dst: Tier) -> None:
    if layers.indices(num_layers) != (0, num_layers, 1):
        raise ValueError(
            f"{dst.medium.label} tier stores whole blocks; layers {layers} needs a destination with view()"
        )


_HAS_VIEW = {Medium.DEVICE: True, Medium.HOST: True, Medium.DISK: False, Medium.REMOTE: False}


def _default_handler(src: Medium, dst: Medium) -> Handler:
    if _HAS_VIEW[dst]:
        return read_into_view
    return write_from_view if _HAS_VIEW[src] else bounce


HANDLERS: dict[tuple[Medium, Medium], Handler] = {(s, d): _default_handler(s, d) for s in Medium for d in Medium}


@dataclass(frozen=True)
class _Job:
    handler: Handler
    src: Tier
    src_slot: int
    dst: Tier
    dst_slot: int
    key: BlockKey
    layers: slice
    cuda: torch.device | None  # the CUDA device involved, if any
    ready: object | None  # torch.cuda.Event: the submitter's queued work is done


class TransferEngine:
    """Runs block transfers on ``workers`` threads; at most ``workers`` handlers run at once.

    Args:
        workers: worker threads (>= 1).
        handlers: overrides of the default handler per (src medium, dst medium).
    """

    def __init__(self, workers: int = 2, handlers: Mapping[tuple[Medium, Medium], Handler] | None = None) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"transfer engine: workers must be a positive integer, got {workers!r}")
        self.handlers = {**HANDLERS, **(handlers or {})}
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstrata-transfer")
        self._streams = threading.local()  # per thread: {device: torch.cuda.Stream}

    def submit(
        self, src: Tier, src_slot: int, dst: Tier, dst_slot: int, key: BlockKey, layers: slice = slice(None)
    ) -> Future[TransferResult]:
        """Queue a transfer. Bad arguments raise here; failures while moving bytes (e.g.
        CorruptBlock) surface through the future, and the destination slot stays reserved
        for the caller to complete with ``ok=False``."""
        return self._pool.submit(self._execute, self._job(src, src_slot, dst, dst_slot, key, layers))

    def run(
        self, src: Tier, src_slot: int, dst: Tier, dst_slot: int, key: BlockKey, layers: slice = slice(None)
    ) -> TransferResult:
        """The same transfer, on the calling thread; returns when the bytes are in place."""
        return self._execute(self._job(src, src_slot, dst, dst_slot, key, layers))

    def run_many(
        self, src: Tier, src_slots: list[int], keys: list[BlockKey], dst: Tier, dst_slots: list[int], layers: slice
    ) -> TransferResult:
        """Copy ``layers`` of several blocks into a tier with views (device, host), in one
        batched call of the source tier (``read_many_into``) on the calling thread: one layer
        of many blocks costs one dispatch. Returns when the bytes are in place."""
        start = time.perf_counter()
        dsts = [dst.view(slot)[layers] for slot in dst_slots]
        if any(d is None for d in dsts):
            raise ValueError(f"run_many needs a destination with views, not {dst.medium.label}")
        cuda = next((t.device for t in (src, dst) if t.device.type == "cuda"), None)
        if cuda is None:
            src.read_many_into(src_slots, keys, dsts, layers)
        else:
            stream = self._stream(cuda)
            stream.wait_stream(torch.cuda.current_stream(cuda))
            try:
                with torch.cuda.stream(stream):
                    src.read_many_into(src_slots, keys, dsts, layers)
            finally:
                stream.synchronize()
        moved = sum(d.numel() for d in dsts)
        return TransferResult(src.medium, dst.medium, moved, time.perf_counter() - start)

    def submit_call(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """Run ``fn(*args)`` on a worker: for a batch of transfers made with ``run`` (one
        layer of many blocks, say), so the batch counts once against the worker bound."""
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        """Finish queued transfers and stop the workers. Idempotent."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _job(self, src: Tier, src_slot: int, dst: Tier, dst_slot: int, key: BlockKey, layers: slice) -> _Job:
        if src.layout != dst.layout:
            raise ValueError(f"transfer between different layouts: {src.layout.describe()} -> {dst.layout.describe()}")
        if not isinstance(layers, slice) or layers.step not in (None, 1):
            raise ValueError(f"layers must be a contiguous slice, got {layers!r}")
        handler = self.handlers.get((src.medium, dst.medium))
        if handler is None:
            raise ValueError(f"no transfer handler for {src.medium.label} -> {dst.medium.label}")
        cuda = next((t.device for t in (src, dst) if t.device.type == "cuda"), None)
        ready = torch.cuda.current_stream(cuda).record_event() if cuda is not None else None
        return _Job(handler, src, src_slot, dst, dst_slot, key, layers, cuda, ready)

    def _execute(self, job: _Job) -> TransferResult:
        start = time.perf_counter()
        args = (job.src, job.src_slot, job.dst, job.dst_slot, job.key, job.layers)
        if job.cuda is None:
            moved = job.handler(*args)
        else:
            stream = self._stream(job.cuda)
            stream.wait_event(job.ready)
            try:
                with torch.cuda.stream(stream):
                    moved = job.handler(*args)
            finally:
                # Even on failure: no copy may still be landing in a slot the caller releases.
                stream.synchronize()
        return TransferResult(job.src.medium, job.dst.medium, moved, time.perf_counter() - start)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        streams = self._streams.__dict__.setdefault("by_device", {})
        if device not in streams:
            streams[device] = torch.cuda.Stream(device=device)
        return streams[device]
