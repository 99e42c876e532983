"""The remote tier moves blocks in pieces of a caller's memory (``write_pieces``, ``read_pieces``)
against the real pool: every block is copied between its pieces and the tier's own registered
staging, one object per block from and into ``[header, staging row]``, in batched calls (the
caller's memory is never registered); every value read is copied out of staging, then verified
across its pieces, sealed or not."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from kvstrata.errors import CorruptBlock
from kvstrata.tiers import poolvalue
from kvstrata.tiers.remote import BlockMissing, PoolUnavailable, RemoteMode, RemoteTier
from tests.pool_support import RawPool
from tests.tiers.conformance import cut
from tests.tiers.test_remote import LAYOUT, MODES, SLACK_S, content, make_key, timed

HALF = LAYOUT.block_bytes // 2
UNEVEN = [1500, 1000, 0, LAYOUT.block_bytes - 2500]  # layers 1 and 2 span pieces; an empty piece
VALUE = poolvalue.HEADER_BYTES + LAYOUT.block_bytes
MANY = [LAYOUT.block_bytes // 16] * 16  # a layer-first page's kind: a part a layer


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

    def spy(what, op, *args, **kwargs):
        if op.name.endswith("multi_buffers"):
            seen.extend((op.name, list(sizes)) for sizes in args[2])
        return start(what, op, *args, **kwargs)

    client.start = spy
    return seen


def exposed(tier: RemoteTier, memory: torch.Tensor) -> bool:
    """Whether any byte of ``memory`` lies in a range registered with the pool's transfer engine."""
    lo, hi = memory.data_ptr(), memory.data_ptr() + memory.numel()
    return any(start < hi and lo < end for start, end in tier._client._ranges)


@pytest.fixture(scope="module")
def attacker(pool):
    """A raw client of the pool (no secret) and a registered buffer of one value."""
    attacker = RawPool(pool, VALUE)
    yield attacker
    attacker.close()


def tamper(attacker: RawPool, name: str, offset: int) -> None:
    """Flip one byte of the object ``name`` in place (a raw get, remove, put)."""
    value = bytearray(attacker.get(name))
    assert len(value) == VALUE
    value[offset] ^= 0xFF
    attacker.put(name, bytes(value))


# --- through the tier's own staging -----------------------------------------------------------


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("sizes", [[HALF, HALF], UNEVEN, MANY], ids=["k/v halves", "uneven", "a part a layer"])
def test_pieces_go_through_staging_one_object_per_block(make_remote_tier, mode, sizes, monkeypatch):
    from kvstrata.tiers import staging

    monkeypatch.setattr(staging, "STAGE_BYTES", 2 * 2 * LAYOUT.block_bytes)  # halves of 2 blocks: 6 go in 3 calls
    tier = make_remote_tier(mode)
    keys = [make_key(i, f"pieces-{mode.value}-{len(sizes)}") for i in range(6)]
    memory = torch.zeros(2 * 6 * LAYOUT.block_bytes, dtype=torch.uint8)
    sources = filled(memory[: 6 * LAYOUT.block_bytes], sizes, keys)
    targets = cut(memory[6 * LAYOUT.block_bytes :].fill_(0xAA), sizes, 6)
    objects = recording_objects(tier)
    assert tier.write_pieces([0] * 6, keys, sources) == [None] * 6
    assert tier.read_pieces([0] * 6, keys, targets) == [None] * 6
    assert all(torch.equal(joined(targets[i]), content(key)) for i, key in enumerate(keys))
    value = [poolvalue.HEADER_BYTES, LAYOUT.block_bytes]  # the header, then the block's staging row
    assert objects == [("batch_put_from_multi_buffers", value)] * 6 + [("batch_get_into_multi_buffers", value)] * 6
    assert not exposed(tier, memory)  # the caller's memory never met the transfer engine
    whole = torch.empty(LAYOUT.num_layers, LAYOUT.layer_bytes, dtype=torch.uint8)  # and it reads as a block
    tier.read_into(0, keys[3], whole)
    assert torch.equal(whole, content(keys[3]))


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_a_tampered_value_among_many_calls_is_the_only_miss(make_remote_tier, secret, attacker, mode, monkeypatch):
    from kvstrata.tiers import staging

    monkeypatch.setattr(staging, "STAGE_BYTES", 2 * 3 * LAYOUT.block_bytes)  # halves of 3 blocks: 7 go in three calls
    tier = make_remote_tier(mode, secret=secret)
    keys = [make_key(i, f"many-{mode.value}") for i in range(7)]
    memory = torch.zeros(7 * LAYOUT.block_bytes, dtype=torch.uint8)
    assert tier.write_pieces([0] * 7, keys, filled(memory, MANY, keys)) == [None] * 7
    tamper(attacker, tier.object_name(keys[4]), poolvalue.HEADER_BYTES + 7)
    targets = cut(memory.fill_(0xAA), MANY, 7)
    got = tier.read_pieces([0] * 7, keys, targets)
    assert isinstance(got[4], CorruptBlock) and [g for i, g in enumerate(got) if i != 4] == [None] * 6
    assert all(torch.equal(joined(targets[i]), content(k)) for i, k in enumerate(keys) if i != 4)


