"""The tiered cache: block-hashed prefix lookup over device, host, disk (and remote) tiers.

``lookup(tokens)`` finds the longest cached prefix and the fastest tier of each block;
``load(match)`` brings those blocks into the device tier asynchronously, layer by layer, and
returns a handle the model can wait on per layer; ``store(tokens, kv)`` saves the full blocks
of a sequence's KV, and the write policy sends them down the tiers. ``match(keys)`` and
``store_keys(keys, kv)`` take any run of a prefix's keys (a window's: :mod:`kvstrata.cache.grouped`);
``put`` and ``get_into`` move blocks between the tiers and a caller's own memory (:mod:`kvstrata.cache.direct`).

A facade over two halves: the block manager (``kvstrata.manager``) decides, synchronously and
without touching bytes, which blocks go where (plans), and the transfer worker
(``kvstrata.transfer.worker``) moves the bytes those plans name, on its own threads, and says
per leg what happened; the manager then settles every slot. Each operation here is the same
three steps: prepare a plan, carry it out, complete it.

Integrity: a block is readable only once READY in a tier; one failing verification leaves its tier and ends the match.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, wait
from typing import Any

import torch

from kvstrata.cache.build import block_manager, build_tiers, check_tiers, remote_error
from kvstrata.cache.config import CacheConfig
from kvstrata.cache.direct import Direct
from kvstrata.cache.writeback import write_down
from kvstrata.cache.inplace import load_in_place
from kvstrata.cache.outcomes import Outcomes
from kvstrata.cache.poolview import PoolView
from kvstrata.cache.results import LoadHandle, LoadResult, PrefetchFuture, PutResult, StoreResult
from kvstrata.index.keys import BlockKey, Namespace, block_keys, token_array
from kvstrata.index.prefix import Match
from kvstrata.manager.plans import CopyPlan, LoadPlan, Room, Step, StorePlan
from kvstrata.media import Medium
from kvstrata.metrics import CacheMetrics
from kvstrata.policies.prefetch import PrefetchPolicy, PrefetchRule
from kvstrata.plan.loadtime import promotion_s
from kvstrata.tensors import block_tensor, check_kv
from kvstrata.timing import collector_paused
from kvstrata.tiers.base import Pieces, Tier
from kvstrata.transfer.worker import TransferResult, TransferWorker


class TieredCache:
    """See the module docstring. ``tiers``: the tiers to use (the device tier required),
    instead of those ``config`` describes; the cache closes them."""

    def __init__(self, config: CacheConfig, tiers: Sequence[Tier] | None = None) -> None:
        self.config = config
        self.layout = config.layout
        self.metrics = CacheMetrics()
        with collector_paused():  # recovery makes a few long-lived objects per block found
            tiers, self._remote_error = build_tiers(config) if tiers is None else (tiers, None)
            self._tiers = check_tiers(tiers, config)
            try:
                self.manager = block_manager(self._tiers, config)  # reconciles its view of a pool that comes back
                for tier in self._tiers.values():
                    self.manager.adopt(tier.medium, tier.recover(), past_capacity=True)  # a tier reopened smaller keeps them
            except BaseException:
                for tier in self._tiers.values():
                    tier.close()
                raise
        self._worker = TransferWorker(self._tiers, config.workers)
        # Into a CPU device a load's one copy runs in load(): it takes the caller's cores either
        # way, and a worker adds two thread wake-ups (~1 ms on a busy 2-core host).
        device = self._tiers[Medium.DEVICE].device.type
        self._on_cpu = device == "cpu"
        self._copy_in_load = not self.manager.config.layer_ranges and device != "cuda"
        self._outcomes = Outcomes(self.manager, self.metrics)
        self._direct = Direct(self.manager, self._worker, self._outcomes, self._carry_out)
        self._pool_view = (PoolView(self.manager, self._worker, self.metrics, self._carry_out, lambda: self.remote_error)
                           if Medium.REMOTE in self._tiers else None)
        self._namespaces: dict[str, Namespace] = {}
        self._closed = False

    def tier(self, medium: Medium) -> Tier:
        if medium not in self._tiers:
            raise ValueError(f"this cache has no {medium.label} tier")
        return self._tiers[medium]

    @property
    def media(self) -> list[Medium]:
        return list(self.manager.media)

    @property
    def remote_error(self) -> str | None:
        """Why the configured pool is not serving now (down: retried in the background); None: it serves."""
        return remote_error(self._tiers, self._remote_error)

    def keys(self, tokens: Any, tenant: str = "") -> list[BlockKey]:
        if tenant not in self._namespaces:  # one per tenant, kept: its digest is computed once
            self._namespaces[tenant] = self.config.namespace(tenant)
        return block_keys(tokens, self._namespaces[tenant])

    def lookup(self, tokens: Any, tenant: str = "") -> Match:
        """The longest cached prefix of ``tokens`` (full blocks) and where each block is."""
        return self.match(self.keys(tokens, tenant))

    def match(self, keys: list[BlockKey], lookup: bool = True) -> Match:
        """The leading cached run of ``keys`` and where each block is (others' pool blocks too);
        ``lookup``: counted as one (False: a read's own look)."""
        self._check_open()
        match = self.manager.match(keys)
        if self._pool_view is not None and self._pool_view.follow(keys, match):
            match = self.manager.match(keys)
        if lookup:
            self.metrics.lookup(match.counts, len(keys) - match.blocks)
        return match

    def device_block(self, slot: int) -> torch.Tensor:
        """Device slot ``slot`` as KV, ``layout.block_shape``."""
        return block_tensor(self._tiers[Medium.DEVICE].view(slot), self.layout)

    def load(self, match: Match, in_place: bool = False) -> LoadHandle:
        """Bring the matched blocks into the device tier; returns a handle at once (into a CPU
        device, once a load that is one copy from memory tiers has copied). ``in_place``, on a
        CPU: blocks all in memory stay where they are (:mod:`kvstrata.cache.inplace`)."""
        self._check_open()
        served = load_in_place(self.manager, self._tiers, match, self.layout) if in_place and self._on_cpu else None
        if served is not None:
            return served
        start = time.perf_counter()
        handle = LoadHandle(match, self.layout.num_layers, self.device_block,
                            lambda keys: self.manager.unpin(Medium.DEVICE, keys))
        plan = self.manager.prepare_load(match)
        if plan.one_copy and self._copy_in_load:
            self._run_load(plan, handle, time.perf_counter() - start)
        elif plan.room or any(b.step is not Step.RESIDENT for b in plan.blocks):
            self._worker.submit(self._run_load, plan, handle, time.perf_counter() - start)
        else:  # every block is on the device already: nothing to wait for, no thread to wake
            handle._plan(plan.keys, plan.device_slots)
            handle._layers_done(range(self.layout.num_layers))
            self._complete_load(plan, handle, [], start, aside=True)
        return handle

    def _run_load(self, plan: LoadPlan, handle: LoadHandle, planned_s: float) -> None:
        start = time.perf_counter() - planned_s  # the load's own time: waiting for this thread excluded
        moves: list[TransferResult] = []  # the load's own legs (not its room's demotions)
        try:
            self._carry_out(plan.room)
            fetches = plan.legs(Step.FETCH)
            fetched = self._outcomes.moved(self._worker.move(fetches, cancelled=handle.cancelled), moves)
            plan, drops = self.manager.complete_fetch(plan, fetched.failures)
            self._outcomes.settled(fetches, fetched)
            self._carry_out(drops)
            if fetched.error is not None:
                raise fetched.error
            handle._plan(plan.keys, plan.device_slots)
            copies = plan.legs(Step.COPY)
            copied = self._outcomes.moved(self._worker.copy_layers(copies, plan.ranges, handle._layers_done), moves)
            if copied.error is not None:
                raise copied.error
            if not copies:
                handle._layers_done(range(self.layout.num_layers))
        except BaseException as exc:  # noqa: BLE001 - surfaced through the handle
            self.manager.abandon_load(plan)
            handle._finish(None, exc)
            return
        self._complete_load(plan, handle, moves, start, aside=False)

    def _complete_load(self, plan: LoadPlan, handle: LoadHandle, moves: list, start: float, aside: bool) -> None:
        """The blocks are in: READY for the handle; hot blocks the write policy sends down now
        (``aside``: on a worker thread, when the caller's thread got here), then the result."""
        hot = self.manager.complete_load(plan)
        if hot and aside:
            self._worker.submit(self._finish_load, plan, handle, moves, start, hot)
        else:
            self._finish_load(plan, handle, moves, start, hot)

    def _finish_load(self, plan: LoadPlan, handle: LoadHandle, moves: list, start: float, hot: tuple) -> None:
        if hot:  # into every tier below the device that lacks them (best effort: a full tier is skipped)
            self._copy(self.manager.prepare_copies(list(hot), self.manager.media[1:]))
        handle._finish(LoadResult.of(plan, moves, time.perf_counter() - start, self.layout))

    def store(self, tokens: Any, kv: torch.Tensor, tenant: str = "") -> Future:
        """Save the full blocks of ``kv`` (``[layers, kv, tokens, kv_heads, head_dim]``, the
        layout's dtype, any device) keyed by ``tokens``. Returns a Future of StoreResult."""
        check_kv(kv, self.layout)
        ids = token_array(tokens)
        count = min(kv.shape[2], len(ids)) // self.layout.block_tokens
        return self.store_keys(self.keys(ids[: count * self.layout.block_tokens], tenant), kv)  # [] checks the tenant

    def store_keys(self, keys: list[BlockKey], kv: torch.Tensor) -> Future:
        """Save ``kv``'s first ``len(keys)`` blocks under ``keys`` (a chosen run of a prefix's blocks)."""
        self._check_open()
        check_kv(kv, self.layout, len(keys) * self.layout.block_tokens)
        ready = torch.cuda.current_stream(kv.device).record_event() if kv.is_cuda else None
        return self._worker.submit(self._run_store, keys, kv, ready)

    def _run_store(self, keys: list[BlockKey], kv: torch.Tensor, ready: Any) -> StoreResult:
        """Store in rounds: each reserves what the device has room for. Write-through pins each
        new block until it is written down (an eviction in between would drop its only copy),
        so a device full of this store's own blocks waits for its oldest write-down."""
        start = time.perf_counter()
        writing: deque[Future] | None = deque() if self.config.write.on_store() else None
        new = done = refused = 0
        try:
            while done < len(keys):
                plan = self.manager.prepare_store(keys[done:])
                new += self._store_round(plan, kv, done, ready, writing)
                done += plan.consumed
                if plan.stopped is not None and not plan.blocks:  # nothing could go in this round
                    if not writing:
                        refused = len(keys) - done  # every device block is pinned by others: refuse cleanly
                        break
                    writing.popleft().result()
        finally:
            for future in writing or ():
                future.result()
        return StoreResult(len(keys), new, time.perf_counter() - start, refused)

    def _store_round(self, plan: StorePlan, kv: torch.Tensor, offset: int, ready: Any, writing: deque | None) -> int:
        self._carry_out(plan.room)
        bs = self.layout.block_tokens
        sources = [kv[:, :, (offset + b.position) * bs : (offset + b.position + 1) * bs] for b in plan.blocks]
        moved = self._outcomes.moved(self._worker.ingest([self.device_block(b.slot) for b in plan.blocks], sources,
                                                         ready))
        stored = self.manager.complete_store(plan, moved.failures, pin=writing is not None)
        if moved.error is not None:
            raise moved.error
        if writing is not None and stored:
            # The round's blocks go down as soon as they are in, in one plan: the worker moves its
            # legs in parallel (a file each) or batched (the pool's puts); the store returns when all are down.
            writing.append(self._worker.submit_aside(self._write_down_then_unpin, list(stored)))
        return len(stored)

    def _write_down_then_unpin(self, keys: list[BlockKey]) -> None:
        try:
            self._copy(self.manager.prepare_copies(keys, self.manager.media[1:]))
        finally:
            self.manager.unpin(Medium.DEVICE, keys)

    def _copy(self, plan: CopyPlan) -> int:
        self._carry_out(plan.room)
        moved = self._outcomes.moved(self._worker.move(plan.legs))
        landed, drops = self.manager.complete_copies(plan, moved.failures)
        self._outcomes.settled(plan.legs, moved)
        self._carry_out(drops)
        return landed

    def put(self, keys: list[BlockKey], blocks: Sequence[Pieces]) -> PutResult:
        """Store blocks straight from the caller's memory (each its bytes in pieces) into the
        tiers below the device (:mod:`kvstrata.cache.direct`): per block, whether it is stored."""
        self._check_open()
        return self._direct.put(keys, blocks)

    def get_into(self, keys: list[BlockKey], blocks: Sequence[Pieces]) -> int:
        """Read the leading run of ``keys`` (others' pool blocks too: ``match``) straight into the caller's
        memory (block i into ``blocks[i]``, its pieces): how many blocks, from the first, landed verified."""
        return self._direct.get(keys, blocks) if self.match(keys, lookup=False).blocks else 0

    def evict(self, medium: Medium, blocks: int) -> int:
        """Evict up to ``blocks`` unpinned blocks from a tier (demoting per the write policy), in
        rooms: one ends where the tier below has no room left for its demotions until they land."""
        self._check_open()
        self.tier(medium)
        done = 0
        while done < blocks:
            room = self.manager.prepare_evict(medium, blocks - done)
            self._carry_out(room)
            if not (moved := sum(1 for v in room.victims if v.slot.medium is medium)):
                break
            done += moved
        return done

    def _carry_out(self, room: Room) -> None:
        if room:
            moved = self._outcomes.moved(self._worker.carry_out(room))
            self.manager.complete_room(room, moved.failures)
            self._outcomes.settled([v.demotion for v in room.victims], moved)

    def prefetch(
        self, tokens: Any, rule: PrefetchRule | None = None, tenant: str = "", deadline_s: float | None = None
    ) -> PrefetchFuture:
        """Promote the prefix's disk/remote blocks to the host for a queued request. Waits as
        ``rule`` says; the Future gives the number of blocks promoted. ``deadline_s``
        (``time.monotonic()``): when the request is expected to start. With the DEADLINE policy
        and a calibration the promotion starts as late as its predicted time allows
        (:func:`kvstrata.policies.prefetch.schedule`, in ``PrefetchFuture.timing``) and the call
        returns at once; without a calibration it starts at once."""
        self._check_open()
        rule = rule or PrefetchRule()
        match = self.lookup(tokens, tenant)
        deadline = rule.policy is PrefetchPolicy.DEADLINE and self.config.calibration is not None
        predicted = self.predict_promotion_s(match) if deadline else None  # None: nothing says how late
        future = PrefetchFuture(rule.timing(time.monotonic(), deadline_s, predicted))
        future.begin(lambda: self._worker.submit(self._run_prefetch, match), self._worker.at)
        if (wait_s := rule.wait_s()) != 0:
            wait([future], timeout=wait_s)
        return future

    def predict_promotion_s(self, match: Match) -> float:
        """Predicted seconds to promote the match's disk and remote blocks to the host, from the
        configured calibration (0 without one, or with nothing to promote)."""
        cal = self.config.calibration
        return 0.0 if cal is None else promotion_s(cal, match.media, self.layout.block_bytes, self.config.workers)

    def _run_prefetch(self, match: Match) -> int:
        below = [key for key, medium in zip(match.keys, match.media) if medium.value > Medium.HOST.value]
        return self._copy(self.manager.prepare_copies(below, (Medium.HOST,))) if Medium.HOST in self._tiers else 0

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the cache is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Cancel deadline prefetches not begun, finish what is under way, write back, close the tiers. Idempotent."""
        if self._closed:
            return
        write_down(self.manager, self._copy, self.config)  # a write-back cache's memory-only blocks
        self._closed = True
        self._worker.close()
        for tier in self._tiers.values():
            tier.close()

    def __enter__(self) -> "TieredCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
