"""The transfer worker: carries out the block manager's plans, and owns every thread and timer.

It moves legs (``kvstrata.manager.plans.Leg``) through handlers keyed by ``(source medium,
destination medium)`` (``kvstrata.transfer.handlers``), carries out rooms (demotions, then
discards, deepest tier first), copies a load's layer ranges and copies a store's KV in, moves
blocks between a caller's memory and the tiers (``put``, ``get``: placements, each block as its
pieces), and reports per leg None or a ``Failure``; it never decides anything about a block's state.

Threads: a bounded pool of ``workers`` byte movers (torch copies, file I/O and pool calls
release the GIL); for a tier whose reads pay off in flight at once (``TierCapabilities.readers``: the disk),
that many readers of its own, which read its blocks into memory; one orchestration pool that runs the cache's loads, stores and prefetches
(they wait on byte movers, which never wait on them); one for write-downs and demotions, so a
store never waits on a task queued behind it; and one timer thread for deadline prefetches.
A batch that is one task runs on the calling thread: handing it over only adds a wait.

How a group of legs is split follows the tiers' ``TierCapabilities`` (``_split``), never their
names. CUDA: a handler that touches a GPU tier runs on its thread's own stream
(``kvstrata.transfer.streams``), which first waits for what the submitting thread had queued on
its current stream, and is synchronized before the handler's results are reported, so reported
bytes are in place.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from kvstrata.index.keys import BlockKey
from kvstrata.errors import BlockMissing, CorruptBlock, LoadCancelled, TierUnavailable, TransferAbandoned
from kvstrata.manager.plans import Failure, Leg, Placement, Room, Victim
from kvstrata.media import Medium
from kvstrata.tiers.base import Pieces, Tier
from kvstrata.transfer.handlers import HANDLERS, Handler
from kvstrata.transfer.placement import io_thread_started
from kvstrata.transfer.streams import ReadyEvents, StreamsByThread, record_ready
from kvstrata.transfer.timers import Timers

T = TypeVar("T")
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferResult:
    """One handler call: ``bytes`` moved from ``src`` to ``dst`` in ``seconds`` (its own time,
    queueing excluded)."""

    src: Medium
    dst: Medium
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Decimal GB/s (1 GB = 1e9 bytes)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class Moved:
    """What moving some legs did: per leg (in order) None or its Failure, and the exception
    behind it; the handler calls that moved bytes."""

    failures: tuple[Failure | None, ...] = ()
    errors: tuple[BaseException | None, ...] = ()
    transfers: tuple[TransferResult, ...] = ()

    @property
    def error(self) -> BaseException | None:
        """The first unexpected error (Failure.ERROR), to surface to the caller."""
        return next((e for f, e in zip(self.failures, self.errors) if f is Failure.ERROR), None)

    def abandoned(self, legs: Sequence[Leg]) -> Iterator[tuple[Leg, Future]]:
        """The legs (of those moved, in order) whose transfer was abandoned, each with the future
        that completes once its stray transfer has ended (their destinations are safe then)."""
        for leg, failure, error in zip(legs, self.failures, self.errors, strict=True):
            settled = getattr(error, "settled", None)
            if failure is Failure.ABANDONED and settled is not None:
                yield leg, settled

    def __add__(self, other: Moved) -> Moved:
        return Moved(self.failures + other.failures, self.errors + other.errors, self.transfers + other.transfers)


def classify(error: BaseException | None) -> Failure | None:
    """What an exception from a tier means for the slots of its leg."""
    if error is None:
        return None
    if isinstance(error, TransferAbandoned):
        return Failure.ABANDONED
    if isinstance(error, BlockMissing):
        return Failure.MISSING
    if isinstance(error, CorruptBlock):
        return Failure.CORRUPT
    if isinstance(error, TierUnavailable):
        return Failure.UNAVAILABLE
    if isinstance(error, LoadCancelled):
        return Failure.CANCELLED
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return Failure.NO_SPACE
    return Failure.ERROR


class TransferWorker:
    """Moves bytes between ``tiers`` on ``workers`` threads.

    Args:
        tiers: the tiers by medium.
        workers: byte-moving threads (>= 1).
        handlers: overrides of the default handler per (src medium, dst medium).
        orchestrators: threads running the cache's operations.
    """

    def __init__(self, tiers: Mapping[Medium, Tier], workers: int = 2,
                 handlers: Mapping[tuple[Medium, Medium], Handler] | None = None, orchestrators: int = 4) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"transfer worker: workers must be a positive integer, got {workers!r}")
        self.tiers = dict(tiers)
        if len({t.layout for t in self.tiers.values()}) > 1:
            raise ValueError("transfer worker: tiers of different layouts")
        self.workers = workers
        self.handlers = {**HANDLERS, **(handlers or {})}
        self._movers = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstrata-transfer",
                                          initializer=io_thread_started)
        self._orchestrators = ThreadPoolExecutor(max_workers=orchestrators, thread_name_prefix="kvstrata-plan",
                                                 initializer=io_thread_started)
        self._writers = ThreadPoolExecutor(max_workers=max(2, workers), thread_name_prefix="kvstrata-write",
                                           initializer=io_thread_started)
        self._readers = {medium: ThreadPoolExecutor(max_workers=tier.capabilities.readers,
                                                    thread_name_prefix=f"kvstrata-{medium.label}-read",
                                                    initializer=io_thread_started)
                         for medium, tier in self.tiers.items() if tier.capabilities.readers > 0}
        self._timers = Timers()
        self._streams = StreamsByThread()

    # --- threads -------------------------------------------------------------------------------

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run one of the cache's operations (a load, a store, a prefetch) off the caller's thread."""
        return self._orchestrators.submit(fn, *args)

    def submit_aside(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run a write-down or a demotion, which an operation may wait for."""
        return self._writers.submit(fn, *args)

    def at(self, when_s: float, run: Callable[[], None], on_cancel: Callable[[], None]) -> None:
        """Run ``run()`` at ``time.monotonic()`` ``when_s``; ``on_cancel()`` instead if closed first."""
        self._timers.at(when_s, run, on_cancel)

    # --- moving bytes --------------------------------------------------------------------------

    def move(self, legs: Sequence[Leg], layers: slice = slice(None),
             cancelled: Callable[[], bool] | None = None) -> Moved:
        """Move ``legs`` (``layers`` of each), in parallel on the byte movers: a memory-to-memory
        group is one batched copy, and so is a group into or out of memory by a pipelined tier
        (the pool: it overlaps its calls with its checks itself); a group whose source reads
        many blocks in one call is split in one batch per mover; any other leg (a file read or
        write) is a task of its own, so a slow one holds up one mover, not a fixed share; reads
        into memory of a tier with readers of its own (the disk) run on those. ``cancelled``:
        asked before each call starts; once true, the calls not yet started fail with
        :class:`LoadCancelled` (their slots untouched). Returns when all are settled."""
        _check_layers(layers)
        if not legs:
            return Moved()
        chunks: list[list[int]] = []
        pools: list[ThreadPoolExecutor] = []
        for (src_medium, dst_medium), group in _groups(legs).items():
            split, pool = self._split(self.tiers[src_medium], self.tiers[dst_medium], len(group))
            chunks += [group[w::split] for w in range(split)]
            pools += [pool] * split
        ready = self._ready_event(legs)
        def task(chunk: list[int]) -> tuple[list, TransferResult | None]:
            if cancelled is not None and cancelled():
                return [LoadCancelled("the load was given up before this block was read")] * len(chunk), None
            return self._run_handler([legs[i] for i in chunk], layers, ready)

        tasks = [lambda c=c: task(c) for c in chunks]
        return _assemble(len(legs), chunks, self._run_all(tasks, pools))

    def _split(self, src: Tier, dst: Tier, legs: int) -> tuple[int, ThreadPoolExecutor]:
        """Into how many calls a group of ``legs`` legs from ``src`` to ``dst`` is split, and on
        which pool they run: one batched copy between memory tiers, or into or out of memory by
        a pipelined tier; a batch per mover for a source that reads many blocks in one call; else
        a call per leg, reads into memory on the source's own readers where it has them."""
        into_memory, from_memory = dst.capabilities.mapped, src.capabilities.mapped
        if ((into_memory and from_memory) or (src.capabilities.pipelined and into_memory)
                or (dst.capabilities.pipelined and from_memory)):
            return 1, self._movers
        if src.capabilities.batched_reads and into_memory:
            return min(self.workers, legs), self._movers
        return legs, (self._readers.get(src.medium, self._movers) if into_memory else self._movers)

    def copy_layers(self, legs: Sequence[Leg], ranges: Sequence[range], on_range: Callable[[range], None]) -> Moved:
        """Copy ``legs`` into memory one layer range at a time (ranges in parallel); after each
        range has landed for every leg, ``on_range(range)``. Per leg, the first failure."""
        if not legs:
            return Moved()
        for span in ranges:
            _check_layers(slice(span.start, span.stop, span.step))
        ready = self._ready_event(legs)
        groups = list(_groups(legs).values())

        def copy_range(span: range) -> list[tuple[list[BaseException | None], TransferResult | None]]:
            out = [self._run_handler([legs[i] for i in g], slice(span.start, span.stop), ready) for g in groups]
            if all(e is None for errors, _ in out for e in errors):
                on_range(span)  # only bytes that all landed are announced
            return out

        per_range = self._run_all([lambda r=r: copy_range(r) for r in ranges])
        moved = Moved((None,) * len(legs), (None,) * len(legs))
        for results in per_range:
            moved = _first_failures(moved, _assemble(len(legs), groups, results))
        return moved

    def ingest(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor],
               ready: torch.cuda.Event | None = None) -> Moved:
        """Copy a caller's KV blocks into device slots (a store), in one batched copy. ``ready``:
        a CUDA event the caller recorded after computing ``srcs``."""
        if not dsts:
            return Moved()
        start = time.perf_counter()
        device = next((t.device for t in (*dsts, *srcs) if t.is_cuda), None)
        try:
            with self._streams.scope(device, ready):
                torch._foreach_copy_(list(dsts), list(srcs), non_blocking=device is not None)
        except Exception as error:  # noqa: BLE001 - every block of the batch met it
            return Moved((Failure.ERROR,) * len(dsts), (error,) * len(dsts))
        nbytes = sum(d.numel() * d.element_size() for d in dsts)
        result = TransferResult(Medium.DEVICE, Medium.DEVICE, nbytes, time.perf_counter() - start)
        return Moved((None,) * len(dsts), (None,) * len(dsts), (result,))

    def put(self, placements: Sequence[Placement], blocks: Sequence[Pieces]) -> Moved:
        """Write a caller's blocks (``blocks[p.position]``: each its bytes in pieces, its memory)
        into the placements' slots, tiers in parallel: a memory tier's in one batched copy, a
        pipelined tier's (the pool) in one of its batched calls, any other's (the disk) in a
        call per byte mover. Per placement None or its Failure; returns when all are settled."""
        return self._pieces(placements, blocks, write=True)

    def get(self, sources: Sequence[Placement], blocks: Sequence[Pieces]) -> Moved:
        """Read the sources' blocks into a caller's memory (``blocks[p.position]``), verified,
        split as ``put`` is (a disk's reads a call per reader of its own, on those). Per source
        None or its Failure."""
        return self._pieces(sources, blocks, write=False)

    def _pieces(self, placements: Sequence[Placement], blocks: Sequence[Pieces], write: bool) -> Moved:
        if not placements:
            return Moved()
        chunks: list[list[int]] = []
        pools: list[ThreadPoolExecutor] = []
        for medium, group in _by_medium(placements).items():
            tier = self.tiers[medium]
            # A tier of files: as many calls as threads at it (its readers, else the movers), each
            # of several blocks: a task a block cost more in hand-offs than the copies from the page cache.
            readers = 0 if write else tier.capabilities.readers
            split = 1 if tier.capabilities.mapped or tier.capabilities.pipelined else min(len(group), readers or self.workers)
            pool = self._readers.get(medium, self._movers) if readers else self._movers
            chunks += [group[w::split] for w in range(split)]
            pools += [pool] * split
        tasks = [lambda c=c: self._run_pieces([placements[i] for i in c], blocks, write) for c in chunks]
        return _assemble(len(placements), chunks, self._run_all(tasks, pools))

    def _run_pieces(self, placements: Sequence[Placement], blocks: Sequence[Pieces],
                    write: bool) -> tuple[list, TransferResult | None]:
        """One tier call for placements of one medium; the caller's memory counts as the device."""
        tier = self.tiers[placements[0].slot.medium]
        call = tier.write_pieces if write else tier.read_pieces
        start = time.perf_counter()
        try:
            errors = list(call([p.slot.index for p in placements], [p.key for p in placements],
                               [blocks[p.position] for p in placements]))
        except Exception as error:  # noqa: BLE001 - every block of the call met it
            errors = [error] * len(placements)
        seconds = time.perf_counter() - start
        moved = sum(1 for e in errors if e is None) * tier.layout.block_bytes
        src, dst = (Medium.DEVICE, tier.medium) if write else (tier.medium, Medium.DEVICE)
        return errors, (TransferResult(src, dst, moved, seconds) if moved else None)

    def carry_out(self, room: Room) -> Moved:
        """Carry out a room, deepest tier first: each stage's demotions, then its victims' bytes
        discarded (a disk file deleted). Per victim (in ``room.victims`` order) the outcome of
        its demotion (None without one)."""
        outcome: dict[int, tuple[Failure | None, BaseException | None]] = {}
        transfers: list[TransferResult] = []
        position = {id(v): i for i, v in enumerate(room.victims)}
        for stage in room.stages():
            demoting = [v for v in stage if v.demotion is not None]
            moved = self.move([v.demotion for v in demoting])
            transfers += moved.transfers
            for victim, failure, error in zip(demoting, moved.failures, moved.errors):
                outcome[position[id(victim)]] = (failure, error)
            for victim in stage:
                self._discard(victim)
        pairs = [outcome.get(i, (None, None)) for i in range(len(room.victims))]
        return Moved(tuple(f for f, _ in pairs), tuple(e for _, e in pairs), tuple(transfers))

    def find(self, medium: Medium, keys: Sequence[BlockKey]) -> list[bool]:
        """Which of ``keys`` a shared tier holds that others may have put there."""
        return self.tiers[medium].find(list(keys))

    # --- internals -------------------------------------------------------------------------------

    def _run_all(self, tasks: Sequence[Callable[[], T]], pools: Sequence[ThreadPoolExecutor] | None = None) -> list[T]:
        """Run ``tasks``, each on its pool (``pools``, in step; default: the byte movers)."""
        if len(tasks) <= 1:
            return [task() for task in tasks]
        futures: list[Future[T] | Callable[[], T]] = []
        for i, task in enumerate(tasks):
            try:
                futures.append((pools[i] if pools else self._movers).submit(task))
            except RuntimeError:  # the interpreter is exiting (a cache closed from atexit): the rest run here
                futures.append(task)
        return [f.result() if isinstance(f, Future) else f() for f in futures]

    def _run_handler(self, legs: Sequence[Leg], layers: slice,
                     ready: ReadyEvents | None) -> tuple[list, TransferResult | None]:
        """One handler call for legs of one medium pair: per leg its error (or None), and what moved."""
        src, dst = self.tiers[legs[0].src.medium], self.tiers[legs[0].dst.medium]
        handler = self.handlers.get((src.medium, dst.medium))
        start = time.perf_counter()
        try:
            if handler is None:
                raise ValueError(f"no transfer handler for {src.medium.label} -> {dst.medium.label}")
            with self._streams.scope(_cuda_device(src, dst), ready):
                errors = list(handler(src, dst, legs, layers))
        except Exception as error:  # noqa: BLE001 - every leg of the call met it
            errors = [error] * len(legs)
        seconds = time.perf_counter() - start
        first, stop, _ = layers.indices(src.layout.num_layers)
        moved = sum(1 for e in errors if e is None) * (stop - first) * src.layout.layer_bytes
        return errors, (TransferResult(src.medium, dst.medium, moved, seconds) if moved else None)

    def _ready_event(self, legs: Sequence[Leg]) -> ReadyEvents | None:
        devices = {_cuda_device(self.tiers[leg.src.medium], self.tiers[leg.dst.medium]) for leg in legs}
        return record_ready({d for d in devices if d is not None})

    def _discard(self, victim: Victim) -> None:
        try:
            self.tiers[victim.slot.medium].discard(victim.slot.index, victim.key)
        except Exception:  # noqa: BLE001 - the block leaves the table anyway; its bytes linger
            _log.exception("discarding block %s from the %s tier failed", victim.key.hex()[:12],
                           victim.slot.medium.label)

    def close(self) -> None:
        """Cancel timers not yet run, finish queued work, stop every thread. Idempotent."""
        self._timers.close()
        self._orchestrators.shutdown(wait=True)
        self._writers.shutdown(wait=True)
        for readers in self._readers.values():
            readers.shutdown(wait=True)
        self._movers.shutdown(wait=True)

    def __enter__(self) -> TransferWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_layers(layers: slice) -> None:
    if not isinstance(layers, slice) or layers.step not in (None, 1):
        raise ValueError(f"layers must be a contiguous slice, got {layers!r}")


