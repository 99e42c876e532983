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

:class:`KVStrataConnectorWorker` opens the caches once vLLM registers its KV, answers the
scheduler's lookups (by :func:`kvstrata.cache.grouped.longest_hit` over the groups' caches) and
hands each hook to the part that does its work, all sharing the groups:

* :mod:`~kvstrata.integrations.vllm.loads`: loads in the step (layer by layer, into vLLM's
  blocks before each layer's attention) and off it (vLLM's asynchronous loads, polled in
  ``get_finished``), their budgets, and the blocks of those that failed (vLLM recomputes them).
* :mod:`~kvstrata.integrations.vllm.saves`: saves staged per layer in the forward or copied out
  of vLLM's blocks after the step, the backlog's room, held saves awaiting a verdict (TP > 1),
  and the stores into the caches.
* :mod:`~kvstrata.integrations.vllm.probes`: probe reads of tiers the scheduler stopped loading from.
* :mod:`~kvstrata.integrations.vllm.reporting`: the counters (stats file, vLLM's connector
  stats) and the connector's CPU.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import torch

from kvstrata.cache import TieredCache
from kvstrata.cache.grouped import longest_hit
from kvstrata.cache.sliced import SlicedRank
from kvstrata.integrations.vllm.channel import LookupServer
from kvstrata.integrations.vllm.events import KVStrataKVEvents, TierEvents, publishes
from kvstrata.integrations.vllm.feedback import KVStrataWorkerMeta, StepClock
from kvstrata.integrations.vllm.groups import VLLMGroup, hit_tiers, vllm_groups
from kvstrata.integrations.vllm.loads import Loads
from kvstrata.integrations.vllm.metadata import KVStrataMetadata
from kvstrata.integrations.vllm.paged import OpaqueGroup, SlicedGroup
from kvstrata.integrations.vllm.probes import Probes
from kvstrata.integrations.vllm.prom import KVStrataStats
from kvstrata.integrations.vllm.reporting import WorkerReport
from kvstrata.integrations.vllm.saves import Saves
from kvstrata.integrations.vllm.settings import ConnectorSettings
from kvstrata.kv.geometry import DType
from kvstrata.kv.groups import KVGroup
from kvstrata.kv.heads import HeadSlicing, KVSharing
from kvstrata.kv.layout import KVLayout
from kvstrata.media import Medium
from kvstrata.transfer.placement import io_cpus_for, place_io_threads

if TYPE_CHECKING:

    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


