"""What the scheduler side tells the worker side each step: the plans, as plain data.

vLLM builds :class:`KVStrataMetadata` in the scheduler (``build_connector_meta``), ships it to
every worker and binds it before the forward. Each spec names kvstrata's blocks by the tokens
they cover and vLLM's blocks by id, per KV cache group (:mod:`kvstrata.integrations.vllm.groups`);
the worker looks the tokens up again (blocks may have left kvstrata since) and moves the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstrata.media import Medium


@dataclass
class GroupBlocks:
    """One KV cache group's share of a spec: kvstrata blocks ``first_block ..`` (of the spec's
    tokens) held in vLLM blocks ``block_ids``, one each; empty when the group moves none.

    A sliding or chunked group's blocks before its window are vLLM's null block: never here.
    """

    first_block: int
    block_ids: list[int]

    @property
    def end_block(self) -> int:
        return self.first_block + len(self.block_ids)


@dataclass
class LoadSpec:
    """Load the hit's blocks into vLLM's: per group (vLLM's group order), ``groups[g]``."""

    req_id: str
    tokens: list[int]  # the prefix up to the end of the hit (full blocks)
    external_tokens: int  # tokens of the hit beyond vLLM's own prefix-cache hit
    groups: list[GroupBlocks]
    budget_s: float | None = None  # how long it may hold the step (async: its request) up, then its blocks are computed

    @property
    def block_ids(self) -> list[int]:
        """Every vLLM block this load writes, in every group."""
        return [b for group in self.groups for b in group.block_ids]


@dataclass
class SaveSpec:
    """Store full blocks of ``tokens``: per group, blocks ``groups[g].first_block ..`` (a full
    group's from 0; a windowed group's only its windows before the prefix's end)."""

    req_id: str
    tokens: list[int]
    groups: list[GroupBlocks]
    # vLLM's hashes of the full blocks of ``tokens`` (``ExternalBlockHash``: bytes, or ints), as its
    # own KV events name them; empty where vLLM publishes no KV events (kvstrata's name them too)
    block_hashes: list[bytes | int] = field(default_factory=list)

    @property
    def blocks(self) -> int:
        """The prompt blocks it stores (its first group's: every group stores the same prefix)."""
        return len(self.groups[0].block_ids) if self.groups else 0


@dataclass
class KVStrataMetadata(KVConnectorMetadata):
    """One step's loads and saves, for every worker. ``loads`` feed this step's forward (each
    layer waits for its copy); ``async_loads`` run off the step, their requests waiting in vLLM
    until the workers report them finished (``get_finished``)."""

    loads: list[LoadSpec] = field(default_factory=list)
    async_loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    scheduled_tokens: int = 0  # tokens the step computes, every request's (the prefill's measure)
    step: int = 0  # the scheduler's count of steps: names a step whose saves wait for a verdict
    # earlier steps' verdicts (TP > 1): step -> its loads arrived on every rank, so the saves
    # the workers hold for it are stored (False: dropped; :mod:`~kvstrata.integrations.vllm.verdicts`)
    verdicts: dict[int, bool] = field(default_factory=dict)
    # tiers nothing is written down to now: a local disk whose loads the scheduler declines (its
    # blocks would not be read); the workers' caches drop what they would have sent there
    unwritten: frozenset[Medium] = frozenset()
    # tiers whose loads failed and whose probe is due: each worker reads one block of each off
    # the step and reports the time (feedback.ProbeTiming); no request waits on it
    probes: tuple[Medium, ...] = ()
