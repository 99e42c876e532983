"""The tiered cache: block-hashed prefix lookup over device, host, disk (and remote) tiers.

``lookup(tokens)`` finds the longest cached prefix and the fastest tier of each block;
``load(match)`` brings those blocks into the device tier asynchronously, layer by layer, and
returns a handle the model can wait on per layer; ``store(tokens, kv)`` saves the full blocks
of a sequence's KV, and the write policy sends them down the tiers.

Threads: orchestration (reserving slots, evicting, deciding) runs on a small orchestrator
pool; every byte moves on the transfer engine's bounded worker pool. Engine tasks never
reserve or evict, so they never wait on one another. Each tier's block table and the prefix
index carry their own lock; no lock is held while bytes move.

Integrity: a block is readable only once READY in a tier; a block that fails verification
is dropped from its tier and ends the match there, so wrong KV is never served.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstrata.errors import BlockMissing, CorruptBlock, TierUnavailable, TransferAbandoned
from kvstrata.index.keys import BlockKey, Namespace, block_keys
from kvstrata.index.prefix import Match, PrefixIndex
from kvstrata.kv.layout import KVLayout
from kvstrata.manager.plans import StopReason
from kvstrata.media import FetchPath, Medium, Route
from kvstrata.metrics import CacheMetrics
from kvstrata.plan.host import HostCalibration
from kvstrata.policies.eviction import Eviction
from kvstrata.policies.prefetch import PrefetchPolicy, PrefetchRule, PrefetchTiming, schedule
from kvstrata.policies.write import WriteRule
from kvstrata.pool.config import PoolConfig, RemoteMode
from kvstrata.tensors import torch_dtype
from kvstrata.tiers.base import Tier
from kvstrata.tiers.table import Reservation, TierFull
from kvstrata.transfer.engine import TransferEngine, TransferResult

COPY_TASK_BYTES = 32 * 1024 * 1024  # bytes per copy task of a load: large copies, few dispatches
# A load this small is copied on its planning thread in one dispatch: below it, handing layer
# ranges to the engine's workers (or even dispatching them one by one) costs more than the copies
# (measured on the tiny model, ~1 MB restores: 0.48 -> 0.21 ms idle, 0.81 -> 0.52 ms right after
# a forward pass). Its layers then become ready together, about 0.1 ms in.
SMALL_LOAD_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class CacheConfig:
    """What a TieredCache holds and how it behaves. Capacities in bytes; 0 disables a tier."""

    layout: KVLayout
    model_id: str
    device_bytes: int
    host_bytes: int
    disk_bytes: int = 0
    disk_dir: Path | None = None
    write: WriteRule = field(default_factory=WriteRule)
    eviction: Eviction = Eviction.LRU
    workers: int = 2
    tp_rank: int = 0
    tp_size: int = 1
    device: str | None = None  # torch device for the device tier; None: CUDA if present, else CPU
    pool: PoolConfig | None = None  # the shared remote DRAM pool; None: no remote tier
    remote_bytes: int = 0  # this instance's view of the pool (how many blocks it tracks)
    remote_mode: RemoteMode = RemoteMode.TCP  # TCP (any host) or SHM (a pool daemon on this host)
    remote_path: FetchPath = FetchPath.AUTO  # how pool blocks reach the device
    disk_path: FetchPath = FetchPath.AUTO  # how disk blocks reach the device
    # This host's measured paths (kvstrata.plan.host.HostCalibration): predicted transfer times
    # for prefetch deadlines and load-or-recompute choices. None: not calibrated.
    calibration: HostCalibration | None = None
    disk_read_gbps: float | None = None  # cap disk reads at this rate (emulates slower storage)
    small_load_bytes: int = SMALL_LOAD_BYTES  # loads up to this size: one copy dispatch, layers ready together

    def __post_init__(self) -> None:
        for name in ("device_bytes", "host_bytes", "disk_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"cache {name} must be >= 0, got {getattr(self, name)}")
        if self.disk_bytes and not self.disk_dir:
            raise ValueError("cache disk_bytes > 0 needs a disk_dir")
        if self.workers < 1:
            raise ValueError(f"cache workers must be >= 1, got {self.workers}")
        if self.pool is not None and self.remote_bytes <= 0:
            raise ValueError("cache with a pool needs remote_bytes > 0 (how much of the pool it tracks)")
        for name, kind in (("remote_mode", RemoteMode), ("remote_path", FetchPath), ("disk_path", FetchPath),
                           ("write", WriteRule), ("eviction", Eviction)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"cache {name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        if self.disk_dir is not None and not isinstance(self.disk_dir, Path):
            raise ValueError(f"cache disk_dir must be a pathlib.Path, got {self.disk_dir!r}")
        if self.small_load_bytes < 0:
            raise ValueError(f"cache small_load_bytes must be >= 0, got {self.small_load_bytes}")
        if self.disk_read_gbps is not None and not self.disk_read_gbps > 0:
            raise ValueError(f"cache disk_read_gbps must be positive, got {self.disk_read_gbps}")
        self.namespace()  # a bad model_id or TP rank/size fails here, not on first use

    def namespace(self, tenant: str = "") -> Namespace:
        return Namespace(
            model_id=self.model_id,
            kv_dtype=self.layout.dtype.name.lower(),
            kv_layout=self.layout.describe(),
            block_size=self.layout.block_tokens,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            tenant=tenant,
        )


@dataclass(frozen=True)
class LoadResult:
    blocks: int
    tokens: int
    bytes_from: dict[Medium, int]  # per source medium of every leg (disk -> host -> device: both)
    seconds: float
    stopped: StopReason | None  # why fewer blocks than matched were loaded, if so
    restored_bytes: int = 0  # bytes that arrived on the device (blocks not already there)
    paths: dict[Route, int] = field(default_factory=dict)  # blocks per route, e.g. (REMOTE, HOST, DEVICE)
    stopped_at: Medium | None = None  # the tier of the block the load stopped at, if one did

    @property
    def gbps(self) -> float:
        """Restored bytes per second, end to end."""
        return self.restored_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class LoadHandle:
    """A load in flight: completion, error, and per-layer readiness of the device copies."""

    def __init__(self, cache: "TieredCache", match: Match) -> None:
        self.match = match
        self._cache = cache
        self._layers = [threading.Event() for _ in range(cache.layout.num_layers)]
        self._done = threading.Event()
        self._result: LoadResult | None = None
        self._error: BaseException | None = None
        self._slots: list[int] = []
        self._keys: list[BlockKey] = []
        self._released = False
        self._release_lock = threading.Lock()

    # --- filled by the cache ---
    def _plan(self, keys: list[BlockKey], slots: list[int]) -> None:
        self._keys, self._slots = keys, slots

    def _layer_done(self, layer: int) -> None:
        self._layers[layer].set()

    def _finish(self, result: LoadResult | None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
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

    @property
    def blocks(self) -> int:
        """Blocks being loaded (known once the first layer is ready)."""
        return len(self._slots)

    def block(self, i: int) -> torch.Tensor:
        """The device copy of the i-th loaded block, shaped ``layout.block_shape``."""
        return self._cache.device_block(self._slots[i])

    def release(self) -> None:
        """Unpin the loaded device blocks; they may be evicted from now on. Waits for a load
        still in flight (its pins are taken as it goes). Idempotent."""
        self._done.wait()
        with self._release_lock:
            if self._released:
                return
            self._released = True
        self._cache._unpin(Medium.DEVICE, self._keys)

    def __enter__(self) -> "LoadHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.wait()
        finally:
            self.release()


@dataclass(frozen=True)
class StoreResult:
    blocks: int  # full blocks of the sequence
    new_blocks: int  # blocks this store wrote to the device tier
    seconds: float
    refused_blocks: int = 0  # blocks not stored: the device tier was full of pinned blocks


class TieredCache:
    def __init__(self, config: CacheConfig, tiers: Sequence[Tier] | None = None) -> None:
        self.config = config
        self.layout = config.layout
        self.metrics = CacheMetrics()
        self.index = PrefixIndex()
        self.remote_error: str | None = None  # why a configured pool is not in use
        self._namespaces: dict[str, Namespace] = {}
        self._tiers: dict[Medium, Tier] = {}
        for tier in tiers if tiers is not None else self._default_tiers(config):
            if tier.layout != self.layout:
                raise ValueError(f"{tier.medium.label} tier layout {tier.layout} differs from the cache's {self.layout}")
            if tier.medium in self._tiers:
                raise ValueError(f"two {tier.medium.label} tiers given")
            self._tiers[tier.medium] = tier
        if Medium.DEVICE not in self._tiers:
            raise ValueError("the cache needs a device tier")
        self._order = sorted(self._tiers, key=lambda m: m.value)
        for tier in self._tiers.values():
            for key, _ in tier.recover():
                self.index.add(key, tier.medium)
        device = self._tiers[Medium.DEVICE]
        remote = self._tiers.get(Medium.REMOTE)
        if remote is not None and config.remote_path is not FetchPath.STAGED:
            # Direct pool -> device where the pool can address device memory: a CPU stand-in
            # for HBM here, or GPU memory over RDMA (GPUDirect) on GPU hosts.
            direct = device.device.type == "cpu" or (config.pool is not None and config.pool.protocol == "rdma")
            self._remote_direct = config.remote_path is FetchPath.DIRECT or direct
            if self._remote_direct and device.device.type == "cpu" and hasattr(remote, "register"):
                remote.register(device.buffer)
        else:
            self._remote_direct = False
        # "auto": disk blocks read straight into device slots the CPU can address (the CPU
        # stand-in for HBM); into GPU memory they are staged in the host tier (GPUDirect
        # Storage would lift that).
        self._disk_direct = config.disk_path is FetchPath.DIRECT or (config.disk_path is FetchPath.AUTO and device.device.type == "cpu")
        self._engine = TransferEngine(config.workers)
        self._orchestrator = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvstrata-plan")
        self._timers: dict[threading.Timer, Future] = {}  # deadline prefetches not yet begun
        self._timer_lock = threading.Lock()
        # Write-downs of stores: their own threads, so a store never waits on a task queued
        # behind it in the orchestrator; bytes still move on the engine's bounded pool.
        self._writers = ThreadPoolExecutor(max_workers=max(2, config.workers), thread_name_prefix="kvstrata-write")
        self._closed = False

    def _default_tiers(self, config: CacheConfig) -> list[Tier]:
        from kvstrata.tiers.memory import DeviceTier, HostTier, default_device

        remote = self._connect_remote(config)
        device_buffer = None
        where = torch.device(config.device) if config.device else default_device()
        if remote is not None and config.remote_mode is RemoteMode.SHM and where.type == "cpu":
            # A CPU stand-in for HBM on a shared-memory pool: in the pool's memory, so the
            # direct pool -> device path is zero-copy too.
            slots = config.device_bytes // config.layout.block_bytes
            device_buffer = remote.allocate(slots * config.layout.block_bytes) if slots else None
        tiers: list[Tier] = [
            DeviceTier(config.layout, config.device_bytes, config.device, config.eviction, buffer=device_buffer)
        ]
        if config.host_bytes:
            # On a pool, the host tier lives in memory the pool can address: zero-copy both ways.
            slots = config.host_bytes // config.layout.block_bytes
            buffer = remote.allocate(slots * config.layout.block_bytes) if remote is not None and slots else None
            tiers.append(HostTier(config.layout, config.host_bytes, config.eviction, buffer=buffer))
        if config.disk_bytes:
            from kvstrata.tiers.disk import DiskTier

            tag = config.namespace().tag
            tiers.append(DiskTier(config.layout, config.disk_bytes, config.disk_dir, config.eviction, namespace_tag=tag,
                                  read_gbps=config.disk_read_gbps))
        if remote is not None:
            tiers.append(remote)
        return tiers

    def _connect_remote(self, config: CacheConfig) -> Tier | None:
        """The pool's tier, or None (recording why) when the pool cannot be reached: the cache
        then serves from its local tiers."""
        if config.pool is None:
            return None
        from kvstrata.tiers.remote import RemoteTier

        try:
            return RemoteTier(
                config.layout,
                config.remote_bytes,
                config.pool,
                config.remote_mode,
                namespace_tag=config.namespace().tag,
                eviction=config.eviction,
            )
        except TierUnavailable as exc:
            self.remote_error = str(exc)
            return None

    # --- reading ---------------------------------------------------------------------------

    def tier(self, medium: Medium) -> Tier:
        try:
            return self._tiers[medium]
        except KeyError:
            raise ValueError(f"this cache has no {medium.label} tier") from None

    @property
    def media(self) -> list[Medium]:
        return list(self._order)

    def keys(self, tokens: Any, tenant: str = "") -> list[BlockKey]:
        return block_keys(tokens, self._namespace(tenant))

    def _namespace(self, tenant: str) -> Namespace:
        """One Namespace per tenant, kept: its digest is computed once, not per lookup."""
        namespace = self._namespaces.get(tenant)
        if namespace is None:
            namespace = self._namespaces.setdefault(tenant, self.config.namespace(tenant))
        return namespace

    def lookup(self, tokens: Any, tenant: str = "") -> Match:
        """The longest cached prefix of ``tokens`` (full blocks) and where each block is."""
        keys = self.keys(tokens, tenant)
        match = self.index.match(keys, self.layout.block_tokens)
        if match.blocks < len(keys) and Medium.REMOTE in self._tiers and self._discover(keys[match.blocks :]):
            match = self.index.match(keys, self.layout.block_tokens)
        self.metrics.lookup(match.media, len(keys) - match.blocks)
        return match

    def _discover(self, keys: list[BlockKey]) -> int:
        """Blocks other instances put in the shared pool: the leading run of ``keys`` found
        there joins this cache's view (READY in the remote table, in the index)."""
        remote = self._tiers[Medium.REMOTE]
        try:
            found = remote.exists(keys)
        except TierUnavailable:
            return 0
        run = next((i for i, hit in enumerate(found) if not hit), len(found))
        adopted = remote.adopt(keys[:run])
        if len(adopted) < run:  # our view of the pool is full: forget the coldest, not the pool's
            self.evict(Medium.REMOTE, run - len(adopted))
            adopted += remote.adopt(keys[:run])
        for key in adopted:
            self.index.add(key, Medium.REMOTE)
        return run

    def device_block(self, slot: int) -> torch.Tensor:
        view = self.tier(Medium.DEVICE).view(slot)
        return view.view(torch_dtype(self.layout.dtype)).view(self.layout.block_shape)

    def load(self, match: Match) -> LoadHandle:
        """Bring the matched blocks into the device tier; returns at once with a handle."""
        self._check_open()
        handle = LoadHandle(self, match)
        self._orchestrator.submit(self._run_load, match, handle)
        return handle

    def _run_load(self, match: Match, handle: LoadHandle) -> None:
        start = time.perf_counter()
        device = self.tier(Medium.DEVICE)
        plan: list[_Planned] = []
        bytes_from: dict[Medium, int] = {}
        stopped = None
        try:
            stopped = self._plan_load(match, plan)
            stopped = self._fetch_unviewable(plan, bytes_from) or stopped
            reason, at = stopped or (None, None)
            handle._plan([p.key for p in plan], [p.dst_slot for p in plan])
            fresh = [p for p in plan if p.fresh]
            self._copy_layers([p for p in fresh if not p.done], handle, bytes_from)
            restored = len(fresh) * self.layout.block_bytes
            for p in plan:
                if p.fresh:
                    device.table.complete_store(p.key, ok=True, pin=True)
                    self.index.add(p.key, Medium.DEVICE)
                    self._unpin(p.src, [p.key])
                    p.fresh = False
            keys = [p.key for p in plan]
            self._maybe_write_down_hot(keys)
            seconds = time.perf_counter() - start
            tokens = len(keys) * self.layout.block_tokens
            paths = dict(Counter(p.route for p in plan))
            handle._finish(LoadResult(len(keys), tokens, bytes_from, seconds, reason, restored, paths, at))
        except BaseException as exc:  # noqa: BLE001 - surfaced through the handle
            self._abandon(plan)
            handle._plan([], [])  # _abandon dropped every pin: release() must not unpin again
            handle._finish(None, exc)

    def _plan_load(self, match: Match, plan: list["_Planned"]) -> tuple[StopReason, Medium] | None:
        """Pin each matched block where it is and reserve a device slot for those not on the
        device, in order; stop at the first block that cannot be had. Returns why it stopped."""
        device = self.tier(Medium.DEVICE)
        for key in match.keys:
            slot = device.table.pin(key)
            if slot is not None:
                plan.append(_Planned(key, slot, fresh=False, route=(Medium.DEVICE,)))
                continue
            source = self._pin_source(key, above=Medium.DEVICE, hit=True)
            if source is None:
                return StopReason.GONE, match.media[len(plan)]
            try:
                reservation = self._reserve(device, key)
            except TierFull:
                reservation, why = None, StopReason.DEVICE_FULL
            else:
                why = StopReason.LOADING_ELSEWHERE
            if reservation is None:
                self._unpin(source[0], [key])
                slot = device.table.pin(key)  # the other request may have finished meanwhile
                if slot is None:
                    return why, source[0]
                plan.append(_Planned(key, slot, fresh=False, route=(Medium.DEVICE,)))
                continue
            route = (source[0], Medium.DEVICE)
            plan.append(_Planned(key, reservation.slot, fresh=True, src=source[0], src_slot=source[1], route=route))
        return None

    def _abandon(self, planned: list["_Planned"]) -> None:
        """Undo a plan's reservations and pins (a load that stops or fails)."""
        device = self.tier(Medium.DEVICE)
        for p in planned:
            if p.fresh:
                if p.quarantined:
                    device.table.quarantine(p.key)  # the key is free again, the slot never
                else:
                    device.table.complete_store(p.key, ok=False)
                if p.src is not None:  # None: dropped as corrupt, its pin went with it
                    self._unpin(p.src, [p.key])
            else:
                self._unpin(Medium.DEVICE, [p.key])
        planned.clear()

    def _pin_source(self, key: BlockKey, above: Medium | None = None, hit: bool = False) -> tuple[Medium, int] | None:
        """Pin ``key`` in the fastest tier holding it READY (below ``above``, if given)."""
        for medium in self._order:
            if above is not None and medium.value <= above.value:
                continue
            slot = self._tiers[medium].table.pin(key, hit=hit)
            if slot is not None:
                return medium, slot
        return None

    def _fetch_unviewable(self, plan: list["_Planned"], bytes_from: dict[Medium, int]) -> tuple[StopReason, Medium] | None:
        """Bring planned sources that have no in-memory view (disk, remote) within reach, in
        parallel: a remote block straight into its device slot where the transport allows
        (``remote -> device``, the GDR path), else staged in the host tier (a promotion; the
        plan then reads the host copy). A block that cannot be had (corrupt, gone, no room)
        cuts the plan before it. Returns why, if cut."""
        pending = [i for i, p in enumerate(plan) if p.fresh and self._tiers[p.src].view(p.src_slot) is None]
        if not pending:
            return None
        host = self._tiers.get(Medium.HOST)
        device = self.tier(Medium.DEVICE)
        failed: dict[int, tuple[StopReason, Medium]] = {}
        futures: list[tuple[int, Future, Reservation | None]] = []
        batched = [i for i in pending if plan[i].src is Medium.REMOTE and self._remote_direct]
        batches = [batched[w :: self.config.workers] for w in range(self.config.workers)]
        batch_futures = [(b, self._engine.submit_call(self._read_remote_batch, [plan[i] for i in b])) for b in batches if b]
        for i in pending:
            p = plan[i]
            if i in batched:
                p.route = (Medium.REMOTE, Medium.DEVICE)
                continue
            if p.src is Medium.DISK and self._disk_direct:
                p.route = (Medium.DISK, Medium.DEVICE)
                futures.append((i, self._engine.submit(self._tiers[p.src], p.src_slot, device, p.dst_slot, p.key), None))
                continue
            try:
                reservation = self._reserve(host, p.key) if host is not None else None
                why = StopReason.NO_STAGING if host is None else StopReason.STAGING_ELSEWHERE
            except TierFull:
                reservation, why = None, StopReason.STAGING_FULL
            if reservation is None:
                failed[i] = why, p.src
                break
            p.route = (p.src, Medium.HOST, Medium.DEVICE)
            futures.append((i, self._engine.submit(self._tiers[p.src], p.src_slot, host, reservation.slot, p.key), reservation))
        outcomes: list[tuple[int, Any, Reservation | None]] = []
        for i, future, reservation in futures:
            try:
                outcomes.append((i, future.result(), reservation))
            except BaseException as exc:  # noqa: BLE001 - judged below, per block
                outcomes.append((i, exc, reservation))
        for indices, future in batch_futures:
            outcomes += [(i, outcome, None) for i, outcome in zip(indices, future.result(), strict=True)]
        error: BaseException | None = None
        for i, outcome, reservation in sorted(outcomes, key=lambda o: o[0]):
            p = plan[i]
            try:
                if isinstance(outcome, BaseException):
                    raise outcome
                result = outcome
            except TransferAbandoned:
                # Bytes may still land in the destination later: never reuse that slot.
                if reservation is None:
                    p.quarantined = True  # the device slot: retired when the plan is abandoned
                else:
                    host.table.quarantine(p.key)
                failed[i] = StopReason.ABANDONED, p.src
                continue
            except TierUnavailable:
                # The destination was never exposed: a plain miss, its slot is reusable.
                if reservation is not None:
                    host.table.complete_store(p.key, ok=False)
                failed[i] = StopReason.UNAVAILABLE, p.src
                continue
            except CorruptBlock as exc:
                if reservation is not None:
                    host.table.complete_store(p.key, ok=False)
                failed[i] = StopReason.MISSING if isinstance(exc, BlockMissing) else StopReason.CORRUPT, p.src
                self._drop_corrupt(p.src, p.key, p.src_slot)
                p.src = None  # its pin went with the block
                continue
            except BaseException as exc:  # noqa: BLE001 - raised once every transfer is settled
                if reservation is not None:
                    host.table.complete_store(p.key, ok=False)
                error = error or exc
                continue
            self.metrics.transfer(result)
            bytes_from[result.src] = bytes_from.get(result.src, 0) + result.bytes
            if reservation is None:
                p.done = True  # the whole block is on the device already
                continue
            host.table.complete_store(p.key, ok=True, pin=True)
            self.index.add(p.key, Medium.HOST)
            self._unpin(p.src, [p.key])
            p.src, p.src_slot = Medium.HOST, reservation.slot
        if error is not None:
            raise error  # the caller abandons the plan: host pins and device reservations
        if not failed:
            return None
        cut = min(failed)
        rest = plan[cut:]
        del plan[cut:]
        self._abandon(rest)
        return failed[cut]

    def _read_remote_batch(self, items: list["_Planned"]) -> list:
        """Several pool blocks straight into their device slots in one pool call: per block a
        TransferResult or the exception that block met."""
        remote, device = self._tiers[Medium.REMOTE], self.tier(Medium.DEVICE)
        start = time.perf_counter()
        try:
            errors = remote.read_batch([p.key for p in items], [device.view(p.dst_slot) for p in items])
        except BaseException as exc:  # noqa: BLE001 - e.g. the pool went down: every block meets it
            errors = [exc] * len(items)
        share = (time.perf_counter() - start) / len(items)
        return [
            error if error is not None else TransferResult(Medium.REMOTE, Medium.DEVICE, self.layout.block_bytes, share)
            for error in errors
        ]

    def _copy_layers(self, copies: list["_Planned"], handle: LoadHandle, bytes_from: dict[Medium, int]) -> None:
        """Copy the blocks' layers in tasks of whole layer ranges; each range's layer events fire
        as it lands. A small load (``small_load_bytes``) is one range; a single range is copied
        on this thread, since handing it to a worker only adds a wait."""
        device = self.tier(Medium.DEVICE)
        layers = range(self.layout.num_layers)
        if not copies:
            for layer in layers:
                handle._layer_done(layer)
            return

        by_source: dict[Medium, list[_Planned]] = {}
        for p in copies:
            by_source.setdefault(p.src, []).append(p)

        # Tasks of whole layer ranges: a range of a block is contiguous (blocks are layer-major),
        # so each copy stays large; events still fire per layer as each range lands.
        # At least two tasks per worker, so early layers land (and fire) while later ones move.
        if len(copies) * self.layout.block_bytes <= self.config.small_load_bytes:
            per_task = len(layers)
        else:
            big_enough = -(-COPY_TASK_BYTES // (len(copies) * self.layout.layer_bytes))
            per_task = max(1, min(big_enough, -(-len(layers) // (2 * self.config.workers))))
        ranges = [range(a, min(a + per_task, len(layers))) for a in range(0, len(layers), per_task)]

        def copy_range(chunk: range) -> list:
            span = slice(chunk.start, chunk.stop)
            out = [
                self._engine.run_many(
                    self._tiers[medium], [p.src_slot for p in group], [p.key for p in group],
                    device, [p.dst_slot for p in group], span,
                )
                for medium, group in by_source.items()
            ]
            for layer in chunk:
                handle._layer_done(layer)
            return out

        if len(ranges) == 1:
            batches = [copy_range(ranges[0])]
        else:
            futures = [self._engine.submit_call(copy_range, chunk) for chunk in ranges]
            wait(futures)
            batches = [future.result() for future in futures]  # raises the first copy error, if any
        for batch in batches:
            for result in batch:
                self.metrics.transfer(result)
                bytes_from[result.src] = bytes_from.get(result.src, 0) + result.bytes

    # --- writing ---------------------------------------------------------------------------

    def store(self, tokens: Any, kv: torch.Tensor, tenant: str = "") -> Future:
        """Save the full blocks of ``kv`` (``[layers, kv, tokens, kv_heads, head_dim]``, the
        layout's dtype, any device) keyed by ``tokens``. Returns a Future of StoreResult."""
        self._check_open()
        self._check_kv(kv)
        count = min(kv.shape[2], len(tokens)) // self.layout.block_tokens
        keys = self.keys(list(tokens)[: count * self.layout.block_tokens], tenant)  # [] validates the tenant too
        return self._orchestrator.submit(self._run_store, keys, kv)

    def _check_kv(self, kv: torch.Tensor) -> None:
        layout = self.layout
        if not isinstance(kv, torch.Tensor):
            raise ValueError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
        if kv.dtype != torch_dtype(layout.dtype):
            raise ValueError(f"kv dtype {kv.dtype} does not match the cache layout's {torch_dtype(layout.dtype)}")
        expected = (layout.num_layers, layout.kv_tensors, "tokens", layout.kv_heads, layout.head_dim)
        if kv.dim() != 5 or tuple(kv.shape[i] for i in (0, 1, 3, 4)) != tuple(expected[i] for i in (0, 1, 3, 4)):
            raise ValueError(f"kv shape {tuple(kv.shape)} does not match [layers, kv, tokens, kv_heads, head_dim] = {expected}")

    def _run_store(self, keys: list[BlockKey], kv: torch.Tensor) -> StoreResult:
        start = time.perf_counter()
        device = self.tier(Medium.DEVICE)
        bs = self.layout.block_tokens
        write_through = self.config.write.on_store()
        new: list[BlockKey] = []
        writing: deque[Future] = deque()  # write-downs in flight, oldest first
        refused = 0
        try:
            for i, key in enumerate(keys):
                reservation = self._reserve_waiting(device, key, writing)
                if reservation is False:
                    refused = len(keys) - i  # every device block is pinned: refuse the rest cleanly
                    break
                if reservation is None:
                    continue  # already cached (or being written by someone else)
                src = kv[:, :, i * bs : (i + 1) * bs]
                dst = self.device_block(reservation.slot)
                try:
                    seconds = self._engine.submit_call(_copy_timed, dst, src).result()
                except BaseException:
                    device.table.complete_store(key, ok=False)
                    raise
                self.metrics.transfer(TransferResult(Medium.DEVICE, Medium.DEVICE, self.layout.block_bytes, seconds))
                # Write-through pins the new block from READY until it is written down: an
                # eviction in between would drop its only copy (write-through never demotes on
                # eviction), and the store would be acknowledged with the block nowhere.
                device.table.complete_store(key, ok=True, pin=write_through)
                self.index.add(key, Medium.DEVICE)
                new.append(key)
                if write_through:
                    # Each block goes down as soon as it is in, several at once (the engine
                    # bounds the byte movers); the store returns when all are down.
                    writing.append(self._writers.submit(self._write_down_then_unpin, key))
        finally:
            for future in writing:
                future.result()
        return StoreResult(len(keys), len(new), time.perf_counter() - start, refused)

    def _reserve_waiting(self, tier: Tier, key: BlockKey, writing: deque) -> Reservation | None | bool:
        """``_reserve``, waiting for this store's own write-downs to unpin blocks when the tier
        is full of them; False when it is full of blocks pinned by others."""
        while True:
            try:
                return self._reserve(tier, key)
            except TierFull:
                if not writing:
                    return False
                writing.popleft().result()

    def _write_down_then_unpin(self, key: BlockKey) -> None:
        try:
            self._write_down(key, Medium.DEVICE)
        finally:
            self._unpin(Medium.DEVICE, [key])

    def _write_down(self, key: BlockKey, frm: Medium) -> None:
        """Copy ``key`` into every tier below ``frm`` that lacks it (best effort: a full tier
        is skipped, never an error)."""
        for medium in self._order:
            if medium.value <= frm.value:
                continue
            self._copy_to(key, self._tiers[medium])

    def _copy_to(self, key: BlockKey, dst: Tier) -> bool:
        source = self._pin_source(key)
        if source is None:
            return False
        medium, slot = source
        pinned = True
        try:
            if medium is dst.medium:
                return True
            try:
                reservation = self._reserve(dst, key)
            except TierFull:
                return False
            if reservation is None:
                return True
            try:
                result = self._engine.submit(self._tiers[medium], slot, dst, reservation.slot, key).result()
            except TransferAbandoned:
                # Bytes may still move later: the source stays pinned (never reused) and the
                # destination slot is retired. Both slots are lost to this process.
                pinned = False
                dst.table.quarantine(key)
                return False
            except CorruptBlock:
                dst.table.complete_store(key, ok=False)
                pinned = False  # _drop_corrupt unpins
                self._drop_corrupt(medium, key, slot)
                return False
            except BaseException:
                dst.table.complete_store(key, ok=False)
                return False
            self.metrics.transfer(result)
            dst.table.complete_store(key, ok=True)
            self.index.add(key, dst.medium)
            return True
        finally:
            if pinned:
                self._unpin(medium, [key])

    def _maybe_write_down_hot(self, keys: list[BlockKey]) -> None:
        device = self.tier(Medium.DEVICE)
        for key in keys:
            if self.config.write.on_hit(device.table.hits(key)):
                self._write_down(key, Medium.DEVICE)

    # --- capacity: reservations and eviction -------------------------------------------------

    def _reserve(self, tier: Tier, key: BlockKey) -> Reservation | None:
        """A WRITING slot for ``key`` in ``tier``, evicting (and demoting) as needed."""
        while True:
            try:
                return tier.table.prepare_store(key)
            except TierFull:
                victims = tier.table.choose_victims(1)
                if not victims:
                    raise
                for victim in victims:
                    self._evict(tier, victim)

    def _evict(self, tier: Tier, victim: Reservation) -> None:
        hits = tier.table.hits(victim.key)
        lower = [m for m in self._order if m.value > tier.medium.value]
        if lower and self.config.write.on_evict(hits) and lower[0] not in self.index.media(victim.key):
            self._demote(tier, victim, self._tiers[lower[0]])
        self.index.discard(victim.key, tier.medium)
        tier.table.release(victim.key)
        tier.discard(victim.slot, victim.key)

    def _demote(self, tier: Tier, victim: Reservation, dst: Tier) -> None:
        try:
            reservation = self._reserve(dst, victim.key)
        except TierFull:
            return  # nowhere to go: the block is dropped (it is a cache)
        if reservation is None:
            return
        try:
            result = self._engine.submit(tier, victim.slot, dst, reservation.slot, victim.key).result()
        except BaseException:
            dst.table.complete_store(victim.key, ok=False)
            return
        self.metrics.transfer(result)
        dst.table.complete_store(victim.key, ok=True)
        self.index.add(victim.key, dst.medium)

    def evict(self, medium: Medium, blocks: int) -> int:
        """Evict up to ``blocks`` unpinned blocks from a tier (demoting per the write policy)."""
        tier = self.tier(medium)
        victims = tier.table.choose_victims(blocks)
        # Demotions of several victims run at once (bytes still move on the engine's pool).
        for future in [self._writers.submit(self._evict, tier, victim) for victim in victims]:
            future.result()
        return len(victims)

    def _drop_corrupt(self, medium: Medium, key: BlockKey, slot: int) -> None:
        """Unpin a block that failed verification and drop it, unless another reader still
        holds it: then it stays READY and indexed, and the last reader to fail drops it."""
        tier = self._tiers[medium]
        self._unpin(medium, [key])
        if tier.table.remove(key):
            self.index.discard(key, medium)
            tier.discard(slot, key)

    # --- prefetch ----------------------------------------------------------------------------

    def prefetch(
        self, tokens: Any, rule: PrefetchRule | None = None, tenant: str = "", deadline_s: float | None = None
    ) -> PrefetchFuture:
        """Promote the prefix's disk/remote blocks to the host for a queued request. Waits as
        ``rule`` says; the Future gives the number of blocks promoted.

        ``deadline_s`` (``time.monotonic()`` clock) is when the request is expected to start.
        With the DEADLINE policy and a calibration, the promotion starts as late as its predicted
        time allows (see :func:`kvstrata.policies.prefetch.schedule`); the call returns at once
        (the request's load, at its start, uses what has arrived) and the returned
        :class:`PrefetchFuture`'s ``timing`` holds the schedule. Without a calibration the
        promotion starts at once.
        """
        self._check_open()
        rule = rule or PrefetchRule()
        match = self.lookup(tokens, tenant)
        now = time.monotonic()
        timing = None
        if rule.policy is PrefetchPolicy.DEADLINE:
            if deadline_s is None:
                raise ValueError("the deadline prefetch policy needs deadline_s (time.monotonic() of the request's start)")
            if self.config.calibration is not None:  # without one, nothing says how late to start
                timing = schedule(now, deadline_s, self.predict_promotion_s(match), rule.margin)
        future = PrefetchFuture(timing)
        future.set_running_or_notify_cancel()

        def begin(timer: threading.Timer | None = None) -> None:
            with self._timer_lock:
                if timer is not None and self._timers.pop(timer, None) is None:
                    return  # close() got there first and failed the future
            try:
                inner = self._orchestrator.submit(self._run_prefetch, match)
            except RuntimeError as exc:  # the cache closed meanwhile
                future.set_exception(exc)
                return
            inner.add_done_callback(lambda f: _chain(f, future))

        if timing is not None and timing.start_s > now:
            timer = threading.Timer(timing.start_s - now, lambda: begin(timer))
            timer.daemon = True
            with self._timer_lock:
                self._timers[timer] = future
            timer.start()
        else:
            begin()
        wait_s = rule.wait_s()
        if wait_s != 0:
            wait([future], timeout=wait_s)
        return future

    def predict_promotion_s(self, match: Match) -> float:
        """Predicted seconds to promote the match's disk and remote blocks to the host, from the
        configured calibration (0 without one, or with nothing to promote)."""
        cal = self.config.calibration
        if cal is None:
            return 0.0
        seconds = 0.0
        for medium, tier in ((Medium.DISK, "disk"), (Medium.REMOTE, "remote")):
            blocks = match.count(medium)
            if blocks:
                seconds += cal.restore_s(tier, blocks * self.layout.block_bytes, blocks, self.config.workers)
        return seconds

    def _run_prefetch(self, match: Match) -> int:
        host = self._tiers.get(Medium.HOST)
        if host is None:
            return 0
        promoted = 0
        for key, medium in zip(match.keys, match.media):
            if medium.value > Medium.HOST.value and self._copy_to(key, host):
                promoted += 1
        return promoted

    # --- plumbing ----------------------------------------------------------------------------

    def _unpin(self, medium: Medium, keys: list[BlockKey]) -> None:
        table = self._tiers[medium].table
        for key in keys:
            table.unpin(key)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the cache is closed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._timer_lock:  # deadline prefetches that have not begun never will
            pending, self._timers = self._timers, {}
        for timer, future in pending.items():
            timer.cancel()
            future.set_exception(RuntimeError("the cache closed before this prefetch began"))
        self._orchestrator.shutdown(wait=True)
        self._writers.shutdown(wait=True)
        self._engine.close()
        for tier in self._tiers.values():
            tier.close()

    def __enter__(self) -> "TieredCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass
class _Planned:
    """One block of a load: where it lands on the device and, if not there yet, its source."""

    key: BlockKey
    dst_slot: int
    fresh: bool  # True: a reserved (WRITING) device slot to fill from ``src``
    src: Medium | None = None
    src_slot: int = -1
    route: Route = ()  # how the block reached the device, for LoadResult.paths
    done: bool = False  # the whole block already landed (remote -> device)
    quarantined: bool = False  # a transfer into the slot was abandoned: never free it


class PrefetchFuture(Future):
    """A prefetch's Future (its result: blocks promoted), with the deadline schedule it ran
    on (``timing``; None unless the DEADLINE policy had a calibration to schedule from)."""

    def __init__(self, timing: PrefetchTiming | None) -> None:
        super().__init__()
        self.timing = timing


def _chain(src: Future, dst: Future) -> None:
    if src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.result())


def _copy_timed(dst: torch.Tensor, src: torch.Tensor) -> float:
    start = time.perf_counter()
    dst.copy_(src)
    if dst.is_cuda:
        torch.cuda.current_stream(dst.device).synchronize()
    return time.perf_counter() - start
