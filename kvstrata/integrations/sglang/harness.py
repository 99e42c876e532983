"""SGLang's own host pools, storage factory and controller on a CPU: for tests and benchmarks.

Not on the serving path (SGLang builds all of this itself). Here a benchmark or a test builds,
from SGLang's real classes (sglang 0.5.23): a host KV pool of a model's shape
(:func:`host_pool`, on a CPU device pool), a storage config (:func:`storage_config`), a backend
through SGLang's factory (:func:`create_backend`: kvstrata through the dynamic loader, or a
built-in such as ``"file"``), and :class:`Controller`, which runs ``HiCacheController``'s own
backup and prefetch methods (``_page_backup``, ``_page_transfer`` and the page functions they
call) on an object holding just the attributes they read, so pages go through the backend
exactly as SGLang sends them. Those methods are SGLang's private API: pin SGLang's version.
"""

from __future__ import annotations

import hashlib
import queue
import types
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.integrations.sglang import define_torchvision_ops

define_torchvision_ops()

from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation, StorageOperation  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

from kvstrata.integrations.sglang.settings import KEY_PREFIX  # noqa: E402
from kvstrata.kv.layout import KVLayout  # noqa: E402
from kvstrata.tensors import torch_dtype  # noqa: E402

MODULE_PATH = "kvstrata.integrations.sglang"
CLASS_NAME = "KVStrataHiCacheStorage"
_CONTROLLER_METHODS = ("_generic_page_get", "_generic_page_set", "_page_get_zero_copy", "_page_set_zero_copy",
                       "_page_transfer_kv_batch", "_page_transfer", "_page_backup")


