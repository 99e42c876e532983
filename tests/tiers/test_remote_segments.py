"""The remote tier spreads its puts over the pool's segments (pool daemons), against a real master
and two real daemons on loopback: a batched put deals its blocks out to the segments one by one
(a call per segment), going on round them over the tier's puts; a put alone goes where
its key says; one segment takes everything; every block reads back as written."""

from __future__ import annotations

import importlib.util
import os
import signal
from dataclasses import dataclass, replace

import pytest
import torch

from kvstrata.pool import embedded, native_log, ops
from kvstrata.pool import network as netns
from kvstrata.pool.client import PoolClient
from kvstrata.pool.config import PoolConfig
from kvstrata.pool.network import PoolNetwork
from kvstrata.tiers.remote import PoolUnavailable, RemoteMode, RemoteTier, fresh_tag
from tests.process_support import stop_process, wait_until
from tests.tiers.test_remote import LAYOUT, MODES, SLACK_S, content, make_key, timed

# Not importorskip: importing mooncake.store before kvstrata.pool.native_log configures Mooncake's log
# sends every line Mooncake logs in this process to stderr (its stores' teardown after pytest's summary).
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="the pool engine is not installed"),
    pytest.mark.pool,  # a master and two daemons of this module's own
]

SEGMENT_BYTES = 16 * 1024**2


@dataclass(frozen=True)
class Segmented:
    """A pool of two daemons: its config naming both segments, each daemon's address (for SHM
    clients) and pid, and a raw client that says where an object lives."""

    pool: PoolConfig
    daemons: tuple[str, str]
    daemon_pids: tuple[int, int]
    raw: PoolClient
    segment_at: dict[str, str]  # a daemon's transport endpoint -> its segment name

    def segment_of(self, name: str) -> str:
        """The segment holding the (one) replica of the object ``name``."""
        (replica,) = self.raw.call(f"replicas of {name}", ops.GET_REPLICA_DESC, name)
        return self.segment_at[replica.get_memory_descriptor().buffer_descriptor.transport_endpoint]


@pytest.fixture(scope="module")
def segmented(tmp_path_factory):
    """A master and two pool daemons on loopback, each daemon's segment named ``127.0.0.1:<port>``
    (its ``--host``). The transport endpoint an object's replica names is not the segment name:
    a probe object put on each segment says which endpoint is which."""
    ReplicateConfig = native_log.store_module().ReplicateConfig  # through native_log: Mooncake's log configured

    run = tmp_path_factory.mktemp("segments")
    master_port = embedded.free_port()
    master = f"127.0.0.1:{master_port}"
    network = embedded.network_for(PoolNetwork.AUTO)  # where an embedded pool runs (a process joins one network)
    prefix, accepting = (netns.exec_prefix(network) if network else ()), embedded.accepts_in(network)
    procs = [embedded.launch_master("127.0.0.1", master_port, embedded.free_port(), run / "master.log", prefix)]
    raw = None
    try:
        embedded.wait_for(master, procs[0], run / "master.log", accepting)
        segments, daemons = [], []
        for n in range(2):
            segment, port = f"127.0.0.1:{embedded.free_port()}", embedded.free_port()
            procs.append(embedded.launch_daemon(segment, port, master, SEGMENT_BYTES, run / f"daemon{n}.log", prefix))
            embedded.wait_for(f"127.0.0.1:{port}", procs[-1], run / f"daemon{n}.log", accepting)
            segments.append(segment)
            daemons.append(f"127.0.0.1:{port}")
        raw = PoolClient(PoolConfig(master=master, network=network))
        probe = raw.allocate(64)
        segment_at = {}
        for segment in segments:
            config = ReplicateConfig()
            config.replica_num, config.preferred_segment = 1, segment
            name = f"probe/{segment}"
            assert raw.call("probe put", ops.BATCH_PUT, [name], [probe.data_ptr()], [64], config) == [0]
            (replica,) = raw.call("probe replicas", ops.GET_REPLICA_DESC, name)
            segment_at[replica.get_memory_descriptor().buffer_descriptor.transport_endpoint] = segment
        assert len(segment_at) == 2, "the daemons' endpoints must tell them apart"
        pids = (procs[1].pid, procs[2].pid)
        yield Segmented(PoolConfig(master=master, segments=tuple(segments), network=network), tuple(daemons), pids, raw,
                        segment_at)
    finally:
        if raw is not None:
            raw.close()
        for proc in reversed(procs):
            embedded.terminate(proc.pid)


@pytest.fixture
def make_tier(segmented):
    """``make(segments=both, mode=TCP, **RemoteTier options)``: a tier of 64 blocks on the two-daemon pool."""
    made = []

    def make(segments: tuple[str, ...] | None = None, mode: RemoteMode = RemoteMode.TCP, **kwargs) -> RemoteTier:
        pool = segmented.pool if segments is None else replace(segmented.pool, segments=segments)
        if mode is RemoteMode.SHM:
            pool = replace(pool, daemon=segmented.daemons[1])
        tier = RemoteTier(LAYOUT, 64 * LAYOUT.block_bytes, pool, mode, namespace_tag=fresh_tag(), **kwargs)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def blocks_in(memory: torch.Tensor, keys: list[bytes]) -> list[torch.Tensor]:
    """One block a key in registered ``memory``, holding the key's content."""
    blocks = list(memory[: len(keys) * LAYOUT.block_bytes].view(len(keys), LAYOUT.num_layers, LAYOUT.layer_bytes))
    for block, key in zip(blocks, keys):
        block.copy_(content(key))
    return blocks


