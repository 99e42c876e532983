"""The remote tier against real pool processes: faults, foreign values, sharing between processes.

Every pool here is real: the session's embedded pool (or ``$KVSTRATA_POOL``), or a private one
a test starts and then kills (SIGKILL) or stops (SIGSTOP). Foreign values are put with the raw
store API under the tier's object names. Run as a script (``python test_remote.py child ...``)
this file is also the other process of the sharing test.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: run as the child too
from process_support import stop_process, wait_until  # noqa: E402

from kvstrata import errors  # noqa: E402
from kvstrata.errors import CorruptBlock
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.pool import embedded
from kvstrata.pool.config import PoolConfig
from kvstrata.tiers import poolvalue
from kvstrata.tiers.remote import (
    BlockMissing,
    PoolUnavailable,
    RemoteMode,
    RemoteTier,
)
from tests.pool_support import RawPool

LAYOUT = KVLayout(num_layers=4, block_tokens=16, kv_heads=2, head_dim=8, dtype=DType.BF16)  # 4 x 1 KiB
MODES = [RemoteMode.TCP, RemoteMode.SHM]
SLACK_S = 1.5  # scheduling slack on a loaded 2-core CI box, on top of a configured bound


# --- deterministic blocks (shared with the child process) -------------------------------------


def make_key(i: int, salt: str = "") -> bytes:
    return xxhash.xxh3_128_digest(f"kvstrata-test-remote:{salt}:{i}".encode())


def content(key: bytes) -> torch.Tensor:
    data = np.random.default_rng(int.from_bytes(key, "little")).bytes(LAYOUT.block_bytes)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(LAYOUT.num_layers, LAYOUT.layer_bytes)


def store(tier: RemoteTier, key: bytes, block: torch.Tensor | None = None) -> None:
    # A pool object is named by its key: the slot (the block manager's view) is not used.
    tier.write(0, key, content(key) if block is None else block)


def load(tier: RemoteTier, key: bytes, dst: torch.Tensor | None = None) -> torch.Tensor:
    dst = torch.full((LAYOUT.num_layers, LAYOUT.layer_bytes), 0xAA, dtype=torch.uint8) if dst is None else dst
    tier.read_into(0, key, dst)
    return dst


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def raw(pool):
    """The raw store API (Mooncake calls, through a bounded client) and a registered buffer."""
    raw = RawPool(pool, 2 * (poolvalue.HEADER_BYTES + LAYOUT.block_bytes))
    yield raw
    raw.close()


def value_bytes(key: bytes, payload: torch.Tensor, layout_text: str = LAYOUT.describe(),
                checksum_of: torch.Tensor | None = None) -> bytes:
    """An unsealed value of ``payload`` under ``key``'s header; the header's payload checksum is
    that of ``checksum_of`` (default: ``payload``; an empty tensor: no checksum)."""
    digest = poolvalue.layout_digest(layout_text)
    summed = payload if checksum_of is None else checksum_of
    checksum = xxhash.xxh3_64_intdigest(summed.numpy()) if summed.numel() else None
    return poolvalue.encode_header(key, digest, payload.numel(), checksum) + payload.numpy().tobytes()




def timed(fn):
    start = time.monotonic()
    try:
        return fn(), time.monotonic() - start
    except Exception as error:  # noqa: BLE001 - returned for the test to check
        return error, time.monotonic() - start


# --- connecting -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_no_pool_at_start_raises_pool_unavailable_quickly(mode):
    address = f"127.0.0.1:{embedded.free_port()}"  # nobody listens
    error, seconds = timed(lambda: RemoteTier(LAYOUT, 0, PoolConfig(master=address, daemon=address), mode,
                                              connect_timeout_s=1.0))
    assert isinstance(error, PoolUnavailable) and address in str(error)
    assert seconds < 1.0 + 2.0


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_pool_that_accepts_but_never_answers_raises_quickly(mode):
    # The kernel completes connections for a listening socket nobody serves (as for a stopped
    # master). Mooncake's setup would retry for minutes while holding the GIL: never called.
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = f"127.0.0.1:{server.getsockname()[1]}"
        error, seconds = timed(lambda: RemoteTier(LAYOUT, 0, PoolConfig(master=address, daemon=address), mode,
                                                  connect_timeout_s=1.0))
    assert isinstance(error, PoolUnavailable) and "does not answer" in str(error)
    assert seconds < 1.0 + 2.0


def test_shm_mode_needs_a_daemon():
    with pytest.raises(ValueError, match="daemon"):
        RemoteTier(LAYOUT, 0, PoolConfig(master="127.0.0.1:1"), RemoteMode.SHM)


# --- private memory ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_blocks_move_through_the_tiers_own_staging_and_partial_reads_verify(make_remote_tier, mode):
    tier = make_remote_tier(mode)
    host = torch.zeros(3 * LAYOUT.block_bytes, dtype=torch.uint8).view(3, LAYOUT.num_layers, LAYOUT.layer_bytes)
    host[0].copy_(content(make_key(1)))
    store(tier, make_key(1), host[0])
    load(tier, make_key(1), host[1])
    assert torch.equal(host[1], host[0])
    client = tier._client
    assert not any(client.is_registered(t) for t in (host, host[0], host[1]))  # the caller's memory: never
    lane = tier._lanes.current()
    assert client.is_registered(lane.stage) and client.is_registered(lane.header)
    for layers in (slice(1, 3), slice(0, 1), slice(3, 4), slice(2, 2)):
        dst = host[2][: len(range(*layers.indices(LAYOUT.num_layers)))]
        dst.fill_(0xAA)
        tier.read_into(0, make_key(1), dst, layers)
        assert torch.equal(dst, host[0][layers])


# --- shared visibility ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_another_tier_finds_and_reads_what_one_wrote(make_remote_tier, mode):
    writer = make_remote_tier(mode)
    keys = [make_key(i, "adopt") for i in range(5)]
    for key in keys[:3]:
        store(writer, key)
    reader = RemoteTier(LAYOUT, 2 * LAYOUT.block_bytes, writer.pool, mode, namespace_tag=writer.namespace_tag)
    try:
        assert reader.shared and reader.find(keys) == reader.exists(keys) == [True, True, True, False, False]
        assert reader.exists([]) == []
        assert [torch.equal(load(reader, k), content(k)) for k in keys[:3]] == [True, True, True]
    finally:
        reader.close()


def test_discard_leaves_the_object_for_others(make_remote_tier):
    tier = make_remote_tier()
    store(tier, make_key(3))
    tier.discard(0, make_key(3))
    assert tier.exists([make_key(3)]) == [True]


def test_block_removed_under_a_reader_is_missing(make_remote_tier):
    tier = make_remote_tier()
    store(tier, make_key(4))
    assert tier.remove_from_pool([make_key(4)], force=True) == [True]
    assert tier.exists([make_key(4)]) == [False]
    with pytest.raises(BlockMissing):
        load(tier, make_key(4))
    assert tier.remove_from_pool([make_key(4)]) == [True]  # already gone


def test_other_namespace_is_a_miss(make_remote_tier):
    writer = make_remote_tier()
    other = make_remote_tier()  # same pool, another tag
    store(writer, make_key(5))
    assert other.exists([make_key(5)]) == [False]
    with pytest.raises(BlockMissing):
        load(other, make_key(5))


# --- foreign values ---------------------------------------------------------------------------


@pytest.mark.parametrize("extra_bytes", [4096, -1024, -LAYOUT.block_bytes], ids=["larger", "smaller", "header-only"])
def test_value_of_the_wrong_size_is_rejected(make_remote_tier, raw, extra_bytes):
    tier = make_remote_tier()
    key = make_key(6)
    good = value_bytes(key, content(key))
    value = good + bytes(extra_bytes) if extra_bytes > 0 else good[:extra_bytes]
    raw.put(tier.object_name(key), value)
    with pytest.raises(CorruptBlock, match="wrong size") as caught:
        load(tier, key)
    assert not isinstance(caught.value, BlockMissing)
    assert tier.up  # a bad value says nothing about the pool


@pytest.mark.parametrize("defect", ["other key", "other layout", "bad magic", "bad header checksum"])
def test_wrong_header_is_rejected(make_remote_tier, raw, defect):
    tier = make_remote_tier()
    key = make_key(7)
    payload = content(key)
    if defect == "other key":
        value = value_bytes(make_key(8), payload)
    elif defect == "other layout":
        value = value_bytes(key, payload, layout_text="layer-major LKTHD:4x2x32x2x8:bf16")
    else:
        value = bytearray(value_bytes(key, payload))
        value[0 if defect == "bad magic" else 20] ^= 0xFF
        value = bytes(value)
    raw.put(tier.object_name(key), value)
    with pytest.raises(CorruptBlock) as caught:
        load(tier, key)
    assert not isinstance(caught.value, BlockMissing)


@pytest.mark.parametrize("defect", ["another block's bytes", "a flipped byte", "no checksum"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_without_a_secret_a_value_whose_payload_is_not_its_headers_is_a_miss(make_remote_tier, raw, mode, defect):
    # A put that lands late, from memory reused meanwhile: block A's valid header (its key, its
    # payload's checksum) over block B's bytes. Before payload checks were on by default, the
    # tier served B's bytes as A's.
    tier = make_remote_tier(mode)
    a, b = make_key(9), make_key(19)
    payload = {"another block's bytes": content(b), "a flipped byte": content(a).clone(), "no checksum": content(a)}[defect]
    payload[2, 5] ^= 1 if defect == "a flipped byte" else 0
    checksum_of = torch.empty(0, dtype=torch.uint8) if defect == "no checksum" else content(a)
    raw.put(tier.object_name(a), value_bytes(a, payload, checksum_of=checksum_of))
    dst = torch.full((LAYOUT.num_layers, LAYOUT.layer_bytes), 0xAA, dtype=torch.uint8)
    with pytest.raises(CorruptBlock, match="checksum") as caught:
        load(tier, a, dst)
    assert not isinstance(caught.value, BlockMissing)
    batch = torch.zeros(LAYOUT.block_bytes, dtype=torch.uint8).view(1, LAYOUT.num_layers, LAYOUT.layer_bytes)
    (error,) = tier.read_many_into([0], [a], list(batch))  # the batched path checks the same
    assert isinstance(error, CorruptBlock) and "checksum" in str(error)
    # The tier's own writes carry a checksum and read back clean, whole or in part.
    store(tier, make_key(10))
    assert torch.equal(load(tier, make_key(10)), content(make_key(10)))
    part = torch.empty(2, LAYOUT.layer_bytes, dtype=torch.uint8)
    tier.read_into(0, make_key(10), part, slice(1, 3))
    assert torch.equal(part, content(make_key(10))[1:3])


# --- batches ----------------------------------------------------------------------------------


def recording_calls(tier: RemoteTier) -> list[tuple[str, int]]:
    """(method, objects) of every batched pool call the tier starts from now on."""
    seen: list[tuple[str, int]] = []
    client = tier._client
    start = client.start

    def spy(what, op, *args, **kwargs):
        if op.name.startswith("batch_"):
            seen.append((op.name, len(args[0])))
        return start(what, op, *args, **kwargs)

    client.start = spy
    return seen


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_a_checked_batch_moves_in_few_pipelined_calls_and_reads_back_exact(make_remote_tier, mode):
    writer = make_remote_tier(mode)  # checked values: the batch is cut for pipelining
    reader = make_remote_tier(mode, namespace_tag=writer.namespace_tag)
    keys = [make_key(i, f"batch-{mode.value}") for i in range(6)]
    src = torch.zeros(6 * LAYOUT.block_bytes, dtype=torch.uint8).view(6, LAYOUT.num_layers, LAYOUT.layer_bytes)
    for i, key in enumerate(keys):
        src[i] = content(key)
    puts = recording_calls(writer)
    assert writer.write_many([0] * 6, keys, list(src)) == [None] * 6
    assert [m for m, _ in puts] == ["batch_put_from_multi_buffers"] * len(puts)
    assert 1 < len(puts) < 6 and sum(n for _, n in puts) == 6  # pipelined batches, not a call per block
    dst = torch.zeros(6 * LAYOUT.block_bytes, dtype=torch.uint8).view(6, LAYOUT.num_layers, LAYOUT.layer_bytes)
    dst.fill_(0xAA)
    gets = recording_calls(reader)
    assert reader.read_many_into([0] * 6, keys, list(dst)) == [None] * 6
    assert 1 < len(gets) < 6 and sum(n for _, n in gets) == 6
    assert all(torch.equal(dst[i], content(k)) for i, k in enumerate(keys))
    assert writer.write_many([0] * 6, keys, list(src)) == [None] * 6  # already there: left as it is


def test_a_bad_block_in_a_pipelined_batch_fails_alone(make_remote_tier, raw):
    tier = make_remote_tier()
    keys = [make_key(i, "batch-bad") for i in range(6)]
    src = torch.zeros(6 * LAYOUT.block_bytes, dtype=torch.uint8).view(6, LAYOUT.num_layers, LAYOUT.layer_bytes)
    for i, key in enumerate(keys):
        src[i] = content(key)
    assert tier.write_many([0] * 6, keys, list(src)) == [None] * 6
    assert tier.remove_from_pool([keys[1]], force=True) == [True]  # in the first call
    tier.remove_from_pool([keys[4]], force=True)  # in a later call: a value of another key instead
    raw.put(tier.object_name(keys[4]), value_bytes(keys[5], content(keys[5])))
    dst = torch.zeros(6 * LAYOUT.block_bytes, dtype=torch.uint8).view(6, LAYOUT.num_layers, LAYOUT.layer_bytes)
    got = tier.read_many_into([0] * 6, keys, list(dst))
    assert isinstance(got[1], BlockMissing)
    assert isinstance(got[4], CorruptBlock) and not isinstance(got[4], BlockMissing)
    assert [got[i] for i in (0, 2, 3, 5)] == [None] * 4
    assert all(torch.equal(dst[i], content(keys[i])) for i in (0, 2, 3, 5))
    assert tier.up  # bad values say nothing about the pool


# --- pool faults ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_pool_killed_mid_run_reads_raise_in_bounded_time(make_remote_tier, private_pool, mode):
    op_timeout_s = 1.0
    tier = make_remote_tier(mode, private_pool.config, op_timeout_s=op_timeout_s, backoff_s=0.2)
    host = torch.zeros(2 * LAYOUT.block_bytes, dtype=torch.uint8).view(2, LAYOUT.num_layers, LAYOUT.layer_bytes)
    keys = [make_key(i, "killed") for i in range(3)]
    for key in keys:
        store(tier, key)
    assert torch.equal(load(tier, keys[0], host[0]), content(keys[0]))
    for victim in ("daemon", "master"):
        os.kill(getattr(private_pool, f"{victim}_pid"), signal.SIGKILL)
        time.sleep(0.3)  # past the cool-off: every call below reaches the dead pool again
        for key in keys:
            for dst in (host[1], None):  # registered memory, then through staging
                error, seconds = timed(lambda key=key, dst=dst: load(tier, key, dst))
                assert isinstance(error, (PoolUnavailable, CorruptBlock)), f"{victim} killed: read returned {error!r}"
                assert seconds < op_timeout_s + SLACK_S
        assert timed(lambda: tier.exists(keys))[0] == [False] * 3
        error, seconds = timed(lambda victim=victim: store(tier, make_key(9, victim)))
        assert isinstance(error, PoolUnavailable) and seconds < op_timeout_s + SLACK_S
    assert timed(tier.close)[1] < op_timeout_s + SLACK_S


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_hung_pool_fails_the_read_leaves_dst_untouched_then_recovers(make_remote_tier, private_pool, mode):
    op_timeout_s, backoff_s, backoff_max_s = 1.0, 0.3, 1.0
    tier = make_remote_tier(mode, private_pool.config, op_timeout_s=op_timeout_s, backoff_s=backoff_s,
                     backoff_max_s=backoff_max_s)
    host = torch.zeros(2 * LAYOUT.block_bytes, dtype=torch.uint8).view(2, LAYOUT.num_layers, LAYOUT.layer_bytes)
    store(tier, make_key(11))
    stop_process(private_pool.daemon_pid)  # holds the bytes (and serves SHM clients)
    host[0].fill_(0xAA)
    error, seconds = timed(lambda: load(tier, make_key(11), host[0]))
    assert type(error) is PoolUnavailable  # host[0] was never handed to the pool: nothing to quarantine
    assert not isinstance(error, errors.TransferAbandoned)
    assert bool((host[0] == 0xAA).all())
    assert op_timeout_s <= seconds < op_timeout_s + SLACK_S
    assert not tier.up
    error, seconds = timed(lambda: load(tier, make_key(11), host[1]))  # known down: fails at once
    assert type(error) is PoolUnavailable and seconds < 0.1
    os.kill(private_pool.daemon_pid, signal.SIGCONT)
    # A background probe finds it back: within the longest backoff (and one probe's wait).
    assert wait_until(lambda: tier.up, backoff_max_s + op_timeout_s + SLACK_S)
    assert torch.equal(load(tier, make_key(11), host[1]), content(make_key(11)))


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_hung_pool_under_a_pipelined_batch_fails_it_and_never_had_the_callers_memory(make_remote_tier, private_pool, mode):
    op_timeout_s = 1.0
    tier = make_remote_tier(mode, private_pool.config, op_timeout_s=op_timeout_s, backoff_s=5.0)
    keys = [make_key(i, "hung-batch") for i in range(8)]  # checked: cut into calls (of 7, then 1)
    memory = torch.zeros(16 * LAYOUT.block_bytes, dtype=torch.uint8).view(16, LAYOUT.num_layers, LAYOUT.layer_bytes)
    for i, key in enumerate(keys):
        memory[i] = content(key)
    assert tier.write_many([0] * 8, keys, list(memory[:8])) == [None] * 8
    stop_process(private_pool.daemon_pid)
    try:
        got, seconds = timed(lambda: tier.read_many_into([0] * 8, keys, list(memory[8:])))
        assert seconds < op_timeout_s + SLACK_S  # one call's budget, not one per call of the batch
        # The caller's memory is never handed to the pool: every block fails plainly, untouched.
        assert all(type(e) is PoolUnavailable for e in got), [type(e).__name__ for e in got]
        assert not tier.up
        others = [make_key(i, "hung-batch-2") for i in range(8)]
        got, seconds = timed(lambda: tier.write_many([0] * 8, others, list(memory[:8])))
        assert all(isinstance(e, PoolUnavailable) for e in got) and seconds < 0.1  # known down: at once
    finally:
        os.kill(private_pool.daemon_pid, signal.SIGCONT)


def test_a_daemon_stalled_past_mooncakes_default_lease_keeps_every_object(make_remote_tier, private_pool):
    # Mooncake's master drops a daemon (and every object in its segment) 10 s after its last
    # heartbeat by default: a 5 s SIGSTOP lost them all. The embedded pool's master keeps it
    # for embedded.CLIENT_TTL_S; a stall well past the default costs no object.
    from kvstrata.pool.embedded import CLIENT_TTL_S

    stall_s = 12.0
    assert stall_s < CLIENT_TTL_S
    tier = make_remote_tier(RemoteMode.TCP, private_pool.config, op_timeout_s=1.0, backoff_s=0.3, backoff_max_s=1.0)
    keys = [make_key(i, "stalled") for i in range(4)]
    for key in keys:
        store(tier, key)
    stop_process(private_pool.daemon_pid)
    try:
        time.sleep(stall_s)
    finally:
        os.kill(private_pool.daemon_pid, signal.SIGCONT)
    assert wait_until(lambda: tier.up and tier.exists(keys) == [True] * 4, 5.0)
    for key in keys:
        assert torch.equal(load(tier, key), content(key))


def test_a_dead_daemon_keeps_a_tcp_client_down(make_remote_tier, private_pool):
    # In TCP mode the client talks to the master, which still answers (and still lists the
    # objects) with the daemon that holds them dead: the probe must check the daemon too.
    tier = make_remote_tier(RemoteMode.TCP, private_pool.config, op_timeout_s=1.0)
    keys = [make_key(i, "dead-daemon") for i in range(2)]
    for key in keys:
        store(tier, key)
    os.kill(private_pool.daemon_pid, signal.SIGKILL)
    error, seconds = timed(lambda: load(tier, keys[0]))
    assert isinstance(error, (PoolUnavailable, CorruptBlock)) and seconds < 1.0 + SLACK_S
    time.sleep(2.0)  # several background probes (0.25 s on, doubling): each finds the daemon dead
    assert not tier.up
    answer, seconds = timed(lambda: tier.exists(keys))
    assert answer == [False, False] and seconds < 0.1  # known down: not the master's stale listing
    assert private_pool.config.daemon in tier.unavailable


# --- sharing between processes ----------------------------------------------------------------


def test_blocks_shared_between_processes_and_outlive_their_writer(make_remote_tier):
    tier = make_remote_tier(RemoteMode.TCP)
    mine = [make_key(i, "parent") for i in range(3)]
    theirs = [make_key(i, "child") for i in range(3)]
    for key in mine:
        store(tier, key)
    args = {"pool": tier.pool.to_json(), "tag": tier.namespace_tag, "read": [k.hex() for k in mine],
            "write": [k.hex() for k in theirs]}
    root = Path(__file__).resolve().parents[2]  # the child imports tests.pool_support, as this module does
    child = subprocess.run([sys.executable, "-m", "tests.tiers.test_remote", "child", json.dumps(args)], cwd=root,
                           capture_output=True, text=True, timeout=60, check=False)
    assert child.returncode == 0, child.stderr[-3000:]
    assert json.loads(child.stdout.strip().splitlines()[-1]) == {"read_ok": [True, True, True]}
    # The child has exited: its blocks live on in the pool.
    assert tier.exists(theirs) == [True, True, True]
    assert [torch.equal(load(tier, k), content(k)) for k in theirs] == [True, True, True]


def _child(args: dict) -> None:
    tier = RemoteTier(LAYOUT, 16 * LAYOUT.block_bytes, PoolConfig(**args["pool"]), RemoteMode.TCP,
                      namespace_tag=args["tag"])
    try:
        wanted = [bytes.fromhex(k) for k in args["read"]]
        assert tier.exists(wanted) == [True] * len(wanted)
        read_ok = [torch.equal(load(tier, k), content(k)) for k in wanted]
        for key in (bytes.fromhex(k) for k in args["write"]):
            store(tier, key)
    finally:
        tier.close()
    print(json.dumps({"read_ok": read_ok}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        _child(json.loads(sys.argv[2]))
