"""The remote tier moves blocks in pieces of a caller's memory (``write_pieces``, ``read_pieces``)
against the real pool: pieces in registered memory go as they lie, one object per block from
and into ``[header, *pieces]``, in batched calls; any other pieces through the default (gathered,
staged); every value read is verified across its pieces, sealed or not."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from kvstrata.errors import CorruptBlock
from kvstrata.pool.client import PoolClient
from kvstrata.tiers import poolvalue
from kvstrata.tiers.remote import BlockMissing, PoolUnavailable, RemoteMode, RemoteTier, TransferAbandoned
from tests.tiers.conformance import cut
from tests.tiers.test_remote import LAYOUT, MODES, SLACK_S, content, make_key, timed

HALF = LAYOUT.block_bytes // 2
UNEVEN = [1500, 1000, 0, LAYOUT.block_bytes - 2500]  # layers 1 and 2 span pieces; an empty piece
VALUE = poolvalue.HEADER_BYTES + LAYOUT.block_bytes
MANY = [LAYOUT.block_bytes // 16] * 16  # a layer-first page's kind: more parts than remote.GATHER_PARTS


def fill(pieces: list[torch.Tensor], block: torch.Tensor) -> None:
    torch._foreach_copy_(pieces, list(block.reshape(-1).split([p.numel() for p in pieces])))


def joined(pieces: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(pieces).view(LAYOUT.num_layers, LAYOUT.layer_bytes)


def filled(memory: torch.Tensor, sizes: list[int], keys: list[bytes]) -> list[list[torch.Tensor]]:
    blocks = cut(memory, sizes, len(keys))
    for pieces, key in zip(blocks, keys):
        fill(pieces, content(key))
    return blocks


def recording_objects(tier: RemoteTier) -> list[tuple[str, list[int]]]:
    """(method, buffer sizes) of every object of every batched pool call the tier starts from now on."""
    seen: list[tuple[str, list[int]]] = []
    client = tier._client
    start = client.start

    def spy(what, method, *args, **kwargs):
        if method.endswith("multi_buffers"):
            seen.extend((method, list(sizes)) for sizes in args[2])
        return start(what, method, *args, **kwargs)

    client.start = spy
    return seen


def staged(tier: RemoteTier) -> bool:
    """Whether this thread's staging buffer was ever made (anything not zero-copy makes it)."""
    return tier._lanes.lane.staging is not None


@pytest.fixture(scope="module")
def attacker(pool):
    """A raw client of the pool (no secret) and a registered buffer of one value."""
    client = PoolClient(pool)
    yield client, client.allocate(VALUE)
    client.close()


def tamper(attacker, name: str, offset: int) -> None:
    """Flip one byte of the object ``name`` in place (a raw get, remove, put)."""
    client, buffer = attacker
    assert client.call("raw get", "batch_get_into", [name], [buffer.data_ptr()], [VALUE]) == [VALUE]
    buffer[offset] ^= 0xFF
    client.call("raw remove", "remove", name, True)
    assert client.call("raw put", "batch_put_from", [name], [buffer.data_ptr()], [VALUE]) == [0]


# --- zero-copy and fallback -------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("sizes", [[HALF, HALF], UNEVEN], ids=["k/v halves", "uneven"])
def test_registered_pieces_go_as_they_lie_one_object_per_block(make_remote_tier, mode, sizes):
    tier = make_remote_tier(mode)  # checked: the batch is cut into pipelined calls
    keys = [make_key(i, f"pieces-{mode.value}") for i in range(6)]
    memory = tier.allocate(2 * 6 * LAYOUT.block_bytes)
    sources = filled(memory[: 6 * LAYOUT.block_bytes], sizes, keys)
    targets = cut(memory[6 * LAYOUT.block_bytes :].fill_(0xAA), sizes, 6)
    objects = recording_objects(tier)
    assert tier.write_pieces([0] * 6, keys, sources) == [None] * 6
    assert tier.read_pieces([0] * 6, keys, targets) == [None] * 6
    assert all(torch.equal(joined(targets[i]), content(key)) for i, key in enumerate(keys))
    pieces = [poolvalue.HEADER_BYTES, *(s for s in sizes if s)]  # the header, then each non-empty piece
    assert objects == [("batch_put_from_multi_buffers", pieces)] * 6 + [("batch_get_into_multi_buffers", pieces)] * 6
    assert not staged(tier)  # nothing gathered, nothing staged
    whole = torch.empty(LAYOUT.num_layers, LAYOUT.layer_bytes, dtype=torch.uint8)  # and it reads as a block
    tier.read_into(0, keys[3], whole)
    assert torch.equal(whole, content(keys[3]))


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_pieces_outside_registered_memory_still_move(make_remote_tier, mode):
    tier = make_remote_tier(mode)
    keys = [make_key(i, f"unregistered-{mode.value}") for i in range(3)]
    registered = tier.allocate(3 * LAYOUT.block_bytes)
    private = torch.empty(3 * LAYOUT.block_bytes, dtype=torch.uint8)  # never registered
    sources = filled(private, UNEVEN, keys)
    sources[1] = filled(registered[: LAYOUT.block_bytes], UNEVEN, keys[1:2])[0]  # one block registered: still the fallback
    assert tier.write_pieces([0] * 3, keys, sources) == [None] * 3
    targets = cut(private.fill_(0xAA), UNEVEN, 3)
    assert tier.read_pieces([0] * 3, keys, targets) == [None] * 3
    assert all(torch.equal(joined(targets[i]), content(key)) for i, key in enumerate(keys))
    assert staged(tier)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("registered", [True, False], ids=["registered", "private"])