# vLLM's KV dtype is the cache's (FP8 KV caches: not yet).
_VLLM_DTYPES = (DType.FP32, DType.BF16, DType.FP16)


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
        self._kv_cache_config = kv_cache_config
        self._events: TierEvents | None = None  # kvstrata's tiers as vLLM's KV events (events.py)
        self.settings = settings
        self._block_size = vllm_config.cache_config.block_size
        self._group_specs = vllm_groups(kv_cache_config, _VLLM_DTYPES)  # a group it cannot cache fails the start
        self._engine_id = engine_id
        # one cache (or sliced rank) per KV cache group, once vLLM's caches are registered; shared
        # with the loads and saves, so only ever changed in place
        self._groups: list[OpaqueGroup | SlicedGroup] = []
        self._server: LookupServer | None = None
        self._layer_of: dict[str, tuple[int, int]] = {}  # layer name -> (group, layer within the group)
        self._unwritten: frozenset[Medium] = frozenset()  # tiers the caches write nothing down to now
        self.clock = StepClock()  # what the scheduler's load-or-recompute decision learns from
        self._report = WorkerReport(settings.stats_path, self.clock)
        transfer = vllm_config.kv_transfer_config
        recomputes = transfer is not None and transfer.kv_load_failure_policy == "recompute"
        self._loads = Loads(self._groups, self._report, self.clock, recomputes, settings.sync_save)
        self._saves = Saves(self._groups, settings, self._report, self.clock, saves_enabled)
        # probe reads of tiers the scheduler stopped loading from, one at a time, never on the step
        self._probes = Probes(lambda: self._caches, self._report, self.clock)

    @property
    def stages_layers(self) -> bool:
        """Saves are staged layer by layer in the forward (``save_kv_layer``): vLLM's blocks on a
        GPU (a gather in the forward's stream), or ``sync_save``."""
        return self._saves.stages_layers

    @property
    def receiving(self) -> bool:
        """Loads off the step are in flight, or loads given up are yet to end (``get_finished``
        reports the ones, releases the others)."""
        return self._loads.receiving

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
            self._groups.clear()
            raise
        self._layer_of = {name: (g, i) for g, group in enumerate(self._groups)
                          for i, name in enumerate(group.spec.layer_names)}
        self._report.describe(self._groups, self._caches, paged[0][0], tp_rank, tp_size)
        # TP rank 0's tiers are what the scheduler looks up: its changes are the server's KV events
        if tp_rank == 0 and publishes(self._vllm_config, self._kv_cache_config):
            self._events = TierEvents(self._groups[0].event_sources(), self._block_size)
        copies_off_step = not paged[0][0].is_cuda and not self.settings.sync_save
        self._saves.registered(holds=tp_size > 1, copies_off_step=copies_off_step, events=self._events)
        # The scheduler asks rank 0: every rank caches the same token blocks (head-sliced: its own
        # heads' slices of them). A rank that then misses its part of a granted hit reports those
        # blocks as load errors (start_load_kv), and vLLM recomputes them.
        if tp_rank == 0:
            self._server = LookupServer(self._engine_id, self.hit_tiers)
        self.clock.started(all(c.manager.indexed_blocks() == 0 for c in self._caches))  # the scheduler's own misses
        self._report.open(tp_rank, lambda: self._caches)

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

    def start_load_kv(self, meta: KVStrataMetadata) -> None:
        """Start this step's loads, in the step and off it (:meth:`Loads.start`)."""
        self._loads.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before layer ``layer_name``'s attention: copy that layer of every load into vLLM's blocks."""
        where = self._layer_of.get(layer_name)
        if where is not None:
            self._loads.wait_for_layer(*where)

    def get_finished(self, finished_req_ids: set[str], idle: bool) -> tuple[set[str], set[str]]:
        """Loads off the step that ended since the last call: (every one, the failed ones)
        (:meth:`Loads.get_finished`)."""
        return self._loads.get_finished(finished_req_ids, idle)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM blocks whose load failed since the last call (vLLM recomputes them, or fails
        their requests: ``kv_load_failure_policy``)."""
        return self._loads.failed_blocks()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, meta: KVStrataMetadata) -> None:
        """Stage this layer of every block to save; called after the layer's attention, when
        its KV (the new tokens' too) is in the paged cache (``kv_layer``: the paged KV registered)."""
        where = self._layer_of.get(layer_name)
        if where is not None and self.stages_layers:
            self._saves.stage_layer(*where, meta)

    def wait_for_save(self, meta: KVStrataMetadata) -> None:
        """End of the step: finish the loads, then start storing the blocks to save
        (:meth:`Saves.wait_for_save`; none if a load failed)."""
        self._saves.wait_for_save(meta, loads_failed=self._loads.finish_step())

    def fence(self) -> None:
        """Before a forward (vLLM's ``handle_preemptions``): the copies out of vLLM's blocks that
        the last steps started have ended (:meth:`Saves.fence`)."""
        self._saves.fence()

    def skip_writes(self, media: frozenset[Medium]) -> None:
        """The scheduler's tiers to write nothing down to (a disk whose loads it declines), to
        every cache; told again only when they change."""
        if media != self._unwritten:
            self._unwritten = media
            for cache in self._caches:
                cache.manager.skip_writes(media)

    def probe(self, media: tuple[Medium, ...]) -> None:
        """Read one block of each tier in ``media`` (the scheduler's due probes) off the step
        (:meth:`Probes.probe`)."""
        self._probes.probe(media)

    def get_kv_connector_stats(self) -> KVStrataStats | None:
        """What the counters and caches say changed since the last call (every step; None: nothing)."""
        return self._report.connector_stats(lambda: self._caches)

    def hook(self, saving: bool = False) -> AbstractContextManager[None]:
        """Around a hook on vLLM's step thread: its CPU is the connector's (``saving``: a store's
        cost too), its time not the forward's."""
        return self._report.hook(saving)

    def cpu_s(self) -> float:
        """CPU seconds the connector used in this worker: its hooks, and its threads."""
        return self._report.cpu_s()

    def kv_cache_events(self) -> KVStrataKVEvents | None:
        """The tiers' changes since the last call, as vLLM's KV events (None: none, or not published)."""
        return self._events.take() if self._events is not None else None

    def build_connector_worker_meta(self) -> KVStrataWorkerMeta | None:
        """What this step measured, for the scheduler's decisions (:mod:`~kvstrata.integrations.vllm.feedback`)."""
        return self.clock.take()

    def shutdown(self) -> None:
        """Stop serving lookups, close the caches (waits for stores in flight), write the stats."""
        if self._server is not None:
            self._server.close()
            self._server = None
        self._loads.close()  # loads off the step still in flight: never reported now
        self._saves.drop_held()  # no verdict will come: never stored
        if self._groups:
            self._close_caches()
            self._report.close()
            self._groups.clear()

    def _close_caches(self) -> None:
        self._probes.close()  # a probe read in flight reads from the caches
        self._saves.close()  # the copies and puts in flight end first: they write into the caches
        for group in self._groups:
            for cache in group.caches:
                cache.close()  # waits for stores in flight
