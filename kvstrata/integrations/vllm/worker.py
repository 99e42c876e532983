"""The worker side: the process's TieredCache, and every byte between it and vLLM's paged KV.

What is cached. Only full blocks of prompt tokens, keyed by kvstrata's chained block hashes in
a namespace of the model, vLLM's block size, the KV dtype, the TP rank and a layout named after
vLLM's device backend. A block is vLLM's per-layer block copied as opaque bytes (vLLM 0.32's
CPU backend keeps ``[kv_heads, block_size, 2 * head_dim]`` per layer and block; nothing here
depends on the order inside): kvstrata block ``[layers, 2, block_tokens, kv_heads, head_dim]``
holds, per layer, the flat elements of vLLM's block for that layer. The layout's sizes are
vLLM's own (its model config's KV heads per TP rank and head size), not a second reading of
the Hugging Face config: the block copied is vLLM's, and its element count is checked.

Loads. ``start_load_kv`` starts one kvstrata load per :class:`LoadSpec`; each layer's hook
waits for that layer and copies it into vLLM's blocks. A block that cannot be loaded (it left
kvstrata after the scheduler's lookup, the load failed or stopped early, a layer was never
copied) is reported through ``get_block_ids_with_load_errors``; vLLM recomputes it
(``kv_load_failure_policy="recompute"``) or fails the request, and never reads it as valid KV.

Saves. Each layer's hook, after the layer's attention, copies that layer of the blocks to save
into a staging tensor; ``wait_for_save`` takes any layer no hook ran for and stores the lot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvstrata.cache import TieredCache
from kvstrata.integrations.vllm.metadata import KVStrataMetadata, LoadSpec, SaveSpec
from kvstrata.integrations.vllm.rpc import LookupServer
from kvstrata.integrations.vllm.settings import ConnectorSettings
from kvstrata.integrations.vllm.stats import WorkerStats
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.tensors import kv_dtype, torch_dtype

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from kvstrata.cache import LoadHandle

# vLLM's KV dtype is the cache's (FP8 KV caches: not yet).
_VLLM_DTYPES = (DType.FP32, DType.BF16, DType.FP16)


@dataclass
class _ActiveLoad:
    spec: LoadSpec
    handle: LoadHandle
    layers_done: int = 0
    failed: bool = False


class KVStrataConnectorWorker:
    """The worker-side half of :class:`~kvstrata.integrations.vllm.KVStrataConnector`.

    Args:
        vllm_config: the engine's config (model, parallelism, block size).
        settings: the parsed extra config.
        engine_id: vLLM's engine id (names the lookup socket).
        saves_enabled: the role stores KV (``kv_both``, ``kv_producer``).
    """

    def __init__(self, vllm_config: VllmConfig, settings: ConnectorSettings, engine_id: str,
                 saves_enabled: bool) -> None:
        self._vllm_config = vllm_config
        self.settings = settings
        self._block_size = vllm_config.cache_config.block_size
        self._engine_id = engine_id
        self._saves_enabled = saves_enabled
        self._cache: TieredCache | None = None
        self._server: LookupServer | None = None
        self._layers: list[torch.Tensor] = []  # vLLM's paged KV per layer, [num_blocks, ...]
        self._layer_index: dict[str, int] = {}
        self._active: list[_ActiveLoad] = []
        self._staged: dict[str, tuple[torch.Tensor, list[bool]]] = {}  # req_id -> (kv, layers staged)
        self._failed_blocks: set[int] = set()
        self._stats = WorkerStats()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's paged KV (layer name -> tensor), open the cache, serve lookups (rank 0)."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        self._layers = [kv_caches[name] for name in names]
        self._layer_index = {name: i for i, name in enumerate(names)}
        first = self._layers[0]
        layout = self._layout(first)
        tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        model = self._vllm_config.model_config.model
        self._cache = TieredCache(self.settings.cache_config(layout, model, str(first.device), tp_rank, tp_size))
        self._stats.remote_error = self._cache.remote_error
        self._stats.block_bytes = layout.block_bytes
        self._stats.vllm_block_shape = list(first.shape[1:])
        if tp_rank == 0:  # the scheduler asks rank 0; every rank caches the same token blocks
            self._server = LookupServer(self._engine_id, self._cache)
        self._write_stats()

    def _layout(self, first: torch.Tensor) -> KVLayout:
        """kvstrata's opaque layout of vLLM's block (``first``: layer 0's paged KV)."""
        from vllm.platforms import current_platform

        model = self._vllm_config.model_config
        kv_heads = model.get_num_kv_heads(self._vllm_config.parallel_config)  # this TP rank's
        head_dim = model.get_head_size()
        per_block = first[0].numel()
        if per_block != 2 * self._block_size * kv_heads * head_dim or first.dtype not in map(torch_dtype, _VLLM_DTYPES):
            raise ValueError(
                f"KVStrataConnector: vLLM block of shape {tuple(first.shape[1:])} ({first.dtype}) is not "
                f"K and V of {self._block_size} tokens x {kv_heads} heads x {head_dim} (MLA, fp8: unsupported)"
            )
        return KVLayout(
            len(self._layers), self._block_size, kv_heads, head_dim, kv_dtype(first.dtype, _VLLM_DTYPES),
            name=f"vllm-{current_platform.device_type} opaque",
        )

    # --- loads ----------------------------------------------------------------------------------

    def start_load_kv(self, meta: KVStrataMetadata) -> None:
        """Start this step's loads (before the forward)."""
        for spec in meta.loads:
            match = self._cache.lookup(spec.tokens)
            if match.blocks <= spec.first_block:
                self._fail(spec.block_ids, "its blocks left kvstrata after the scheduler's lookup")
                continue
            # fewer blocks than granted: the tail is reported once the load's size is known
            self._active.append(_ActiveLoad(spec, self._cache.load(match)))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before layer ``layer_name``'s attention: copy that layer of every load into vLLM's blocks."""
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        for active in self._active:
            if not active.failed:
                self._copy_layer(active, layer)

    def _copy_layer(self, active: _ActiveLoad, layer: int) -> None:
        spec, handle = active.spec, active.handle
        try:
            handle.wait_layer(layer)
        except Exception as exc:  # noqa: BLE001 - the blocks are reported, vLLM recomputes them
            active.failed = True
            self._fail(spec.block_ids, f"load failed: {exc}")
            return
        loaded = min(handle.blocks, spec.first_block + len(spec.block_ids))
        if layer == 0 and loaded < spec.first_block + len(spec.block_ids):
            self._fail(spec.block_ids[max(0, loaded - spec.first_block) :], "the load stopped early")
        paged = self._layers[layer]
        for j in range(spec.first_block, loaded):
            dst = paged[spec.block_ids[j - spec.first_block]]
            dst.copy_(handle.block(j)[layer].view(dst.shape))
        active.layers_done += 1

    def _finish_loads(self) -> None:
        """End of the forward: release the loads, and report any whose layers were not all
        copied (their blocks were read as they were: vLLM must recompute them)."""
        for active in self._active:
            try:
                result = active.handle.wait()
            except Exception:  # noqa: BLE001 - reported in wait_for_layer_load
                result = None
            if not active.failed and active.layers_done < len(self._layers):
                self._fail(active.spec.block_ids, "not every layer was copied")
            elif result is not None and not active.failed:
                self._stats.loaded(len(active.spec.block_ids) * self._block_size, result)
            active.handle.release()
        self._active.clear()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM blocks whose load failed since the last call (vLLM recomputes them)."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def _fail(self, block_ids: list[int], why: str) -> None:
        self._failed_blocks.update(block_ids)
        self._stats.failed(len(block_ids), why)

    # --- saves ----------------------------------------------------------------------------------

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, meta: KVStrataMetadata) -> None:
        """Stage this layer of every block to save; called after the layer's attention, when
        its KV (the new tokens' too) is in the paged cache."""
        layer = self._layer_index.get(layer_name)
        if layer is None or not self._saves_enabled:
            return
        for spec in meta.saves:
            kv, staged = self._staging(spec)
            self._stage_layer(kv, layer, kv_layer, spec.block_ids)
            staged[layer] = True

    def wait_for_save(self, meta: KVStrataMetadata) -> None:
        """End of the step: finish the loads, store the staged blocks (waiting with ``sync_save``)."""
        self._finish_loads()
        futures = []
        for spec in meta.saves if self._saves_enabled else ():
            kv, staged = self._staging(spec)
            for layer, done in enumerate(staged):
                if not done:  # no per-layer hook ran for it: take it now (the forward is over)
                    self._stage_layer(kv, layer, self._layers[layer], spec.block_ids)
            futures.append((self._cache.store(spec.tokens, kv), time.perf_counter()))
        self._staged.clear()
        for future, start in futures:
            if self.settings.sync_save:
                self._stats.stored(future.result(), time.perf_counter() - start)
            else:
                future.add_done_callback(lambda f, t=start: self._stats.stored(f.result(), time.perf_counter() - t))
        if meta.loads or meta.saves:
            self._write_stats()

    def _staging(self, spec: SaveSpec) -> tuple[torch.Tensor, list[bool]]:
        staged = self._staged.get(spec.req_id)
        if staged is None:
            layout = self._cache.layout
            tokens = len(spec.block_ids) * self._block_size
            # kv: [layers, 2, tokens, kv_heads, head_dim], the shape TieredCache.store takes
            kv = torch.empty((layout.num_layers, 2, tokens, layout.kv_heads, layout.head_dim), dtype=self._layers[0].dtype)
            staged = self._staged[spec.req_id] = (kv, [False] * layout.num_layers)
        return staged

    def _stage_layer(self, kv: torch.Tensor, layer: int, paged: torch.Tensor, block_ids: list[int]) -> None:
        layout = self._cache.layout
        n = len(block_ids)
        blocks = paged[torch.tensor(block_ids, device=paged.device)]  # [n, *vLLM block], a copy
        # vLLM's block j of this layer, as flat elements, becomes kv[layer, :, j*bs:(j+1)*bs]
        src = blocks.reshape(n, 2, layout.block_tokens, layout.kv_heads, layout.head_dim).transpose(0, 1)
        kv[layer].view(2, n, layout.block_tokens, layout.kv_heads, layout.head_dim).copy_(src)

    # --- lifetime -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop serving lookups, close the cache (waits for stores in flight), write the stats."""
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._cache is not None:
            self._cache.close()  # waits for stores in flight
            self._write_stats()
            self._cache = None

    def _write_stats(self) -> None:
        if self.settings.stats_path:
            self._stats.write(self.settings.stats_path, self._cache)
