"""A load served where its blocks lie: for a caller that copies them out itself, on a CPU.

A CPU cache's device tier is host memory like its host tier, so bringing a host block "to the
device" is a copy from memory into memory, which the caller (vLLM's connector, copying into its
paged KV) then copies again. A load asked for in place skips it: every matched block is pinned
in the memory tier that holds it (device or host, the fastest), and the handle's blocks are views
of those slots until it is released. The caller's own copy is then the only one.

Only blocks already in memory are served so: a block on disk or in the pool (or one that left
memory since the match) makes the load an ordinary one, which reads it into the device tier and
can be cancelled before it writes anything the caller reads.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping

from kvstrata.cache.results import LoadHandle, LoadResult
from kvstrata.index.prefix import Match
from kvstrata.kv.layout import KVLayout
from kvstrata.manager.manager import BlockManager
from kvstrata.media import Medium, Route
from kvstrata.tensors import block_tensor
from kvstrata.tiers.base import Tier

MEMORY = frozenset({Medium.DEVICE, Medium.HOST})  # the tiers a CPU reads a block out of in place


def load_in_place(manager: BlockManager, tiers: Mapping[Medium, Tier], match: Match, layout: KVLayout) -> LoadHandle | None:
    """``match`` served from the memory tiers holding it: a finished handle whose blocks alias
    their slots, pinned until its release. None (nothing pinned) where a block is not in memory."""
    if not all(m in MEMORY for m in match.media):
        return None
    start = time.perf_counter()
    plan = manager.prepare_get(match.keys)
    if len(plan.sources) < match.blocks or any(p.slot.medium not in MEMORY for p in plan.sources):
        manager.complete_get(plan, [None] * len(plan.sources))  # moved since the match: an ordinary load
        return None
    views = [block_tensor(tiers[p.slot.medium].view(p.slot.index), layout) for p in plan.sources]
    handle = LoadHandle(match, layout.num_layers, views.__getitem__,
                        lambda keys: manager.complete_get(plan, [None] * len(plan.sources)))
    handle._plan(match.keys, tuple(range(len(views))))
    handle._layers_done(range(layout.num_layers))
    media = Counter(p.slot.medium for p in plan.sources)
    # the route the caller's copy takes: from where each block lies to its device
    paths: dict[Route, int] = {(m,) if m is Medium.DEVICE else (m, Medium.DEVICE): n for m, n in media.items()}
    restored = (match.blocks - media[Medium.DEVICE]) * layout.block_bytes
    handle._finish(LoadResult(match.blocks, match.tokens, {m: n * layout.block_bytes for m, n in media.items()},
                              time.perf_counter() - start, None, restored, paths))
    return handle
