"""vLLM v1's KV memory as its prefix-caching block pool sees it (pure): the blocks a server has,
which of them hold a cached full block, and which are free to reuse, oldest first.

The rules followed (vLLM's ``BlockPool`` and ``KVCacheManager``):

* ``--num-gpu-blocks-override`` blocks, one of them the null block: ``blocks - 1`` usable.
* A block holds a cached prefix once it is full of computed tokens; its key chains from the
  first block (:func:`chain_keys`), so a hit is the leading run of a prompt's keys held.
* A hit stops a block short of the prompt's last token (vLLM computes at least that token).
* Free blocks wait in one queue, the least recently freed first; taking a block for new
  tokens takes the queue's head and drops whatever prefix it held. A request's blocks are freed
  last block first, so a prompt's tail goes before its head; a freed block that holds no cached
  prefix (a partial last block) goes to the queue's head, to be reused first.
* A cached block that a new request hits leaves the queue while in use (reference counts).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

BlockKey = int


def chain_keys(tokens: Sequence[int], block_tokens: int, start: tuple[BlockKey, ...] = ()) -> tuple[BlockKey, ...]:
    """Keys of every full block of ``tokens``: block ``k``'s names the first ``k + 1`` blocks.
    ``start``: keys already chained for a prefix of ``tokens`` (extended, not recomputed)."""
    keys = list(start)
    parent = keys[-1] if keys else 0
    for k in range(len(keys), len(tokens) // block_tokens):
        parent = hash((parent, tuple(tokens[k * block_tokens:(k + 1) * block_tokens])))
        keys.append(parent)
    return tuple(keys)


@dataclass
class PrefixBlocks:
    """One server's KV blocks (see the module text).

    Attributes:
        usable: blocks requests can hold (the override less the null block).
    """

    usable: int
    _free: OrderedDict[int, None] = field(default_factory=OrderedDict)  # block -> None, head evicted first
    _key_of: dict[int, BlockKey] = field(default_factory=dict)
    _block_of: dict[BlockKey, int] = field(default_factory=dict)
    _refs: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.usable < 1:
            raise ValueError(f"a server needs at least one usable KV block, got {self.usable}")
        self._free.update((b, None) for b in range(self.usable))

    @property
    def free(self) -> int:
        return len(self._free)

    def cached_run(self, keys: Sequence[BlockKey]) -> int:
        """How many of ``keys``, from the first, are cached here."""
        run = 0
        for key in keys:
            if key not in self._block_of:
                break
            run += 1
        return run

    def can_take(self, hit_blocks: Sequence[int], new: int) -> bool:
        """Whether ``new`` fresh blocks fit once the hit's blocks (cached, maybe free) are held."""
        hit_free = sum(1 for b in hit_blocks if b in self._free)
        return self.free - hit_free >= new

    def hit(self, keys: Sequence[BlockKey]) -> list[int]:
        """Hold the cached blocks of ``keys`` (all cached): their ids, in order."""
        blocks = [self._block_of[k] for k in keys]
        for b in blocks:
            self._free.pop(b, None)
            self._refs[b] = self._refs.get(b, 0) + 1
        return blocks

    def blocks_of(self, keys: Sequence[BlockKey]) -> list[int]:
        return [self._block_of[k] for k in keys]

    def take(self, n: int) -> list[int]:
        """``n`` fresh blocks from the head of the free queue, whatever they cached dropped.

        Raises:
            ValueError: fewer than ``n`` free (check :meth:`can_take` first).
        """
        if n > self.free:
            raise ValueError(f"{n} blocks asked for, {self.free} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            key = self._key_of.pop(b, None)
            if key is not None and self._block_of.get(key) == b:
                del self._block_of[key]
            self._refs[b] = 1
            out.append(b)
        return out

    def cache(self, block: int, key: BlockKey) -> None:
        """``block`` is full: it holds ``key``'s prefix (the first copy of a key is the one kept)."""
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key

    def release(self, blocks: Sequence[int]) -> None:
        """A request lets go of ``blocks`` (in its order): freed last block first, those holding
        no cached prefix to the head of the queue (reused first), the others to its tail."""
        first: list[int] = []
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                del self._refs[b]
                if b in self._key_of:
                    self._free[b] = None
                else:
                    first.append(b)
        for b in reversed(first):  # prepended in order: the first of them is taken first
            self._free[b] = None
            self._free.move_to_end(b, last=False)
