"""Restores through the whole cache of blocks found only in the pool (``kvstrata lab``'s workers;
kvstrata's side of ``bench remote``).

Another instance (``kvstrata.calibrate.ours_remote``, a RemoteTier under this cache's namespace)
put the blocks in the pool; a ``TieredCache`` of the same namespace finds them with
``lookup`` (its index misses, so it asks the pool ``exists`` and adopts what it finds) and
``load`` brings them to the device tier by one of the two restore paths of the seed:

- direct, ``remote -> device``: each block copied out of the remote tier's staging into its
  device slot (a CPU stand-in for HBM) and verified there;
- staged, ``remote -> host -> device``: the same into host-tier slots, then a copy host ->
  device, layer range by layer range. (No tier's memory is registered with the pool.)

Each restore is checked to have taken its path (``LoadResult.paths``) and verified byte for
byte on the device; afterwards the blocks leave the device and host tiers again (untimed;
the write policy is write-through, so eviction drops them rather than copying them down), so
every restore starts from blocks that are in the pool only.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from kvstrata.cache import CacheConfig, TieredCache
from kvstrata.index.prefix import Match
from kvstrata.calibrate.kvdata import timed_restore
from kvstrata.media import FetchPath, Medium, Route, route_text
from kvstrata.pool.client import PoolUnavailable
from kvstrata.tiers.memory import MemoryTier

ROUTES: dict[FetchPath, Route] = {
    FetchPath.DIRECT: (Medium.REMOTE, Medium.DEVICE),
    FetchPath.STAGED: (Medium.REMOTE, Medium.HOST, Medium.DEVICE),
}


class PoolReader:
    """A ``TieredCache`` on the pool that restores the measured blocks by one path.

    Args:
        base: the cache's configuration (layout, namespace, pool, mode); ``remote_path`` and
            the host tier's size are set here: ``path`` DIRECT needs no host tier, STAGED
            one that holds every block.
        path: DIRECT or STAGED.
        tokens: the token ids of the blocks.
        kv_bytes: their KV, uint8 ``[layers, kv, tokens, kv_heads, head_dim * itemsize]``.

    Raises:
        PoolUnavailable: the cache could not reach the pool.
    """

    def __init__(self, base: CacheConfig, path: FetchPath, tokens: list[int], kv_bytes: torch.Tensor) -> None:
        self.route = ROUTES[path]
        # As an engine passes them (``token_array``: a uint32 array is taken without a copy): a
        # list would add ~0.1 ms of conversion to every lookup, no part of asking the pool.
        self.tokens = np.asarray(tokens, dtype=np.uint32)
        self.kv_bytes = kv_bytes
        self.layout = base.layout
        self.blocks = len(tokens) // base.layout.block_tokens
        self.size_bytes = self.blocks * base.layout.block_bytes
        host_bytes = self.size_bytes if path is FetchPath.STAGED else 0
        self.cache = TieredCache(dataclasses.replace(base, remote_path=path, host_bytes=host_bytes))
        if self.cache.remote_error is not None:
            self.cache.close()
            raise PoolUnavailable(f"the cache could not use the pool: {self.cache.remote_error}")
        self.verified_bytes = 0

    # --- steps: each returns the seconds its timed part took -----------------------------------

    def restore_s(self) -> float:
        """``load()`` of every block, found in the pool only, to the device; then verified."""
        match = self._lookup()
        self._zero_device()
        result, seconds = timed_restore(self.cache, match, self.kv_bytes, f"load {route_text(self.route)}")
        if result.paths != {self.route: self.blocks}:
            raise RuntimeError(f"expected every block by {route_text(self.route)}, the load took {result.paths}")
        self.verified_bytes += self.size_bytes
        for medium in (Medium.DEVICE, Medium.HOST):  # back to the pool only
            if medium in self.cache.media:
                self.cache.evict(medium, self.blocks)
        return seconds

    def lookup_s(self) -> float:
        """``lookup()`` of blocks this cache does not know: it asks the pool ``exists`` and
        adopts every block (forgotten first, untimed, so the pool must be asked)."""
        self.cache.evict(Medium.REMOTE, self.blocks)
        start = time.perf_counter()
        match = self.cache.lookup(self.tokens)
        seconds = time.perf_counter() - start
        self._check_in_pool_only(match)
        return seconds

    def close(self) -> None:
        self.cache.close()

    # --- helpers -------------------------------------------------------------------------------

    def _lookup(self) -> Match:
        match = self.cache.lookup(self.tokens)
        self._check_in_pool_only(match)
        return match

    def _check_in_pool_only(self, match: Match) -> None:
        if match.blocks != self.blocks or set(match.media) != {Medium.REMOTE}:
            raise RuntimeError(
                f"expected {self.blocks} blocks in the pool only, lookup found {match.blocks}: {set(match.media)}"
            )

    def _zero_device(self) -> None:
        tier = self.cache.tier(Medium.DEVICE)
        assert isinstance(tier, MemoryTier)
        tier.buffer.zero_()  # a restore that moved nothing must not verify
