"""kvstrata's tiers in vLLM's own KV events: what a server's connector stores and drops, per tier.

vLLM publishes what its prefix cache holds when started with ``--kv-events-config``
(``{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}``): once per
engine step the scheduler takes its own ``BlockStored`` / ``BlockRemoved`` events and the
connector's (``KVConnectorBase_V1.take_events``) and sends them as one ``KVEventBatch`` on one
ZMQ socket. A connector's events come from its workers: each step a worker returns them with its
output (``get_kv_connector_kv_cache_events`` -> ``KVConnectorOutput.kv_cache_events``), vLLM
gathers the workers' outputs and hands them to the scheduler-side connector
(``update_connector_output``), whose ``take_events`` gives them to the publisher (vLLM's
``LMCacheConnectorV1`` does the same). So one socket carries vLLM's tiers and kvstrata's, and a
router that reads vLLM's events (llm-d's indexer, Dynamo's router, ``kvstrata route``) sees both.

Where the facts are learnt. The scheduler decides a save and knows vLLM's hashes of its blocks
(``request.block_hashes``, converted as vLLM converts its own: ``maybe_convert_block_hash``); they
ride in the :class:`~kvstrata.integrations.vllm.metadata.SaveSpec`. The worker keys the save's
tokens and teaches the pairs to an :class:`~kvstrata.fleet.recorder.EventRecorder`, which listens
to its caches' block managers (:meth:`~kvstrata.manager.manager.BlockManager.listen`): every block
that comes to be READY on a tier or leaves it (a store, a write-down, an eviction, a corrupt copy
dropped) is heard where it happens, and published with vLLM's hash; a block whose hash no save
taught (recovered from disk at a start, re-packed from the pool by a load) is not published
until a save names it. No event names a hash vLLM did not compute for the same tokens.

Which tiers, as which ``medium`` (:mod:`kvstrata.fleet.events`; vLLM's strings, which llm-d reads,
``ownership`` ``"kvstrata"``, ``group_idx`` 0):

* host DRAM: ``"CPU"``, ``LOCAL`` (vLLM's CPU offloading tier's);
* the local disk: ``"STORAGE"``, ``LOCAL`` (vLLM's file-system tier's);
* the pool: ``"CPU"``, ``REMOTE`` (DRAM on other machines; a head-sliced block's pool events
  are its rank's slices': stored when the first lands, removed when any leaves).

kvstrata's device tier is not published: ``"GPU"`` is vLLM's own prefix cache, and a consumer
that keys a server's blocks by medium (llm-d's, :class:`~kvstrata.fleet.index.FleetIndex`) would
take kvstrata's ``BlockRemoved`` of a device copy for vLLM's block leaving, and vLLM's for
kvstrata's. On a CPU server the connector's saves go straight into the host tier; on a GPU one
a block reaches the host tier (and the events) when kvstrata's device tier evicts it.

Only TP rank 0 records: the scheduler's lookups ask rank 0's tiers, so its events say what a
request will find (vLLM keeps only the events every worker sent when it aggregates; kvstrata's
ranks store the same blocks at different moments, off the step). Only a model of one KV cache
group: a hybrid model's groups hold one block in several caches, which one event cannot say.
The events ride the engine's steps: a change made while the engine is idle (a save's store
finishing after its request's last step) goes out with the next step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents

from kvstrata.fleet.events import OWNERSHIP, Batch, BlockHash, Stored, event_medium
from kvstrata.fleet.recorder import EventRecorder
from kvstrata.index.keys import BlockKey
from kvstrata.media import Medium

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvstrata.cache import TieredCache

_log = logging.getLogger("kvstrata.integrations.vllm")

LOCAL_TIERS = frozenset((Medium.HOST, Medium.DISK))  # a rank's own tiers whose events are published
POOL = frozenset((Medium.REMOTE,))


def publishes(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> bool:
    """Whether the connector publishes its tiers' events: vLLM publishes KV events
    (``--kv-events-config`` with ``enable_kv_cache_events``) for a model of one KV cache group,
    whose blocks vLLM hashes at its block size (else, with events on, a warning says why not)."""
    config = getattr(vllm_config, "kv_events_config", None)
    if config is None or not config.enable_kv_cache_events:
        return False
    groups = len(kv_cache_config.kv_cache_groups)
    hashed_at = getattr(kv_cache_config, "hash_block_size", None)
    if groups == 1 and hashed_at in (None, vllm_config.cache_config.block_size):
        return True
    _log.warning("KVStrataConnector: vLLM's KV events are on, but kvstrata publishes its tiers' events only for a "
                 "model of one KV cache group hashed at its block size (this one: %d groups, hashed at %s "
                 "tokens): vLLM's own events are published as ever", groups, hashed_at)
    return False


@dataclass(frozen=True)
class EventSource:
    """A cache of a group whose tiers are published: which of its media, and its keys of a
    group's blocks (``keys_of(block_keys)``: one per block, or a head-sliced block's slices,
    block by block)."""

    cache: TieredCache
    media: frozenset[Medium]
    keys_of: Callable[[list[BlockKey]], list[BlockKey]]


class KVStrataKVEvents(KVConnectorKVEvents):
    """One step's events of the worker that records (TP rank 0), as vLLM carries a connector's.

    vLLM's ``aggregate`` keeps the events every worker sent; one worker sends these, so there is
    nothing to intersect and they are kept as they are.
    """

    def __init__(self, events: Sequence[KVCacheEvent] = ()) -> None:
        self._events = list(events)
        self._workers = 1

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> KVStrataKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events.clear()


class _Published:
    """One cache's index listener: its changes on ``media`` to the recorder, the rest dropped."""

    def __init__(self, recorder: EventRecorder, media: frozenset[Medium]) -> None:
        self._recorder, self._media = recorder, media

    def changed(self, medium: Medium, keys: Sequence[BlockKey], held: bool) -> None:
        if medium in self._media:
            self._recorder.changed(medium, keys, held)


