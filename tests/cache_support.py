"""Shared pieces of the tiered-cache tests: small layouts, deterministic KV, invariant checks,
and real tiers with a gate (to hold a transfer mid-flight) or an injected read failure.

KV content is a function of the block key (random bits seeded by the key), so a block has one
right answer wherever it is read from and whoever stored it; comparisons are on raw bytes,
so a NaN bit pattern or a dtype round trip cannot hide a difference.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from kvstrata.cache import TieredCache
from kvstrata.index.keys import BlockKey
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.tensors import torch_dtype
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.memory import HostTier
from kvstrata.manager.table import BlockState

# 2 layers x K,V x 16 tokens x 1 head x 32 dims x bf16: 2 KiB a layer, 4 KiB a block.
LAYOUT = KVLayout(num_layers=2, block_tokens=16, kv_heads=1, head_dim=32, dtype=DType.BF16)


def layout_for(block_tokens: int, num_layers: int = 2) -> KVLayout:
    return KVLayout(num_layers=num_layers, block_tokens=block_tokens, kv_heads=1, head_dim=32, dtype=DType.BF16)


def tokens(seq_id: int, blocks: int, layout: KVLayout = LAYOUT, tail: int = 0) -> list[int]:
    """``blocks`` full blocks (plus ``tail`` tokens) of a sequence no other seq_id shares."""
    return [seq_id * 100_000 + i for i in range(blocks * layout.block_tokens + tail)]


def content(layout: KVLayout, key: BlockKey) -> torch.Tensor:
    """The KV of the block keyed ``key``: ``layout.block_shape``, random bits of the layout's dtype."""
    rng = np.random.default_rng(int.from_bytes(key, "little"))
    raw = rng.integers(0, 256, size=layout.block_bytes, dtype=np.uint8)
    return torch.from_numpy(raw).view(torch_dtype(layout.dtype)).view(layout.block_shape)


def kv_for(cache: TieredCache, toks: list[int], tenant: str = "") -> torch.Tensor:
    """``[layers, kv, len(toks), kv_heads, head_dim]``: each full block's content(key), a
    random tail."""
    layout = cache.layout
    bs = layout.block_tokens
    keys = cache.keys(toks, tenant)
    parts = [content(layout, key) for key in keys]
    tail = len(toks) - len(keys) * bs
    if tail:
        shape = (layout.num_layers, layout.kv_tensors, tail, layout.kv_heads, layout.head_dim)
        parts.append(torch.randn(shape).to(torch_dtype(layout.dtype)))
    return torch.cat(parts, dim=2) if parts else torch.empty(
        (layout.num_layers, layout.kv_tensors, 0, layout.kv_heads, layout.head_dim), dtype=torch_dtype(layout.dtype)
    )


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (uint8, flat), for bit-exact comparison."""
    return t.contiguous().view(torch.uint8).reshape(-1)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a.cpu()), raw(b.cpu()))


def assert_loaded_bytes(cache: TieredCache, handle, keys: list[BlockKey]) -> None:
    """Every block the handle loaded equals what was stored under its key."""
    for i in range(handle.blocks):
        assert same_bytes(handle.block(i), content(cache.layout, keys[i])), f"block {i} differs from what was stored"


def pins(cache: TieredCache) -> dict:
    """{(medium, key): pins} for every pinned block of every tier."""
    return {(medium, key): n for medium in cache.media for key, n in cache.manager.table(medium).pinned().items()}


def assert_quiescent(cache: TieredCache, held: dict | None = None) -> None:
    """No operation left anything behind: every pin is one a live handle holds (``held``:
    {(medium, key): pins}, none by default), no slot is stuck WRITING or EVICTING, and the
    prefix index agrees with the tier tables (a block is in the index for a medium iff it is
    READY in that tier's table)."""
    assert pins(cache) == (held or {}), "pins left behind"
    where: dict[BlockKey, set] = {}
    for medium in cache.media:
        table = cache.manager.table(medium)
        ready = table.ready_keys()
        assert table.used_blocks == len(ready), f"{medium.label}: slots stuck WRITING or EVICTING"
        assert table.used_blocks + table.free_blocks + table.quarantined_slots == (
            table.capacity_blocks + table.excess_blocks), f"{medium.label}: slots neither used, free nor retired"
        for key in ready:
            assert table.state(key) is BlockState.READY
            where.setdefault(key, set()).add(medium)
    for key, media in where.items():
        assert set(cache.manager.where(key)) == media, f"index says {cache.manager.where(key)}, tables say {media}"
    assert cache.manager.indexed_blocks() == len(where), "the index holds blocks no tier holds READY"


def held_pins(cache: TieredCache, handles) -> dict:
    """The device pins ``handles`` (live, not released) account for."""
    from kvstrata.media import Medium

    out: dict = {}
    for handle in handles:
        for key in handle.keys:
            out[(Medium.DEVICE, key)] = out.get((Medium.DEVICE, key), 0) + 1
    return out


class GatedHostTier(HostTier):
    """A real host tier whose reads of layers >= ``gate_from`` wait until ``gate`` is set, so
    a test can hold a load with its first layers landed and the rest in flight. Optionally
    every read fails (``fail_reads``), as a broken DMA engine would."""

    def __init__(self, *args, gate_from: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.gate_from = gate_from
        self.fail_reads = False
        self.reads_waiting = threading.Semaphore(0)

    def _hold(self, layers: slice) -> None:
        start, _, _ = layers.indices(self.layout.num_layers)
        if start >= self.gate_from and not self.gate.is_set():
            self.reads_waiting.release()
            assert self.gate.wait(20), "gate never opened"
        if self.fail_reads:
            raise OSError("injected read failure")

    def read_into(self, slot, key, dst, layers=slice(None)):
        self._hold(layers)
        super().read_into(slot, key, dst, layers)

    def read_many_into(self, slots, keys, dsts, layers=slice(None)):
        self._hold(layers)
        return super().read_many_into(slots, keys, dsts, layers)


class GatedDiskTier(DiskTier):
    """A real disk tier (real files in a real directory) whose reads wait for ``gate``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.reads_waiting = threading.Semaphore(0)

    def read_into(self, slot, key, dst, layers=slice(None)):
        if not self.gate.is_set():
            self.reads_waiting.release()
            assert self.gate.wait(20), "gate never opened"
        super().read_into(slot, key, dst, layers)