def reads_back(tier: RemoteTier, keys: list[bytes]) -> bool:
    """Whether one batched get of ``keys`` (from every segment at once) returns what was written."""
    memory = torch.zeros(len(keys) * LAYOUT.block_bytes, dtype=torch.uint8).fill_(0xAA)
    dsts = list(memory.view(len(keys), LAYOUT.num_layers, LAYOUT.layer_bytes))
    assert tier.read_many_into([0] * len(keys), keys, dsts) == [None] * len(keys)
    return all(torch.equal(dst, content(key)) for dst, key in zip(dsts, keys))


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_a_batched_put_deals_its_blocks_out_to_the_segments_one_by_one(make_tier, segmented, mode):
    tier = make_tier(mode=mode)
    keys = [make_key(i, f"runs-{mode.value}") for i in range(11)]
    assert tier.write_many([0] * 11, keys, blocks_in(torch.zeros(11 * LAYOUT.block_bytes, dtype=torch.uint8), keys)) == [None] * 11
    placed = [segmented.segment_of(tier.object_name(key)) for key in keys]
    first, second = placed[0], placed[1]
    assert {first, second} == set(segmented.pool.segments)
    assert placed == [first, second] * 5 + [first]
    # What dealing is for: any run of consecutive blocks (a later get call) draws on both evenly.
    for start in range(11):
        for stop in range(start + 1, 12):
            window = placed[start:stop]
            assert abs(window.count(first) - window.count(second)) <= 1
    assert reads_back(tier, keys)


def test_puts_go_round_the_segments_block_by_block(make_tier, segmented, secret):
    # Sealed: each batch is cut into calls that grow (1, 3, 9, ... of 16): odd sizes, whose extra
    # block must not always land on the same segment; and single-block puts alternate.
    tier = make_tier(secret=secret)
    keys = [make_key(i, "round") for i in range(40)]
    memory = torch.zeros(40 * LAYOUT.block_bytes, dtype=torch.uint8)
    assert tier.write_many([0] * 34, keys[:34], blocks_in(memory, keys[:34])) == [None] * 34
    for key, block in zip(keys[34:], blocks_in(memory, keys[34:])):
        assert tier.write_many([0], [key], [block]) == [None]
    placed = [segmented.segment_of(tier.object_name(key)) for key in keys]
    assert sorted(placed.count(segment) for segment in segmented.pool.segments) == [20, 20]
    assert len(set(placed[34:])) == 2 and all(a != b for a, b in zip(placed[34:], placed[35:]))  # alternating
    assert reads_back(tier, keys)


def test_a_put_alone_goes_to_the_segment_its_key_picks(make_tier, segmented):
    tier = make_tier()
    keys = [make_key(i, "alone") for i in range(16)]
    for key in keys:
        tier.write(0, key, content(key))  # private memory: one put a block
    placed = [segmented.segment_of(tier.object_name(key)) for key in keys]
    segments = segmented.pool.segments
    assert placed == [segments[int.from_bytes(key, "little") % 2] for key in keys]
    assert set(placed) == set(segments)
    assert reads_back(tier, keys)


def test_one_segment_takes_every_block(make_tier, segmented):
    only = segmented.pool.segments[1]
    tier = make_tier(segments=(only,))
    keys = [make_key(i, "one") for i in range(9)]
    assert tier.write_many([0] * 8, keys[:8], blocks_in(torch.zeros(8 * LAYOUT.block_bytes, dtype=torch.uint8), keys[:8])) == [None] * 8
    tier.write(0, keys[8], content(keys[8]))
    assert {segmented.segment_of(tier.object_name(key)) for key in keys} == {only}
    assert reads_back(tier, keys)


def test_a_hung_daemon_fails_its_run_and_the_other_runs_are_waited_for(make_tier, segmented):
    # A fresh tier's first run goes to the first segment: the second daemon's run hangs. Four
    # blocks go in one call (a checked batch of more is cut into several, and a later call waits
    # for the earlier).
    op_timeout_s = 0.5
    tier = make_tier(op_timeout_s=op_timeout_s, backoff_s=5.0)
    keys = [make_key(i, "hung") for i in range(4)]
    blocks = blocks_in(torch.zeros(4 * LAYOUT.block_bytes, dtype=torch.uint8), keys)
    stop_process(segmented.daemon_pids[1])
    try:
        got, seconds = timed(lambda: tier.write_many([0] * 4, keys, blocks))
        assert seconds < op_timeout_s + SLACK_S
        assert got[0::2] == [None] * 2 and all(isinstance(e, PoolUnavailable) for e in got[1::2])
        assert {segmented.segment_of(tier.object_name(key)) for key in keys[0::2]} == {segmented.pool.segments[0]}
    finally:
        os.kill(segmented.daemon_pids[1], signal.SIGCONT)
    late = [tier.object_name(key) for key in keys[1::2]]  # the stray put lands once the daemon runs: then undone
    assert wait_until(lambda: segmented.raw.call("exists", ops.BATCH_IS_EXIST, late) == [0] * 2, 10.0)
