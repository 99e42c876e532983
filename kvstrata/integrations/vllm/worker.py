"""The worker side: the process's TieredCaches, and every byte between them and vLLM's paged KV.

What is cached. Only full blocks of prompt tokens, per KV cache group
(:mod:`kvstrata.integrations.vllm.groups`): each group has a TieredCache of its own, its blocks
keyed by kvstrata's chained block hashes in a namespace of the model, vLLM's block size, the KV
dtype, the TP rank, a layout named after vLLM's device backend and the group (a one-group
model's namespace is what it was before groups). A group's block is vLLM's per-layer block of
that group's layers copied as opaque bytes (vLLM 0.32's CPU backend keeps
``[kv_heads, block_size, 2 * head_dim]`` per layer and block; nothing here depends on the order
inside): kvstrata block ``[layers, 2, block_tokens, kv_heads, head_dim]`` holds, per layer of
the group, the flat elements of vLLM's block for that layer. The sizes are vLLM's own (the
group's KV cache spec: this TP rank's KV heads, its head size), and the element count is checked.

Loads. ``start_load_kv`` starts, per :class:`LoadSpec`, one kvstrata load per group that has
blocks to fill, of exactly those blocks (a sliding group: its window; blocks vLLM found in its
own prefix cache: none); each layer's hook waits for that layer and copies it into vLLM's blocks.
A load that cannot be served whole in every group (its blocks left kvstrata after the
scheduler's lookup, a load failed or stopped early, a layer was never copied) has every block
it writes reported through ``get_block_ids_with_load_errors``; vLLM recomputes them
(``kv_load_failure_policy="recompute"``) or fails the request, and never reads them as valid KV.

Saves. Each layer's hook, after the layer's attention, copies that layer of the blocks to save
into its group's staging tensor; ``wait_for_save`` takes any layer no hook ran for and stores
each group's blocks in its cache under their keys (a windowed group's run starts at its window:
:mod:`kvstrata.integrations.vllm.scheduler`). The scheduler's lookups are answered here, by
:func:`kvstrata.cache.grouped.longest_hit` over the groups' caches.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING

import torch

from kvstrata.cache import TieredCache
from kvstrata.cache.grouped import longest_hit
from kvstrata.integrations.vllm.groups import VLLMGroup, vllm_groups
from kvstrata.integrations.vllm.metadata import KVStrataMetadata, LoadSpec, SaveSpec
from kvstrata.integrations.vllm.rpc import LookupServer
from kvstrata.integrations.vllm.settings import ConnectorSettings
from kvstrata.integrations.vllm.stats import GroupStats, WorkerStats
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout

if TYPE_CHECKING:
    from concurrent.futures import Future

    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvstrata.cache import LoadHandle, StoreResult

# vLLM's KV dtype is the cache's (FP8 KV caches: not yet).
_VLLM_DTYPES = (DType.FP32, DType.BF16, DType.FP16)


@dataclass
class _Group:
    """One KV cache group on this worker: vLLM's layers of it and kvstrata's cache of it."""

    spec: VLLMGroup
    cache: TieredCache
    layers: list[torch.Tensor]  # vLLM's paged KV per layer of the group, [num_blocks, *block]


@dataclass
class _ActiveLoad:
    spec: LoadSpec
    handles: list[LoadHandle | None]  # per group; None: the group fills no blocks
    layers_done: list[int]  # per group, layers copied
    failed: bool = False


@dataclass
class _PendingSave:
    """One SaveSpec's stores, one per group, recorded together when the last is done."""

    stats: WorkerStats
    start: float
    remaining: int
    results: list[tuple[int, StoreResult]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def done(self, group: int, future: Future) -> None:
        with self.lock:
            self.results.append((group, future.result()))
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            self.stats.stored(self.results, time.perf_counter() - self.start)


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
        self._groups: list[_Group] = []
        self._server: LookupServer | None = None
        self._layer_of: dict[str, tuple[int, int]] = {}  # layer name -> (group, layer within the group)
        self._active: list[_ActiveLoad] = []
        self._staged: dict[tuple[str, int], tuple[torch.Tensor, list[bool]]] = {}  # (req, group) -> kv, staged
        self._failed_blocks: set[int] = set()
        self._stats = WorkerStats()

    @property
    def _caches(self) -> tuple[TieredCache, ...]:
        return tuple(g.cache for g in self._groups)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's paged KV (layer name -> tensor), open a cache per group, serve lookups (rank 0)."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        model = self._vllm_config.model_config.model
        paged = []
        for spec in self._group_specs:
            missing = [n for n in spec.layer_names if n not in kv_caches]
            if missing:
                raise ValueError(f"KVStrataConnector: vLLM registered no KV cache for layer {missing[0]} "
                                 f"of KV cache group {spec.index}")
            paged.append([kv_caches[n] for n in spec.layer_names])
        layouts = [self._layout(spec, layers) for spec, layers in zip(self._group_specs, paged)]
        total = sum(layout.block_bytes for layout in layouts)
        try:
            for spec, layers, layout in zip(self._group_specs, paged, layouts):
                config = self.settings.cache_config(layout, model, str(layers[0].device), tp_rank, tp_size,
                                                    kv_group=spec.namespace, share=Fraction(layout.block_bytes, total))
                self._groups.append(_Group(spec, TieredCache(config), layers))
        except BaseException:
            self._close_caches()
            self._groups = []
            raise
        self._layer_of = {name: (g, i) for g, group in enumerate(self._groups)
                          for i, name in enumerate(group.spec.layer_names)}
        errors = [c.remote_error for c in self._caches if c.remote_error is not None]
        self._stats.remote_error = errors[0] if errors else None
        self._stats.block_bytes = total
        self._stats.vllm_block_shape = list(paged[0][0].shape[1:])
        self._stats.groups = [GroupStats(g.spec.namespace, g.spec.kind.value, g.spec.group.span, g.spec.group.num_layers,
                                         g.cache.layout.block_bytes) for g in self._groups]
        if tp_rank == 0:  # the scheduler asks rank 0; every rank caches the same token blocks
            self._server = LookupServer(self._engine_id, self.hit_blocks)
        self._write_stats()

    def hit_blocks(self, tokens: list[int]) -> int:
        """Blocks of ``tokens`` every group's cache serves: the scheduler's lookup (full blocks)."""
        groups = {str(g.spec.index): g.spec.group for g in self._groups}
        caches = {str(g.spec.index): g.cache for g in self._groups}
        keys = {str(g.spec.index): g.cache.keys(tokens) for g in self._groups}
        return longest_hit(groups, caches, keys, self._block_size).blocks

    def _layout(self, spec: VLLMGroup, layers: list[torch.Tensor]) -> KVLayout:
        """kvstrata's opaque layout of one group's vLLM block (``layers``: its paged KV)."""
        from vllm.platforms import current_platform

        first, group = layers[0], spec.group
        per_block = first[0].numel()
        if per_block != 2 * self._block_size * group.kv_heads * group.head_dim:
            raise ValueError(
                f"KVStrataConnector: vLLM block of shape {tuple(first.shape[1:])} ({first.dtype}) in KV cache group "
                f"{spec.index} is not K and V of {self._block_size} tokens x {group.kv_heads} heads x {group.head_dim}"
            )
        return KVLayout(group.num_layers, self._block_size, group.kv_heads, group.head_dim, group.dtype,
                        name=f"vllm-{current_platform.device_type} opaque")

    # --- loads ----------------------------------------------------------------------------------

    def start_load_kv(self, meta: KVStrataMetadata) -> None:
        """Start this step's loads (before the forward): per spec, one per group with blocks to fill."""
        for spec in meta.loads:
            active = _ActiveLoad(spec, [], [0] * len(self._groups))
            self._active.append(active)
            for group, blocks in zip(self._groups, spec.groups):
                if not blocks.block_ids:
                    active.handles.append(None)
                    continue
                # only the blocks vLLM asks for: not those before a window, nor its own prefix hit
                keys = group.cache.keys(spec.tokens)[blocks.first_block : blocks.end_block]
                part = group.cache.match(keys)
                if part.blocks < len(keys):
                    self._fail_load(active, f"group {group.spec.index}'s blocks left kvstrata after the "
                                    "scheduler's lookup")
                    break
                active.handles.append(group.cache.load(part))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before layer ``layer_name``'s attention: copy that layer of every load into vLLM's blocks."""
        where = self._layer_of.get(layer_name)
        if where is None:
            return
        for active in self._active:
            if not active.failed:
                self._copy_layer(active, *where)

    def _copy_layer(self, active: _ActiveLoad, group: int, layer: int) -> None:
        handle = active.handles[group] if group < len(active.handles) else None
        if handle is None:
            return
        block_ids = active.spec.groups[group].block_ids
        try:
            handle.wait_layer(layer)
        except Exception as exc:  # noqa: BLE001 - the blocks are reported, vLLM recomputes them
            self._fail_load(active, f"load failed: {exc}")
            return
        if handle.blocks < len(block_ids):
            self._fail_load(active, "the load stopped early")
            return
        paged = self._groups[group].layers[layer]
        for j, block_id in enumerate(block_ids):
            dst = paged[block_id]
            dst.copy_(handle.block(j)[layer].view(dst.shape))
        active.layers_done[group] += 1

    def _finish_loads(self) -> None:
        """End of the forward: release the loads, and report any whose layers were not all
        copied (their blocks were read as they were: vLLM must recompute them)."""
        for active in self._active:
            results = []
            for g, handle in enumerate(active.handles):
                if handle is None:
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
        self._active.clear()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM blocks whose load failed since the last call (vLLM recomputes them)."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def _fail_load(self, active: _ActiveLoad, why: str) -> None:
        """Every block the load writes, in every group, is reported: its KV is not all there."""
        active.failed = True
        block_ids = active.spec.block_ids
        self._failed_blocks.update(block_ids)
        self._stats.failed(len(block_ids), why)

    # --- saves ----------------------------------------------------------------------------------

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, meta: KVStrataMetadata) -> None:
        """Stage this layer of every block to save; called after the layer's attention, when
        its KV (the new tokens' too) is in the paged cache."""
        where = self._layer_of.get(layer_name)
        if where is None or not self._saves_enabled:
            return
        group, layer = where
        for spec in meta.saves:
            block_ids = spec.groups[group].block_ids
            if block_ids:
                kv, staged = self._staging(spec, group)
                self._stage_layer(kv, layer, kv_layer, block_ids)
                staged[layer] = True

    def wait_for_save(self, meta: KVStrataMetadata) -> None:
        """End of the step: finish the loads, store the staged blocks (waiting with ``sync_save``)."""
        self._finish_loads()
        pending = []
        for spec in meta.saves if self._saves_enabled else ():
            futures = []
            start = time.perf_counter()
            for g, group in enumerate(self._groups):
                block_ids = spec.groups[g].block_ids
                if not block_ids:
                    continue
                kv, staged = self._staging(spec, g)
                for layer, done in enumerate(staged):
                    if not done:  # no per-layer hook ran for it: take it now (the forward is over)
                        self._stage_layer(kv, layer, group.layers[layer], block_ids)
                first = spec.groups[g].first_block
                keys = group.cache.keys(spec.tokens)[first : first + len(block_ids)]
                futures.append((g, group.cache.store_keys(keys, kv)))
            if futures:
                pending.append((_PendingSave(self._stats, start, len(futures)), futures))
        self._staged.clear()
        for save, futures in pending:
            for g, future in futures:
                if self.settings.sync_save:
                    future.result()
                    save.done(g, future)
                else:
                    future.add_done_callback(lambda f, s=save, g=g: s.done(g, f))
        if meta.loads or meta.saves:
            self._write_stats()

    def _staging(self, spec: SaveSpec, group: int) -> tuple[torch.Tensor, list[bool]]:
        staged = self._staged.get((spec.req_id, group))
        if staged is None:
            layout = self._groups[group].cache.layout
            tokens = len(spec.groups[group].block_ids) * self._block_size
            # kv: [layers, 2, tokens, kv_heads, head_dim], the shape TieredCache.store takes
            kv = torch.empty((layout.num_layers, 2, tokens, layout.kv_heads, layout.head_dim),
                             dtype=self._groups[group].layers[0].dtype)
            staged = self._staged[(spec.req_id, group)] = (kv, [False] * layout.num_layers)
        return staged

    def _stage_layer(self, kv: torch.Tensor, layer: int, paged: torch.Tensor, block_ids: list[int]) -> None:
        _, _, _, kv_heads, head_dim = kv.shape
        n = len(block_ids)
        blocks = paged[torch.tensor(block_ids, device=paged.device)]  # [n, *vLLM block], a copy
        # vLLM's block j of this layer, as flat elements, becomes kv[layer, :, j*bs:(j+1)*bs]
        src = blocks.reshape(n, 2, self._block_size, kv_heads, head_dim).transpose(0, 1)
        kv[layer].view(2, n, self._block_size, kv_heads, head_dim).copy_(src)

    # --- lifetime -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop serving lookups, close the caches (waits for stores in flight), write the stats."""
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._groups:
            self._close_caches()
            self._write_stats()
            self._groups = []

    def _close_caches(self) -> None:
        for group in self._groups:
            group.cache.close()  # waits for stores in flight

    def _write_stats(self) -> None:
        if self.settings.stats_path:
            self._stats.write(self.settings.stats_path, self._caches)
