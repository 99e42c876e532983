"""kvstrata's tiers as vLLM's KV events: what a server stores and drops, per tier (pure).

vLLM publishes what its prefix cache holds as ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` events (``vllm.distributed.kv_events``), each naming its ``medium`` and,
since its offloading tiers publish too, a ``locality`` (``LOCAL`` / ``REMOTE``, relative to the
publisher) and an ``ownership`` (which secondary tier published it). kvstrata speaks the same
vocabulary, so a router that already consumes vLLM's events (llm-d's indexer, Dynamo's router)
sees kvstrata's tiers as vLLM's own offloading tiers:

=================  ==========  =========  ====================================================
kvstrata medium    ``medium``  locality   why
=================  ==========  =========  ====================================================
DEVICE             GPU         LOCAL      vLLM's own KV (``MEDIUM_GPU``; vLLM publishes these)
HOST               CPU         LOCAL      host DRAM, as vLLM's CPU offloading tier (``MEDIUM_CPU``)
DISK               STORAGE     LOCAL      local NVMe, as vLLM's file-system tier (``MEDIUM_STORAGE``)
REMOTE (pool)      CPU         REMOTE     a DRAM pool on other machines: DRAM, not this server's
=================  ==========  =========  ====================================================

No medium string is invented: vLLM 0.32 names GPU, CPU and STORAGE (``kv_offload.base.Medium``)
and says where with ``locality``. The pool is DRAM, so ``CPU``; it is ``REMOTE`` because it is
not this server's memory, and every server reaches it. A consumer that reads ``medium`` alone
(llm-d's scorer weighs "gpu" 1.0 and "cpu" 0.8, case-insensitively) credits the pool as host
memory; one that reads ``locality`` tells them apart (:mod:`kvstrata.fleet.index` does).
kvstrata's events carry ``ownership = "kvstrata"``.

Read back, a medium is matched case-insensitively; a missing one (``None``) is vLLM's own KV
(``DEVICE``), as in vLLM's events before the field existed; any ``REMOTE`` locality is the pool.

Which hash. Every event carries vLLM's block hashes (``ExternalBlockHash``: bytes, or a 64-bit
int where ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is set), the same values as vLLM's own
``BlockStored`` for the block and the ``request.block_hashes`` kvstrata's scheduler is handed
(:mod:`kvstrata.integrations.vllm.scheduler`). Not kvstrata's block keys
(:mod:`kvstrata.index.keys`: an xxh3-128 chain salted with a namespace only the servers know).
vLLM's hash chains each block's tokens onto its parent's hash from a seed every process shares
(``sha256_cbor`` from a fixed seed, or ``PYTHONHASHSEED``), so a router computes it from a
prompt's tokens alone, as llm-d's token processor does, and matches it against every server's
events, vLLM's and kvstrata's alike. The publishing side must therefore know, for each block it
stores or drops, vLLM's hash: the scheduler has it when it sends a block to be saved.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from kvstrata.media import Medium

BlockHash = bytes | int
"""vLLM's ``ExternalBlockHash``: the digest's bytes, or its low 64 bits as an int."""

OWNERSHIP = "kvstrata"  # the ``ownership`` of kvstrata's events: which secondary tier published them


class EventMedium(enum.Enum):
    """vLLM's ``medium`` strings (``vllm.distributed.kv_events.MEDIUM_*``)."""

    GPU = "GPU"
    CPU = "CPU"
    STORAGE = "STORAGE"


class Locality(enum.Enum):
    """vLLM's ``locality``: relative to the publishing server (``vllm.v1.kv_offload.base.Locality``)."""

    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


_TO_EVENT = {
    Medium.DEVICE: (EventMedium.GPU, Locality.LOCAL),
    Medium.HOST: (EventMedium.CPU, Locality.LOCAL),
    Medium.DISK: (EventMedium.STORAGE, Locality.LOCAL),
    Medium.REMOTE: (EventMedium.CPU, Locality.REMOTE),
}
_LOCAL_MEDIUM = {EventMedium.GPU: Medium.DEVICE, EventMedium.CPU: Medium.HOST, EventMedium.STORAGE: Medium.DISK}


def event_medium(medium: Medium) -> tuple[EventMedium, Locality]:
    """The ``(medium, locality)`` an event names for kvstrata's ``medium`` (the module's table)."""
    return _TO_EVENT[medium]


def medium_of(medium: str | None, locality: str | None) -> Medium:
    """kvstrata's medium for an event's ``medium`` and ``locality`` strings.

    Raises:
        ValueError: a medium or locality that vLLM does not name.
    """
    if locality is not None:
        try:
            where = Locality(locality.upper())
        except (ValueError, AttributeError):
            raise ValueError(f"unknown KV event locality {locality!r} (expected LOCAL or REMOTE)") from None
        if where is Locality.REMOTE:
            return Medium.REMOTE
    if medium is None:
        return Medium.DEVICE
    try:
        return _LOCAL_MEDIUM[EventMedium(medium.upper())]
    except (ValueError, AttributeError):
        raise ValueError(f"unknown KV event medium {medium!r} (expected GPU, CPU or STORAGE)") from None


def _check_hashes(hashes: tuple[BlockHash, ...], what: str) -> None:
    for h in hashes:
        if isinstance(h, bool) or not isinstance(h, (bytes, int)):
            raise ValueError(f"{what}: a block hash must be bytes or an int, got {type(h).__name__} {h!r}")


@dataclass(frozen=True)
class Stored:
    """Blocks now held on ``medium`` (vLLM's ``BlockStored``).

    Attributes:
        hashes: vLLM's block hashes, in prompt order (one per block).
        medium: the tier that holds them.
        parent: the hash of the block before the first (None: the first is a prompt's first).
        token_ids: the blocks' tokens, ``block_size`` each (empty where the publisher has none).
        block_size: tokens per block (0 where the publisher does not say).
    """

    hashes: tuple[BlockHash, ...]
    medium: Medium
    parent: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0

    def __post_init__(self) -> None:
        _check_hashes(self.hashes, "BlockStored")
        if self.parent is not None:
            _check_hashes((self.parent,), "BlockStored parent")
        if self.block_size < 0:
            raise ValueError(f"BlockStored: block_size must be >= 0, got {self.block_size}")
        if self.token_ids and self.block_size and len(self.token_ids) != self.block_size * len(self.hashes):
            raise ValueError(f"BlockStored: {len(self.token_ids)} token ids for {len(self.hashes)} blocks "
                             f"of {self.block_size} tokens")


@dataclass(frozen=True)
class Removed:
    """Blocks no longer held on ``medium`` (vLLM's ``BlockRemoved``)."""

    hashes: tuple[BlockHash, ...]
    medium: Medium

    def __post_init__(self) -> None:
        _check_hashes(self.hashes, "BlockRemoved")


@dataclass(frozen=True)
class Cleared:
    """vLLM's ``AllBlocksCleared``: vLLM reset its own prefix cache (the device tier)."""


KVEvent = Stored | Removed | Cleared


@dataclass(frozen=True)
class Batch:
    """Events published together (vLLM's ``KVEventBatch``).

    Attributes:
        ts: when the batch was made, seconds since the epoch (the publisher's clock).
        events: in the order they happened.
        dp_rank: the data-parallel rank that published it (None: not said).
    """

    ts: float
    events: tuple[KVEvent, ...]
    dp_rank: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.ts):
            raise ValueError(f"KV event batch: ts must be finite, got {self.ts}")
        for event in self.events:
            if not isinstance(event, (Stored, Removed, Cleared)):
                raise ValueError(f"KV event batch: not a KV event: {type(event).__name__}")
