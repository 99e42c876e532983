"""An LRU set of chained block ids: the one cache model trace analysis and the simulator share.

A request hits on the leading run of its ids present (chained ids: a block is usable only if
every block before it is); then its ids are inserted or refreshed in order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class BlockLRU:
    """An LRU set of block ids holding at most ``capacity_blocks`` (``None``: unlimited)."""

    def __init__(self, capacity_blocks: int | None) -> None:
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be non-negative, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()  # first key = least recently used

    def __len__(self) -> int:
        return len(self._blocks)

    def leading_run(self, hash_ids: Sequence[int]) -> int:
        """How many of ``hash_ids``, from the first, are present."""
        run = 0
        for block_id in hash_ids:
            if block_id not in self._blocks:
                break
            run += 1
        return run

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._blocks

    def touch(self, hash_ids: Sequence[int]) -> list[int]:
        """Insert or refresh ``hash_ids`` in order, evicting the least recently used when full.

        Returns the evicted ids, oldest first (a write-back hierarchy demotes them).
        """
        evicted: list[int] = []
        if self.capacity_blocks == 0:
            return evicted
        blocks = self._blocks
        for block_id in hash_ids:
            if block_id in blocks:
                blocks.move_to_end(block_id)
            else:
                blocks[block_id] = None
                if self.capacity_blocks is not None and len(blocks) > self.capacity_blocks:
                    evicted.append(blocks.popitem(last=False)[0])
        return evicted

    def refresh(self, hash_ids: Sequence[int]) -> None:
        """Mark those of ``hash_ids`` present as recently used; insert nothing."""
        blocks = self._blocks
        for block_id in hash_ids:
            if block_id in blocks:
                blocks.move_to_end(block_id)
