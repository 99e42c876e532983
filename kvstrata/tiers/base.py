"""The tier interface: a narrow surface that moves bytes; what sits in which slot is the block
manager's (``kvstrata.manager``).

A tier stores whole blocks (``layout.block_bytes`` bytes, viewed as uint8 ``[layers,
layer_bytes]``) in ``capacity_blocks`` slots. Three methods are required; the rest default.
Errors a caller must tell apart are those of ``kvstrata.errors`` (a block that does not verify,
a block gone, a tier down, a transfer abandoned).

Pieces. A caller whose blocks lie in its own memory in separate runs of bytes (one page of
SGLang's host pool: K here, V there) hands each block as its pieces (``Pieces``: contiguous
uint8 1-D CPU tensors whose concatenation, in order, is the block) to ``write_pieces`` and
``read_pieces``. A block's layers are then rows of ``layer_bytes`` of that concatenation: a row
may span pieces. By default a tier gathers the pieces into one block and scatters it back (a
copy each way); memory, disk and the pool override both to move the pieces as they lie.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstrata.index.keys import BlockKey
from kvstrata.kv.layout import KVLayout
from kvstrata.media import Medium

Pieces = Sequence[torch.Tensor]  # one block's bytes: contiguous uint8 1-D CPU tensors, in order


@dataclass(frozen=True)
class TierCapabilities:
    """How a tier's calls should be split across threads: what the transfer worker dispatches on.

    Attributes:
        mapped: ``view()`` gives every slot's bytes in place (the memory tiers): a leg into or
            out of it needs no staging copy, and a group between two mapped tiers is one copy.
        batched_reads: ``read_many_into`` is one call for many blocks (memory, the pool): a group
            read into a mapped tier is split in one batch per mover.
        pipelined: ``read_many_into`` and ``write_many`` overlap a whole batch's calls with their
            own checks (the pool): the worker hands them the whole group on one mover, since
            splitting it across movers only makes the tier's calls compete with each other.
        readers: reads of this tier that pay off in flight at once, each leg a task on threads of
            the tier's own beside the byte movers (the disk: a reader waiting on the device holds
            no CPU, so more readers than movers keep more I/O in flight); 0: its reads run on the movers.
    """

    mapped: bool = False
    batched_reads: bool = False
    pipelined: bool = False
    readers: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.readers, bool) or not isinstance(self.readers, int) or self.readers < 0:
            raise ValueError(f"TierCapabilities: readers must be an integer >= 0, got {self.readers!r}")


class Tier(abc.ABC):
    medium: Medium
    shared: bool = False  # other processes put blocks here too (``find`` sees them)
    capabilities: TierCapabilities = TierCapabilities()  # a file or a store: no view, one leg a call

    def __init__(self, layout: KVLayout, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"{self.medium.label} tier: capacity_bytes must be >= 0, got {capacity_bytes}")
        self.layout = layout
        self.capacity_bytes = capacity_bytes

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_bytes // self.layout.block_bytes

    @abc.abstractmethod
    def write(self, slot: int, key: BlockKey, src: torch.Tensor) -> None:
        """Store one block's bytes (uint8 ``[layers, layer_bytes]``, any device) in ``slot``."""

    @abc.abstractmethod
    def read_into(self, slot: int, key: BlockKey, dst: torch.Tensor, layers: slice = slice(None)) -> None:
        """Copy the block's ``layers`` into ``dst`` (uint8 ``[n_layers, layer_bytes]``).

        Raises:
            CorruptBlock: the stored bytes do not verify; nothing valid was written to ``dst``.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release buffers, files and connections."""

    def read_many_into(
        self, slots: list[int], keys: list[BlockKey], dsts: list[torch.Tensor], layers: slice = slice(None)
    ) -> list[BaseException | None]:
        """``read_into`` for several blocks; per block None or the error it met (one block's
        failure does not stop the others). Memory tiers batch it into one copy, the pool into
        one call."""
        return [outcome(self.read_into, slot, key, dst, layers) for slot, key, dst in zip(slots, keys, dsts, strict=True)]

    def write_many(self, slots: list[int], keys: list[BlockKey], srcs: list[torch.Tensor]) -> list[BaseException | None]:
        """``write`` for several blocks; per block None or the error it met."""
        return [outcome(self.write, slot, key, src) for slot, key, src in zip(slots, keys, srcs, strict=True)]

    def write_pieces(self, slots: list[int], keys: list[BlockKey], blocks: Sequence[Pieces]) -> list[BaseException | None]:
        """Store several whole blocks, each given as its pieces (``Pieces``: their concatenation
        is the block's ``layout.block_bytes`` bytes). Per block None or the error ``write`` would
        have raised for it. The pieces are not read after the call returns (but a pool put that
        timed out may still read them; its object is then undone, as for ``write``; and a memory
        tier on CUDA copies from pinned pieces on the current stream, as its ``write`` does).

        By default: each block gathered into a temporary (one copy), then ``write_many``.

        Raises:
            ValueError: a block's pieces are not contiguous uint8 1-D CPU tensors of
                ``layout.block_bytes`` bytes in all.
        """
        self._check_pieces(blocks)
        shape = (self.layout.num_layers, self.layout.layer_bytes)
        srcs = [(pieces[0] if len(pieces) == 1 else torch.cat(list(pieces))).view(shape) for pieces in blocks]
        return self.write_many(slots, keys, srcs)

    def read_pieces(self, slots: list[int], keys: list[BlockKey], blocks: Sequence[Pieces]) -> list[BaseException | None]:
        """Read whole blocks into their pieces, verified. Per block None (its bytes in place,
        verified) or the error ``read_into`` would have raised for it (BlockMissing,
        CorruptBlock, TierUnavailable, TransferAbandoned, ...). After an error a block's pieces
        may hold some of its bytes and must not be used; after TransferAbandoned a stray
        transfer may still write them until ``error.settled`` (a Future) completes.

        By default: ``read_many_into`` temporaries, then each block that verified scattered
        into its pieces (one copy).

        Raises:
            ValueError: as ``write_pieces``.
        """
        self._check_pieces(blocks)
        shape = (self.layout.num_layers, self.layout.layer_bytes)
        temps = [torch.empty(shape, dtype=torch.uint8) for _ in blocks]
        out = self.read_many_into(slots, keys, temps)
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for pieces, temp, error in zip(blocks, temps, out, strict=True):
            if error is None:
                dsts += pieces
                srcs += split_like(temp.view(-1), pieces)
            elif getattr(error, "settled", None) is not None:  # a stray transfer may write it: keep it alive
                error.settled.add_done_callback(lambda _, temp=temp: temp)
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return out

    def view(self, slot: int) -> torch.Tensor | None:
        """The slot's bytes in place (memory tiers: ``capabilities.mapped``), for zero-copy
        transfers; else None."""
        return None

    def discard(self, slot: int, key: BlockKey) -> None:
        """Forget a block's bytes as it leaves the tier (disk: delete its file)."""

    def recover(self) -> list[BlockKey]:
        """Blocks found intact at start (persistent tiers), oldest first; more than
        ``capacity_blocks`` where the tier was reopened smaller (the cache adopts them all and
        evicts the excess as new blocks need room)."""
        return []

    def find(self, keys: list[BlockKey]) -> list[bool]:
        """Which of ``keys`` this tier holds that others may have put there (``shared`` tiers);
        False where it cannot say."""
        return [False] * len(keys)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def unavailable(self) -> str | None:
        """Why the tier cannot serve now (a pool that is down); None when it can."""
        return None

    def _check_pieces(self, blocks: Sequence[Pieces]) -> None:
        """Raises ValueError unless every block is contiguous uint8 1-D CPU pieces of
        ``layout.block_bytes`` bytes in all."""
        for i, pieces in enumerate(blocks):
            for piece in pieces:
                if (piece.dtype != torch.uint8 or piece.dim() != 1 or piece.device.type != "cpu"
                        or not piece.is_contiguous()):
                    layout = "contiguous" if piece.is_contiguous() else "not contiguous"
                    raise ValueError(
                        f"{self.medium.label} tier: block {i}: pieces must be contiguous uint8 1-D CPU tensors, got "
                        f"{piece.dtype} {list(piece.shape)} on {piece.device} ({layout})"
                    )
            total = sum(piece.numel() for piece in pieces)
            if total != self.layout.block_bytes:
                raise ValueError(
                    f"{self.medium.label} tier: block {i}: pieces add up to {total} bytes, a block is "
                    f"{self.layout.block_bytes}"
                )

    def _layer_range(self, layers: slice) -> tuple[int, int]:
        """``layers`` as ``(start, stop)`` layer indices, ``start <= stop``.

        Raises:
            ValueError: ``layers`` has a step other than 1.
        """
        start, stop, step = layers.indices(self.layout.num_layers)
        if step != 1:
            raise ValueError(f"{self.medium.label} tier: layers must be a contiguous range, got {layers}")
        return start, max(start, stop)


def split_like(flat: torch.Tensor, pieces: Pieces) -> list[torch.Tensor]:
    """``flat`` (1-D) cut into consecutive views of the sizes of ``pieces``, in order."""
    return list(flat.split([piece.numel() for piece in pieces]))


def outcome(call, *args) -> BaseException | None:
    """None once ``call(*args)`` returns, or the exception it raised."""
    try:
        call(*args)
    except Exception as error:  # noqa: BLE001 - per block, for the caller to classify
        return error
    return None
