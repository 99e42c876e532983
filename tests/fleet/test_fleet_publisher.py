"""A real ZMQ round trip on loopback: kvstrata's publisher -> a SUB socket -> vLLM's decoder,
and vLLM's own publisher -> the same SUB -> kvstrata's decoder."""

from __future__ import annotations

import os
import time

import msgspec
import pytest
import zmq

from kvstrata.fleet.events import Batch, Removed, Stored
from kvstrata.fleet.publisher import EventPublisher
from kvstrata.fleet.wire import from_frames
from kvstrata.media import Medium

kv_events = pytest.importorskip("vllm.distributed.kv_events")
DEADLINE_S = 10.0


def _batch(i: int) -> Batch:
    return Batch(float(i), (Stored((i, i + 1), Medium.DISK, None, tuple(range(8)), 4), Removed((i,), Medium.HOST)))


def _receive(sub: zmq.Socket, send) -> list[bytes]:
    """Send until one arrives: a SUB socket joins a PUB's stream some time after connecting."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        send()
        if sub.poll(50):
            return sub.recv_multipart()
    raise AssertionError("no message arrived")


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def _subscriber(context: zmq.Context, topic: bytes) -> zmq.Socket:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.LINGER, 0)
    return sub


def test_kvstratas_publisher_to_a_sub_socket_decoded_by_vllms_own_classes(context):
    with EventPublisher("tcp://127.0.0.1:0", topic="kv@a", bind=True, context=context) as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith(":0")
        sub = _subscriber(context, b"kv@")
        sub.connect(pub.endpoint)
        try:
            topic, seq, payload = _receive(sub, lambda: pub.publish(_batch(0)))
            later = [pub.publish(_batch(i)) for i in (1, 2)]
            rest = [sub.recv_multipart() for _ in range(2)]
        finally:
            sub.close()
    assert topic == b"kv@a" and len(seq) == 8
    decoded = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch).decode(payload)
    stored, removed = decoded.events
    assert (stored.block_hashes, stored.medium, stored.locality, stored.ownership) == ([0, 1], "STORAGE", "LOCAL",
                                                                                       "kvstrata")
    assert (removed.block_hashes, removed.medium) == ([0], "CPU")
    # seq counts every batch published, one apart, as vLLM's does
    frames = [from_frames(m) for m in rest]
    assert [f.seq for f in frames] == later == [later[0], later[0] + 1]
    assert [f.batch for f in frames] == [_batch(1), _batch(2)]


def test_vllms_own_publisher_is_read_by_kvstratas_decoder(context):
    sub = _subscriber(context, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    pub = kv_events.ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://127.0.0.1:{port}", topic="vllm")
    theirs = kv_events.KVEventBatch(ts=5.0, events=[kv_events.BlockStored(
        block_hashes=[b"\x01" * 32], parent_block_hash=None, token_ids=[1, 2], block_size=2, lora_id=None,
        medium=kv_events.MEDIUM_GPU, lora_name=None)])
    try:
        frame = from_frames(_receive(sub, lambda: pub.publish(theirs)))
    finally:
        pub.shutdown()
        sub.close()
    assert frame.topic == "vllm"
    assert frame.batch == Batch(5.0, (Stored((b"\x01" * 32,), Medium.DEVICE, None, (1, 2), 2),), dp_rank=0)


def test_an_ipc_endpoint_in_a_private_directory(context, tmp_path):
    private = tmp_path / "events"
    private.mkdir(mode=0o700)
    endpoint = f"ipc://{private}/kv"
    with EventPublisher(endpoint, context=context) as pub:  # ipc: bound, as vLLM binds it
        sub = _subscriber(context, b"")
        sub.connect(endpoint)
        try:
            frame = from_frames(_receive(sub, lambda: pub.publish(_batch(3))))
        finally:
            sub.close()
    assert frame.batch == _batch(3)


def test_an_ipc_endpoint_others_can_reach_is_refused(context, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ValueError, match="open to others"):
        EventPublisher(f"ipc://{shared}/kv", context=context)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    with pytest.raises(ValueError, match="symlink"):
        EventPublisher(f"ipc://{link}/kv", context=context)


def test_a_closed_publisher_refuses_to_publish(context):
    pub = EventPublisher("tcp://127.0.0.1:0", bind=True, context=context)
    pub.close()
    pub.close()
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish(_batch(0))
