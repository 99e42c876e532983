"""The tier interface: a narrow surface that moves bytes; what sits in which slot is the block
manager's (``kvstrata.manager``).

A tier stores whole blocks (``layout.block_bytes`` bytes, viewed as uint8 ``[layers,
layer_bytes]``) in ``capacity_blocks`` slots. Three methods are required; the rest default.
Errors a caller must tell apart are those of ``kvstrata.errors`` (a block that does not verify,
a block gone, a tier down, a transfer abandoned).
"""

from __future__ import annotations

import abc

import torch

from kvstrata.index.keys import BlockKey
from kvstrata.kv.layout import KVLayout
from kvstrata.media import Medium


class Tier(abc.ABC):
    medium: Medium
    shared: bool = False  # other processes put blocks here too (``find`` sees them)
    batched_reads: bool = False  # ``read_many_into`` is one call for many blocks (memory, the pool)
    # ``read_many_into`` and ``write_many`` overlap a whole batch's calls with their own checks
    # (the pool): the worker hands them the whole group on one mover, since splitting it across
    # movers only makes the tier's calls compete with each other.
    pipelined: bool = False
    # Reads of this tier that pay off in flight at once, each leg a task on threads of the
    # tier's own beside the byte movers (the disk: a reader waiting on the device holds no CPU,
    # so more readers than movers keep more I/O in flight); 0: its reads run on the movers.
    readers: int = 0

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
        return [_outcome(self.read_into, slot, key, dst, layers) for slot, key, dst in zip(slots, keys, dsts, strict=True)]

    def write_many(self, slots: list[int], keys: list[BlockKey], srcs: list[torch.Tensor]) -> list[BaseException | None]:
        """``write`` for several blocks; per block None or the error it met."""
        return [_outcome(self.write, slot, key, src) for slot, key, src in zip(slots, keys, srcs, strict=True)]

    def view(self, slot: int) -> torch.Tensor | None:
        """The slot's bytes in place (memory tiers), for zero-copy transfers; else None."""
        return None

    def discard(self, slot: int, key: BlockKey) -> None:
        """Forget a block's bytes as it leaves the tier (disk: delete its file)."""

    def recover(self) -> list[BlockKey]:
        """Blocks found intact at start (persistent tiers), oldest first, at most
        ``capacity_blocks``."""
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

    def _layer_range(self, layers: slice) -> tuple[int, int]:
        """``layers`` as ``(start, stop)`` layer indices, ``start <= stop``.

        Raises:
            ValueError: ``layers`` has a step other than 1.
        """
        start, stop, step = layers.indices(self.layout.num_layers)
        if step != 1:
            raise ValueError(f"{self.medium.label} tier: layers must be a contiguous range, got {layers}")
        return start, max(start, stop)


def _outcome(call, *args) -> BaseException | None:
    try:
        call(*args)
    except Exception as error:  # noqa: BLE001 - per block, for the caller to classify
        return error
    return None