def test_a_key_twice_in_one_call_is_stored_once(make_remote_tier):
    tier = make_remote_tier()
    key = make_key(0, "twice")
    memory = torch.zeros(2 * LAYOUT.block_bytes, dtype=torch.uint8)
    blocks = filled(memory, [HALF, HALF], [key, key])
    assert tier.write_pieces([0, 0], [key, key], blocks) == [None, None]
    assert tier.read_pieces([0, 0], [key, key], blocks) == [None, None]
    assert all(torch.equal(joined(b), content(key)) for b in blocks)


def test_whole_blocks_and_pieces_read_each_others_checksums(make_remote_tier):
    # The checksum of a value put from pieces is streamed over them; a whole write's is over one.
    tier = make_remote_tier()
    a, b = make_key(1, "mix"), make_key(2, "mix")
    memory = torch.zeros(2 * LAYOUT.block_bytes, dtype=torch.uint8)
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
    memory = torch.zeros(3 * LAYOUT.block_bytes, dtype=torch.uint8)
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
    memory = torch.zeros(2 * 9 * LAYOUT.block_bytes, dtype=torch.uint8)
    assert tier.write_pieces([0] * 9, keys, filled(memory[: 9 * LAYOUT.block_bytes], UNEVEN, keys)) == [None] * 9
    tamper(attacker, tier.object_name(keys[5]), poolvalue.HEADER_BYTES + where)
    targets = cut(memory[9 * LAYOUT.block_bytes :], UNEVEN, 9)
    got = tier.read_pieces([0] * 9, keys, targets)
    assert isinstance(got[5], CorruptBlock) and not isinstance(got[5], BlockMissing)
    assert [g for i, g in enumerate(got) if i != 5] == [None] * 8
    assert all(torch.equal(joined(targets[i]), content(k)) for i, k in enumerate(keys) if i != 5)
    assert not exposed(tier, memory)


def test_encrypted_values_move_from_pieces_through_the_default(make_remote_tier, secret, attacker):
    tier = make_remote_tier(secret=secret, encrypt=True)  # the cipher needs the payload whole: gathered
    keys = [make_key(i, "encrypted") for i in range(3)]
    memory = torch.zeros(2 * 3 * LAYOUT.block_bytes, dtype=torch.uint8)
    assert tier.write_pieces([0] * 3, keys, filled(memory[: 3 * LAYOUT.block_bytes], UNEVEN, keys)) == [None] * 3
    tamper(attacker, tier.object_name(keys[0]), poolvalue.HEADER_BYTES + 7)
    targets = cut(memory[3 * LAYOUT.block_bytes :], UNEVEN, 3)
    got = tier.read_pieces([0] * 3, keys, targets)
    assert isinstance(got[0], CorruptBlock) and got[1:] == [None, None]
    assert all(torch.equal(joined(targets[i]), content(keys[i])) for i in (1, 2))


# --- faults -----------------------------------------------------------------------------------


def test_a_hung_pool_fails_the_pieces_and_a_stray_get_never_lands_in_them(make_remote_tier, private_pool):
    op_timeout_s = 1.0
    tier = make_remote_tier(RemoteMode.TCP, private_pool.config, op_timeout_s=op_timeout_s, backoff_s=5.0)
    keys = [make_key(i, "hung-pieces") for i in range(2)]
    memory = torch.zeros(2 * 2 * LAYOUT.block_bytes, dtype=torch.uint8)
    assert tier.write_pieces([0, 0], keys, filled(memory[: 2 * LAYOUT.block_bytes], UNEVEN, keys)) == [None, None]
    targets = memory[2 * LAYOUT.block_bytes :].fill_(0xAA)
    os.kill(private_pool.daemon_pid, signal.SIGSTOP)
    try:
        got, seconds = timed(lambda: tier.read_pieces([0, 0], keys, cut(targets, UNEVEN, 2)))
        assert seconds < op_timeout_s + SLACK_S
        assert all(type(e) is PoolUnavailable for e in got)  # not TransferAbandoned: the pieces were never handed over
        others = [make_key(i, "hung-pieces-2") for i in range(2)]
        got, seconds = timed(lambda: tier.write_pieces([0, 0], others, cut(memory[: 2 * LAYOUT.block_bytes], UNEVEN, 2)))
        assert all(isinstance(e, PoolUnavailable) for e in got) and seconds < 0.1  # known down: at once
    finally:
        os.kill(private_pool.daemon_pid, signal.SIGCONT)
    time.sleep(1.0)  # the stray get ends once the daemon runs again: into the retired staging
    assert bool((targets == 0xAA).all())
