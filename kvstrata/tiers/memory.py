"""Memory tiers: a preallocated pool of block slots in device memory (HBM) or host DRAM.

The pool is one uint8 tensor ``[slots, layers, layer_bytes]``, allocated and pre-faulted once
at construction: the first write into fresh pages costs a page fault per 4 KiB and runs
several times slower than a write into memory already touched. Slot ``i`` is ``pool[i]``,
so ``view(slot)`` hands out the bytes in place and a transfer needs no staging copy.

Copies that involve CUDA run ``non_blocking`` when the host side is pinned; they are then
ordered on the current CUDA stream and the caller must synchronize that stream before it
trusts the bytes (the transfer worker does so before it reports a transfer).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from kvstrata.index.keys import BlockKey
from kvstrata.kv.layout import KVLayout
from kvstrata.media import Medium
from kvstrata.tiers.base import Pieces, Tier, TierCapabilities, split_like


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for same-shape uint8 tensors, asynchronous where that is safe.

    Raises:
        ValueError: shapes or dtypes differ (``copy_`` would broadcast or convert silently).
    """
    if dst.shape != src.shape or dst.dtype != torch.uint8 or src.dtype != torch.uint8:
        raise ValueError(
            f"block copy needs two uint8 tensors of one shape, got {src.dtype}{tuple(src.shape)} "
            f"-> {dst.dtype}{tuple(dst.shape)}"
        )
    dst.copy_(src, non_blocking=_can_copy_async(dst, src))


