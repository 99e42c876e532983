"""kvstrata's tiers in vLLM's own KV events, on a real ``vllm serve`` with ``--kv-events-config``.

One server (the tiny model, 32-token blocks) with kvstrata's host tier of 12 blocks over a disk
tier, write-back; a subscriber on vLLM's event socket takes every message. Three prompts of 9
blocks each are asked: the first's blocks are stored in the host tier, then, as the other two
fill it, evicted from the host and written to disk. Each message is decoded twice: by vLLM's own
classes (``vllm.distributed.kv_events.KVEventBatch``, the decoder a consumer written against vLLM
uses) and by kvstrata's feed into a :class:`~kvstrata.fleet.index.FleetIndex`, as ``kvstrata
route`` takes them in. Before it, the pieces without a server: the events as vLLM's classes,
and a worker's recorder over a real cache.
"""

from __future__ import annotations

import json
import random
import time

import msgspec
import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")
zmq = pytest.importorskip("zmq")

import torch  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

from tests.cache_support import LAYOUT, kv_for, tokens  # noqa: E402

from kvstrata.cache import CacheConfig, TieredCache  # noqa: E402
from kvstrata.fleet.events import Batch, Removed, Stored  # noqa: E402
from kvstrata.fleet.feed import EventFeed  # noqa: E402
from kvstrata.fleet.hashes import prompt_block_hashes  # noqa: E402
from kvstrata.fleet.index import FleetIndex  # noqa: E402
from kvstrata.fleet.wire import decode_batch  # noqa: E402
from kvstrata.integrations.vllm.events import (  # noqa: E402
    LOCAL_TIERS, EventSource, KVStrataKVEvents, TierEvents, vllm_events)
from kvstrata.integrations.vllm.server import ServerSpec, VllmServer, free_port  # noqa: E402
from kvstrata.media import Medium  # noqa: E402
from kvstrata.policies.write import WritePolicy, WriteRule  # noqa: E402

BLOCK = 32
PROMPT_BLOCKS = 9
BLOCK_BYTES = 4 * 2 * BLOCK * 2 * 64 * 2  # the tiny model: 4 layers x K,V x 32 tokens x 2 KV heads x 64 dims x bf16
HOST_BLOCKS = 12  # one prompt's blocks, not two: the second pushes the first's down to disk
SERVER = "a"


def test_the_events_are_vllms_own_classes_that_kvstratas_wire_reads_back():
    """vLLM's publisher encodes them (msgspec); kvstrata's decoder (a router without vLLM) reads
    the same tiers back: the host and disk as LOCAL CPU and STORAGE, the pool as REMOTE CPU."""
    H, S, P = Medium.HOST, Medium.DISK, Medium.REMOTE
    batch = Batch(5.0, (Stored((1, 2), H), Removed((1,), H), Stored((1,), S), Stored((3,), P)))
    events = vllm_events(batch, BLOCK)
    assert [(type(e), e.medium, e.locality, e.ownership) for e in events] == [
        (BlockStored, "CPU", "LOCAL", "kvstrata"), (BlockRemoved, "CPU", "LOCAL", "kvstrata"),
        (BlockStored, "STORAGE", "LOCAL", "kvstrata"), (BlockStored, "CPU", "REMOTE", "kvstrata")]
    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=5.0, events=events))
    back = decode_batch(payload)
    assert [(type(e), e.hashes, e.medium) for e in back.events] == [(type(e), e.hashes, e.medium) for e in batch.events]
    assert all(e.block_size == BLOCK for e in back.events if isinstance(e, Stored))
    # one worker sends them: vLLM's aggregation (the events every worker sent) keeps them all
    carried = KVStrataKVEvents(events)
    assert carried.aggregate().get_all_events() == events and carried.get_number_of_workers() == 1


def test_a_workers_recorder_publishes_a_saves_blocks_on_the_host_not_the_device(tmp_path):
    """A cache of device and host tiers: a block stored through the device tier is not
    published there (``"GPU"`` is vLLM's own); put into the host (the connector's save on a CPU
    server), it is, with the hash its save taught; a block no save named is not."""
    b = LAYOUT.block_bytes
    config = CacheConfig(LAYOUT, "events", device_bytes=4 * b, host_bytes=4 * b,
                         write=WriteRule(WritePolicy.WRITE_BACK))
    with TieredCache(config) as cache:
        events = TierEvents([EventSource(cache, LOCAL_TIERS, list)], LAYOUT.block_tokens)
        toks = tokens(1, 3)
        keys, kv = cache.keys(toks), kv_for(cache, toks)
        events.learn(keys[:2], [11, 12])
        cache.store_keys(keys[:1], kv[:, :, :LAYOUT.block_tokens].contiguous()).result()
        assert cache.manager.where(keys[0]) == (Medium.DEVICE,) and events.take() is None
        blocks = [[kv[:, :, i * LAYOUT.block_tokens:(i + 1) * LAYOUT.block_tokens].contiguous().view(-1)
                   .view(torch.uint8)] for i in (1, 2)]
        cache.put(keys[1:3], blocks)
        taken = events.take()
        assert taken is not None
        assert [(type(e), e.block_hashes, e.medium) for e in taken.get_all_events()] == [(BlockStored, [12], "CPU")]
        assert events.recorder.unknown == 1  # keys[2]: no save named it
        with pytest.raises(ValueError, match="a save of 2 blocks came with 1 vLLM hashes"):
            events.learn(keys[:2], [11])


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(PROMPT_BLOCKS * BLOCK + 5)]


