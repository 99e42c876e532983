"""An LRU set of chained block ids: the one cache model trace analysis and the simulator share.

A request hits on the leading run of its ids present (chained ids: a block is usable only if
every block before it is); then its ids are inserted or refreshed in order. The ordering is the
eviction policy's :class:`kvstrata.policies.eviction.LRU`; this adds the capacity and the run.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.policies.eviction import LRU


class BlockLRU(LRU[int]):
    """An LRU set of block ids holding at most ``capacity_blocks`` (``None``: unlimited)."""

    def __init__(self, capacity_blocks: int | None) -> None:
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be non-negative, got {capacity_blocks}")
        super().__init__()
        self.capacity_blocks = capacity_blocks

    def leading_run(self, hash_ids: Sequence[int]) -> int:
        """How many of ``hash_ids``, from the first, are present."""
        present, run = self._keys, 0
        for block_id in hash_ids:
            if block_id not in present:
                break
            run += 1
        return run

    def touch(self, hash_ids: Sequence[int]) -> list[int]:
        """Insert or refresh ``hash_ids`` in order, evicting the least recently used when full.

        Returns the evicted ids, oldest first (a write-back hierarchy demotes them). A cache of
        no blocks holds, and so evicts, nothing.
        """
        if self.capacity_blocks == 0:
            return []
        return self.inserted_all(hash_ids, self.capacity_blocks)

    def refresh(self, hash_ids: Sequence[int]) -> None:
        """Mark those of ``hash_ids`` present as recently used; insert nothing."""
        self.accessed_all(hash_ids)
