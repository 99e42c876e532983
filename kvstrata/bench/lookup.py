"""How long keying and looking up a long prompt takes, next to a vLLM-style baseline.

Everything runs in one process on the same random token ids, so the numbers compare directly:

- ``ours``: ``block_keys`` (namespace-chained xxh3-128 over uint32 ids, with input checks) then
  ``PrefixIndex.match`` with every block present on two media, the worst case for a lookup
  (nothing stops it early and every block needs its fastest medium resolved).
- ``hash_only``: ``block_keys`` alone.
- ``sha256_pickle``: vLLM's prefix-caching hash, ``sha256(pickle.dumps((parent, tuple(block))))``
  chained per block, over a Python list of ids (what vLLM holds; the list is built untimed).
- ``xxh3_loop``: the bare chained xxh3-128 loop over the ids' bytes, no checks: the floor for a
  chained hash driven from Python. It yields the same keys as ``block_keys``.
"""

from __future__ import annotations

import gc
import hashlib
import pickle
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import xxhash

from kvstrata.index.keys import BlockKey, Namespace, block_keys
from kvstrata.index.prefix import PrefixIndex
from kvstrata.media import Medium

VOCAB = 128_256  # Llama 3's vocabulary: ids need the full 17 bits, as real prompts do


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


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm caches and lazily built state (the namespace digest) outside the timing
    samples = []
    enabled = gc.isenabled()
    gc.disable()  # a collection landing in one sample is noise, not the cost of the code
    try:
        for _ in range(repeats):
            start = time.perf_counter_ns()
            fn()
            samples.append(time.perf_counter_ns() - start)
    finally:
        if enabled:
            gc.enable()
    return statistics.median(samples) / 1e6


@dataclass(frozen=True)
class LookupTimes:
    """Median milliseconds of each variant (see the module text) on ``tokens`` ids."""

    block_size: int
    tokens: int
    ours_ms: float
    hash_only_ms: float
    sha256_pickle_ms: float
    xxh3_loop_ms: float


def hash_and_lookup_ms(tokens: int = 131072, block_size: int = 256, repeats: int = 50) -> LookupTimes:
    """Median milliseconds to key and look up ``tokens`` random ids, and the baselines.

    Args:
        tokens: prompt length in tokens (a partial last block is hashed by nobody).
        block_size: tokens per block.
        repeats: timed runs per variant; the median is reported.

    """
    for name, value in (("tokens", tokens), ("block_size", block_size), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if tokens < block_size:
        raise ValueError(f"tokens ({tokens}) must cover at least one block of {block_size}")

    ids = np.random.default_rng(0).integers(0, VOCAB, size=tokens, dtype=np.uint32)
    ids_list = ids.tolist()
    namespace = Namespace("bench/model", "bfloat16", "bench-layout", block_size)

    index = PrefixIndex()
    keys: list[BlockKey] = block_keys(ids, namespace)
    for key in keys:  # all present, on two media, so match walks every block and picks HOST
        index.add(key, Medium.DISK)
        index.add(key, Medium.HOST)
    match = index.match(keys, block_size)
    if match.blocks != len(keys) or match.count(Medium.HOST) != len(keys):
        raise RuntimeError("benchmark index is not the all-present worst case")

    return LookupTimes(
        block_size=block_size,
        tokens=tokens,
        ours_ms=_median_ms(lambda: index.match(block_keys(ids, namespace), block_size), repeats),
        hash_only_ms=_median_ms(lambda: block_keys(ids, namespace), repeats),
        sha256_pickle_ms=_median_ms(lambda: sha256_pickle_keys(ids_list, block_size), repeats),
        xxh3_loop_ms=_median_ms(lambda: xxh3_loop_keys(ids, block_size, namespace.digest), repeats),
    )
