"""What the scheduler side tells the worker side each step: the plans, as plain data.

vLLM builds :class:`KVStrataMetadata` in the scheduler (``build_connector_meta``), ships it to
every worker and binds it before the forward. Each spec names kvstrata's blocks by the tokens
they cover and vLLM's blocks by id; the worker looks the tokens up again (blocks may have left
kvstrata since) and moves the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class LoadSpec:
    """Load kvstrata's blocks ``first_block ..`` of ``tokens`` into vLLM blocks ``block_ids``."""

    req_id: str
    tokens: list[int]  # the prefix up to the end of the hit (full blocks)
    first_block: int  # blocks before it are vLLM's own prefix-cache hit
    block_ids: list[int]


@dataclass
class SaveSpec:
    """Store the full blocks of ``tokens``, held in vLLM blocks ``block_ids`` (one per block)."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]


@dataclass
class KVStrataMetadata(KVConnectorMetadata):
    """One step's loads and saves, for every worker."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
