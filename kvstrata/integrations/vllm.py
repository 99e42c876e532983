"""A vLLM V1 KV connector backed by kvstrata's TieredCache.

Load it with::

    kv_transfer_config={
        "kv_connector": "KVStrataConnector",
        "kv_connector_module_path": "kvstrata.integrations.vllm",
        "kv_role": "kv_both",  # or kv_producer (prefill) / kv_consumer (decode)
        "kv_load_failure_policy": "recompute",  # a block that fails to load is recomputed
        "kv_connector_extra_config": {"host_bytes": 1 << 30, "disk_dir": "...", "disk_bytes": 8 << 30},
    }

Roles and processes. vLLM builds a scheduler-side connector (in the engine core) and a
worker-side one (in each worker). On CPU vLLM always runs the worker in its own process (the
platform turns the uniprocess executor into the multiprocess one; only
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps them together), on a GPU with TP=1 they share the
engine core process. The worker owns the one TieredCache of its process: it moves every byte.
The scheduler asks it how long a prompt's cached prefix is: directly when both live in one
process (the per-process registry below), else over a Unix socket the worker serves.

What is cached. Only full blocks of prompt tokens, keyed by kvstrata's chained block hashes in
a namespace of the model, vLLM's block size, the KV dtype, the TP rank and a layout named after
vLLM's device backend. A block is vLLM's per-layer block copied as opaque bytes (vLLM 0.32's
CPU backend keeps ``[kv_heads, block_size, 2 * head_dim]`` per layer and block; nothing here
depends on the order inside): kvstrata block ``[layers, 2, block_tokens, kv_heads, head_dim]`` holds, per
layer, the flat elements of vLLM's block for that layer. A hit never reaches the prompt's last
token (vLLM must compute at least one). A block that cannot be loaded is reported through
``get_block_ids_with_load_errors``; vLLM recomputes it (``kv_load_failure_policy="recompute"``)
or fails the request, and never reads it as valid KV.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path
from collections import Counter
from dataclasses import dataclass, field, fields
from multiprocessing.connection import Client, Listener
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstrata.cache import CacheConfig, TieredCache
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.media import route_text
from kvstrata.pool.config import PoolConfig, RemoteMode, load_pool_config, pool_from_env
from kvstrata.tensors import kv_dtype, torch_dtype

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

MiB = 1024**2
# vLLM's KV dtype is the cache's (FP8 KV caches: not yet).
_VLLM_DTYPES = (DType.FP32, DType.BF16, DType.FP16)
_LOOKUP_WAIT_S = 10.0  # how long the scheduler waits for its worker's lookup socket to appear


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config``: which tiers the cache has. Capacities in bytes.

    Attributes:
        device_bytes: kvstrata's device tier (where loads land before the copy into vLLM's
            paged blocks).
        host_bytes: host DRAM tier, per process.
        disk_dir, disk_bytes: a disk tier (one process per directory; it is locked).
        pool: a pool config file (TOML, or an embedded pool's pool.json), or "env" for
            ``$KVSTRATA_POOL``; None: no remote tier.
        remote_bytes: how much of the pool this instance tracks.
        remote_mode: "tcp" or "shm".
        model_id: namespace of the blocks; None: vLLM's model name or path.
        stats_path: a JSON file the worker rewrites with its load/store counters.
        sync_save: wait in ``wait_for_save`` until a step's blocks are stored (and written
            down the tiers), so a finished request's KV is in kvstrata when its output is out.
    """

    device_bytes: int = 64 * MiB
    host_bytes: int = 512 * MiB
    disk_dir: str | None = None
    disk_bytes: int = 0
    pool: str | None = None
    remote_bytes: int = 256 * MiB
    remote_mode: str = "tcp"
    model_id: str | None = None
    stats_path: str | None = None
    sync_save: bool = True

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "ConnectorSettings":
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = set(extra) - known
        if unknown:
            raise ValueError(f"KVStrataConnector: unknown extra config {sorted(unknown)}; known: {sorted(known)}")
        return cls(**extra)

    def __post_init__(self) -> None:
        modes = [m.value for m in RemoteMode]
        if self.remote_mode not in modes:
            raise ValueError(f"KVStrataConnector: remote_mode must be one of {modes}, got {self.remote_mode!r}")

    def pool_config(self) -> PoolConfig | None:
        if self.pool is None:
            return None
        if self.pool == "env":
            config = pool_from_env()
            if config is None:
                raise ValueError("KVStrataConnector: pool='env' but $KVSTRATA_POOL is not set")
            return config
        return load_pool_config(self.pool)


