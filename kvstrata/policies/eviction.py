"""Eviction policies: which unpinned blocks leave a full tier first.

A policy only orders keys; the block table decides which keys may go (READY and unpinned).
"""

from __future__ import annotations

import enum
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator
from typing import Protocol

from kvstrata.index.keys import BlockKey


class EvictionPolicy(Protocol):
    def inserted(self, key: BlockKey) -> None: ...
    def accessed(self, key: BlockKey) -> None: ...
    def removed(self, key: BlockKey) -> None: ...
    def order(self) -> Iterator[BlockKey]:
        """Keys from the first to evict to the last."""
        ...


class LRU:
    """Least recently used first."""

    def __init__(self) -> None:
        self._keys: OrderedDict[BlockKey, None] = OrderedDict()

    def inserted(self, key: BlockKey) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)

    def accessed(self, key: BlockKey) -> None:
        if key in self._keys:
            self._keys.move_to_end(key)

    def removed(self, key: BlockKey) -> None:
        self._keys.pop(key, None)

    def order(self) -> Iterator[BlockKey]:
        return iter(list(self._keys))


class LFU:
    """Least frequently used first; ties go to the least recently used."""

    def __init__(self) -> None:
        self._count: dict[BlockKey, int] = {}
        self._buckets: defaultdict[int, OrderedDict[BlockKey, None]] = defaultdict(OrderedDict)

    def inserted(self, key: BlockKey) -> None:
        self.removed(key)
        self._count[key] = 1
        self._buckets[1][key] = None

    def accessed(self, key: BlockKey) -> None:
        count = self._count.get(key)
        if count is None:
            return
        del self._buckets[count][key]
        if not self._buckets[count]:
            del self._buckets[count]
        self._count[key] = count + 1
        self._buckets[count + 1][key] = None

    def removed(self, key: BlockKey) -> None:
        count = self._count.pop(key, None)
        if count is not None:
            del self._buckets[count][key]
            if not self._buckets[count]:
                del self._buckets[count]

    def order(self) -> Iterator[BlockKey]:
        return iter([k for count in sorted(self._buckets) for k in self._buckets[count]])


class Eviction(enum.Enum):
    LRU = "lru"
    LFU = "lfu"

    def make(self) -> EvictionPolicy:
        factory: Callable[[], EvictionPolicy] = {Eviction.LRU: LRU, Eviction.LFU: LFU}[self]
        return factory()
