"""The first blocks of the prompts a server sent to store: a lookup of any other prompt is a miss (pure).

A cached prefix is a chain of blocks keyed from its first block's tokens on: no block of a
prompt can be served unless its first block is. A server whose caches started empty and share
no pool holds only what its own scheduler sent to store, so the scheduler can answer most
misses itself, with no question to the workers: the prompt's first block was never stored.
Only where the first block was stored (it may since have been evicted, or its store dropped)
is the worker asked.

The record is bounded: past ``capacity`` first blocks the least recently stored or asked for is
forgotten, and a prompt starting with it is then asked of the workers no more (a miss, so it is
recomputed: never wrong KV). ``capacity`` is meant to be what the tiers can hold in blocks, past
which that many first blocks cannot all still be cached.

Tokens are compared by a hash of the first block's ids (a collision costs one question).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class StoredFirstBlocks:
    """The first blocks of prompts stored, most recent last (see the module text).

    Args:
        block_tokens: tokens per block.
        capacity: how many first blocks are remembered at most.
    """

    def __init__(self, block_tokens: int, capacity: int) -> None:
        if block_tokens <= 0 or capacity <= 0:
            raise ValueError(f"StoredFirstBlocks needs block_tokens > 0 and capacity > 0, got {block_tokens}, "
                             f"{capacity}")
        self.block_tokens = block_tokens
        self.capacity = capacity
        self._firsts: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._firsts)

    def _key(self, tokens: Sequence[int]) -> int | None:
        if len(tokens) < self.block_tokens:
            return None
        return hash(tuple(tokens[: self.block_tokens]))

    def stored(self, tokens: Sequence[int]) -> None:
        """A prompt beginning with ``tokens`` had its first block sent to store."""
        key = self._key(tokens)
        if key is None:
            return
        self._firsts[key] = None
        self._firsts.move_to_end(key)
        while len(self._firsts) > self.capacity:
            self._firsts.popitem(last=False)

    def may_hold(self, tokens: Sequence[int]) -> bool:
        """Whether a prompt beginning with ``tokens`` may have cached blocks (False: it has none)."""
        key = self._key(tokens)
        if key is None or key not in self._firsts:
            return False
        self._firsts.move_to_end(key)
        return True
