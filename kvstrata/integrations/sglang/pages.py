"""SGLang's host KV pool pages as kvstrata blocks: a page's bytes, in place, as pieces.

One SGLang page (``page_size`` tokens of every layer) is one kvstrata block, its bytes in the
order of SGLang's flat page (``get_data_page(i, flat=True)``) for the pool's layout. A page is a
few runs of the pool's memory (its pieces): kvstrata's tiers write them out and read them back
where they lie (vectored file I/O, the pool's multi-buffer calls), no copy on the way.

The host pool's buffer and one page of it, by layout (P = page_size, S = slots, N = S / P;
MLA's buffer is viewed with a leading kv axis of 1, and heads = 1, so the same indexing serves):

    layout              kv_buffer             a page              its order       its pieces
    layer_first         [2, L, S, H, D]       [:, :, i:i+P]       [2, L, P, H, D] 2 x L of [P, H, D]
    page_first          [2, S, L, H, D]       [:, i:i+P]          [2, P, L, H, D] 2 of [P, L, H, D]
    page_first_direct   [2, N, L, P, H, D]    [:, i // P]         [2, L, P, H, D] 2 of [L, P, H, D]

The order is the block layout's name (:meth:`PoolGeometry.kv_layout`), so it is in the
namespace: layer_first and page_first_direct pools share their pages; a page_first pool's pages
are its own (another order of the same bytes would load as garbage).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.kv.layout import KVLayout
from kvstrata.tensors import kv_dtype

_PREFIX = "KVStrataHiCacheStorage:"
# A page's byte order, by host layout (a flat page's axes): the block layout's name.
_ORDER = {
    "layer_first": "SGLang page [kv, layers, tokens, heads, dim]",
    "page_first": "SGLang page [kv, tokens, layers, heads, dim]",
    "page_first_direct": "SGLang page [kv, layers, tokens, heads, dim]",
}
LAYOUTS = tuple(_ORDER)


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

    def buffer_shape(self, slots: int) -> tuple[int, ...]:
        """The host pool's ``kv_buffer`` with a kv axis, for ``slots`` token slots."""
        k, layers, p, h, d = self.kv, self.layers, self.page_size, self.heads, self.head_dim
        return {"layer_first": (k, layers, slots, h, d), "page_first": (k, slots, layers, h, d),
                "page_first_direct": (k, slots // p, layers, p, h, d)}[self.layout]

    def kv_layout(self) -> KVLayout:
        """kvstrata's block: one page, in its flat page's order (the layout's name says which)."""
        return KVLayout(self.layers, self.page_size, self.heads, self.head_dim, kv_dtype(self.dtype),
                        kv_tensors=self.kv, name=_ORDER[self.layout])


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
    if host.layout not in _ORDER:
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
    if not buffer.is_contiguous() or buffer.device.type != "cpu":
        raise ValueError(f"{_PREFIX} the host kv_buffer must be one contiguous block of CPU memory")
    return geometry


def _buffer(host: object, mla: bool) -> torch.Tensor:
    return host.kv_buffer.unsqueeze(0) if mla else host.kv_buffer  # MLA: a kv axis of 1


class HostPages:
    """The pages of one SGLang host pool as kvstrata blocks: each page's bytes as pieces of the
    pool's memory (uint8, in place)."""

    def __init__(self, host: object) -> None:
        self.geometry = geometry = pool_geometry(host)
        self.page_size = geometry.page_size
        self.memory = _buffer(host, geometry.mla).view(-1).view(torch.uint8)  # the whole pool, flat bytes
        k, layers, p = geometry.kv, geometry.layers, geometry.page_size
        row = geometry.heads * geometry.head_dim * geometry.dtype.itemsize  # one token of one layer
        slots = host.size
        # Per layout: the pieces of the page at slot 0 (offset, bytes), and how far a slot moves them.
        if geometry.layout == "layer_first":
            self._first = [((kv * layers + layer) * slots * row, p * row) for kv in range(k) for layer in range(layers)]
        elif geometry.layout == "page_first":
            self._first = [(kv * slots * layers * row, p * layers * row) for kv in range(k)]
        else:  # page_first_direct: [kv, N, L, P, H, D], a page's L x P tokens together
            self._first = [(kv * slots * layers * row, layers * p * row) for kv in range(k)]
        self._slot_bytes = row * (1 if geometry.layout == "layer_first" else layers)
        self.page_bytes = k * layers * p * row
        self.page_numel = self.page_bytes // geometry.dtype.itemsize

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

    def pieces(self, slot: int) -> list[torch.Tensor]:
        """The bytes of the page that starts at host slot ``slot``, in its order, as pieces of
        the pool's memory (read from and written into in place)."""
        at, memory = slot * self._slot_bytes, self.memory
        return [memory[at + offset : at + offset + size] for offset, size in self._first]

    def flat(self, page: torch.Tensor, writable: bool = False) -> list[torch.Tensor]:
        """A flat page of the generic interface (already in its order) as one piece: its own
        memory (``writable``: always, so what is read into it lands in ``page``; else a copy where
        it is not contiguous).

        Raises:
            ValueError: not a page of this pool (dtype or size), or a ``writable`` one that is
                not contiguous CPU memory.
        """
        if not isinstance(page, torch.Tensor) or page.dtype != self.geometry.dtype or page.numel() != self.page_numel:
            raise ValueError(f"{_PREFIX} a page is {self.page_numel} values of {self.geometry.dtype}, got "
                             f"{_describe(page)}")
        if writable and (not page.is_contiguous() or page.device.type != "cpu"):
            raise ValueError(f"{_PREFIX} a page to load into must be contiguous CPU memory")
        return [page.detach().cpu().contiguous().view(-1).view(torch.uint8)]

    def empty_flat(self) -> torch.Tensor:
        """A new flat page of this pool (for a generic get given no target)."""
        return torch.empty(self.page_numel, dtype=self.geometry.dtype)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.numel()} values of {value.dtype}"
    return type(value).__name__
