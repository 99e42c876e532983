"""The DRAM pool every instance of a simulation shares, keyed and sized by how blocks are shared.

One LRU of ``(namespace, block id)`` keys bounded in bytes. Each instance sees it through a
:class:`PoolView` with the interface of :class:`kvstrata.sim.lru.BlockLRU` (a leading run,
touch, refresh, membership), which maps the instance's block ids to its keys and charges each
insertion what the instance's block costs the pool (:func:`kvstrata.plan.sharing.pool_bytes`):

* TP-matched: the namespace is the writer's TP size, so an instance hits only blocks written
  at its own TP size, and a block costs every rank's copy of a replicated head;
* head-sliced: one namespace, one copy: any instance hits any block.

It also counts what the pool saw: its own hit ratio (the leading run of each request's blocks
present in the pool, whatever faster tiers held), and the copies it keeps of each distinct
block id (its bytes over one logical copy), at the end and averaged over arrivals.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

_Key = tuple[Hashable, int]


@dataclass(frozen=True)
class PoolStats:
    """What a shared pool held and served over one run.

    Attributes:
        capacity_bytes: the pool's KV capacity.
        block_bytes: one logical (head-sliced) copy of a block.
        lookup_blocks: blocks of every request looked up in the pool.
        hit_blocks: of those, the leading runs present.
        input_tokens: prompt tokens of every request.
        hit_tokens: prompt tokens the leading runs cover (the last block may be partial).
        used_bytes: the pool's bytes at the end.
        distinct_blocks: distinct block ids (prefix blocks) held at the end, in any namespace.
        copies_mean: copies per distinct block at the end (bytes over ``block_bytes``), mean.
        copies_max: the same, the largest.
        copies_mean_time_avg: ``copies_mean`` averaged over the arrivals (sampled after each).
    """

    capacity_bytes: int
    block_bytes: int
    lookup_blocks: int
    hit_blocks: int
    input_tokens: int
    hit_tokens: int
    used_bytes: int
    distinct_blocks: int
    copies_mean: float
    copies_max: float
    copies_mean_time_avg: float

    @property
    def block_hit_ratio(self) -> float:
        return self.hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    def to_json(self) -> dict:
        return {
            "capacity_bytes": self.capacity_bytes,
            "block_bytes": self.block_bytes,
            "hit_ratio_blocks": self.block_hit_ratio,
            "hit_ratio_tokens": self.token_hit_ratio,
            "used_bytes": self.used_bytes,
            "distinct_blocks": self.distinct_blocks,
            "copies_mean": self.copies_mean,
            "copies_max": self.copies_max,
            "copies_mean_time_avg": self.copies_mean_time_avg,
        }


class SharedPool:
    """An LRU of ``(namespace, block id)`` keys holding at most ``capacity_bytes`` of their costs.

    Args:
        capacity_bytes: what the keys' costs may sum to.
        block_bytes: one logical copy of a block, the unit copies are counted in.
    """

    def __init__(self, capacity_bytes: int, block_bytes: int) -> None:
        if capacity_bytes < 0 or block_bytes <= 0:
            raise ValueError(f"a pool needs capacity_bytes >= 0 and block_bytes > 0, got {capacity_bytes}, {block_bytes}")
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.used_bytes = 0
        self._keys: OrderedDict[_Key, int] = OrderedDict()  # first = least recently used; value: its cost
        self._block_bytes: dict[int, int] = {}  # block id -> bytes over all its namespaces
        self._lookups = [0, 0, 0, 0]  # lookup blocks, hit blocks, input tokens, hit tokens
        self._samples, self._copies_sum = 0, 0.0

    def view(self, namespace: Hashable, cost_bytes: int) -> PoolView:
        """The pool as one instance sees it: its keys in ``namespace``, each costing ``cost_bytes``."""
        return PoolView(self, namespace, cost_bytes)

    def insert(self, keys: Sequence[_Key], cost_bytes: int) -> list[_Key]:
        """Insert or refresh ``keys`` in order; return the keys pushed out, oldest first.

        A key that alone exceeds the capacity is not held (as a cache of no blocks holds none).
        """
        order, out = self._keys, []
        for key in keys:
            if key in order:
                order.move_to_end(key)
                continue
            if cost_bytes > self.capacity_bytes:
                continue
            order[key] = cost_bytes
            self._charge(key[1], cost_bytes)
            while self.used_bytes > self.capacity_bytes:
                old, cost = order.popitem(last=False)
                self._charge(old[1], -cost)
                out.append(old)
        return out

    def _charge(self, block_id: int, cost_bytes: int) -> None:
        self.used_bytes += cost_bytes
        left = self._block_bytes.get(block_id, 0) + cost_bytes
        if left:
            self._block_bytes[block_id] = left
        else:
            del self._block_bytes[block_id]

    def refresh(self, keys: Sequence[_Key]) -> None:
        order = self._keys
        for key in keys:
            if key in order:
                order.move_to_end(key)

    def contains(self, key: _Key) -> bool:
        return key in self._keys

    def looked_up(self, blocks: int, hit_blocks: int, input_tokens: int, hit_tokens: int) -> None:
        """Count one request's look-up in the pool."""
        for i, n in enumerate((blocks, hit_blocks, input_tokens, hit_tokens)):
            self._lookups[i] += n

    def sample(self) -> None:
        """Add the copies per block now to the time average (one sample per arrival)."""
        self._samples += 1
        self._copies_sum += self._copies_mean()

    def _copies_mean(self) -> float:
        blocks = len(self._block_bytes)
        return self.used_bytes / self.block_bytes / blocks if blocks else 0.0

    def stats(self) -> PoolStats:
        lookup, hits, tokens, hit_tokens = self._lookups
        most = max(self._block_bytes.values(), default=0)
        return PoolStats(
            self.capacity_bytes, self.block_bytes, lookup, hits, tokens, hit_tokens, self.used_bytes,
            len(self._block_bytes), self._copies_mean(), most / self.block_bytes,
            self._copies_sum / self._samples if self._samples else 0.0,
        )


class PoolView:
    """One instance's view of a :class:`SharedPool`: :class:`kvstrata.sim.lru.BlockLRU`'s interface."""

    def __init__(self, pool: SharedPool, namespace: Hashable, cost_bytes: int) -> None:
        self.pool = pool
        self.namespace = namespace
        self.cost_bytes = cost_bytes

    def __contains__(self, block_id: object) -> bool:
        return self.pool.contains((self.namespace, block_id))

    def leading_run(self, hash_ids: Sequence[int]) -> int:
        """How many of ``hash_ids``, from the first, the pool holds in this view's namespace."""
        run, ns, keys = 0, self.namespace, self.pool._keys
        for block_id in hash_ids:
            if (ns, block_id) not in keys:
                break
            run += 1
        return run

    def touch(self, hash_ids: Sequence[int]) -> list[int]:
        """Insert or refresh ``hash_ids`` in order; return the ids of this namespace pushed out
        (a write-back hierarchy demotes them into this instance's next tier)."""
        ns = self.namespace
        out = self.pool.insert([(ns, b) for b in hash_ids], self.cost_bytes)
        return [b for n, b in out if n == ns]

    def refresh(self, hash_ids: Sequence[int]) -> None:
        self.pool.refresh([(self.namespace, b) for b in hash_ids])
