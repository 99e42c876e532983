"""The worker side: the process's TieredCaches, and every byte between them and vLLM's paged KV.

What is cached. Only full blocks of prompt tokens, per KV cache group
(:mod:`kvstrata.integrations.vllm.groups`): each group has a TieredCache of its own, its blocks
keyed by kvstrata's chained block hashes in a namespace of the model, vLLM's block size, the KV
dtype, a layout and the group (a one-group model's namespace is what it was before groups).
How a block's bytes are kept is ``kv_sharing`` (:mod:`kvstrata.integrations.vllm.paged`):
head-sliced (the default), one object per KV head in a namespace without a TP size, so an
instance of any TP size loads what one of another stored, and MLA's latent is stored once
(rank 0 writes it); or TP-matched, this rank's vLLM block as opaque bytes, namespaced by the TP
rank and size. The sizes are vLLM's own (the group's KV cache spec: this TP rank's KV heads,
its head size; the model's total KV heads for the slicing), checked against vLLM's tensors.

Loads. ``start_load_kv`` starts, per :class:`LoadSpec`, one kvstrata load per group that has
blocks to fill, of exactly those blocks (a sliding group: its window; blocks vLLM found in its
own prefix cache: none); each layer's hook waits for that layer and copies it into vLLM's blocks.
A load that cannot be served whole in every group (its blocks left kvstrata after the
scheduler's lookup, a load failed or stopped early, a layer was never copied, or it held the
step up past its budget, a multiple of the prefill of its tokens: :class:`LoadSpec` ``budget_s``) has every block
it writes reported through ``get_block_ids_with_load_errors``; vLLM recomputes them
(``kv_load_failure_policy="recompute"``) or fails the request, and never reads them as valid KV.

Loads off the step (``async_loads``: vLLM's asynchronous loads, from a disk or the pool where
holding the running requests up would cost more than a step, and every load of a hybrid model:
the scheduler decides) start with the step's other loads and are
polled in ``get_finished``: one that arrived is copied into vLLM's blocks there, whole, and
reported finished; one that failed, ran past its budget or whose request ended is given up
(released once it ends) and reported, a failure as ``failed_recving`` (vLLM recomputes it).

Saves. Each layer's hook, after the layer's attention, copies that layer of the blocks to save
into its group's staging tensor; ``wait_for_save`` takes any layer no hook ran for and stores
each group's blocks in its cache under their keys (a windowed group's run starts at its window:
:mod:`kvstrata.integrations.vllm.scheduler`). The scheduler's lookups are answered here, by
:func:`kvstrata.cache.grouped.longest_hit` over the groups' caches.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import torch

from kvstrata.cache import TieredCache
from kvstrata.cache.grouped import longest_hit
from kvstrata.cache.sliced import SlicedRank
from kvstrata.index.keys import BlockKey
from kvstrata.integrations.vllm.groups import VLLMGroup, hit_tiers, vllm_groups
from kvstrata.integrations.vllm.metadata import KVStrataMetadata, LoadSpec, SaveSpec
from kvstrata.integrations.vllm.paged import OpaqueGroup, SlicedGroup, staging
from kvstrata.integrations.vllm.prom import KVStrataStats, WorkerReporter
from kvstrata.integrations.vllm.channel import LookupServer
from kvstrata.integrations.vllm.feedback import KVStrataWorkerMeta, LoadOutcome, ProbeTiming, StepClock
from kvstrata.integrations.vllm.settings import ConnectorSettings
from kvstrata.kv.heads import KVSharing
from kvstrata.integrations.vllm.stats import GroupStats, PendingSave, StatsFile, WorkerStats
from kvstrata.kv.geometry import DType
from kvstrata.kv.groups import KVGroup
from kvstrata.kv.heads import HeadSlicing
from kvstrata.kv.layout import KVLayout
from kvstrata.media import Medium
from kvstrata.transfer.placement import io_cpus_for, io_thread_started, io_threads_cpu_s, place_io_threads

if TYPE_CHECKING:

    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


# vLLM's KV dtype is the cache's (FP8 KV caches: not yet).
_VLLM_DTYPES = (DType.FP32, DType.BF16, DType.FP16)


_log = logging.getLogger("kvstrata.integrations.vllm")
MAX_HELD_STEPS = 8  # steps whose saves wait for their loads' verdict at most (TP > 1)
IDLE_WAIT_S = 0.002  # a step with nothing to compute waits this long for a load off the step to end


@dataclass
class _StagedSave:
    """A save staged out of vLLM's blocks, not yet stored: per group (group, keys, staged KV)."""

    start: float
    blocks: int  # its blocks (as dropped, if so)
    stores: list[tuple[int, list[BlockKey], torch.Tensor]]


