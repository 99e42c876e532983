"""Eviction policies: which unpinned blocks leave a full tier first.

A policy only orders keys; the block table decides which keys may go (READY and unpinned). Where
every key may go (the simulator's caches, :class:`kvstrata.sim.lru.BlockLRU`), an :class:`LRU`
bounded by a capacity pushes the least recent out itself (:meth:`LRU.inserted_all`).
"""

from __future__ import annotations

import enum
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Generic, Protocol, TypeVar

from kvstrata.index.keys import BlockKey

K = TypeVar("K", bound=Hashable)


class EvictionPolicy(Protocol):
    def inserted(self, key: BlockKey) -> None: ...
    def accessed(self, key: BlockKey) -> None: ...
    def removed(self, key: BlockKey) -> None: ...
    def order(self) -> Iterator[BlockKey]:
        """Keys from the first to evict to the last."""
        ...


class LRU(Generic[K]):
    """Least recently used first: the package's one LRU ordering.

    The block tables order their :data:`BlockKey` s with one; the simulator's caches of block ids
    are ones bounded by a capacity. :meth:`inserted_all` and :meth:`accessed_all` take a request's
    keys in one call, so that the simulator's loop over blocks runs here without a method call per
    block; :meth:`inserted` and :meth:`accessed` are those with one key.
    """

    def __init__(self) -> None:
        self._keys: OrderedDict[K, None] = OrderedDict()  # first key = least recently used

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def inserted(self, key: K) -> None:
        self.inserted_all((key,))

    def accessed(self, key: K) -> None:
        self.accessed_all((key,))

    def removed(self, key: K) -> None:
        self._keys.pop(key, None)

    def order(self) -> Iterator[K]:
        return iter(list(self._keys))

    def inserted_all(self, keys: Iterable[K], capacity: int | None = None) -> list[K]:
        """Insert or refresh ``keys`` in order, so that the last is the most recently used.

        Args:
            keys: to insert (a key present is refreshed instead).
            capacity: if given, each insertion that takes the count past it pushes out the least
                recently used key, which can be one of ``keys`` inserted earlier in this call.

        Returns:
            The keys pushed out, oldest first (empty without a ``capacity``).
        """
        order, out = self._keys, []
        for key in keys:
            if key in order:
                order.move_to_end(key)
            else:
                order[key] = None
                if capacity is not None and len(order) > capacity:
                    out.append(order.popitem(last=False)[0])
        return out

    def accessed_all(self, keys: Iterable[K]) -> None:
        """Make those of ``keys`` present the most recently used, in order; insert nothing."""
        order = self._keys
        for key in keys:
            if key in order:
                order.move_to_end(key)


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