def test_blocks_in_many_pieces_move_through_the_gather_buffer_one_buffer_a_value(make_remote_tier, secret, attacker,
                                                                                mode, registered, monkeypatch):
    from kvstrata.tiers import remote

    monkeypatch.setattr(remote, "GATHER_BYTES", 3 * LAYOUT.block_bytes)  # a buffer of 3 blocks: 7 go in three rounds
    tier = make_remote_tier(mode, secret=secret)
    keys = [make_key(i, f"many-{mode.value}-{registered}") for i in range(7)]
    memory = tier.allocate(7 * LAYOUT.block_bytes) if registered else torch.empty(7 * LAYOUT.block_bytes, dtype=torch.uint8)
    objects = recording_objects(tier)
    assert tier.write_pieces([0] * 7, keys, filled(memory, MANY, keys)) == [None] * 7
    assert [sizes for _, sizes in objects] == [[poolvalue.HEADER_BYTES, LAYOUT.block_bytes]] * 7  # gathered: one slice
    tamper(attacker, tier.object_name(keys[4]), poolvalue.HEADER_BYTES + 7)
    targets = cut(memory.fill_(0xAA), MANY, 7)
    got = tier.read_pieces([0] * 7, keys, targets)
    assert isinstance(got[4], CorruptBlock) and [g for i, g in enumerate(got) if i != 4] == [None] * 6
    assert all(torch.equal(joined(targets[i]), content(k)) for i, k in enumerate(keys) if i != 4)
    assert not joined(targets[4]).ne(0xAA).any()  # a block that failed is not scattered
    assert not staged(tier)


def test_a_key_twice_in_one_call_is_stored_once(make_remote_tier):
    tier = make_remote_tier()
    key = make_key(0, "twice")
    memory = tier.allocate(2 * LAYOUT.block_bytes)
    blocks = filled(memory, [HALF, HALF], [key, key])
    assert tier.write_pieces([0, 0], [key, key], blocks) == [None, None]
    assert tier.read_pieces([0, 0], [key, key], blocks) == [None, None]
    assert all(torch.equal(joined(b), content(key)) for b in blocks)


def test_whole_blocks_and_pieces_read_each_others_checksums(make_remote_tier):
    # The checksum of a value put from pieces is streamed over them; a whole write's is over one.
    tier = make_remote_tier()
    a, b = make_key(1, "mix"), make_key(2, "mix")
    memory = tier.allocate(2 * LAYOUT.block_bytes)
    assert tier.write_pieces([0], [a], filled(memory[: LAYOUT.block_bytes], UNEVEN, [a])) == [None]
    tier.write(0, b, content(b))
    whole = memory[LAYOUT.block_bytes :].view(LAYOUT.num_layers, LAYOUT.layer_bytes)
    assert tier.read_many_into([0], [a], [whole]) == [None] and torch.equal(whole, content(a))
    targets = cut(memory[: LAYOUT.block_bytes].fill_(0xAA), UNEVEN, 1)
    assert tier.read_pieces([0], [b], targets) == [None] and torch.equal(joined(targets[0]), content(b))


# --- values that do not verify ----------------------------------------------------------------


