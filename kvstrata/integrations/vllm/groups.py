"""vLLM's KV cache groups as kvstrata KV groups, and how a prompt's hit spans them.

vLLM's hybrid KV cache manager (HMA) splits a hybrid model's layers into KV cache groups, one
spec each (``KVCacheConfig.kv_cache_groups``): full attention, sliding window, chunked local
attention, Mamba state. Every group has its own block table; a request's block ids come per
group (a tuple of lists), and a sliding or chunked group's blocks that fell out of the window
are vLLM's null block. The connector keeps one kvstrata cache per group (its own namespace),
so each group's blocks are stored, found and evicted by themselves.

Which specs are taken is decided by the spec's exact type (a subclass such as R-SWA's caches
something else): full, sliding and chunked attention whose K and V have one head size, and
MLA's latent (``MLAAttentionSpec``: one "head" of ``kv_lora_rank + rope_dim``, the same on
every TP rank; vLLM's CPU build runs it). A Mamba state group is refused: vLLM 0.32's CPU build cannot run a Mamba hybrid
(see ``tests/integrations/test_vllm_hma.py``), so there is nothing here to store its state
snapshots against.

A prompt's usable hit is the longest prefix every group can serve: every block of a full
group, the window before the prefix's end of a windowed one
(:func:`kvstrata.cache.grouped.longest_hit`, the grouped cache's own rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstrata.kv.dtypes import DType
from kvstrata.kv.groups import GroupKind, KVGroup
from kvstrata.media import Medium

if TYPE_CHECKING:
    from kvstrata.cache.grouped import GroupedMatch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

_PREFIX = "KVStrataConnector:"


@dataclass(frozen=True)
class VLLMGroup:
    """One of vLLM's KV cache groups, as kvstrata caches it.

    Attributes:
        index: vLLM's group id (the position of its block ids in every per-group tuple).
        group: the kvstrata group: kind, decoder layer indices, this TP rank's KV heads,
            head size, window or chunk (``span``), dtype.
        layer_names: vLLM's attention layer names, in ``group.layers`` order.
        namespace: the group's ``CacheConfig.kv_group``; "" for a one-group model, whose blocks
            keep the keys they had before groups existed.
    """

    index: int
    group: KVGroup
    layer_names: tuple[str, ...]
    namespace: str

    @property
    def kind(self) -> GroupKind:
        return self.group.kind


def vllm_groups(kv_cache_config: KVCacheConfig, dtypes: tuple[DType, ...]) -> tuple[VLLMGroup, ...]:
    """kvstrata's view of vLLM's KV cache groups, in vLLM's group order.

    Args:
        kv_cache_config: vLLM's KV cache config (the one the connector was built with).
        dtypes: the KV dtypes the connector copies.

    Raises:
        ValueError: a group kvstrata cannot cache (a Mamba state, cross attention, a
            KV dtype outside ``dtypes``, a group vLLM does not transfer), in one line.
    """
    from vllm.model_executor.models.utils import extract_layer_index

    from kvstrata.tensors import kv_dtype

    specs = kv_cache_config.kv_cache_groups
    if not specs:
        raise ValueError(f"{_PREFIX} vLLM's KV cache config has no KV cache groups")
    out = []
    for index, spec_group in enumerate(specs):
        spec = spec_group.kv_cache_spec
        kind = _kind(spec)
        if not spec_group.enable_kv_transfer:
            raise ValueError(f"{_PREFIX} KV cache group {index} ({type(spec).__name__}) is not transferable")
        if kind is not GroupKind.MLA and spec.head_size_v != spec.head_size:
            raise ValueError(f"{_PREFIX} KV cache group {index}: K and V head sizes differ "
                             f"({spec.head_size} vs {spec.head_size_v})")
        try:
            dtype = kv_dtype(spec.dtype, dtypes)
        except ValueError as exc:
            raise ValueError(f"{_PREFIX} KV cache group {index}: {exc}") from None
        names = sorted(spec_group.layer_names, key=extract_layer_index)
        span = spec.sliding_window if kind is GroupKind.SLIDING else (
            spec.attention_chunk_size if kind is GroupKind.CHUNKED else None)
        group = KVGroup(kind, tuple(extract_layer_index(n) for n in names), dtype,
                        kv_heads=spec.num_kv_heads, head_dim=spec.head_size, span=span,
                        label=type(spec).__name__)
        namespace = "" if len(specs) == 1 else f"{index}-{kind.value}{span or ''}"
        out.append(VLLMGroup(index, group, tuple(names), namespace))
    return tuple(out)


def _kind(spec: KVCacheSpec) -> GroupKind:
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    kinds = {FullAttentionSpec: GroupKind.FULL, SlidingWindowSpec: GroupKind.SLIDING,
             ChunkedLocalAttentionSpec: GroupKind.CHUNKED, MLAAttentionSpec: GroupKind.MLA}
    kind = kinds.get(type(spec))  # exact types: a subclass (R-SWA, sinks, sparse MLA) caches something else
    if kind is not None:
        return kind
    if isinstance(spec, MambaSpec):
        raise ValueError(f"{_PREFIX} Mamba state groups are not cached: vLLM's CPU build cannot run a Mamba "
                         "hybrid to test state snapshots against")
    raise ValueError(f"{_PREFIX} KV cache spec {type(spec).__name__} is not cached (full, sliding window and "
                     "chunked local attention and MLA are)")


def group_spans(kv_cache_config: KVCacheConfig) -> tuple[int | None, ...]:
    """Per KV cache group (vLLM's order), its window or chunk in tokens; None for full attention."""
    spans = []
    for spec_group in kv_cache_config.kv_cache_groups:
        spec = spec_group.kv_cache_spec
        kind = _kind(spec)
        spans.append(spec.sliding_window if kind is GroupKind.SLIDING else
                     spec.attention_chunk_size if kind is GroupKind.CHUNKED else None)
    return tuple(spans)


def rank_block_bytes(kv_cache_config: KVCacheConfig) -> int:
    """A block's bytes in one rank's paged KV over every group's layers (what its tiers keep of a block)."""
    return sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in kv_cache_config.kv_cache_groups)


def hit_tiers(match: GroupedMatch) -> tuple[Medium, ...]:
    """Per block of a usable hit, the tier its load waits for: the slowest of the groups' copies
    of it; a block no group needs (before every window) takes the next needed block's."""
    tiers: list[Medium | None] = [None] * match.blocks
    for part in match.groups.values():
        for i, medium in enumerate(part.match.media[: match.blocks - part.first_block], part.first_block):
            held = tiers[i]
            tiers[i] = medium if held is None or medium.value > held.value else held
    out: list[Medium] = []
    later = Medium.DEVICE  # never taken: every group needs a hit's last block
    for held in reversed(tiers):
        later = held if held is not None else later
        out.append(later)
    return tuple(reversed(out))