# --- scheduler -> worker metadata ---------------------------------------------------------


@dataclass
class LoadSpec:
    """Load kvstrata's blocks ``first_block ..`` of ``tokens`` into vLLM blocks ``block_ids``."""

    req_id: str
    tokens: list[int]  # the prefix up to the end of the hit (full blocks)
    first_block: int  # blocks before it are vLLM's own prefix-cache hit
    block_ids: list[int]


@dataclass
class SaveSpec:
    """Store the full blocks of ``tokens``, held in vLLM blocks ``block_ids`` (one per block)."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]


@dataclass
class KVStrataMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


# --- one cache per process ----------------------------------------------------------------

_REGISTRY: dict[str, TieredCache] = {}  # engine_id -> the worker's cache (TP rank 0) in this process
_REGISTRY_LOCK = threading.Lock()


def _socket_path(engine_id: str) -> str:
    directory = os.path.join(tempfile.gettempdir(), f"kvstrata-{os.getuid()}")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    return os.path.join(directory, f"{engine_id}.sock")


class _LookupServer:
    """Answers the scheduler's prefix lookups from the worker's cache: tokens -> hit tokens."""

    def __init__(self, cache: TieredCache, path: str, authkey: bytes) -> None:
        self._cache = cache
        if os.path.exists(path):
            os.unlink(path)
        self._listener = Listener(path, family="AF_UNIX", authkey=authkey)
        self._path = path
        threading.Thread(target=self._accept, name="kvstrata-lookup", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError):
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="kvstrata-lookup-conn", daemon=True).start()

    def _serve(self, conn: Any) -> None:
        with conn:
            while True:
                try:
                    tokens = conn.recv()
                except (EOFError, OSError):
                    return
                conn.send(self._cache.lookup(tokens).tokens)

    def close(self) -> None:
        self._listener.close()
        if os.path.exists(self._path):
            os.unlink(self._path)


class _LookupClient:
    def __init__(self, path: str, authkey: bytes) -> None:
        self._path, self._authkey = path, authkey
        self._conn: Any = None
        self._lock = threading.Lock()

    def lookup(self, tokens: list[int]) -> int:
        with self._lock:
            if self._conn is None:
                deadline = time.monotonic() + _LOOKUP_WAIT_S
                while not os.path.exists(self._path):
                    if time.monotonic() > deadline:
                        return 0  # no worker cache to ask: a miss, never a guess
                    time.sleep(0.05)
                self._conn = Client(self._path, family="AF_UNIX", authkey=self._authkey)
            self._conn.send(tokens)
            return self._conn.recv()

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


# --- the connector --------------------------------------------------------------------------


class KVStrataConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra(transfer.kv_connector_extra_config)
        self._block_size = vllm_config.cache_config.block_size
        self._engine_id = transfer.engine_id
        self._authkey = f"kvstrata:{self._engine_id}".encode()
        self._loads_enabled = transfer.is_kv_consumer
        self._saves_enabled = transfer.is_kv_producer
        # scheduler side
        self._client: _LookupClient | None = None
        self._requests: dict[str, "Request"] = {}
        self._to_load: dict[str, int] = {}  # req_id -> external tokens granted this step
        self._saved_blocks: dict[str, int] = {}  # req_id -> prompt blocks already sent to save
        # worker side
        self._cache: TieredCache | None = None
        self._server: _LookupServer | None = None
        self._layers: list[torch.Tensor] = []  # vLLM's paged KV per layer, [num_blocks, ...]
        self._layer_index: dict[str, int] = {}
        self._active: list[_ActiveLoad] = []
        self._staged: dict[str, tuple[torch.Tensor, list[bool]]] = {}  # req_id -> (kv, layers staged)
        self._failed_blocks: set[int] = set()
        self._stats = _Stats()

    # ==== worker side =========================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        from vllm.model_executor.models.utils import extract_layer_index
        from vllm.platforms import current_platform

        names = sorted(kv_caches, key=extract_layer_index)
        self._layers = [kv_caches[name] for name in names]
        self._layer_index = {name: i for i, name in enumerate(names)}
        first = self._layers[0]
        model = self._vllm_config.model_config
        kv_heads = model.get_num_kv_heads(self._vllm_config.parallel_config)
        head_dim = model.get_head_size()
        per_block = first[0].numel()
        if per_block != 2 * self._block_size * kv_heads * head_dim or first.dtype not in map(torch_dtype, _VLLM_DTYPES):
            raise ValueError(
                f"KVStrataConnector: vLLM block of shape {tuple(first.shape[1:])} ({first.dtype}) is not "
                f"K and V of {self._block_size} tokens x {kv_heads} heads x {head_dim} (MLA, fp8: unsupported)"
            )
        layout = KVLayout(
            len(self._layers), self._block_size, kv_heads, head_dim, kv_dtype(first.dtype, _VLLM_DTYPES),
            name=f"vllm-{current_platform.device_type} opaque",
        )
        tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        s = self.settings
        config = CacheConfig(
            layout=layout,
            model_id=s.model_id or model.model,
            device_bytes=s.device_bytes,
            host_bytes=s.host_bytes,
            disk_bytes=s.disk_bytes,
            disk_dir=Path(s.disk_dir) if s.disk_dir else None,
            device=str(first.device),
            pool=s.pool_config(),
            remote_bytes=s.remote_bytes,
            remote_mode=RemoteMode(s.remote_mode),
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self._cache = TieredCache(config)
        self._stats.remote_error = self._cache.remote_error
        self._stats.block_bytes = layout.block_bytes
        self._stats.vllm_block_shape = list(first.shape[1:])
        if tp_rank == 0:  # the scheduler asks rank 0; every rank caches the same token blocks
            with _REGISTRY_LOCK:
                _REGISTRY[self._engine_id] = self._cache
            self._server = _LookupServer(self._cache, _socket_path(self._engine_id), self._authkey)
        self._write_stats()

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStrataMetadata)
        for spec in meta.loads:
            match = self._cache.lookup(spec.tokens)
            if match.blocks <= spec.first_block:
                self._fail(spec.block_ids, "its blocks left kvstrata after the scheduler's lookup")
                continue
            # fewer blocks than granted: the tail is reported once the load's size is known
            self._active.append(_ActiveLoad(spec, self._cache.load(match)))

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        paged = self._layers[layer]
        for active in self._active:
            if active.failed:
                continue
            spec, handle = active.spec, active.handle
            try:
                handle.wait_layer(layer)
            except Exception as exc:  # noqa: BLE001 - the blocks are reported, vLLM recomputes them
                active.failed = True
                self._fail(spec.block_ids, f"load failed: {exc}")
                continue
            loaded = min(handle.blocks, spec.first_block + len(spec.block_ids))
            if layer == 0 and loaded < spec.first_block + len(spec.block_ids):
                self._fail(spec.block_ids[max(0, loaded - spec.first_block) :], "the load stopped early")
            for j in range(spec.first_block, loaded):
                dst = paged[spec.block_ids[j - spec.first_block]]
                dst.copy_(handle.block(j)[layer].view(dst.shape))
            active.layers_done += 1

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata", **kwargs: Any
    ) -> None:
        """Stage this layer of every block to save; called after the layer's attention, when
        its KV (the new tokens' too) is in the paged cache."""
        layer = self._layer_index.get(layer_name)
        if layer is None or not self._saves_enabled:
            return
        meta = self._get_connector_metadata()
        for spec in meta.saves:
            kv, staged = self._staging(spec)
            self._stage_layer(kv, layer, kv_layer, spec.block_ids)
            staged[layer] = True

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStrataMetadata)
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

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._cache is not None:
            with _REGISTRY_LOCK:
                if _REGISTRY.get(self._engine_id) is self._cache:
                    del _REGISTRY[self._engine_id]
            self._cache.close()  # waits for stores in flight
            self._write_stats()
            self._cache = None

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
                self._stats.loaded(active.spec, result, self._block_size)
            active.handle.release()
        self._active.clear()

    def _fail(self, block_ids: list[int], why: str) -> None:
        self._failed_blocks.update(block_ids)
        self._stats.failed_blocks += len(block_ids)
        self._stats.last_failure = why

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

    def _write_stats(self) -> None:
        if self.settings.stats_path:
            tmp = f"{self.settings.stats_path}.tmp"
            with open(tmp, "w") as f:
                json.dump(self._stats.to_json(self._cache), f, indent=1)
            os.replace(tmp, self.settings.stats_path)

    # ==== scheduler side ======================================================================

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        if not self._loads_enabled:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        # vLLM computes at least the last prompt token itself: look up full blocks before it.
        usable = (len(prompt) - 1) // self._block_size * self._block_size
        if usable <= num_computed_tokens:
            return 0, False
        hit = self._lookup(prompt[:usable])
        return max(0, hit - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self._requests[request.request_id] = request
        if num_external_tokens > 0:
            self._to_load[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KVStrataMetadata()
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        bs = self._block_size
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
            prompt = list(request.prompt_token_ids or [])
            external = self._to_load.pop(req_id, 0)
            if external:
                # num_computed_tokens already counts the hit: local blocks, then external ones
                end = computed[req_id]
                first = (end - external) // bs
                meta.loads.append(LoadSpec(req_id, prompt[:end], first, block_ids[first : end // bs]))
            if self._saves_enabled:
                full = min(computed[req_id] + scheduled, len(prompt)) // bs
                if full > self._saved_blocks.get(req_id, 0):
                    meta.saves.append(SaveSpec(req_id, prompt[: full * bs], block_ids[:full]))
                    self._saved_blocks[req_id] = full
        self._to_load.clear()  # a grant for a request not scheduled after all: asked again next time
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves are copied out of vLLM's blocks within the step that computed them: nothing
        # here holds the blocks, so vLLM may free them now.
        self._requests.pop(request.request_id, None)
        self._saved_blocks.pop(request.request_id, None)
        self._to_load.pop(request.request_id, None)
        return False, None

    def _lookup(self, tokens: list[int]) -> int:
        with _REGISTRY_LOCK:
            cache = _REGISTRY.get(self._engine_id)
        if cache is not None:  # the worker lives in this process
            return cache.lookup(tokens).tokens
        if self._client is None:
            self._client = _LookupClient(_socket_path(self._engine_id), self._authkey)
        return self._client.lookup(tokens)


@dataclass
class _ActiveLoad:
    spec: LoadSpec
    handle: Any  # kvstrata.cache.LoadHandle
    layers_done: int = 0
    failed: bool = False


@dataclass
class _Stats:
    """The worker's counters, written to ``stats_path`` as JSON."""

    block_bytes: int = 0
    vllm_block_shape: list[int] = field(default_factory=list)  # one layer's block in vLLM's cache
    load_requests: int = 0
    loaded_tokens: int = 0  # tokens copied into vLLM's blocks from kvstrata
    restored_bytes: int = 0  # bytes kvstrata brought to its device tier (not already there)
    load_seconds: float = 0.0  # kvstrata's own load time (to its device tier), summed
    load_paths: Counter = field(default_factory=Counter)
    store_requests: int = 0
    stored_blocks: int = 0  # full blocks offered to the cache
    new_blocks: int = 0  # blocks the cache did not hold yet
    store_seconds: float = 0.0  # copy out of vLLM + store + write-down, summed
    failed_blocks: int = 0
    last_failure: str | None = None
    remote_error: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def loaded(self, spec: LoadSpec, result: Any, block_size: int) -> None:
        with self._lock:
            self.load_requests += 1
            self.loaded_tokens += len(spec.block_ids) * block_size
            self.restored_bytes += result.restored_bytes
            self.load_seconds += result.seconds
            self.load_paths.update(result.paths)

    def stored(self, result: Any, seconds: float) -> None:
        with self._lock:
            self.store_requests += 1
            self.stored_blocks += result.blocks
            self.new_blocks += result.new_blocks
            self.store_seconds += seconds

    def to_json(self, cache: TieredCache | None) -> dict[str, Any]:
        with self._lock:
            data = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
            data["load_paths"] = {route_text(r): n for r, n in self.load_paths.items()}
        data["stored_bytes"] = data["new_blocks"] * self.block_bytes
        if cache is not None:
            data["media"] = [m.label for m in cache.media]
        return data
