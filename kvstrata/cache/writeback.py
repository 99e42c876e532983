"""A write-back cache's blocks that only its memory holds, written down when it closes.

Write-back sends a block below the host only when the host evicts it, so at any moment some
blocks live in memory alone. A graceful stop writes them to the first tier below (the disk),
in the order they came in (a smaller tier below keeps the latest), a batch at a time, for at
most the cache's ``write_back_flush_s``; a crash loses them, as it loses the memory tiers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvstrata.cache.config import CacheConfig
from kvstrata.index.keys import BlockKey
from kvstrata.manager.manager import BlockManager
from kvstrata.manager.plans import CopyPlan
from kvstrata.media import Medium
from kvstrata.policies.write import WritePolicy

_log = logging.getLogger("kvstrata.cache")
BATCH = 64  # blocks per copy plan (the deadline is checked between)


def memory_only(manager: BlockManager) -> tuple[list[BlockKey], Medium | None]:
    """The blocks no tier below the host holds (the host's first), and that first tier below (None: none)."""
    below = [m for m in manager.media if m.value > Medium.HOST.value]
    if not below:
        return [], None
    seen: dict[BlockKey, None] = {}  # in the order they came in
    for medium in reversed([m for m in manager.media if m.value <= Medium.HOST.value]):
        for key in manager.ready_keys(medium):
            if key not in seen and not any(m in below for m in manager.where(key)):
                seen[key] = None
    return list(seen), below[0]


def write_down(manager: BlockManager, copy: Callable[[CopyPlan], int], config: CacheConfig) -> int:
    """Under write-back, copy the memory-only blocks down (``copy``: the cache's carrying out of
    a copy plan) for at most ``config.write_back_flush_s`` (a batch begun ends); how many landed.
    Never raises: a cache that cannot write down still closes (a warning says so)."""
    if config.write.policy is not WritePolicy.WRITE_BACK:
        return 0
    end, landed = time.monotonic() + config.write_back_flush_s, 0
    try:
        keys, to = memory_only(manager)
        for start in range(0, len(keys), BATCH):
            if to is None or time.monotonic() >= end:
                break
            landed += copy(manager.prepare_copies(keys[start : start + BATCH], (to,)))
    except Exception as exc:  # noqa: BLE001
        _log.warning("closing the cache: writing its memory-only blocks down failed: %s", exc)
    return landed
