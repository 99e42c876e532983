"""The blocks of the prompts a server was sent, to tell a workload with reuse from one without (pure).

A block kvstrata serves is, by definition, one an earlier prompt had too: every hit is a repeat.
So the share of prompt blocks that repeat an earlier prompt's bounds the share a store could ever
serve, and it is seen at once, as prompts arrive, whether or not anything was stored: a workload
whose prompts share nothing shows it from its first requests, long before a store could have come
back (:class:`~kvstrata.policies.saving.SaveOrSkip` weighs it).

Keys are vLLM's block hashes, which chain each block onto its prefix: a block's hash repeats only
where its whole prefix does, so the repeats of a prompt are its leading blocks seen before.

The record is bounded: past ``capacity`` blocks the least recently seen is forgotten (a repeat
older than what the tiers can hold could not be served anyway). It keeps each key's ``hash``
only (an int, whatever the key: about 100 bytes a block; a collision counts one repeat too many).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence


class SeenBlocks:
    """Block keys of the prompts seen, most recent last.

    Args:
        capacity: how many blocks are remembered at most.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"SeenBlocks needs capacity > 0, got {capacity}")
        self.capacity = capacity
        self._seen: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def observe(self, keys: Sequence[Hashable]) -> int:
        """A prompt's full blocks' keys, in order: how many leading ones an earlier prompt had;
        all are remembered from now on."""
        seen = self._seen
        hashes = [hash(key) for key in keys]
        repeated = 0
        while repeated < len(hashes) and hashes[repeated] in seen:
            repeated += 1
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)
        return repeated
