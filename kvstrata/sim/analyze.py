"""Prefix-cache hit ratio of a trace, replayed through one LRU cache of blocks.

The model: requests arrive in timestamp order at a single cache holding ``cache_tokens //
BLOCK_TOKENS`` blocks (or unlimited). A request hits on its *leading* run of ``hash_ids`` present
at arrival (chained ids: a block is usable only if every block before it is), worth
``min(BLOCK_TOKENS * run, input_length)`` tokens, as the last block may be partial. Then all its
blocks are inserted or refreshed in order, so its last block is the most recently used; each
insertion into a full cache evicts the least recently used block first (which, when a request has
more blocks than the cache, can be one of its own earlier blocks).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvstrata.sim.lru import BlockLRU
from kvstrata.sim.trace import BLOCK_TOKENS, Request, sort_by_time


@dataclass(frozen=True)
class CapacityResult:
    """Hit figures at one cache size.

    Attributes:
        cache_tokens: the cache's size in tokens; ``None`` for an unlimited cache.
        hit_tokens: prompt tokens served from the cache, summed over requests.
        input_tokens: prompt tokens of all requests.
    """

    cache_tokens: int | None
    hit_tokens: int
    input_tokens: int

    @property
    def unlimited(self) -> bool:
        return self.cache_tokens is None

    @property
    def cache_blocks(self) -> int | None:
        return None if self.cache_tokens is None else self.cache_tokens // BLOCK_TOKENS

    @property
    def hit_ratio(self) -> float:
        """Hit tokens over input tokens; 0.0 for a trace without input tokens."""
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    def to_json(self) -> dict:
        return {
            "cache_tokens": "inf" if self.unlimited else self.cache_tokens,
            "hit_ratio": self.hit_ratio,
        }


@dataclass(frozen=True)
class TraceAnalysis:
    """A trace's shape and its hit ratio at each cache size asked for (in the order asked)."""

    requests: int
    input_tokens: int
    output_tokens: int
    unique_blocks: int
    capacities: tuple[CapacityResult, ...]

    @property
    def mean_input(self) -> float:
        return self.input_tokens / self.requests if self.requests else 0.0

    @property
    def mean_output(self) -> float:
        return self.output_tokens / self.requests if self.requests else 0.0

    def to_json(self) -> dict:
        return {
            "requests": self.requests,
            "mean_input": self.mean_input,
            "mean_output": self.mean_output,
            "unique_blocks": self.unique_blocks,
            "capacities": [c.to_json() for c in self.capacities],
        }


def hit_tokens(requests: Sequence[Request], cache_tokens: int | None) -> int:
    """Total hit tokens replaying ``requests`` (already in arrival order) through one LRU cache.

    Args:
        requests: in arrival order.
        cache_tokens: cache size in tokens (rounded down to whole blocks); ``None`` = unlimited.
    """
    if cache_tokens is not None and cache_tokens < 0:
        raise ValueError(f"cache_tokens must be non-negative, got {cache_tokens}")
    lru = BlockLRU(None if cache_tokens is None else cache_tokens // BLOCK_TOKENS)
    total = 0
    for r in requests:
        total += min(lru.leading_run(r.hash_ids) * BLOCK_TOKENS, r.input_length)
        lru.touch(r.hash_ids)
    return total


def analyze(
    requests: Iterable[Request], cache_tokens: Sequence[int | None]
) -> TraceAnalysis:
    """Shape of a trace and its hit ratio at each cache size (``None`` = unlimited).

    Requests are replayed in timestamp order (stable, so ties keep trace order); one pass per size.
    """
    ordered = sort_by_time(requests)
    input_tokens = sum(r.input_length for r in ordered)
    results = tuple(
        CapacityResult(c, hit_tokens(ordered, c), input_tokens) for c in cache_tokens
    )
    return TraceAnalysis(
        requests=len(ordered),
        input_tokens=input_tokens,
        output_tokens=sum(r.output_length for r in ordered),
        unique_blocks=len({b for r in ordered for b in r.hash_ids}),
        capacities=results,
    )
