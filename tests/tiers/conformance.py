"""The tier conformance suite: what every tier (device, host, disk, remote) must do.

It drives a tier the way the cache does, through a block table beside it (``tier.table``, made by
the fixture: the block manager keeps one per tier) and the tier's byte methods: ``prepare_store``
-> ``write`` -> ``complete_store`` to store, ``pin`` -> ``read_into`` -> ``unpin`` to read,
``choose_victims`` -> ``discard`` -> ``release`` to evict.

Contracts decided here (every tier must follow them):

* ``read_into`` / ``write`` refuse a tensor of the wrong shape or dtype with ValueError; they
  never broadcast or convert.
* ``close()`` is idempotent; afterwards ``write`` and ``read_into`` raise RuntimeError.
* ``view()`` is None for tiers without addressable memory, else the slot's bytes in place.
* ``write_pieces`` / ``read_pieces`` move whole blocks given as pieces of a caller's memory,
  however split (a layer may span pieces), bit-exact and interchangeable with ``write`` /
  ``read_into``; pieces that are not contiguous uint8 1-D CPU tensors of one block's bytes in
  all are refused with ValueError.

``test_conformance.py`` binds the ``tier_spec`` and ``make_tier`` fixtures per tier.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.policies.eviction import Eviction
from kvstrata.tiers.base import Tier
from kvstrata.manager.table import BlockState, TierFull

# Small heads keep blocks small (token_bytes = 2 * heads * head_dim * 2 = 64 B): 4 to 64 KiB.
LAYOUTS = {
    f"t{tokens}": KVLayout(num_layers=4, block_tokens=tokens, kv_heads=2, head_dim=8, dtype=DType.FP16)
    for tokens in (16, 32, 256)
}
SMALL = LAYOUTS["t16"]


@dataclass(frozen=True)
class TierSpec:
    """How to build one kind of tier for the suite."""

    name: str
    build: Callable[..., Tier]  # (layout, capacity_bytes, tmp_path, **fixtures) -> Tier
    has_view: bool
    fixtures: tuple[str, ...] = ()  # pytest fixtures ``build`` takes as keyword arguments


MakeTier = Callable[..., Tier]  # (layout=SMALL, blocks=4, eviction=LRU, extra_bytes=0) -> Tier


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def random_block(layout: KVLayout, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, layout.layer_bytes)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)


def store(tier: Tier, k: bytes, block: torch.Tensor) -> int:
    """Store a block the way the cache does; its slot."""
    reservation = tier.table.prepare_store(k)
    assert reservation is not None, "key already present"
    tier.write(reservation.slot, k, block)
    tier.table.complete_store(k, ok=True)
    return reservation.slot


def load(tier: Tier, k: bytes, layers: slice = slice(None)) -> torch.Tensor:
    """Read a READY block back the way the cache does (pin, read, unpin)."""
    slot = tier.table.pin(k)
    assert slot is not None, f"block {k.hex()} not readable"
    try:
        rows = len(range(*layers.indices(tier.layout.num_layers)))
        out = torch.full((rows, tier.layout.layer_bytes), 0xAA, dtype=torch.uint8)
        tier.read_into(slot, k, out, layers)
        return out
    finally:
        tier.table.unpin(k)


# How a block is cut into pieces, as sizes in bytes of SMALL's 4 KiB (4 layers of 1 KiB).
SPLITS = {
    "one piece": [SMALL.block_bytes],
    "k/v halves": [SMALL.block_bytes // 2] * 2,
    "uneven, mid-layer": [1, 1000, 0, 1537, 7, 551, SMALL.block_bytes - 3096],  # and an empty piece
}


def cut(memory: torch.Tensor, sizes: list[int], blocks: int) -> list[list[torch.Tensor]]:
    """``blocks`` blocks of pieces of ``sizes`` in ``memory``, piece j of every block together
    (as a layer-first host pool holds K of every page, then V): no block lies in one run."""
    out: list[list[torch.Tensor]] = [[] for _ in range(blocks)]
    at = 0
    for size in sizes:
        for pieces in out:
            pieces.append(memory[at : at + size])
            at += size
    return out


def joined(pieces: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(pieces).view(SMALL.num_layers, SMALL.layer_bytes)


def fill(pieces: list[torch.Tensor], block: torch.Tensor) -> None:
    flat, at = block.reshape(-1), 0
    for piece in pieces:
        piece.copy_(flat[at : at + piece.numel()])
        at += piece.numel()


def store_pieces(tier: Tier, keys: list[bytes], blocks: list[list[torch.Tensor]]) -> None:
    """Store blocks from pieces the way the cache does, all in one call."""
    slots = [tier.table.prepare_store(k).slot for k in keys]
    errors = tier.write_pieces(slots, keys, blocks)
    for k, error in zip(keys, errors):
        tier.table.complete_store(k, ok=error is None)
    assert errors == [None] * len(keys)


def load_pieces(tier: Tier, keys: list[bytes], blocks: list[list[torch.Tensor]]) -> list[BaseException | None]:
    """Read READY blocks into pieces the way the cache does (pin, read, unpin), in one call."""
    slots = [tier.table.pin(k) for k in keys]
    assert None not in slots
    try:
        return tier.read_pieces(slots, keys, blocks)
    finally:
        for k in keys:
            tier.table.unpin(k)


def evict(tier: Tier, count: int) -> list[bytes]:
    victims = tier.table.choose_victims(count)
    for victim in victims:
        tier.discard(victim.slot, victim.key)
        tier.table.release(victim.key)
    return [v.key for v in victims]


class TierConformance:
    """Every test gets ``tier_spec`` (a TierSpec) and ``make_tier`` (a MakeTier)."""

    # --- bytes ------------------------------------------------------------------------------

    @pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
    def test_round_trip_is_bit_exact(self, make_tier: MakeTier, layout: KVLayout) -> None:
        tier = make_tier(layout=layout, blocks=3)
        blocks = {key(i): random_block(layout, seed=i) for i in range(3)}
        for k, block in blocks.items():
            store(tier, k, block)
        for k, block in blocks.items():
            assert torch.equal(load(tier, k), block)

    @pytest.mark.parametrize("layers", [slice(1, 3), slice(0, 1), slice(3, None), slice(None)])
    def test_partial_layer_reads(self, make_tier: MakeTier, layers: slice) -> None:
        tier = make_tier()
        block = random_block(SMALL, seed=7)
        store(tier, key(1), block)
        assert torch.equal(load(tier, key(1), layers), block[layers])

    def test_wrong_shape_or_dtype_is_refused(self, make_tier: MakeTier) -> None:
        tier = make_tier()
        block = random_block(SMALL, seed=1)
        reservation = tier.table.prepare_store(key(1))
        with pytest.raises(ValueError):
            tier.write(reservation.slot, key(1), block[:2])  # half a block
        with pytest.raises(ValueError):
            tier.write(reservation.slot, key(1), block.to(torch.int16))
        tier.write(reservation.slot, key(1), block)
        tier.table.complete_store(key(1), ok=True)
        with pytest.raises(ValueError):  # 1 layer asked, 4-layer buffer given: no broadcast
            tier.read_into(reservation.slot, key(1), torch.empty_like(block), slice(0, 1))

    @pytest.mark.parametrize("split", SPLITS.values(), ids=SPLITS.keys())
    def test_pieces_round_trip_and_mix_with_whole_blocks(self, make_tier: MakeTier, tier_spec: TierSpec,
                                                         split: list[int]) -> None:
        tier = make_tier(blocks=6)
        memory = torch.empty(4 * SMALL.block_bytes, dtype=torch.uint8)
        memory.fill_(0xAA)
        sources, targets = cut(memory[: 2 * SMALL.block_bytes], split, 2), cut(memory[2 * SMALL.block_bytes :], split, 2)
        blocks = {key(i): random_block(SMALL, seed=i) for i in range(4)}
        for pieces, block in zip(sources, blocks.values()):
            fill(pieces, block)
        store_pieces(tier, [key(0), key(1)], sources)  # pieces in, whole out
        for i in (0, 1):
            assert torch.equal(load(tier, key(i)), blocks[key(i)])
        assert torch.equal(load(tier, key(1), slice(1, 3)), blocks[key(1)][1:3])  # layers that span pieces
        for i in (2, 3):  # whole in, pieces out
            store(tier, key(i), blocks[key(i)])
        assert load_pieces(tier, [key(3), key(2)], targets) == [None, None]
        assert torch.equal(joined(targets[0]), blocks[key(3)]) and torch.equal(joined(targets[1]), blocks[key(2)])
        assert load_pieces(tier, [key(0), key(1)], targets) == [None, None]  # pieces in, pieces out
        assert torch.equal(joined(targets[0]), blocks[key(0)]) and torch.equal(joined(targets[1]), blocks[key(1)])

    def test_bad_pieces_are_refused(self, make_tier: MakeTier, tier_spec: TierSpec) -> None:
        tier = make_tier()
        memory = torch.empty(2 * SMALL.block_bytes, dtype=torch.uint8)
        half = SMALL.block_bytes // 2
        bad = {  # the pieces, and what the error says
            "torch.int16": [memory[:half].view(torch.int16), memory[half : 2 * half]],
            "not contiguous": [memory[: 2 * half : 2], memory[2 * half : 3 * half]],
            r"torch.uint8 \[2, ": [memory[:half].view(2, -1), memory[half : 2 * half]],  # not 1-D
            f"add up to {SMALL.block_bytes - 1} bytes": [memory[:half], memory[half : 2 * half - 1]],
        }
        slot = tier.table.prepare_store(key(1)).slot
        for message, pieces in bad.items():
            with pytest.raises(ValueError, match=message):
                tier.write_pieces([slot], [key(1)], [pieces])
            with pytest.raises(ValueError, match=message):
                tier.read_pieces([slot], [key(1)], [pieces])
        good = [memory[:half], memory[half : 2 * half]]
        with pytest.raises(ValueError, match="block 1"):  # the error names the block
            tier.write_pieces([slot, slot], [key(1), key(2)], [good, good[:1]])

    def test_released_slot_reused_serves_new_bytes(self, make_tier: MakeTier) -> None:
        tier = make_tier(blocks=1)
        old, new = random_block(SMALL, seed=1), random_block(SMALL, seed=2)
        slot = store(tier, key(1), old)
        assert evict(tier, 1) == [key(1)]
        assert store(tier, key(2), new) == slot
        assert torch.equal(load(tier, key(2)), new)
        assert tier.table.state(key(1)) is None

    # --- capacity ---------------------------------------------------------------------------

    @pytest.mark.parametrize("blocks, extra_bytes", [(0, 0), (0, 1), (3, 0), (3, 100)])
    def test_capacity_in_whole_blocks(self, make_tier: MakeTier, blocks: int, extra_bytes: int) -> None:
        tier = make_tier(blocks=blocks, extra_bytes=extra_bytes)
        assert tier.capacity_bytes == blocks * SMALL.block_bytes + extra_bytes
        assert tier.capacity_blocks == tier.table.capacity_blocks == blocks
        assert tier.table.free_blocks == blocks

    def test_full_tier_raises_tier_full(self, make_tier: MakeTier) -> None:
        tier = make_tier(blocks=2)
        store(tier, key(1), random_block(SMALL, 1))
        assert tier.table.prepare_store(key(2)) is not None  # WRITING still takes a slot
        with pytest.raises(TierFull):
            tier.table.prepare_store(key(3))

    def test_zero_slot_tier_refuses_every_store(self, make_tier: MakeTier) -> None:
        tier = make_tier(blocks=0, extra_bytes=SMALL.block_bytes - 1)
        with pytest.raises(TierFull):
            tier.table.prepare_store(key(1))

    def test_failed_store_frees_its_slot(self, make_tier: MakeTier) -> None:
        tier = make_tier(blocks=1)
        reservation = tier.table.prepare_store(key(1))
        assert tier.table.pin(key(1)) is None  # WRITING: never readable
        tier.table.complete_store(key(1), ok=False)
        assert tier.table.state(key(1)) is None
        assert store(tier, key(2), random_block(SMALL, 2)) == reservation.slot

    # --- eviction ---------------------------------------------------------------------------

    def test_lru_evicts_least_recently_read(self, make_tier: MakeTier) -> None:
        tier = make_tier(blocks=4, eviction=Eviction.LRU)
        for i in range(4):
            store(tier, key(i), random_block(SMALL, i))
        load(tier, key(0))
        load(tier, key(2))
        assert evict(tier, 2) == [key(1), key(3)]
        assert evict(tier, 5) == [key(0), key(2)]

    def test_lfu_evicts_least_often_read(self, make_tier: MakeTier) -> None:
        tier = make_tier(blocks=4, eviction=Eviction.LFU)
        for i in range(4):
            store(tier, key(i), random_block(SMALL, i))
        for i, reads in enumerate([3, 0, 1, 2]):
            for _ in range(reads):
                load(tier, key(i))
        assert evict(tier, 4) == [key(1), key(2), key(3), key(0)]

    def test_victims_are_never_pinned_or_writing(self, make_tier: MakeTier) -> None:
        tier = make_tier(blocks=4)
        for i in range(3):
            store(tier, key(i), random_block(SMALL, i))
        assert tier.table.prepare_store(key(9)) is not None  # WRITING
        assert tier.table.pin(key(0)) is not None
        load(tier, key(1))
        load(tier, key(2))  # key 0 is least recently used again, and still pinned
        victims = tier.table.choose_victims(4)
        assert [v.key for v in victims] == [key(1), key(2)]
        assert all(tier.table.state(v.key) is BlockState.EVICTING for v in victims)
        assert tier.table.state(key(0)) is BlockState.READY
        assert tier.table.state(key(9)) is BlockState.WRITING

    def test_evicting_block_stays_readable_until_released(self, make_tier: MakeTier) -> None:
        tier = make_tier(blocks=1)
        block = random_block(SMALL, 5)
        store(tier, key(1), block)
        (victim,) = tier.table.choose_victims(1)
        out = torch.empty_like(block)
        tier.read_into(victim.slot, victim.key, out)  # a demotion copies it down now
        assert torch.equal(out, block)

    def test_take_refuses_pinned_block(self, make_tier: MakeTier) -> None:
        tier = make_tier(blocks=1)
        store(tier, key(1), random_block(SMALL, 1))
        tier.table.pin(key(1))
        assert tier.table.take(key(1)) is None
        assert tier.table.state(key(1)) is BlockState.READY
        tier.table.unpin(key(1))
        assert tier.table.take(key(1)) is not None
        tier.discard(tier.table.slot(key(1)), key(1))
        tier.table.release(key(1))
        assert tier.table.free_blocks == 1

    # --- view, recover, close ---------------------------------------------------------------

    def test_view_contract(self, make_tier: MakeTier, tier_spec: TierSpec) -> None:
        tier = make_tier(blocks=2)
        block = random_block(SMALL, 3)
        slot = store(tier, key(1), block)
        view = tier.view(slot)
        if not tier_spec.has_view:
            assert view is None
            return
        assert view.shape == (SMALL.num_layers, SMALL.layer_bytes)
        assert view.dtype == torch.uint8 and view.device == tier.device
        assert torch.equal(view.cpu(), block)
        view[1].fill_(0x5C)  # aliases the slot: the write is what the tier now serves
        assert torch.equal(load(tier, key(1))[1], torch.full((SMALL.layer_bytes,), 0x5C, dtype=torch.uint8))
        assert tier.view(slot).data_ptr() == view.data_ptr()
        assert tier.view(1 - slot).data_ptr() != view.data_ptr()

    def test_fresh_tier_recovers_nothing(self, make_tier: MakeTier) -> None:
        tier = make_tier()
        assert tier.recover() == []
        assert tier.table.used_blocks == 0

    def test_close_is_idempotent_and_final(self, make_tier: MakeTier) -> None:
        tier = make_tier(blocks=1)
        block = random_block(SMALL, 1)
        slot = store(tier, key(1), block)
        tier.close()
        tier.close()
        with pytest.raises(RuntimeError):
            tier.read_into(slot, key(1), torch.empty_like(block))
        with pytest.raises(RuntimeError):
            tier.write(slot, key(1), block)
        pieces = [block.view(-1)[:100], block.view(-1)[100:]]
        with pytest.raises(RuntimeError):
            tier.write_pieces([slot], [key(1)], [pieces])
        with pytest.raises(RuntimeError):
            tier.read_pieces([slot], [key(1)], [pieces])