def _cuda_device(src: Tier, dst: Tier) -> torch.device | None:
    return next((t.device for t in (src, dst) if t.device.type == "cuda"), None)


def _groups(legs: Sequence[Leg]) -> dict[tuple[Medium, Medium], list[int]]:
    """Leg indices per (src medium, dst medium), in order."""
    groups: dict[tuple[Medium, Medium], list[int]] = {}
    for i, leg in enumerate(legs):
        groups.setdefault((leg.src.medium, leg.dst.medium), []).append(i)
    return groups


def _by_medium(placements: Sequence[Placement]) -> dict[Medium, list[int]]:
    """Placement indices per medium, in order."""
    groups: dict[Medium, list[int]] = {}
    for i, placement in enumerate(placements):
        groups.setdefault(placement.slot.medium, []).append(i)
    return groups


def _assemble(n: int, chunks: Sequence[Sequence[int]], results: Sequence[tuple[list, TransferResult | None]]) -> Moved:
    errors: list[BaseException | None] = [None] * n
    transfers = []
    for chunk, (chunk_errors, transfer) in zip(chunks, results, strict=True):
        for i, error in zip(chunk, chunk_errors, strict=True):
            errors[i] = error
        if transfer is not None:
            transfers.append(transfer)
    return Moved(tuple(classify(e) for e in errors), tuple(errors), tuple(transfers))


def _first_failures(so_far: Moved, more: Moved) -> Moved:
    pairs = [(f, e) if f is not None else (g, x)
             for f, e, g, x in zip(so_far.failures, so_far.errors, more.failures, more.errors, strict=True)]
    return Moved(tuple(f for f, _ in pairs), tuple(e for _, e in pairs), so_far.transfers + more.transfers)