@dataclass(frozen=True)
class HostShape:
    """A model's KV on one rank as SGLang's host pool holds it: MHA (``heads`` KV heads of
    ``head_dim``) or MLA (a latent of ``kv_lora_rank + qk_rope_head_dim``)."""

    layers: int
    page_size: int
    heads: int = 0
    head_dim: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if (self.kv_lora_rank > 0) == (self.heads > 0 and self.head_dim > 0):
            raise ValueError(f"a host shape is MHA (heads, head_dim) or MLA (kv_lora_rank, qk_rope_head_dim), "
                             f"got {self}")

    @classmethod
    def mha(cls, layers: int, heads: int, head_dim: int, page_size: int,
            dtype: torch.dtype = torch.bfloat16) -> HostShape:
        return cls(layers, page_size, heads=heads, head_dim=head_dim, dtype=dtype)

    @classmethod
    def mla(cls, layers: int, kv_lora_rank: int, qk_rope_head_dim: int, page_size: int,
            dtype: torch.dtype = torch.bfloat16) -> HostShape:
        return cls(layers, page_size, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim, dtype=dtype)

    @classmethod
    def from_layout(cls, layout: KVLayout) -> HostShape:
        """The host pool of kvstrata blocks of ``layout`` (one page a block), e.g. a preset's:
        ``HostShape.from_layout(KVLayout.from_geometry(load_geometry("qwen2.5-7b"), 64, tp=1))``.
        An MLA latent's split into ``kv_lora_rank`` and rope dims (64, DeepSeek's) changes no
        byte of a page."""
        dtype = torch_dtype(layout.dtype)
        if layout.kv_tensors == 2:
            return cls.mha(layout.num_layers, layout.kv_heads, layout.head_dim, layout.block_tokens, dtype)
        rope = min(64, layout.head_dim // 2)
        return cls.mla(layout.num_layers, layout.head_dim - rope, rope, layout.block_tokens, dtype)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def page_bytes(self) -> int:
        width = self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else 2 * self.heads * self.head_dim
        return self.layers * self.page_size * width * self.dtype.itemsize


def host_pool(shape: HostShape, layout: str, pages: int) -> MHATokenToKVPoolHost | MLATokenToKVPoolHost:
    """SGLang's host KV pool of ``pages`` pages of ``shape`` in ``layout``, in CPU memory (built
    over a small CPU device pool, whose buffers it needs)."""
    p = shape.page_size
    if shape.is_mla:
        device = MLATokenToKVPool(4 * p, p, shape.dtype, shape.kv_lora_rank, shape.qk_rope_head_dim, shape.layers,
                                  "cpu", False)
        extra = dict(target_layer_num=device.layer_num, override_kv_cache_dim=device.kv_cache_dim)
        kind = MLATokenToKVPoolHost
    else:
        device = MHATokenToKVPool(4 * p, p, shape.dtype, shape.heads, shape.head_dim, shape.layers, "cpu", False)
        extra, kind = {}, MHATokenToKVPoolHost
    with host_memory_budget_scope(1 << 50):  # size it as asked (SGLang keeps 10 GiB of free RAM otherwise)
        return kind(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, p, layout, pin_memory=False,
                    device="cpu", device_capacity_tokens=device.size, start_layer=device.start_layer,
                    end_layer=device.end_layer, host_token_capacity=pages * p, **extra)


def backend_extra(interface_v1: bool = True, **options: Any) -> dict[str, Any]:
    """SGLang's extra config loading kvstrata: ``options`` are ``kvstrata_`` options without
    the prefix (``disk_dir=..., disk_bytes=...``)."""
    extra: dict[str, Any] = {"backend_name": "kvstrata", "module_path": MODULE_PATH, "class_name": CLASS_NAME}
    if interface_v1:
        extra["interface_v1"] = 1
    extra.update({KEY_PREFIX + name: value for name, value in options.items()})
    return extra


def storage_config(host: Any, extra: dict[str, Any], *, tp_rank: int = 0, tp_size: int = 1,
                   model_name: str = "harness/model", metrics: bool = False, **fields: Any) -> HiCacheStorageConfig:
    """The storage config SGLang's controller would make for ``host`` (``fields``: any other of
    its fields, e.g. ``pp_rank``, ``pp_size``, ``dp_rank``, ``should_split_heads``)."""
    values = dict(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                  is_mla_model=isinstance(host, MLATokenToKVPoolHost), enable_storage_metrics=metrics,
                  is_page_first_layout=host.layout == "page_first", model_name=model_name, extra_config=dict(extra))
    values.update(fields)
    return HiCacheStorageConfig(**values)


def create_backend(config: HiCacheStorageConfig, host: Any, backend: str = "dynamic") -> HiCacheStorage:
    """A storage backend made by SGLang's factory (``"dynamic"``: the class the extra config names)
    and given ``host``, as ``HiCacheController.attach_storage_backend`` does."""
    storage = StorageBackendFactory.create_backend(backend, config, host)
    try:
        storage.register_mem_pool_host(host)
    except BaseException:
        if hasattr(storage, "close"):
            storage.close()
        raise
    return storage


class Controller:
    """``HiCacheController``'s storage backup and prefetch, run on a stand-in holding what they
    read. ``interface_v1`` picks the page functions as ``attach_storage_backend`` does."""

    def __init__(self, backend: HiCacheStorage, host: Any, interface_v1: bool) -> None:
        stand_in = types.SimpleNamespace(storage_backend=backend, storage_host_pool=host, mem_pool_host=host,
                                         page_size=host.page_size, prefetch_sync_queue=queue.Queue())
        for name in _CONTROLLER_METHODS:
            setattr(stand_in, name, types.MethodType(getattr(HiCacheController, name), stand_in))
        stand_in.page_get_func = stand_in._page_get_zero_copy if interface_v1 else stand_in._generic_page_get
        stand_in.page_set_func = stand_in._page_set_zero_copy if interface_v1 else stand_in._generic_page_set
        self._stand_in = stand_in

    def backup(self, keys: list[str], host_indices: torch.Tensor) -> int:
        """Back up pages (``_page_backup``, 128 a batch, stopping at a batch that fails): tokens written."""
        operation = StorageOperation(host_indices, token_ids=[], hash_value=list(keys))
        HiCacheController._page_backup(self._stand_in, operation)
        return operation.completed_tokens

    def prefetch(self, keys: list[str], host_indices: torch.Tensor) -> int:
        """Prefetch pages into ``host_indices`` (``_page_transfer``): pages loaded, from the first."""
        operation = PrefetchOperation("harness", token_ids=[])
        operation.hash_value, operation.host_indices = list(keys), host_indices
        pages = HiCacheController._page_transfer(self._stand_in, operation)
        while not self._stand_in.prefetch_sync_queue.empty():  # one ack a batch, for SGLang's sync thread
            self._stand_in.prefetch_sync_queue.get_nowait()
        return pages


def page_keys(pages: int, page_size: int, seed: int = 0) -> list[str]:
    """Page keys of the form SGLang hands a backend: a chained SHA-256 (hex) over the prior
    page's digest and the page's token ids (SGLang's native hasher needs a C++ build)."""
    keys, prior = [], b""
    for i in range(pages):
        tokens = torch.arange(i * page_size, (i + 1) * page_size, dtype=torch.int64) + seed * 1_000_003
        prior = hashlib.sha256(prior + tokens.numpy().tobytes()).digest()
        keys.append(prior.hex())
    return keys


def fill_pages(host: Any, pages: int, seed: int = 0) -> torch.Tensor:
    """Allocate ``pages`` pages in ``host`` and fill them with random bytes: their host indices."""
    indices = host.alloc(pages * host.page_size)
    if indices is None:
        raise ValueError(f"the host pool has no room for {pages} more pages")
    generator = torch.Generator().manual_seed(seed)
    for slot in indices[:: host.page_size].tolist():
        page = host.get_data_page(slot, flat=False)
        page.view(torch.uint8).copy_(torch.randint(0, 256, page.view(torch.uint8).shape, dtype=torch.uint8,
                                                   generator=generator))
    return indices


def zero_pages(host: Any, pages: int) -> torch.Tensor:
    """Allocate ``pages`` pages in ``host`` and zero them: their host indices."""
    indices = host.alloc(pages * host.page_size)
    if indices is None:
        raise ValueError(f"the host pool has no room for {pages} more pages")
    for slot in indices[:: host.page_size].tolist():
        host.get_data_page(slot, flat=False).zero_()
    return indices


def page_bytes(host: Any, slot: int) -> torch.Tensor:
    """The bytes of the page at host slot ``slot`` in the pool's own order (a copy)."""
    return host.get_data_page(slot, flat=True).contiguous().view(torch.uint8).clone()
