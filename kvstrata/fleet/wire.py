"""kvstrata's KV events as bytes: vLLM's msgpack wire format, without vLLM (edge: msgspec).

A batch travels as vLLM's ``ZmqEventPublisher`` sends it: three ZMQ frames, ``(topic, seq,
payload)``, ``seq`` a big-endian 8-byte counter from 0 and ``payload`` the ``KVEventBatch``
encoded by ``msgspec.msgpack``: an array ``[ts, events, data_parallel_rank]`` (the batch is
``array_like``), each event a map tagged with its class name (``{"type": "BlockStored", ...}``),
fields at their defaults left out (``omit_defaults``).

The structs below mirror vLLM 0.32's (``vllm.distributed.kv_events``) field for field, so a
consumer decodes kvstrata's bytes with vLLM's own ``msgspec.msgpack.Decoder(type=KVEventBatch)``,
and a router without vLLM installed decodes vLLM's bytes with :func:`decode_batch` (fields it
does not know are skipped: vLLM may add more). The tests hold both directions against vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvstrata.fleet.events import (OWNERSHIP, Batch, BlockHash, Cleared, KVEvent, Removed, Stored, event_medium,
                                   medium_of)

SEQ_BYTES = 8  # vLLM's seq frame: big-endian, 8 bytes


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's ``KVCacheEvent``: tagged with the class name."""


class BlockStored(_Event):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


@dataclass(frozen=True)
class Frame:
    """One published batch as a subscriber receives it."""

    topic: str
    seq: int
    batch: Batch


def encode_batch(batch: Batch) -> bytes:
    """The msgpack payload of ``batch``, as vLLM's publisher encodes a ``KVEventBatch``."""
    return _ENCODER.encode(KVEventBatch(batch.ts, [_to_wire(e) for e in batch.events], batch.dp_rank))


def decode_batch(payload: bytes) -> Batch:
    """A payload's batch (kvstrata's or vLLM's own).

    Raises:
        ValueError: one line naming what was wrong (not msgpack, not a batch, an unknown event
            type, a field of the wrong type, an unknown medium or locality).
    """
    try:
        wire = _DECODER.decode(payload)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise ValueError(f"malformed KV event batch: {e}") from None
    try:
        return Batch(wire.ts, tuple(_from_wire(e) for e in wire.events), wire.data_parallel_rank)
    except ValueError as e:
        raise ValueError(f"malformed KV event batch: {e}") from None


def to_frames(topic: str, seq: int, batch: Batch) -> tuple[bytes, bytes, bytes]:
    """The three frames vLLM's ``ZmqEventPublisher`` sends for one batch."""
    if seq < 0:
        raise ValueError(f"seq must be >= 0, got {seq}")
    return topic.encode("utf-8"), seq.to_bytes(SEQ_BYTES, "big"), encode_batch(batch)


def from_frames(frames: list[bytes]) -> Frame:
    """A received multipart message's batch.

    Raises:
        ValueError: not three frames, a seq not of 8 bytes, a topic not UTF-8, or a payload
            :func:`decode_batch` refuses.
    """
    if len(frames) != 3:
        raise ValueError(f"malformed KV event message: {len(frames)} frames (expected topic, seq, payload)")
    topic, seq, payload = frames
    if len(seq) != SEQ_BYTES:
        raise ValueError(f"malformed KV event message: a seq of {len(seq)} bytes (expected {SEQ_BYTES})")
    try:
        name = bytes(topic).decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("malformed KV event message: its topic is not UTF-8") from None
    return Frame(name, int.from_bytes(seq, "big"), decode_batch(bytes(payload)))


def _to_wire(event: KVEvent) -> BlockStored | BlockRemoved | AllBlocksCleared:
    if isinstance(event, Stored):
        medium, locality = event_medium(event.medium)
        return BlockStored(list(event.hashes), event.parent, list(event.token_ids), event.block_size, None,
                           medium.value, None, locality=locality.value, ownership=OWNERSHIP)
    if isinstance(event, Removed):
        medium, locality = event_medium(event.medium)
        return BlockRemoved(list(event.hashes), medium.value, locality=locality.value, ownership=OWNERSHIP)
    return AllBlocksCleared()


def _from_wire(event: BlockStored | BlockRemoved | AllBlocksCleared) -> KVEvent:
    if isinstance(event, BlockStored):
        hashes: tuple[BlockHash, ...] = tuple(event.block_hashes)
        return Stored(hashes, medium_of(event.medium, event.locality), event.parent_block_hash,
                      tuple(event.token_ids), event.block_size)
    if isinstance(event, BlockRemoved):
        return Removed(tuple(event.block_hashes), medium_of(event.medium, event.locality))
    return Cleared()
