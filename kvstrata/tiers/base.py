"""The tier interface: a narrow, byte-moving surface; bookkeeping lives in its BlockTable.

A tier stores whole blocks (``layout.block_bytes`` bytes, viewed as uint8 ``[layers,
layer_bytes]``) in slots. Its ``table`` (pure) says which key sits in which slot and in what
state; the tier's methods only move bytes. Three methods are required; the rest default.
"""

from __future__ import annotations

import abc

import torch

from kvstrata.index.keys import BlockKey
from kvstrata.kv.layout import KVLayout
from kvstrata.media import Medium
from kvstrata.policies.eviction import Eviction
from kvstrata.tiers.table import BlockTable


class Tier(abc.ABC):
    medium: Medium

    def __init__(self, layout: KVLayout, capacity_bytes: int, eviction: Eviction = Eviction.LRU) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"{self.medium.label} tier: capacity_bytes must be >= 0, got {capacity_bytes}")
        self.layout = layout
        self.capacity_bytes = capacity_bytes
        self.table = BlockTable(capacity_bytes // layout.block_bytes, eviction.make(), self.medium.label)

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
    ) -> None:
        """``read_into`` for several blocks at once; memory tiers batch it into one call."""
        for slot, key, dst in zip(slots, keys, dsts, strict=True):
            self.read_into(slot, key, dst, layers)

    def view(self, slot: int) -> torch.Tensor | None:
        """The slot's bytes in place (memory tiers), for zero-copy transfers; else None."""
        return None

    def discard(self, slot: int, key: BlockKey) -> None:
        """Forget a block's bytes after the table released it (disk: delete the file)."""

    def recover(self) -> list[tuple[BlockKey, int]]:
        """Blocks found intact at start (persistent tiers), as (key, slot) already READY in
        the table."""
        return []

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def _layer_range(self, layers: slice) -> tuple[int, int]:
        """``layers`` as ``(start, stop)`` layer indices, ``start <= stop``.

        Raises:
            ValueError: ``layers`` has a step other than 1.
        """
        start, stop, step = layers.indices(self.layout.num_layers)
        if step != 1:
            raise ValueError(f"{self.medium.label} tier: layers must be a contiguous range, got {layers}")
        return start, max(start, stop)