class TierEvents:
    """A worker's recorder over its published caches (see the module text).

    Args:
        sources: the caches whose tiers are published (one KV cache group's).
        block_size: vLLM's block size (the events' ``block_size``).
    """

    def __init__(self, sources: Sequence[EventSource], block_size: int) -> None:
        self._sources = tuple(sources)
        self._block_size = block_size
        self.recorder = EventRecorder()
        for source in self._sources:
            source.cache.manager.listen(_Published(self.recorder, source.media))

    def learn(self, keys: list[BlockKey], hashes: Sequence[BlockHash]) -> None:
        """A save's blocks: kvstrata's keys and vLLM's hashes of them, pairwise."""
        if len(keys) != len(hashes):
            raise ValueError(f"KVStrataConnector: a save of {len(keys)} blocks came with {len(hashes)} vLLM hashes")
        for source in self._sources:
            own = source.keys_of(keys)
            per = len(own) // len(keys) if keys else 0  # a head-sliced block's slices, block by block
            self.recorder.learn(own, [h for h in hashes for _ in range(per)])

    def take(self) -> KVStrataKVEvents | None:
        """The events recorded since the last take, as vLLM's (None: none)."""
        batch = self.recorder.take(time.time())
        return KVStrataKVEvents(vllm_events(batch, self._block_size)) if batch is not None else None


def vllm_events(batch: Batch, block_size: int) -> list[KVCacheEvent]:
    """``batch``'s events as vLLM's own classes (``vllm.distributed.kv_events``)."""
    out: list[KVCacheEvent] = []
    for event in batch.events:
        medium, locality = event_medium(event.medium)
        common: dict[str, Any] = {"medium": medium.value, "group_idx": 0, "locality": locality.value,
                                  "ownership": OWNERSHIP}
        if isinstance(event, Stored):
            out.append(BlockStored(block_hashes=list(event.hashes), parent_block_hash=None, token_ids=[],
                                   block_size=block_size, lora_id=None, lora_name=None, **common))
        else:
            out.append(BlockRemoved(block_hashes=list(event.hashes), **common))
    return out