def test_a_missing_object_is_a_miss_for_its_block_only(make_remote_tier):
    tier = make_remote_tier()
    keys = [make_key(i, "missing") for i in range(3)]
    memory = tier.allocate(3 * LAYOUT.block_bytes)
    assert tier.write_pieces([0, 0], [keys[0], keys[2]], filled(memory[: 2 * LAYOUT.block_bytes], UNEVEN,
                                                                   [keys[0], keys[2]])) == [None, None]
    targets = cut(memory.fill_(0xAA), UNEVEN, 3)
    got = tier.read_pieces([0] * 3, keys, targets)
    assert isinstance(got[1], BlockMissing) and got[0] is None and got[2] is None
    assert torch.equal(joined(targets[2]), content(keys[2]))


@pytest.mark.parametrize("where", [0, HALF - 1, HALF, LAYOUT.block_bytes - 1])
def test_a_sealed_value_altered_in_any_piece_is_refused(make_remote_tier, pool, secret, attacker, where):
    tier = make_remote_tier(secret=secret)
    keys = [make_key(i, "sealed") for i in range(9)]  # sealed: cut into several pipelined calls
    memory = tier.allocate(2 * 9 * LAYOUT.block_bytes)
    assert tier.write_pieces([0] * 9, keys, filled(memory[: 9 * LAYOUT.block_bytes], UNEVEN, keys)) == [None] * 9
    tamper(attacker, tier.object_name(keys[5]), poolvalue.HEADER_BYTES + where)
    targets = cut(memory[9 * LAYOUT.block_bytes :], UNEVEN, 9)
    got = tier.read_pieces([0] * 9, keys, targets)
    assert isinstance(got[5], CorruptBlock) and not isinstance(got[5], BlockMissing)
    assert [g for i, g in enumerate(got) if i != 5] == [None] * 8
    assert all(torch.equal(joined(targets[i]), content(k)) for i, k in enumerate(keys) if i != 5)
    assert not staged(tier)


def test_encrypted_values_move_from_pieces_through_the_default(make_remote_tier, secret, attacker):
    tier = make_remote_tier(secret=secret, encrypt=True)  # the cipher needs the payload whole: gathered
    keys = [make_key(i, "encrypted") for i in range(3)]
    memory = tier.allocate(2 * 3 * LAYOUT.block_bytes)
    assert tier.write_pieces([0] * 3, keys, filled(memory[: 3 * LAYOUT.block_bytes], UNEVEN, keys)) == [None] * 3
    tamper(attacker, tier.object_name(keys[0]), poolvalue.HEADER_BYTES + 7)
    targets = cut(memory[3 * LAYOUT.block_bytes :], UNEVEN, 3)
    got = tier.read_pieces([0] * 3, keys, targets)
    assert isinstance(got[0], CorruptBlock) and got[1:] == [None, None]
    assert all(torch.equal(joined(targets[i]), content(keys[i])) for i in (1, 2))


# --- faults -----------------------------------------------------------------------------------


def test_a_hung_pool_abandons_the_pieces_it_was_handed_until_settled(make_remote_tier, private_pool):
    op_timeout_s = 1.0
    tier = make_remote_tier(RemoteMode.TCP, private_pool.config, op_timeout_s=op_timeout_s, backoff_s=5.0)
    keys = [make_key(i, "hung-pieces") for i in range(2)]
    memory = tier.allocate(2 * 2 * LAYOUT.block_bytes)
    assert tier.write_pieces([0, 0], keys, filled(memory[: 2 * LAYOUT.block_bytes], UNEVEN, keys)) == [None, None]
    os.kill(private_pool.daemon_pid, signal.SIGSTOP)
    try:
        got, seconds = timed(lambda: tier.read_pieces([0, 0], keys, cut(memory[2 * LAYOUT.block_bytes :], UNEVEN, 2)))
        assert seconds < op_timeout_s + SLACK_S
        abandoned = got
        assert all(isinstance(e, TransferAbandoned) for e in abandoned)  # one call: both handed to the pool
        assert not abandoned[0].settled.done()  # the stray get may still land in the pieces
        others = [make_key(i, "hung-pieces-2") for i in range(2)]
        got, seconds = timed(lambda: tier.write_pieces([0, 0], others, cut(memory[: 2 * LAYOUT.block_bytes], UNEVEN, 2)))
        assert all(isinstance(e, PoolUnavailable) for e in got) and seconds < 0.1  # known down: at once
    finally:
        os.kill(private_pool.daemon_pid, signal.SIGCONT)
    settled = abandoned[0].settled
    settled.exception(timeout=30)  # the stray get ends once the daemon runs again: the pieces are safe then
