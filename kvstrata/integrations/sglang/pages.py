"""SGLang's host KV pool pages as kvstrata blocks: views, no copies.

One SGLang page (``page_size`` tokens of every layer) is one kvstrata block in kvstrata's
layer-major layout, ``[layers, kv, page_size, heads, head_dim]`` (MHA: kv = 2, K then V; MLA:
kv = 1, heads = 1, head_dim = the latent's width, ``kv_lora_rank + qk_rope_head_dim``). So what is
stored does not depend on SGLang's ``--hicache-mem-layout``: a page stored from a page-first pool
loads into a layer-first one.

The host pool's buffer and one page of it, by layout (P = page_size, S = slots, N = S / P;
MLA's buffer is viewed with a leading kv axis of 1, and heads = 1, so the same indexing serves):

    layout              kv_buffer             a page              its axes
    layer_first         [2, L, S, H, D]       [:, :, i:i+P]       [2, L, P, H, D]
    page_first          [2, S, L, H, D]       [:, i:i+P]          [2, P, L, H, D]
    page_first_direct   [2, N, L, P, H, D]    [:, i // P]         [2, L, P, H, D]

A page's axes in that table are also the order of SGLang's flat pages (``get_data_page(i,
flat=True)``, ``set_from_flat_data_page``) on the generic interface: a flat page is read in its
pool's layout (layer_first and page_first_direct share an order; ``is_page_first_layout`` is
false for page_first_direct, so the layout is read from the pool). One permutation takes a page
to kvstrata's ``[L, kv, P, H, D]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvstrata.kv.layout import KVLayout
from kvstrata.tensors import kv_dtype

_PREFIX = "KVStrataHiCacheStorage:"
# A page's axes in the host layout -> kvstrata's [L, kv, P, H, D].
_TO_LKTHD = {
    "layer_first": (1, 0, 2, 3, 4),
    "page_first": (2, 0, 1, 3, 4),
    "page_first_direct": (1, 0, 2, 3, 4),
}
LAYOUTS = tuple(_TO_LKTHD)


@dataclass(frozen=True)
class PoolGeometry:
    """What one page of a host pool holds: its layout's name, MLA or MHA, and its sizes."""

    layout: str
    mla: bool
    layers: int
    page_size: int
    heads: int  # MLA: 1
    head_dim: int  # MLA: the latent's width
    dtype: torch.dtype

    @property
    def kv(self) -> int:
        return 1 if self.mla else 2

    def page_shape(self) -> tuple[int, ...]:
        """A page's axes in the host layout (the order of its flat page)."""
        k, layers, p, h, d = self.kv, self.layers, self.page_size, self.heads, self.head_dim
        return (k, p, layers, h, d) if self.layout == "page_first" else (k, layers, p, h, d)

    def buffer_shape(self, slots: int) -> tuple[int, ...]:
        """The host pool's ``kv_buffer`` with a kv axis, for ``slots`` token slots."""
        k, layers, p, h, d = self.kv, self.layers, self.page_size, self.heads, self.head_dim
        return {"layer_first": (k, layers, slots, h, d), "page_first": (k, slots, layers, h, d),
                "page_first_direct": (k, slots // p, layers, p, h, d)}[self.layout]

    def kv_layout(self) -> KVLayout:
        """kvstrata's block: one page, layer-major."""
        return KVLayout(self.layers, self.page_size, self.heads, self.head_dim, kv_dtype(self.dtype),
                        kv_tensors=self.kv)


def pool_geometry(host: object) -> PoolGeometry:
    """The geometry of SGLang's host KV pool ``host``.

    Raises:
        ValueError: a pool kvstrata does not store, in one line naming why (another class of
            pool, a layout other than layer_first/page_first/page_first_direct, K and V of
            different widths, a KV dtype kvstrata has no type for, no buffer on this rank).
    """
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    kind = type(host)
    if kind not in (MHATokenToKVPoolHost, MLATokenToKVPoolHost):  # subclasses carry scales, sparse or split K/V
        raise ValueError(f"{_PREFIX} stores pages of MHATokenToKVPoolHost and MLATokenToKVPoolHost, "
                         f"not {kind.__name__}")
    if host.layout not in _TO_LKTHD:
        raise ValueError(f"{_PREFIX} host layout {host.layout!r} is not supported: use one of {list(LAYOUTS)}")
    if getattr(host, "kv_buffer", None) is None:
        raise ValueError(f"{_PREFIX} the host pool has no KV buffer on this rank (an allocator-only MLA pool)")
    mla = kind is MLATokenToKVPoolHost
    if not mla and host.head_dim != host.v_head_dim:
        raise ValueError(f"{_PREFIX} K width {host.head_dim} and V width {host.v_head_dim} differ: not supported")
    try:
        kv_dtype(host.dtype)
    except ValueError as error:  # uint8: SGLang's store type of FP8 KV, which does not say which FP8
        raise ValueError(f"{_PREFIX} {error}" + (" (SGLang stores FP8 KV as uint8)" if host.dtype == torch.uint8
                                                 else "")) from None
    geometry = PoolGeometry(host.layout, mla, host.layer_num, host.page_size, 1 if mla else host.head_num,
                            host.kv_cache_dim if mla else host.head_dim, host.dtype)
    buffer = _buffer(host, mla)
    if tuple(buffer.shape) != geometry.buffer_shape(host.size):
        raise ValueError(f"{_PREFIX} host kv_buffer is {tuple(buffer.shape)}, expected "
                         f"{geometry.buffer_shape(host.size)} for {geometry}")
    return geometry


def _buffer(host: object, mla: bool) -> torch.Tensor:
    return host.kv_buffer.unsqueeze(0) if mla else host.kv_buffer  # MLA: a kv axis of 1


class HostPages:
    """The pages of one SGLang host pool as kvstrata blocks (views into the pool, no copies)."""

    def __init__(self, host: object) -> None:
        self.geometry = pool_geometry(host)
        self.page_size = self.geometry.page_size
        self._buffer = _buffer(host, self.geometry.mla)
        self._perm = _TO_LKTHD[self.geometry.layout]
        self._page_shape = self.geometry.page_shape()
        self.page_numel = math.prod(self._page_shape)

    def first_slots(self, host_indices: torch.Tensor, pages: int) -> list[int]:
        """The first host slot of each of ``pages`` pages in SGLang's ``host_indices`` (``pages *
        page_size`` slots, a page's slots contiguous and page-aligned).

        Raises:
            ValueError: another number of slots, or a page not page-aligned.
        """
        if host_indices.numel() != pages * self.page_size:
            raise ValueError(f"{_PREFIX} {pages} pages need {pages * self.page_size} host indices, "
                             f"got {host_indices.numel()}")
        firsts = host_indices[:: self.page_size].tolist()
        if any(slot % self.page_size for slot in firsts):
            raise ValueError(f"{_PREFIX} host indices of a page must start at a multiple of {self.page_size}")
        return firsts

    def page(self, slot: int) -> torch.Tensor:
        """The page that starts at host slot ``slot``, ``[L, kv, P, H, D]``, a view of the pool."""
        return self._span(slot, 1)

    def runs(self, slots: list[int]) -> list[tuple[int, torch.Tensor]]:
        """The pages that start at ``slots``, in order, as runs of consecutive pages: per run, its
        pages and its view ``[L, kv, pages * P, H, D]``. In layer_first and page_first a page that
        follows the previous one in the pool continues its run (its tokens follow the previous
        page's on the token axis); page_first_direct keeps each page's layers together, so each
        of its pages is a run of its own."""
        p, out, i = self.page_size, [], 0
        while i < len(slots):
            j = i + 1
            if self.geometry.layout != "page_first_direct":
                while j < len(slots) and slots[j] == slots[j - 1] + p:
                    j += 1
            out.append((j - i, self._span(slots[i], j - i)))
            i = j
        return out

    def _span(self, slot: int, pages: int) -> torch.Tensor:
        end = slot + pages * self.page_size
        layout = self.geometry.layout
        if layout == "layer_first":
            span = self._buffer[:, :, slot:end]
        elif layout == "page_first":
            span = self._buffer[:, slot:end]
        else:  # page_first_direct: one page
            span = self._buffer[:, slot // self.page_size]
        return span.permute(self._perm)

    def flat(self, page: torch.Tensor, writable: bool = False) -> torch.Tensor:
        """A flat page of the generic interface (the host layout's order) as ``[L, kv, P, H, D]``:
        a view of it (``writable``: always, so a copy into it lands in ``page``; else where its
        memory allows, as it always does for SGLang's flat pages).

        Raises:
            ValueError: not a page of this pool (dtype or size), or a ``writable`` one that is
                not contiguous.
        """
        if not isinstance(page, torch.Tensor) or page.dtype != self.geometry.dtype or page.numel() != self.page_numel:
            raise ValueError(f"{_PREFIX} a page is {self.page_numel} values of {self.geometry.dtype}, got "
                             f"{_describe(page)}")
        if writable and not page.is_contiguous():
            raise ValueError(f"{_PREFIX} a page to load into must be contiguous")
        return (page.view(self._page_shape) if writable else page.reshape(self._page_shape)).permute(self._perm)

    def empty_flat(self) -> torch.Tensor:
        """A new flat page of this pool (for a generic get given no target)."""
        return torch.empty(self.page_numel, dtype=self.geometry.dtype)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.numel()} values of {value.dtype}"
    return type(value).__name__
