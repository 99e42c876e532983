"""The connector vLLM loads: one class for both roles, delegating each hook to its role's half.

vLLM builds one connector per role: a scheduler-side one in the engine core, a worker-side one
in each worker (see :mod:`kvstrata.integrations.vllm.channel` for where they run). Like vLLM's own
connectors (``OffloadingConnector``, ``NixlConnector``), :class:`KVStrataConnector` builds
either a :class:`KVStrataConnectorScheduler` or a :class:`KVStrataConnectorWorker` and hands
each hook to it; the settings are parsed in both, so a bad extra config fails the start early.

It declares :class:`SupportsHMA`: vLLM keeps its hybrid KV cache manager on for a hybrid model
(one block table per KV cache group; without the declaration vLLM turns the manager off, and a
sliding-window model then keeps every token in its sliding layers) and hands every hook the
block ids of every group (:mod:`kvstrata.integrations.vllm.groups`).

Its counters go to vLLM's own ``/metrics`` through vLLM's connector-stats hooks
(:mod:`kvstrata.integrations.vllm.prom`), the tiers of each hit to vLLM's
``prompt_tokens_cached_by_source``, and what its tiers store and drop to vLLM's own KV event
publisher (``--kv-events-config``: :mod:`kvstrata.integrations.vllm.events`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorTransferResults,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstrata.integrations.vllm.events import KVStrataKVEvents, publishes
from kvstrata.integrations.vllm.feedback import KVStrataWorkerMeta
from kvstrata.integrations.vllm.groups import group_spans, rank_block_bytes
from kvstrata.integrations.vllm.metadata import KVStrataMetadata
from kvstrata.integrations.vllm.prom import KVStrataPromMetrics, KVStrataStats, stats_of
from kvstrata.integrations.vllm.scheduler import KVStrataConnectorScheduler
from kvstrata.integrations.vllm.settings import ConnectorSettings
from kvstrata.integrations.vllm.worker import KVStrataConnectorWorker
from kvstrata.media import Medium

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

_log = logging.getLogger("kvstrata.integrations.vllm")

# kvstrata's tiers as vLLM's cache-hit sources (vLLM's "device" is local HBM: kvstrata's device
# tier is; the shared pool is no peer instance, so not "p2p").
_SOURCES = {Medium.DEVICE: CacheHitSource.DEVICE, Medium.HOST: CacheHitSource.HOST, Medium.DISK: CacheHitSource.DISK,
            Medium.REMOTE: CacheHitSource.EXTERNAL_UNSPECIFIED}


class KVStrataConnector(KVConnectorBase_V1, SupportsHMA):
    """A vLLM V1 KV connector backed by kvstrata's TieredCache (see :mod:`kvstrata.integrations.vllm`).

    Attributes:
        settings: the parsed ``kv_connector_extra_config``.
        connector_scheduler: the scheduler-side half (role SCHEDULER), else None.
        connector_worker: the worker-side half (role WORKER), else None.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra(transfer.kv_connector_extra_config)
        self.connector_scheduler: KVStrataConnectorScheduler | None = None
        self.connector_worker: KVStrataConnectorWorker | None = None
        self._kv_events: list[KVCacheEvent] = []  # the workers' KV events, until vLLM's publisher takes them
        if role == KVConnectorRole.SCHEDULER:
            if (lost := self.settings.stop_loses_host(getattr(vllm_config, "shutdown_timeout", 0))) is not None:
                _log.warning("%s", lost)
            self.connector_scheduler = KVStrataConnectorScheduler(
                vllm_config.cache_config.block_size, transfer.engine_id,
                loads_enabled=transfer.is_kv_consumer, saves_enabled=transfer.is_kv_producer,
                spans=group_spans(kv_cache_config), horizon_blocks=kv_cache_config.num_blocks,
                judge_saves=self.settings.pool is None,  # a pool's blocks serve other servers too: unseen here
                # at any TP size: a load one rank gives up is recomputed on every rank (vLLM takes the
                # union of the ranks' invalid blocks, and fails an off-step load any rank failed), and
                # the step's saves wait for every rank's verdict (verdicts.py)
                load_budget=self.settings.load_budget,
                ranks=vllm_config.parallel_config.tensor_parallel_size,
                # no pool: the caches hold what this server stores, and what a disk kept (the workers say)
                own_blocks_only=self.settings.pool is None,
                held_blocks=self.settings.held_blocks(rank_block_bytes(kv_cache_config)),
                block_hashes=publishes(vllm_config, kv_cache_config),  # the workers' KV events name them
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = KVStrataConnectorWorker(
                vllm_config, kv_cache_config, self.settings, transfer.engine_id, saves_enabled=transfer.is_kv_producer
            )

    @property
    def _worker(self) -> KVStrataConnectorWorker:
        assert self.connector_worker is not None, "a worker-side hook called on the scheduler's connector"
        return self.connector_worker

    @property
    def _scheduler(self) -> KVStrataConnectorScheduler:
        assert self.connector_scheduler is not None, "a scheduler-side hook called on a worker's connector"
        return self.connector_scheduler

    def _metadata(self) -> KVStrataMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStrataMetadata)
        return meta

    # --- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    # A step with nothing to load or save costs the per-layer hooks one check each: no timing.

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward writes into any block (vLLM calls it first in every step): the last
        steps' saves are copied out of vLLM's blocks, so blocks freed since may be overwritten."""
        if self.connector_worker is not None:
            self.connector_worker.fence()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.connector_worker is not None and isinstance(connector_metadata, KVStrataMetadata):
            self.connector_worker.clock.begin(connector_metadata.scheduled_tokens)  # the forward starts
            self.connector_worker.skip_writes(connector_metadata.unwritten)
            if connector_metadata.probes:
                self.connector_worker.probe(connector_metadata.probes)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._metadata()
        if meta.loads or meta.async_loads:
            with self._worker.hook():
                self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._metadata().loads:
            with self._worker.hook():
                self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        meta = self._metadata()
        if meta.saves and self._worker.stages_layers:
            with self._worker.hook(saving=True):
                self._worker.save_kv_layer(layer_name, kv_layer, meta)

    def wait_for_save(self) -> None:
        worker, meta = self._worker, self._metadata()
        worker.clock.end()  # the forward is over
        if meta.loads or meta.saves or meta.verdicts:
            with worker.hook():
                worker.wait_for_save(meta)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.build_connector_worker_meta()

    def get_kv_connector_kv_cache_events(self) -> KVStrataKVEvents | None:
        """kvstrata's tiers' changes since the last step, as vLLM's KV events (TP rank 0's)."""
        return self._worker.kv_cache_events()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Loads off the step that ended (the failed ones too: vLLM recomputes their requests)."""
        worker = self._worker
        if not worker.receiving:
            return KVConnectorTransferResults()
        with worker.hook():
            finished, failed = worker.get_finished(finished_req_ids, idle=self._metadata().scheduled_tokens == 0)
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    # --- scheduler side ---------------------------------------------------------------------------

    # Each hook's CPU is counted (``counting_cpu``).

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        with self._scheduler.counting_cpu():
            return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        with self._scheduler.counting_cpu():
            self._scheduler.update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        with self._scheduler.counting_cpu():
            return self._scheduler.build_connector_meta(scheduler_output, self._kv_cache_manager)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVStrataWorkerMeta):
            with self._scheduler.counting_cpu():
                self._scheduler.measured(meta)
        if isinstance(events := connector_output.kv_cache_events, KVStrataKVEvents):
            self._kv_events.extend(events.get_all_events())

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The workers' events of kvstrata's tiers since the last call, for vLLM's KV event
        publisher (:mod:`~kvstrata.integrations.vllm.events`)."""
        events, self._kv_events = self._kv_events, []
        return events

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        sources: dict[CacheHitSource, int] = {}
        for medium, tokens in self._scheduler.hit_sources(request).items():
            sources[_SOURCES[medium]] = sources.get(_SOURCES[medium], 0) + tokens
        return sources

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request)

    # --- both -------------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVStrataStats | None:
        """What changed since the last call: the worker's loads, stores and tiers, the scheduler's lookups."""
        if self.connector_worker is not None:
            return self.connector_worker.get_kv_connector_stats()
        return self._scheduler.stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return stats_of(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVStrataPromMetrics:
        return KVStrataPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