def _can_copy_async(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Only a copy that involves CUDA can be asynchronous, and only if every host side is
    # pinned: from pageable memory the driver stages through its own buffer and blocks anyway.
    if a.device.type != "cuda" and b.device.type != "cuda":
        return False
    return all(t.is_pinned() for t in (a, b) if t.device.type == "cpu")


def _all_async(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(_can_copy_async(x, y) for x, y in zip(a, b, strict=True))


_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as torch's own


def _unpin(pool: torch.Tensor) -> None:
    # Runs once: from close(), or when the tier is garbage-collected. It holds the pool, so
    # the memory is unregistered before torch frees it.
    torch.cuda.cudart().cudaHostUnregister(pool.data_ptr())


class MemoryTier(Tier):
    """A tier whose slots are rows of one preallocated tensor. Use DeviceTier or HostTier.

    ``close()`` is idempotent; after it, ``write``, ``read_into`` and ``view`` raise
    RuntimeError. Views handed out earlier keep their memory alive but are no longer pinned.
    """

    capabilities = TierCapabilities(mapped=True, batched_reads=True)

    def __init__(
        self,
        layout: KVLayout,
        capacity_bytes: int,
        device: torch.device,
        pin: bool,
    ) -> None:
        super().__init__(layout, capacity_bytes)
        # Always its own memory: a tier's memory lent to a transport (a pool's shared segment,
        # memory registered with its transfer engine) is memory other processes may read and
        # write, and a memory tier's blocks are served unchecked.
        pool = torch.empty((self.capacity_blocks, layout.num_layers, layout.layer_bytes), dtype=torch.uint8,
                           device=device)
        pool.zero_()  # pre-fault every page now, not on the first write into each slot
        self._device = pool.device
        self._finalizer: weakref.finalize | None = None
        if pin and pool.numel():
            # Register the exact bytes: torch.empty(pin_memory=True) goes through the caching
            # host allocator, which rounds a request up to the next power of two (a 40 GiB
            # pool would pin 64 GiB).
            error = int(torch.cuda.cudart().cudaHostRegister(pool.data_ptr(), pool.numel(), _REGISTER_PORTABLE))
            if error:
                raise RuntimeError(
                    f"{self.medium.label} tier: cudaHostRegister of {pool.numel()} bytes failed (cudaError {error})"
                )
            self._finalizer = weakref.finalize(self, _unpin, pool)
        self._pool: torch.Tensor | None = pool

    @property
    def slots(self) -> int:
        return self.capacity_blocks

    @property
    def pinned(self) -> bool:
        return self._finalizer is not None and self._finalizer.alive

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def buffer(self) -> torch.Tensor:
        """The whole pool, uint8 ``[slots, layers, layer_bytes]``."""
        return self._live_pool()

    def _live_pool(self) -> torch.Tensor:
        if self._pool is None:
            raise RuntimeError(f"{self.medium.label} tier is closed")
        return self._pool

    def _slot(self, slot: int) -> torch.Tensor:
        # pool[-1] would silently be the last slot: check the range ourselves.
        pool = self._live_pool()
        if not 0 <= slot < self.slots:
            raise IndexError(f"{self.medium.label} tier: slot {slot} out of range [0, {self.slots})")
        return pool[slot]

    def view(self, slot: int) -> torch.Tensor:
        """``pool[slot]``: uint8 ``[layers, layer_bytes]``, aliasing the pool."""
        return self._slot(slot)

    def write(self, slot: int, key: BlockKey, src: torch.Tensor) -> None:
        copy_bytes(self._slot(slot), src)

    def read_into(self, slot: int, key: BlockKey, dst: torch.Tensor, layers: slice = slice(None)) -> None:
        copy_bytes(dst, self._slot(slot)[layers])

    def read_many_into(
        self, slots: list[int], keys: list[BlockKey], dsts: list[torch.Tensor], layers: slice = slice(None)
    ) -> list[BaseException | None]:
        """One batched copy (``torch._foreach_copy_``): a layer of many blocks costs one
        dispatch, not one per block. It succeeds or fails for all of them (raises)."""
        srcs = [self._slot(slot)[layers] for slot in slots]
        for src, dst in zip(srcs, dsts, strict=True):
            if dst.shape != src.shape or dst.dtype != torch.uint8:
                raise ValueError(f"block copy needs uint8 {tuple(src.shape)}, got {dst.dtype}{tuple(dst.shape)}")
        if srcs:
            torch._foreach_copy_(dsts, srcs, non_blocking=any(_can_copy_async(d, s) for d, s in zip(dsts, srcs)))
        return [None] * len(srcs)

    def write_pieces(self, slots: list[int], keys: list[BlockKey], blocks: Sequence[Pieces]) -> list[BaseException | None]:
        """Each block's pieces copied into its slot as they lie, the whole call in one batched
        copy. It succeeds or fails for all blocks (raises)."""
        slot_parts, pieces = self._pair_pieces(slots, blocks)
        if pieces:
            torch._foreach_copy_(slot_parts, pieces, non_blocking=_all_async(slot_parts, pieces))
        return [None] * len(blocks)

    def read_pieces(self, slots: list[int], keys: list[BlockKey], blocks: Sequence[Pieces]) -> list[BaseException | None]:
        """Each slot copied into its block's pieces, the whole call in one batched copy. It
        succeeds or fails for all blocks (raises)."""
        slot_parts, pieces = self._pair_pieces(slots, blocks)
        if pieces:
            torch._foreach_copy_(pieces, slot_parts, non_blocking=_all_async(slot_parts, pieces))
        return [None] * len(blocks)

    def _pair_pieces(self, slots: list[int], blocks: Sequence[Pieces]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The slots' bytes cut as their blocks' pieces are, and the pieces, in step (flat)."""
        self._check_pieces(blocks)
        slot_parts: list[torch.Tensor] = []
        pieces: list[torch.Tensor] = []
        for slot, block in zip(slots, blocks, strict=True):
            slot_parts += split_like(self._slot(slot).view(-1), block)
            pieces += block
        return slot_parts, pieces

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # unregisters once; later calls are no-ops
        self._pool = None


def default_device() -> torch.device:
    """CUDA when available, else the CPU (which then stands in for HBM)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class DeviceTier(MemoryTier):
    """GPU memory (HBM). Where there is no CUDA, a CPU pool stands in, so the whole cache
    runs, and its tests pass, on any machine.

    Args:
        layout: the block layout.
        capacity_bytes: pool size; ``capacity_bytes // layout.block_bytes`` slots (0 allowed:
            the cache then stores nothing).
        device: where the pool lives; by default CUDA when available, else CPU.
    """

    medium = Medium.DEVICE

    def __init__(
        self,
        layout: KVLayout,
        capacity_bytes: int,
        device: torch.device | str | None = None,
    ) -> None:
        where = default_device() if device is None else torch.device(device)
        if where.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device tier: device {where} requested but CUDA is not available")
        super().__init__(layout, capacity_bytes, where, pin=False)


class HostTier(MemoryTier):
    """Host DRAM, pinned (page-locked) when CUDA is present so copies to and from the GPU
    run asynchronously at full PCIe rate.

    Args:
        layout: the block layout.
        capacity_bytes: pool size; ``capacity_bytes // layout.block_bytes`` slots (0 allowed).
        pin: pin the pool; by default only when CUDA is available. ``True`` without CUDA is
            an error.
    """

    medium = Medium.HOST

    def __init__(
        self,
        layout: KVLayout,
        capacity_bytes: int,
        pin: bool | None = None,
    ) -> None:
        cuda = torch.cuda.is_available()
        if pin and not cuda:
            raise ValueError("host tier: pin=True needs CUDA, which is not available")
        pin = cuda if pin is None else pin
        super().__init__(layout, capacity_bytes, torch.device("cpu"), pin=pin)
