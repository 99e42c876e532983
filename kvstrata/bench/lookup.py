"""How long keying and looking up a long prompt takes, beside the bare hash loop it is built on,
and how the lookup scales with the blocks indexed.

Everything runs in one process on the same random token ids (uint32, as engines should pass):

- ``ours``: ``block_keys`` (namespace-chained xxh3-128 over uint32 ids, with input checks) then
  ``PrefixIndex.match`` with every block present on two media, the worst case for a lookup
  (nothing stops it early and every block needs its fastest medium resolved).
- ``hash_only``: ``block_keys`` alone.
- ``cache``: ``TieredCache.lookup`` of a CPU cache whose device and host tiers both hold every
  block (adopted: no bytes): the real path, with its tenant's namespace and metrics.
- ``sha256_pickle``: vLLM's prefix-caching hash, ``sha256(pickle.dumps((parent, tuple(block))))``
  chained per block, over a Python list of ids (what vLLM holds; the list is built untimed).
- ``xxh3_loop``: the bare chained xxh3-128 loop over the ids' bytes, no checks: the floor for a
  chained hash driven from Python, and the baseline of the goal. It yields the same keys as
  ``block_keys``.

Method (:mod:`kvstrata.rounds`): rounds; a variant's sample in a round is the median of
as many calls as fill :data:`SAMPLE_S` (a call at 256 tokens a block is ~0.2 ms), and the calls
of the variants alternate one by one (ours, baseline, ours, baseline ...) in an order that
rotates from round to round; the garbage collector is off. A ratio is the median over rounds of the
ratio within each round, with the lowest and highest round's beside it.

Scaling (:func:`index_scaling`): the same lookup (hash + match, all blocks present) against an
index holding 1K blocks and one holding 1M, interleaved the same way; the prompt's blocks sit
among the others in insertion order, as a long-running cache's would.
"""

from __future__ import annotations

import hashlib
import math
import os
import pickle
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import xxhash

from kvstrata.calibrate.kvdata import VOCAB
from kvstrata.rounds import Rounds, Spread, rotated
from kvstrata.index.keys import KEY_BYTES, BlockKey, Namespace, block_keys
from kvstrata.index.prefix import PrefixIndex
from kvstrata.media import Medium
from kvstrata.timing import collector_paused

SAMPLE_S = 5e-3  # each sample calls a variant about this long in all (its median is the sample)
MAX_CALLS = 25