@dataclass
class _ActiveLoad:
    spec: LoadSpec
    handles: list[Any]  # per group, a LoadHandle or SlicedLoad; None: the group fills no blocks
    layers_done: list[int]  # per group, layers copied
    failed: bool = False
    left: bool = False  # failed because its blocks left kvstrata after the scheduler's lookup
    held_s: float = 0.0  # how long it has held vLLM's step up (waiting for it, copying it)
    started: float = 0.0  # perf_counter when it started (off the step: its time is from here to its end)
    off_step: bool = False  # vLLM's asynchronous load: reported through get_finished, not in the step

    @property
    def outcome(self) -> LoadOutcome:
        if not self.failed:
            return LoadOutcome.ARRIVED
        return LoadOutcome.LEFT if self.left else LoadOutcome.FAILED


class _CountingSaver(ThreadPoolExecutor):
    """One of the connector's save threads: each task's thread CPU goes to ``on_cpu`` (a store's cost)."""

    def __init__(self, on_cpu: Callable[[float], None], name: str = "kvstrata-save") -> None:
        super().__init__(1, thread_name_prefix=name, initializer=io_thread_started)
        self._on_cpu = on_cpu

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        def counted() -> Any:
            cpu = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self._on_cpu(time.thread_time() - cpu)

        return super().submit(counted)