@pytest.fixture(scope="module")
def published(tiny_model_dir, tmp_path_factory):
    """Every event message the server published while three prompts were asked, and a short
    request after each (its step carries what the caches' threads finished since the last)."""
    work = tmp_path_factory.mktemp("vllm-events")
    port = free_port()
    kv_events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
                            "topic": "kv"})
    connector = {"host_bytes": HOST_BLOCKS * BLOCK_BYTES, "disk_dir": str(work / "disk"),
                 "disk_bytes": 100 * BLOCK_BYTES, "write": "write-back"}
    spec = ServerSpec(str(tiny_model_dir), kv_blocks=64, block_size=BLOCK, connector=connector,
                      extra_args=("--kv-events-config", kv_events),
                      env={"VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"})
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    messages: list[list[bytes]] = []
    try:
        with VllmServer(spec, work / "server.log", start_timeout_s=240) as server:
            client = openai.OpenAI(base_url=server.base_url, api_key="none")
            model = client.models.list().data[0].id
            for seed in (0, 1, 2):
                client.completions.create(model=model, prompt=prompt(seed), max_tokens=2, temperature=0)
                time.sleep(0.5)  # the save's store ends on the caches' threads
                client.completions.create(model=model, prompt=[7, 8, 9], max_tokens=1, temperature=0)
                messages += _drain(sub, 0.5)
            first = prompt_block_hashes(prompt(0), BLOCK)
            deadline = time.monotonic() + 30
            while not _on_disk(messages, first) and time.monotonic() < deadline:
                client.completions.create(model=model, prompt=[7, 8, 9], max_tokens=1, temperature=0)
                messages += _drain(sub, 0.5)
        yield messages
    finally:
        sub.close(linger=0)
        context.term()


def _drain(sub, wait_s: float) -> list[list[bytes]]:
    out, deadline = [], time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        if sub.poll(int(left * 1000)):
            out.append(sub.recv_multipart())
    return out


def _on_disk(messages, hashes) -> bool:
    index = FleetIndex([SERVER])
    feed = EventFeed(index)
    for frames in messages:
        feed.take(SERVER, frames)
    return all(Medium.DISK in index.held(SERVER, h) for h in hashes)


def vllm_decoded(messages) -> list:
    """Every event, decoded by vLLM's own decoder (a consumer written against vLLM)."""
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    return [event for frames in messages for event in decoder.decode(frames[2]).events]


@pytest.mark.server
def test_kvstratas_stores_and_write_downs_are_vllm_events_with_vllms_hashes(published):
    events = vllm_decoded(published)
    ours = [e for e in events if e.ownership == "kvstrata"]
    vllms_stored = {h for e in events if isinstance(e, BlockStored) and e.ownership is None for h in e.block_hashes}
    first = prompt_block_hashes(prompt(0), BLOCK)
    assert len(first) == PROMPT_BLOCKS
    stored = {(e.medium, e.locality): set() for e in ours if isinstance(e, BlockStored)}
    removed = {(e.medium, e.locality): set() for e in ours if isinstance(e, BlockRemoved)}
    for e in ours:
        (stored if isinstance(e, BlockStored) else removed)[(e.medium, e.locality)].update(e.block_hashes)
    # the host tier as vLLM's CPU tier, the disk as its storage tier; kvstrata's device tier is not published
    assert set(first) <= stored[("CPU", "LOCAL")]
    assert set(first) <= removed[("CPU", "LOCAL")]  # evicted from the host as the others came in
    assert set(first) <= stored[("STORAGE", "LOCAL")]  # written down on the way out (write-back)
    assert all(e.medium in ("CPU", "STORAGE") and e.group_idx == 0 for e in ours)
    assert all(e.block_size == BLOCK for e in ours if isinstance(e, BlockStored))
    # every hash kvstrata names is one vLLM's own engine published for the same tokens
    assert {h for e in ours for h in e.block_hashes} <= vllms_stored
    # in vLLM's own form: 64-bit ints by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), as the router computes them
    assert {type(h) for e in ours for h in e.block_hashes} == {type(h) for h in vllms_stored} == {int}


@pytest.mark.server
def test_a_fleet_index_fed_by_the_events_finds_the_prompt_on_the_servers_disk(published):
    """The router's side: the feed takes every message (a malformed one among them is refused
    in one line and the rest still apply); the first prompt is reached on the server, on its
    disk and no longer its host, the third still in its host tier."""
    index = FleetIndex([SERVER])
    feed = EventFeed(index)
    bad = feed.take(SERVER, [b"kv", (0).to_bytes(8, "big"), b"\xc1 not msgpack"])
    assert bad.applied is None and bad.error.startswith(f"KV events from {SERVER!r} refused: malformed KV event batch")
    assert "\n" not in bad.error
    for frames in published:
        taken = feed.take(SERVER, frames)
        assert taken.error is None, taken.error
    first, third = (prompt_block_hashes(prompt(seed), BLOCK) for seed in (0, 2))
    assert len(index.reach(SERVER, first)) == PROMPT_BLOCKS
    for h in first:
        held = index.held(SERVER, h)
        assert Medium.DISK in held and Medium.HOST not in held, held
    assert all(Medium.HOST in index.held(SERVER, h) for h in third[-3:])
    assert index.count(SERVER, Medium.HOST) <= HOST_BLOCKS