def sha256_pickle_keys(ids: list[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """vLLM-style chained keys: sha256 over the pickled (parent hash, block token tuple)."""
    keys = []
    for start in range(0, len(ids) - block_size + 1, block_size):
        block = tuple(ids[start : start + block_size])
        parent = hashlib.sha256(pickle.dumps((parent, block), protocol=pickle.HIGHEST_PROTOCOL)).digest()
        keys.append(parent)
    return keys


def xxh3_loop_keys(ids: np.ndarray, block_size: int, parent: bytes) -> list[bytes]:
    """The bare loop: xxh3_128(parent || block's uint32 bytes), chained; ``ids`` must be uint32."""
    data = ids.tobytes()
    step = block_size * 4
    digest = xxhash.xxh3_128_digest
    keys = []
    for start in range(0, len(data) - step + 1, step):
        parent = digest(parent + data[start : start + step])
        keys.append(parent)
    return keys


@dataclass(frozen=True)
class LookupTimes:
    """Median milliseconds of each variant (see the module text) on ``tokens`` ids, and the
    paired ratios: ``ours_of_xxh3`` is the goal's figure (hash + lookup over the bare loop)."""

    block_size: int
    tokens: int
    ours_ms: float
    hash_only_ms: float
    cache_ms: float
    sha256_pickle_ms: float
    xxh3_loop_ms: float
    ours_of_xxh3: Spread
    hash_of_xxh3: Spread
    cache_of_xxh3: Spread
    ours_of_sha256: Spread


@dataclass(frozen=True)
class IndexScaling:
    """The lookup of one prompt (``blocks`` blocks, all present) with ``small`` and ``large``
    blocks indexed: medians in milliseconds and paired ratios large / small, of the whole lookup
    (``lookup``: hash + match, what a request pays; the goal's figure) and of the match alone."""

    block_size: int
    blocks: int
    small: int
    large: int
    lookup_small_ms: float
    lookup_large_ms: float
    match_small_ms: float
    match_large_ms: float
    lookup: Spread
    match: Spread


def _check(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _calls_per_sample(fn: Callable[[], object]) -> int:
    fn()  # warm caches and lazily built state (the namespace digest) outside the timing
    start = time.perf_counter()
    fn()
    return max(1, min(MAX_CALLS, math.ceil(SAMPLE_S / max(time.perf_counter() - start, 1e-9))))


def interleaved(variants: dict[str, Callable[[], object]], repeats: int) -> Rounds:
    """``repeats`` rounds; a variant's sample in a round is the median of its calls' seconds.
    A round makes as many passes as the variant with the most calls to make needs; each pass
    calls every variant once, in an order that rotates from round to round (ours, baseline,
    ours, baseline ...), so a burst of noise lands on both sides of a ratio, and a call that lost
    the CPU midway (this is a shared machine) moves the median of its round little."""
    calls = {name: _calls_per_sample(fn) for name, fn in variants.items()}
    rounds = Rounds()
    names = list(variants)
    clock = time.perf_counter
    with collector_paused():
        for r in range(repeats):
            order = rotated(names, r)
            spent: dict[str, list[float]] = {name: [] for name in names}
            for _ in range(max(calls.values())):
                for name in order:
                    if len(spent[name]) < calls[name]:
                        start = clock()
                        variants[name]()
                        spent[name].append(clock() - start)
            for name in names:
                rounds.add(name, statistics.median(spent[name]))
    return rounds


def _median_ms(rounds: Rounds, name: str) -> float:
    return statistics.median(rounds.seconds[name]) * 1e3


def token_ids(tokens: int) -> np.ndarray:
    """``tokens`` random token ids (seeded: every run hashes the same prompt)."""
    return np.random.default_rng(0).integers(0, VOCAB, size=tokens, dtype=np.uint32)


def _namespace(block_size: int) -> Namespace:
    return Namespace("bench/model", "bfloat16", "bench-layout", block_size)


def hash_and_lookup_ms(tokens: int = 131072, block_size: int = 256, repeats: int = 30) -> LookupTimes:
    """Key and look up ``tokens`` random ids, beside the baselines, in interleaved rounds.

    Args:
        tokens: prompt length in tokens (a partial last block is hashed by nobody).
        block_size: tokens per block.
        repeats: timed rounds; medians and paired ratios are over them.
    """
    _check(tokens=tokens, block_size=block_size, repeats=repeats)
    if tokens < block_size:
        raise ValueError(f"tokens ({tokens}) must cover at least one block of {block_size}")

    ids = token_ids(tokens)
    ids_list = ids.tolist()
    namespace = _namespace(block_size)

    index = PrefixIndex()
    keys: list[BlockKey] = block_keys(ids, namespace)
    for key in keys:  # all present, on two media, so match walks every block and picks HOST
        index.add(key, Medium.DISK)
        index.add(key, Medium.HOST)
    match = index.match(keys, block_size)
    if match.blocks != len(keys) or match.count(Medium.HOST) != len(keys):
        raise RuntimeError("benchmark index is not the all-present worst case")

    with _all_present_cache(ids, block_size) as cache:
        rounds = interleaved({
            "ours": lambda: index.match(block_keys(ids, namespace), block_size),
            "hash_only": lambda: block_keys(ids, namespace),
            "cache": lambda: cache.lookup(ids),
            "sha256_pickle": lambda: sha256_pickle_keys(ids_list, block_size),
            "xxh3_loop": lambda: xxh3_loop_keys(ids, block_size, namespace.digest),
        }, repeats)

    return LookupTimes(
        block_size=block_size,
        tokens=tokens,
        ours_ms=_median_ms(rounds, "ours"),
        hash_only_ms=_median_ms(rounds, "hash_only"),
        cache_ms=_median_ms(rounds, "cache"),
        sha256_pickle_ms=_median_ms(rounds, "sha256_pickle"),
        xxh3_loop_ms=_median_ms(rounds, "xxh3_loop"),
        ours_of_xxh3=rounds.time_ratio_spread("ours", "xxh3_loop"),
        hash_of_xxh3=rounds.time_ratio_spread("hash_only", "xxh3_loop"),
        cache_of_xxh3=rounds.time_ratio_spread("cache", "xxh3_loop"),
        ours_of_sha256=rounds.time_ratio_spread("ours", "sha256_pickle"),
    )


@contextmanager
def _all_present_cache(ids: np.ndarray, block_size: int) -> Iterator[object]:
    """A CPU ``TieredCache`` (tiny blocks) whose device and host tiers hold every block of
    ``ids``, adopted without bytes: its lookups walk every block and pick the device."""
    from kvstrata.cache.config import CacheConfig
    from kvstrata.cache.tiered import TieredCache
    from kvstrata.kv.geometry import DType
    from kvstrata.kv.layout import KVLayout

    layout = KVLayout(1, block_size, 1, 8, DType.BF16)
    blocks = len(ids) // block_size
    config = CacheConfig(layout, "bench/model", device_bytes=blocks * layout.block_bytes,
                         host_bytes=blocks * layout.block_bytes, device="cpu")
    cache = TieredCache(config)
    try:
        keys = cache.keys(ids)
        for medium in (Medium.HOST, Medium.DEVICE):
            cache.manager.adopt(medium, keys)
        match = cache.lookup(ids)
        if match.blocks != len(keys) or match.count(Medium.DEVICE) != len(keys):
            raise RuntimeError("benchmark cache is not the all-present worst case")
        yield cache
    finally:
        cache.close()


def index_scaling(
    tokens: int = 131072, block_size: int = 256, small: int = 1_000, large: int = 1_000_000, repeats: int = 30
) -> IndexScaling:
    """The lookup of a ``tokens`` prompt against ``small`` and ``large`` blocks indexed.

    Raises:
        ValueError: ``small`` is below the prompt's blocks, or ``large`` below ``small``.
    """
    _check(tokens=tokens, block_size=block_size, small=small, large=large, repeats=repeats)
    ids = token_ids(tokens)
    namespace = _namespace(block_size)
    keys = block_keys(ids, namespace)
    if not keys or small < len(keys) or large < small:
        raise ValueError(f"need {len(keys)} (the prompt's blocks) <= small ({small}) <= large ({large}), and a block")
    indexes = {n: _index_holding(keys, n) for n in (small, large)}
    fresh = {n: _fresh_keys(keys, MAX_CALLS * (repeats + 2)) for n in (small, large)}  # hashes not cached yet

    def lookup(index: PrefixIndex) -> Callable[[], object]:
        return lambda: index.match(block_keys(ids, namespace), block_size)

    def match(index: PrefixIndex, pool: Iterator[list[BlockKey]]) -> Callable[[], object]:
        return lambda: index.match(next(pool), block_size)

    rounds = interleaved({
        "lookup.small": lookup(indexes[small]),
        "lookup.large": lookup(indexes[large]),
        "match.small": match(indexes[small], fresh[small]),
        "match.large": match(indexes[large], fresh[large]),
    }, repeats)
    for index in indexes.values():
        if index.match(keys, block_size).blocks != len(keys):
            raise RuntimeError("benchmark index is not the all-present case")
    return IndexScaling(
        block_size=block_size,
        blocks=len(keys),
        small=small,
        large=large,
        lookup_small_ms=_median_ms(rounds, "lookup.small"),
        lookup_large_ms=_median_ms(rounds, "lookup.large"),
        match_small_ms=_median_ms(rounds, "match.small"),
        match_large_ms=_median_ms(rounds, "match.large"),
        lookup=rounds.time_ratio_spread("lookup.large", "lookup.small"),
        match=rounds.time_ratio_spread("match.large", "match.small"),
    )


def _index_holding(keys: list[BlockKey], total: int) -> PrefixIndex:
    """An index of ``total`` blocks on the host: ``keys`` spread evenly among random others."""
    others = os.urandom(KEY_BYTES * (total - len(keys)))
    filler = [others[i : i + KEY_BYTES] for i in range(0, len(others), KEY_BYTES)]
    every = max(1, total // len(keys))
    ordered: list[BlockKey] = []
    it = iter(filler)
    for key in keys:
        ordered.extend(next(it) for _ in range(every - 1))
        ordered.append(key)
    ordered.extend(it)
    index = PrefixIndex()
    index.add_many(ordered, Medium.HOST)
    if len(index) != total:
        raise RuntimeError(f"benchmark index holds {len(index)} blocks, not {total}")
    return index


def _fresh_keys(keys: list[BlockKey], count: int) -> Iterator[list[BlockKey]]:
    """Copies of ``keys`` as new bytes objects, as ``block_keys`` returns them (a bytes object
    caches its hash: a probe of a key seen before skips hashing it)."""
    joined = b"".join(keys)
    made = [[joined[i : i + KEY_BYTES] for i in range(0, len(joined), KEY_BYTES)] for _ in range(count)]
    return iter(made)  # made before the timing starts
