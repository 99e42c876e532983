"""kvstrata's KV events as a consumer written by others reads them: vLLM's own event classes
decode kvstrata's bytes field for field, kvstrata decodes vLLM's, and bad input is one clear line."""

from __future__ import annotations

import msgspec
import pytest

from kvstrata.fleet.events import Batch, Cleared, EventMedium, Locality, Removed, Stored, event_medium, medium_of
from kvstrata.fleet.wire import decode_batch, encode_batch, from_frames, to_frames
from kvstrata.media import Medium

kv_events = pytest.importorskip("vllm.distributed.kv_events")
VLLM_DECODER = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)

H = [bytes([i]) * 32 for i in range(4)]  # vLLM's block hashes: sha256 digests, as bytes


def test_each_tier_names_vllms_medium_and_locality_and_reads_back():
    assert event_medium(Medium.DEVICE) == (EventMedium.GPU, Locality.LOCAL)
    assert event_medium(Medium.HOST) == (EventMedium.CPU, Locality.LOCAL)
    assert event_medium(Medium.DISK) == (EventMedium.STORAGE, Locality.LOCAL)
    assert event_medium(Medium.REMOTE) == (EventMedium.CPU, Locality.REMOTE)
    for medium in Medium:
        name, where = event_medium(medium)
        assert medium_of(name.value, where.value) is medium
    # vLLM's own strings are the ones it exports
    assert {m.value for m in EventMedium} == {kv_events.MEDIUM_GPU, kv_events.MEDIUM_CPU, kv_events.MEDIUM_STORAGE}


def test_read_back_a_medium_is_case_insensitive_none_is_vllms_own_and_any_remote_is_the_pool():
    assert medium_of(None, None) is Medium.DEVICE
    assert medium_of("gpu", None) is Medium.DEVICE  # llm-d writes its media in lower case
    assert medium_of("cpu", "local") is Medium.HOST
    assert medium_of("STORAGE", None) is Medium.DISK
    assert medium_of("STORAGE", "REMOTE") is Medium.REMOTE


def test_vllms_decoder_reads_kvstratas_events_field_for_field():
    batch = Batch(12.5, (
        Stored((H[0], H[1]), Medium.HOST, None, tuple(range(32)), 16),
        Stored((H[2],), Medium.DISK, H[1], tuple(range(32, 48)), 16),
        Removed((H[0],), Medium.REMOTE),
        Cleared(),
    ), dp_rank=0)
    decoded = VLLM_DECODER.decode(encode_batch(batch))
    assert isinstance(decoded, kv_events.KVEventBatch)
    assert decoded.ts == 12.5 and decoded.data_parallel_rank == 0
    host, disk, removed, cleared = decoded.events
    assert isinstance(host, kv_events.BlockStored)
    assert host.block_hashes == [H[0], H[1]] and host.parent_block_hash is None
    assert host.token_ids == list(range(32)) and host.block_size == 16
    assert (host.medium, host.locality, host.ownership) == ("CPU", "LOCAL", "kvstrata")
    assert host.lora_id is None and host.lora_name is None and host.group_idx is None
    assert (disk.medium, disk.locality, disk.parent_block_hash) == ("STORAGE", "LOCAL", H[1])
    assert isinstance(removed, kv_events.BlockRemoved)
    assert (removed.block_hashes, removed.medium, removed.locality) == ([H[0]], "CPU", "REMOTE")
    assert isinstance(cleared, kv_events.AllBlocksCleared)


def test_kvstrata_reads_vllms_own_events_with_fields_it_does_not_use():
    theirs = kv_events.KVEventBatch(ts=3.0, events=[
        kv_events.BlockStored(block_hashes=[7, 8], parent_block_hash=6, token_ids=list(range(8)), block_size=4,
                              lora_id=None, medium=kv_events.MEDIUM_GPU, lora_name=None, extra_keys=[None, None],
                              group_idx=0, kv_cache_spec_kind="full_attention", session_id="s1"),
        kv_events.BlockRemoved(block_hashes=[7], medium=kv_events.MEDIUM_CPU, locality="LOCAL", ownership="kvcr"),
        kv_events.AllBlocksCleared(),
    ])
    batch = decode_batch(msgspec.msgpack.encode(theirs))
    assert batch == Batch(3.0, (Stored((7, 8), Medium.DEVICE, 6, tuple(range(8)), 4),
                                Removed((7,), Medium.HOST), Cleared()))


def test_a_batch_round_trips_through_kvstratas_own_frames():
    batch = Batch(1.0, (Stored((H[3],), Medium.REMOTE),))
    frame = from_frames(list(to_frames("kv", 41, batch)))
    assert (frame.topic, frame.seq, frame.batch) == ("kv", 41, batch)


def _vllm_payload(*events) -> bytes:
    return msgspec.msgpack.encode(kv_events.KVEventBatch(ts=1.0, events=list(events)))


@pytest.mark.parametrize(("payload", "says"), [
    (b"\xc1 not msgpack", "malformed KV event batch"),
    (msgspec.msgpack.encode({"ts": 1.0}), "malformed KV event batch"),
    (msgspec.msgpack.encode([1.0, [{"type": "BlockMoved", "block_hashes": [1]}]]), "BlockMoved"),
    (msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": "x", "medium": "CPU"}]]), "block_hashes"),
    (_vllm_payload(kv_events.BlockRemoved(block_hashes=[1], medium="TPU")), "unknown KV event medium 'TPU'"),
    (_vllm_payload(kv_events.BlockRemoved(block_hashes=[1], medium="CPU", locality="MARS")), "locality 'MARS'"),
    (_vllm_payload(kv_events.BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[1, 2, 3],
                                         block_size=4, lora_id=None, medium="GPU", lora_name=None)), "3 token ids"),
])
def test_a_malformed_batch_is_one_value_error_naming_what_was_wrong(payload, says):
    with pytest.raises(ValueError, match=says) as caught:
        decode_batch(payload)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("frames", "says"), [
    ([b"kv", b"\x00" * 8], "2 frames"),
    ([b"kv", b"\x00" * 4, b""], "seq of 4 bytes"),
    ([b"\xff", b"\x00" * 8, b""], "not UTF-8"),
])
def test_a_malformed_message_is_one_value_error(frames, says):
    with pytest.raises(ValueError, match=says):
        from_frames(frames)


def test_events_refuse_what_is_not_a_block_hash():
    with pytest.raises(ValueError, match="bytes or an int"):
        Stored((True,), Medium.HOST)
    with pytest.raises(ValueError, match="bytes or an int"):
        Removed(("abc",), Medium.HOST)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a KV event"):
        Batch(0.0, ("BlockStored",))  # type: ignore[arg-type]
