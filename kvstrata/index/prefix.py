"""The prefix index: which tiers hold each block, and the longest cached prefix of a sequence.

One dict maps a block key to a bitmask of the media holding it READY. The block manager keeps
it in step with every tier's block table (it adds a medium when a block becomes READY there,
removes it when the block leaves). A lookup is one dict probe per block, in C (``map``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvstrata.index.keys import BlockKey
from kvstrata.media import FASTEST_BY_MASK, Medium


@dataclass(frozen=True)
class Match:
    """The longest cached prefix of a sequence's blocks.

    Attributes:
        keys: the keys of the matched blocks, in order.
        media: per matched block, the fastest medium holding it.
        block_size: tokens per block.
        total_blocks: full blocks in the looked-up sequence.
    """

    keys: tuple[BlockKey, ...]
    media: tuple[Medium, ...]
    block_size: int
    total_blocks: int

    @property
    def blocks(self) -> int:
        return len(self.keys)

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    def count(self, medium: Medium) -> int:
        return sum(1 for m in self.media if m is medium)


class PrefixIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._where: dict[BlockKey, int] = {}

    def add(self, key: BlockKey, medium: Medium) -> None:
        with self._lock:
            self._where[key] = self._where.get(key, 0) | medium.bit

    def discard(self, key: BlockKey, medium: Medium) -> None:
        with self._lock:
            mask = self._where.get(key, 0) & ~medium.bit
            if mask:
                self._where[key] = mask
            else:
                self._where.pop(key, None)

    def media(self, key: BlockKey) -> tuple[Medium, ...]:
        with self._lock:
            return Medium.from_mask(self._where.get(key, 0))

    def match(self, keys: list[BlockKey], block_size: int) -> Match:
        with self._lock:
            masks = list(map(self._where.get, keys))
        try:
            n = masks.index(None)
        except ValueError:
            n = len(masks)
        return Match(tuple(keys[:n]), tuple(map(FASTEST_BY_MASK.__getitem__, masks[:n])), block_size, len(keys))

    def __len__(self) -> int:
        with self._lock:
            return len(self._where)