class KVStrataConnectorWorker:
    """The worker-side half of :class:`~kvstrata.integrations.vllm.KVStrataConnector`.

    Args:
        vllm_config: the engine's config (model, parallelism, block size).
        kv_cache_config: vLLM's KV cache groups (which layers, which spec).
        settings: the parsed extra config.
        engine_id: vLLM's engine id (names the lookup socket).
        saves_enabled: the role stores KV (``kv_both``, ``kv_producer``).
    """

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: ConnectorSettings,
                 engine_id: str, saves_enabled: bool) -> None:
        self._vllm_config = vllm_config
        self.settings = settings
        self._block_size = vllm_config.cache_config.block_size
        self._group_specs = vllm_groups(kv_cache_config, _VLLM_DTYPES)  # a group it cannot cache fails the start
        self._engine_id = engine_id
        self._saves_enabled = saves_enabled
        self._groups: list[OpaqueGroup | SlicedGroup] = []
        self._server: LookupServer | None = None
        self._layer_of: dict[str, tuple[int, int]] = {}  # layer name -> (group, layer within the group)
        self._active: list[_ActiveLoad] = []
        self._recving: dict[str, _ActiveLoad] = {}  # req -> its load off the step, until reported
        self._abandoned: list[Any] = []  # loads given up while in flight: released once they end, never waited for
        self._staged: dict[tuple[str, int], tuple[torch.Tensor, list[bool]]] = {}  # (req, group) -> kv, staged
        self._taken: dict[str, bool] = {}  # req -> whether this step stores its save (the backlog's room)
        self._held: dict[int, list[_StagedSave]] = {}  # step -> its saves, until the verdict on its loads (TP > 1)
        self._holds = False  # TP > 1: set once the caches are registered
        self._failed_blocks: set[int] = set()
        self._unwritten: frozenset[Medium] = frozenset()  # tiers the caches write nothing down to now
        self._stats = WorkerStats()
        self._stats_path = settings.stats_path
        self._stats_file: StatsFile | None = None
        self._reporter = WorkerReporter(0)  # its TP rank, once the caches are registered
        self.clock = StepClock()  # what the scheduler's load-or-recompute decision learns from
        self._saving_blocks = 0  # blocks of saves not yet stored (the cache's threads finish them)
        self._saving_lock = threading.Lock()
        self._hooks_cpu_s = 0.0  # CPU the connector's hooks used on vLLM's step thread
        self._changed = True  # anything to report since the last report (a load, a save, a store done)
        # the saves' puts into the tiers, one at a time, in step order, on the I/O CPUs
        self._saver = _CountingSaver(self.clock.save_cpu)
        # vLLM's blocks in CPU memory: a step's saves are copied out of them after the step, on a
        # thread of their own, and the next step's forward waits for those copies first (``fence``)
        self._copier = _CountingSaver(self.clock.save_cpu, "kvstrata-copy")
        self._copies_off_step = False  # set once the caches are registered
        self._copying: list[Future] = []  # copies out of vLLM's blocks not yet fenced
        # probe reads of tiers the scheduler stopped loading from, one at a time, never on the step
        self._prober = ThreadPoolExecutor(1, thread_name_prefix="kvstrata-probe", initializer=io_thread_started)
        self._probing: set[Medium] = set()  # tiers whose probe read is in flight
        self._threads_cpu = (0.0, -1.0)  # the connector's own threads' CPU seconds, and when read
        transfer = vllm_config.kv_transfer_config
        self._recomputes = transfer is not None and transfer.kv_load_failure_policy == "recompute"

    @property
    def stages_layers(self) -> bool:
        """Saves are staged layer by layer in the forward (``save_kv_layer``): vLLM's blocks on a
        GPU (a gather in the forward's stream), or ``sync_save``."""
        return self._saves_enabled and not self._copies_off_step

    @property
    def receiving(self) -> bool:
        """Loads off the step are in flight, or loads given up are yet to end (``get_finished``
        reports the ones, releases the others)."""
        return bool(self._recving or self._abandoned)

    @property
    def _caches(self) -> tuple[TieredCache, ...]:
        return tuple(c for g in self._groups for c in g.caches)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's paged KV (layer name -> tensor), open a cache per group, serve lookups (rank 0)."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        model = self._vllm_config.model_config.model
        place_io_threads(io_cpus_for(self.settings.io_cpus))  # before the caches start threads
        paged = []
        for spec in self._group_specs:
            missing = [n for n in spec.layer_names if n not in kv_caches]
            if missing:
                raise ValueError(f"KVStrataConnector: vLLM registered no KV cache for layer {missing[0]} "
                                 f"of KV cache group {spec.index}")
            paged.append([kv_caches[n] for n in spec.layer_names])
        sliced = self.settings.kv_sharing is KVSharing.SLICED
        layouts = [self._layout(spec, layers, sliced) for spec, layers in zip(self._group_specs, paged)]
        total = sum(layout.block_bytes for layout in layouts)
        try:
            for spec, layers, layout in zip(self._group_specs, paged, layouts):
                config = self.settings.cache_config(layout, model, str(layers[0].device), tp_rank, tp_size,
                                                    kv_group=spec.namespace, share=Fraction(layout.block_bytes, total))
                if sliced:  # the rank's packs in its own tiers, the slices in the pool (SlicedRank.open)
                    rank = SlicedRank.open(config, self._slicing(spec), tp_size, tp_rank)
                    try:
                        self._groups.append(SlicedGroup(spec, rank, layers))
                    except BaseException:
                        rank.close()
                        raise
                    continue
                cache = TieredCache(config)
                try:
                    self._groups.append(OpaqueGroup(spec, cache, layers))
                except BaseException:
                    cache.close()
                    raise
        except BaseException:
            self._close_caches()
            self._groups = []
            raise
        self._layer_of = {name: (g, i) for g, group in enumerate(self._groups)
                          for i, name in enumerate(group.spec.layer_names)}
        self._describe(paged[0][0], tp_rank, tp_size)
        self._holds = tp_size > 1
        self._copies_off_step = not paged[0][0].is_cuda and not self.settings.sync_save
        if tp_rank > 0 and self._stats_path is not None:  # each rank its own file: rank 0's is stats_path
            self._stats_path = self._stats_path.with_name(f"{self._stats_path.stem}.rank{tp_rank}{self._stats_path.suffix}")
        # The scheduler asks rank 0: every rank caches the same token blocks (head-sliced: its own
        # heads' slices of them). A rank that then misses its part of a granted hit reports those
        # blocks as load errors (start_load_kv), and vLLM recomputes them.
        if tp_rank == 0:
            self._server = LookupServer(self._engine_id, self.hit_tiers)
        self.clock.started(all(c.manager.indexed_blocks() == 0 for c in self._caches))  # the scheduler's own misses
        if self._stats_path is not None:
            self._stats_file = StatsFile(self._stats_path, self._stats, lambda: self._caches)
            self._stats_file.write_now()

    def _describe(self, paged: torch.Tensor, tp_rank: int, tp_size: int) -> None:
        """The stats' account of the caches just opened (``paged``: one layer of vLLM's KV)."""
        errors = [c.remote_error for c in self._caches if c.remote_error is not None]
        self._stats.remote_error = errors[0] if errors else None
        self._stats.block_bytes = sum(g.layout.block_bytes for g in self._groups)  # this rank's share of a block
        self._stats.vllm_block_shape = list(paged.shape[1:])
        self._stats.groups = [GroupStats(g.spec.namespace, g.spec.kind.value, g.spec.group.span, g.spec.group.num_layers,
                                         g.layout.block_bytes) for g in self._groups]
        self._stats.tp = [tp_rank, tp_size]
        self._reporter, self._stats.writes = WorkerReporter(tp_rank), all(g.writes for g in self._groups)

    def hit_tiers(self, tokens: list[int]) -> tuple[Medium, ...]:
        """The tier of each block of ``tokens`` every group's cache serves: the scheduler's
        lookup (full blocks)."""
        groups = {str(g.spec.index): g.spec.group for g in self._groups}
        caches: Any = {str(g.spec.index): g for g in self._groups}  # match() in blocks, as a TieredCache's
        keys = {str(g.spec.index): g.keys(tokens) for g in self._groups}
        return hit_tiers(longest_hit(groups, caches, keys, self._block_size))

    def _layout(self, spec: VLLMGroup, layers: list[torch.Tensor], sliced: bool) -> KVLayout:
        """The layout of one group's cache: one head slice, or this rank's opaque vLLM block."""
        from vllm.platforms import current_platform

        if sliced:
            return KVLayout.head_slice(self._whole(spec), self._block_size)
        return OpaqueGroup.layout_of(spec, layers, self._block_size, current_platform.device_type)

    def _slicing(self, spec: VLLMGroup) -> HeadSlicing:
        return HeadSlicing.for_group(self._whole(spec))

    def _whole(self, spec: VLLMGroup) -> KVGroup:
        return SlicedGroup.whole_group(spec, self._vllm_config.model_config.get_total_num_kv_heads())

    # --- loads ----------------------------------------------------------------------------------

    def start_load_kv(self, meta: KVStrataMetadata) -> None:
        """Start this step's loads: per spec, one per group with blocks to fill. Those for the
        forward (``loads``: before it) hold the step up from here; those off the step
        (``async_loads``) are reported once they end (``get_finished``)."""
        for spec in meta.loads:
            active = self._start_load(spec)
            self._active.append(active)
            active.held_s = time.perf_counter() - active.started
            self.clock.charge(spec.req_id, active.held_s)
        for spec in meta.async_loads:
            self._recving[spec.req_id] = self._start_load(spec, off_step=True)

    def _start_load(self, spec: LoadSpec, off_step: bool = False) -> _ActiveLoad:
        active = _ActiveLoad(spec, [], [0] * len(self._groups), started=time.perf_counter(), off_step=off_step)
        for group, blocks in zip(self._groups, spec.groups):
            if not blocks.block_ids:
                active.handles.append(None)
                continue
            # only the blocks vLLM asks for: not those before a window, nor its own prefix hit
            keys = group.keys(spec.tokens)[blocks.first_block : blocks.end_block]
            load = group.load(keys)
            if load is None:  # left since the lookup, or (TP > 1) this rank's slices were never there
                self._fail_load(active, f"group {group.spec.index}'s blocks left kvstrata after the "
                                "scheduler's lookup")
                active.left = True
                break
            active.handles.append(load)
        return active

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before layer ``layer_name``'s attention: copy that layer of every load into vLLM's blocks."""
        where = self._layer_of.get(layer_name)
        if where is None:
            return
        for active in self._active:
            if not active.failed:
                started = time.perf_counter()
                self._copy_layer(active, *where)
                took = time.perf_counter() - started
                active.held_s += took
                self.clock.charge(active.spec.req_id, took)

    def _copy_layer(self, active: _ActiveLoad, group: int, layer: int) -> None:
        handle = active.handles[group] if group < len(active.handles) else None
        if handle is None:
            return
        block_ids = active.spec.groups[group].block_ids
        budget = active.spec.budget_s
        try:
            handle.wait_layer(layer, None if budget is None else max(0.0, budget - active.held_s))
        except TimeoutError as exc:
            if handle.done():  # the load's own error (a timeout of its tier's), not this wait's
                self._fail_load(active, f"load failed: {exc}")
                return
            # past its budget: computing its tokens is quicker than waiting on
            self._stats.late()
            self._fail_load(active, f"the load held the step up past its budget of {budget * 1e3:.1f} ms "
                            "(set from the prefill of its tokens): its blocks are computed")
            return
        except Exception as exc:  # noqa: BLE001 - the blocks are reported, vLLM recomputes them
            self._fail_load(active, f"load failed: {exc}")
            return
        if handle.blocks < len(block_ids):
            self._fail_load(active, "the load stopped early")
            return
        self._groups[group].copy_layer(handle, layer, block_ids)
        active.layers_done[group] += 1

    def _finish_loads(self) -> bool:
        """End of the forward: release the loads, and report any whose layers were not all
        copied (their blocks were read as they were: vLLM must recompute them). A failed load
        still in flight (given up past its budget) is not waited for: released once it ends.
        Returns whether a load failed this step."""
        self._abandoned = [h for h in self._abandoned if not _released_if_done(h)]
        failed = False
        for active in self._active:
            self._finish(active)
            failed = failed or active.failed
            self.clock.load_done(active.spec.req_id, active.outcome)
        self._active.clear()
        return failed

    def _finish(self, active: _ActiveLoad) -> float:
        """Release a load's handles (a failed one's still in flight: once it ends), failing it
        where not every layer was copied; count it if it arrived. Returns its own time (its
        slowest group's: the tiers' reading, not waiting for a thread)."""
        results = []
        for g, handle in enumerate(active.handles):
            if handle is None:
                continue
            if active.failed and not handle.done():
                self._abandoned.append(handle)
                continue
            try:
                results.append((g, len(active.spec.groups[g].block_ids), handle.wait()))
            except Exception as exc:  # noqa: BLE001 - reported here or in wait_for_layer_load
                if not active.failed:
                    self._fail_load(active, f"load failed: {exc}")
            if not active.failed and active.layers_done[g] < self._groups[g].spec.group.num_layers:
                self._fail_load(active, "not every layer was copied")
            handle.release()
        if not active.failed:
            self._stats.loaded(active.spec.external_tokens, results)
        return max((result.seconds for _, _, result in results), default=0.0)

    def get_finished(self, finished_req_ids: set[str], idle: bool) -> tuple[set[str], set[str]]:
        """Loads off the step that ended since the last call: (every one, the failed ones).

        One that arrived is copied into vLLM's blocks here, whole, and counted as arrived. One
        past its budget (its request has waited longer than computing its tokens would take)
        is given up, as is one whose request ended (vLLM frees the request's blocks once it is
        reported); either is released once it ends, never waited for. A failed one's request
        is recomputed (``failed_recving``). ``idle``: the step computed nothing (every request
        waits), so wait briefly for a load to end rather than spin vLLM's loop.
        """
        self._abandoned = [h for h in self._abandoned if not _released_if_done(h)]
        if not self._recving:
            return set(), set()
        if idle:
            _settle(self._recving.values(), IDLE_WAIT_S)
        finished, failed = set(), set()
        for req_id, active in list(self._recving.items()):
            aborted = req_id in finished_req_ids
            if not self._ended(active, aborted):
                continue
            copying = time.perf_counter()
            if not active.failed:
                for g, group in enumerate(self._groups):
                    for layer in range(group.spec.group.num_layers):
                        if not active.failed:
                            self._copy_layer(active, g, layer)
            own = self._finish(active) + time.perf_counter() - copying
            # the scheduler learns the tier's speed: an arrived load's own time, not the steps it waited through
            self.clock.charge(req_id, own if not active.failed else time.perf_counter() - active.started)
            self.clock.load_done(req_id, active.outcome)
            del self._recving[req_id]
            self._stats.off_step()
            finished.add(req_id)
            if active.failed and not aborted:
                failed.add(req_id)
                if self._recomputes:
                    self._stats.recomputed(len(active.spec.block_ids))
        if finished:
            self._changed = True
            self._write_stats(now=self.settings.sync_save)
        return finished, failed

    def _ended(self, active: _ActiveLoad, aborted: bool) -> bool:
        """Whether a load off the step is to be reported now: it ended, failed, its request
        ended (given up), or it ran past its budget (given up, failed)."""
        if active.failed:
            return True
        if aborted:
            self._cancel(active)
            return True
        if all(h is None or h.done() for h in active.handles):
            return True
        budget = active.spec.budget_s
        if budget is None or time.perf_counter() - active.started <= budget:
            return False
        self._stats.late()
        self._fail_load(active, f"its request waited past the load's budget of {budget * 1e3:.1f} ms (set from "
                        "the prefill of its tokens): its blocks are computed")
        return True

    def _cancel(self, active: _ActiveLoad) -> None:
        """Give up a load whose request ended: nothing to report but its end."""
        active.failed = True
        for handle in active.handles:
            if handle is not None:
                handle.cancel()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM blocks whose load failed since the last call (vLLM recomputes them, or fails
        their requests: ``kv_load_failure_policy``)."""
        failed, self._failed_blocks = self._failed_blocks, set()
        if failed and self._recomputes:
            self._stats.recomputed(len(failed))
            self._changed = True
        return failed

    def get_kv_connector_stats(self) -> KVStrataStats | None:
        """What the counters and caches say changed since the last call (every step; None:
        nothing). Only a step after a load, a save or a store's end looks at them: the rest (a
        decode step) change nothing but the CPU counter, which the next report carries."""
        if not self._changed:
            return None
        self._changed = False  # before reading: a store ending meanwhile marks it again
        return self._reporter.report(self._stats, self._caches, self.cpu_s())

    @contextmanager
    def hook(self, saving: bool = False) -> Iterator[None]:
        """Around a hook on vLLM's step thread: its CPU is the connector's (``saving``: a store's
        cost too), its time not the forward's."""
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            yield
        finally:
            used = time.thread_time() - cpu
            self._hooks_cpu_s += used
            if saving:
                self.clock.save_cpu(used)
            self.clock.hooked(time.perf_counter() - wall)

    def cpu_s(self) -> float:
        """CPU seconds the connector used in this worker: its hooks, and its threads (read from
        ``/proc`` at most twice a second)."""
        threads, at = self._threads_cpu
        now = time.monotonic()
        if now - at >= 0.5:
            threads = io_threads_cpu_s()
            self._threads_cpu = (threads, now)
        return self._hooks_cpu_s + threads

    def build_connector_worker_meta(self) -> KVStrataWorkerMeta | None:
        """What this step measured, for the scheduler's decisions (:mod:`~kvstrata.integrations.vllm.feedback`)."""
        return self.clock.take()

    def _fail_load(self, active: _ActiveLoad, why: str) -> None:
        """Every block the load writes, in every group, is reported (a load off the step
        reports its request instead: ``get_finished``): its KV is not all there."""
        self._cancel(active)  # its bytes will not be used: what it has not started reading, it does not read
        block_ids = active.spec.block_ids
        if not active.off_step:
            self._failed_blocks.update(block_ids)
        self._stats.failed(len(block_ids), why)

    # --- saves ----------------------------------------------------------------------------------

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, meta: KVStrataMetadata) -> None:
        """Stage this layer of every block to save; called after the layer's attention, when
        its KV (the new tokens' too) is in the paged cache."""
        where = self._layer_of.get(layer_name)
        if where is None or not self.stages_layers:
            return
        group, layer = where
        if not self._groups[group].writes:  # an earlier rank stores these heads
            return
        for spec in meta.saves:
            block_ids = spec.groups[group].block_ids
            if block_ids and self._taking(spec):
                kv, staged = self._staging(spec, group, self._staged)
                self._groups[group].stage_layer(kv, layer, block_ids)  # kv_layer: the paged KV registered
                staged[layer] = True

    def _taking(self, spec: SaveSpec) -> bool:
        """Whether this step stores ``spec``: not when the saves still in flight hold
        ``save_backlog_bytes`` or more (the tiers below cannot keep up: a slow disk, a pool that
        stalls). Such a save is dropped and counted, never waited for: its blocks are recomputed
        if asked for again. Decided once per spec and step."""
        taking = self._taken.get(spec.req_id)
        if taking is None:
            with self._saving_lock:
                taking = self._saving_blocks * self._stats.block_bytes < self.settings.save_backlog_bytes
            self._taken[spec.req_id] = taking
            if not taking:
                self._stats.dropped(spec.blocks)
        return taking

    def _saved(self, blocks: int) -> None:
        with self._saving_lock:
            self._saving_blocks -= blocks
        self._changed = True
        self._write_stats()  # the store's counts, off the step

    def skip_writes(self, media: frozenset[Medium]) -> None:
        """The scheduler's tiers to write nothing down to (a disk whose loads it declines), to
        every cache; told again only when they change."""
        if media != self._unwritten:
            self._unwritten = media
            for cache in self._caches:
                cache.manager.skip_writes(media)

    def probe(self, media: tuple[Medium, ...]) -> None:
        """Read one block of each tier in ``media`` (the scheduler's due probes) off the step, on
        the probe thread; the time goes back with a later step's metadata. A tier whose last
        probe is still reading is not read again."""
        for medium in media:
            if medium not in self._probing and any(medium in c.media for c in self._caches):
                self._probing.add(medium)
                self._prober.submit(self._probe_read, medium)

    def _probe_read(self, medium: Medium) -> None:
        """Read a block only ``medium`` holds (so the read is from it) into memory of its own,
        verified, as a load would; nothing else changes. No such block: nothing read."""
        start = time.perf_counter()
        timing = ProbeTiming(medium, 0.0, False, False)
        try:
            for cache in self._caches:
                key = cache.manager.held_only_in(medium) if medium in cache.media else None
                if key is not None:
                    start = time.perf_counter()
                    read = cache.get_into([key], [[torch.empty(cache.layout.block_bytes, dtype=torch.uint8)]])
                    timing = ProbeTiming(medium, time.perf_counter() - start, read == 1)
                    break
        except Exception:  # noqa: BLE001 - a failed read is the probe's answer: the tier still fails
            timing = ProbeTiming(medium, time.perf_counter() - start, False)
        finally:
            self._probing.discard(medium)
        self.clock.probed(timing)
        if timing.read:
            self._stats.probed(medium, timing.seconds)
            self._changed = True
            self._write_stats()

    def wait_for_save(self, meta: KVStrataMetadata) -> None:
        """End of the step: finish the loads, start storing the blocks to save (the cache's
        threads store them and write them down; ``sync_save``: wait for that here). From vLLM's
        blocks in CPU memory, the copy out of them runs after the step too, on the copy thread,
        and the next forward waits for it (:meth:`fence`). With TP > 1 a step that loaded holds
        its staged saves until the scheduler's verdict on its loads
        (:mod:`~kvstrata.integrations.vllm.verdicts`); earlier steps' verdicts are applied here."""
        failed = self._finish_loads()
        cpu = time.thread_time()
        pending = self._judged(meta.verdicts)
        taken: list[SaveSpec] = []
        for spec in meta.saves if self._saves_enabled else ():
            if failed:
                # A load failed this step: its request, and any other that found the same blocks
                # in vLLM's prefix cache this step, computed over KV that is not all there; their
                # new blocks' later layers are wrong (vLLM recomputes them). Which requests read
                # those blocks is vLLM's to know: no save of the step is stored.
                self._stats.dropped(spec.blocks)
                continue
            if self._taking(spec):
                taken.append(spec)
        hold = bool(meta.loads) and self._holds  # another rank's load may have failed: wait for the verdict
        staged: list[_StagedSave] = []
        if taken and self._copies_off_step and not hold:
            self._copying.append(self._copier.submit(self._copy_out, taken))
        else:
            staged = [save for save in (self._staged_save(spec, self._staged) for spec in taken) if save.stores]
        self._staged.clear()
        self._taken.clear()
        if staged and hold:
            self._held[meta.step] = staged
            self._drop_stale_holds()
        else:
            pending += self._store(staged)
        if meta.saves or pending:
            self.clock.save_cpu(time.thread_time() - cpu)
        self._settle(pending)
        if meta.loads or meta.saves or pending:
            self._changed = True
            self._write_stats(now=self.settings.sync_save)  # a pass's reader expects its saves there

    def _settle(self, pending: list[tuple[PendingSave, list[tuple[int, Future]]]]) -> None:
        """Count each store as it ends (``sync_save``: wait for it here)."""
        for save, futures in pending:
            for g, future in futures:
                if self.settings.sync_save:
                    save.done(g, future)
                    future.result()  # a failed store fails the step, as it always has with sync_save
                else:
                    future.add_done_callback(lambda f, s=save, g=g: s.done(g, f))

    def _copy_out(self, specs: list[SaveSpec]) -> None:
        """On the copy thread, after the step: copy the saves out of vLLM's blocks and hand them to
        the caches. Never raises: a save that cannot be copied is dropped and counted."""
        try:
            staged = [save for save in (self._staged_save(spec, {}) for spec in specs) if save.stores]
        except Exception as error:  # noqa: BLE001 - the step has moved on: count it, never raise into vLLM
            for spec in specs:
                self._stats.dropped(spec.blocks)
            self._changed = True
            _log.warning("KVStrataConnector: a save could not be copied out of vLLM's blocks (%s); dropped", error)
            return
        self._settle(self._store(staged))

    def fence(self) -> None:
        """Before a forward (vLLM's ``handle_preemptions``): the copies out of vLLM's blocks that
        the last steps started have ended, so a block vLLM freed since (a request finished or
        preempted) may be written again."""
        copying, self._copying = self._copying, []
        if copying:
            wait(copying)

    def _staged_save(self, spec: SaveSpec, prestaged: dict[tuple[str, int], tuple[torch.Tensor, list[bool]]]
                     ) -> _StagedSave:
        """A save's every group staged (the layers not in ``prestaged``, staged by the per-layer
        hook, are taken now, the forward over)."""
        save = _StagedSave(time.perf_counter(), spec.blocks, [])
        for g, group in enumerate(self._groups):
            block_ids = spec.groups[g].block_ids
            if not block_ids or not group.writes:
                continue
            kv, staged = self._staging(spec, g, prestaged)
            for layer, done in enumerate(staged):
                if not done:
                    group.stage_layer(kv, layer, block_ids)
            first = spec.groups[g].first_block
            save.stores.append((g, group.keys(spec.tokens)[first : first + len(block_ids)], kv))
        return save

    def _store(self, staged: list[_StagedSave]) -> list[tuple[PendingSave, list[tuple[int, Future]]]]:
        """Hand the staged saves to the caches; what is pending, to settle once each store ends."""
        pending = []
        for save in staged:
            futures = [(g, self._groups[g].store_keys(keys, kv, self._saver)) for g, keys, kv in save.stores]
            blocks = max(len(keys) for _, keys, _ in save.stores)
            self.clock.saved(blocks)
            with self._saving_lock:
                self._saving_blocks += blocks
            pending.append((PendingSave(self._stats, save.start, len(futures), lambda n=blocks: self._saved(n)),
                            futures))
        return pending

    def _judged(self, verdicts: dict[int, bool]) -> list[tuple[PendingSave, list[tuple[int, Future]]]]:
        """Store the held saves of steps whose loads arrived on every rank; drop (and count)
        those of steps where one failed."""
        pending = []
        for step, ok in verdicts.items():
            held = self._held.pop(step, None)
            if held is None:
                continue
            if ok:
                pending += self._store(held)
            else:
                for save in held:
                    self._stats.dropped(save.blocks)
        return pending

    def _drop_stale_holds(self) -> None:
        """A verdict always follows within a step or two; holds past MAX_HELD_STEPS (a verdict
        lost) are dropped, counted, so their staging is not kept for ever."""
        while len(self._held) > MAX_HELD_STEPS:
            step = min(self._held)
            for save in self._held.pop(step):
                self._stats.dropped(save.blocks)
            _log.warning("KVStrataConnector: no verdict on the loads of step %d; its saves are dropped", step)

    def _staging(self, spec: SaveSpec, group: int, prestaged: dict[tuple[str, int], tuple[torch.Tensor, list[bool]]]
                 ) -> tuple[torch.Tensor, list[bool]]:
        staged = prestaged.get((spec.req_id, group))
        if staged is None:
            layout = self._groups[group].layout
            # [blocks, layers, kv, block_tokens, this rank's kv_heads, head_dim] on vLLM's device:
            # a GPU gathers device to device in the forward's stream, never a host copy inside it
            kv = staging(layout, len(spec.groups[group].block_ids), self._groups[group].layers[0])
            staged = prestaged[(spec.req_id, group)] = (kv, [False] * layout.num_layers)
        return staged

    # --- lifetime -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop serving lookups, close the caches (waits for stores in flight), write the stats."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for active in self._recving.values():  # loads off the step still in flight: never reported now
            self._cancel(active)
            self._abandoned += [h for h in active.handles if h is not None]
        self._recving = {}
        for handle in self._abandoned:
            handle.release()  # waits for it to end: it writes into the caches' memory
        self._abandoned = []
        for held in self._held.values():  # no verdict will come: never stored
            for save in held:
                self._stats.dropped(save.blocks)
        self._held = {}
        if self._groups:
            self._close_caches()
            if self._stats_file is not None:
                self._stats_file.close()
            self._write_stats(now=True)
            self._groups = []

    def _close_caches(self) -> None:
        self._prober.shutdown(wait=True)  # a probe read in flight reads from the caches
        self._copier.shutdown(wait=True)  # the copies in flight hand their saves to the saver first
        self._saver.shutdown(wait=True)  # the puts in flight end first: they write into the caches
        for group in self._groups:
            for cache in group.caches:
                cache.close()  # waits for stores in flight

    def _write_stats(self, now: bool = False) -> None:
        """Rewrite the stats file: ``now`` on this thread, else soon on the file's own."""
        if self._stats_file is not None:
            if now:
                self._stats_file.write_now()
            else:
                self._stats_file.poke()


def _settle(loads: Any, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for the first of ``loads`` still in flight to end."""
    for active in loads:
        for handle in active.handles:
            if handle is not None and not handle.done():
                try:
                    handle.wait(timeout)
                except Exception:  # noqa: BLE001 - a timeout, or the load's error: get_finished sees it
                    pass
                return


def _released_if_done(handle: Any) -> bool:
    """Release a load given up in flight once it has ended; whether it has."""
    if not handle.done():
        return False
    handle.release()
    return True
