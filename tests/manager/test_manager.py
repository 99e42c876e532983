"""The block manager alone, without threads or bytes: scripted plans, then a state machine.

A plan is carried out here by a model of the tiers' bytes (``Bytes``): memory tiers hold a key
per slot, disk and pool hold keys by name (their slots are bookkeeping), and a leg copies what
its source holds. So the checks are about bytes, not only bookkeeping: a READY block's slot
holds that block, a leg never reads a slot someone else has written, a retired slot is never
served again (an abandoned transfer "lands" garbage in it).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstrata.index.keys import Namespace, block_keys
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.manager.config import ManagerConfig
from kvstrata.manager.manager import BlockManager
from kvstrata.manager.plans import Failure, Leg, Room, Slot, Step, StopReason
from kvstrata.manager.table import BlockState
from kvstrata.media import Medium
from kvstrata.policies.eviction import Eviction
from kvstrata.policies.write import WritePolicy, WriteRule

D, H, K, R = Medium.DEVICE, Medium.HOST, Medium.DISK, Medium.REMOTE
LAYOUT = KVLayout(num_layers=4, block_tokens=4, kv_heads=1, head_dim=8, dtype=DType.BF16)
NAMESPACE = Namespace("manager-test", "bf16", LAYOUT.describe(), LAYOUT.block_tokens)
MEMORY = (D, H)
GARBAGE = b"garbage"


def keys_of(seq: int, blocks: int) -> list[bytes]:
    return block_keys([seq * 1000 + i for i in range(blocks * LAYOUT.block_tokens)], NAMESPACE)


def manager(capacities: dict[Medium, int], write: WritePolicy = WritePolicy.WRITE_BACK,
            direct: frozenset[Medium] = frozenset(), small_load_bytes: int = 0) -> BlockManager:
    return BlockManager(ManagerConfig(LAYOUT, capacities, Eviction.LRU, WriteRule(write, 1), direct,
                                      workers=2, small_load_bytes=small_load_bytes))


class Bytes:
    """What each tier holds: memory by slot, disk and pool by key."""

    def __init__(self) -> None:
        self.slots: dict[Medium, dict[int, bytes]] = {D: {}, H: {}}
        self.named: dict[Medium, set[bytes]] = {K: set(), R: set()}

    def read(self, leg: Leg) -> bytes | None:
        return self.read_slot(leg.key, leg.src)

    def read_slot(self, key: bytes, src: Slot) -> bytes | None:
        if src.medium in MEMORY:
            return self.slots[src.medium].get(src.index)
        return key if key in self.named[src.medium] else None

    def write(self, medium: Medium, index: int, key: bytes, content: bytes) -> None:
        if medium in MEMORY:
            self.slots[medium][index] = content
        elif content == key:
            self.named[medium].add(key)

    def move(self, legs, failures) -> list[Failure | None]:
        """Carry out legs; a failure given for a leg is what the tier reported. A memory source
        holding other bytes than its key is a served-wrong-KV bug: asserted, never reported."""
        out = []
        for leg, failure in zip(legs, failures, strict=True):
            content = self.read(leg)
            if leg.src.medium in MEMORY:
                assert content == leg.key, f"{leg.src} holds {content!r}, not the block {leg.key.hex()[:8]}"
            elif content is None and failure is None:
                failure = Failure.MISSING  # the file or object is not there: the tier says so
            if failure is None:
                self.write(leg.dst.medium, leg.dst.index, leg.key, content)
            elif failure is Failure.ABANDONED and leg.dst.medium in MEMORY:
                self.slots[leg.dst.medium][leg.dst.index] = GARBAGE  # a stray transfer lands late
            out.append(failure)
        return out

    def carry_out(self, room: Room, failures) -> list[Failure | None]:
        """A room, deepest tier first, as the worker runs it; per victim its demotion's outcome."""
        outcome = {}
        drawn = dict(zip(map(id, room.victims), failures, strict=True))
        for stage in room.stages():
            for victim in stage:
                if victim.demotion is not None:
                    outcome[id(victim)] = self.move([victim.demotion], [drawn[id(victim)]])[0]
                if victim.slot.medium is K:
                    self.named[K].discard(victim.key)  # the file is deleted; the pool keeps objects
        return [outcome.get(id(v)) for v in room.victims]


def check(m: BlockManager, tiers: Bytes) -> None:
    """The manager's invariants, at any moment (plans may be in flight)."""
    ready_where: dict[bytes, set[Medium]] = {}
    for medium in m.media:
        table = m.table(medium)
        owners = table.owners()
        assert len(owners) + table.free_blocks + table.quarantined_slots == table.capacity_blocks + table.excess_blocks
        assert medium not in MEMORY or all(slot < table.capacity_blocks for slot in owners)  # memory has no more
        for key in table.ready_keys():
            ready_where.setdefault(key, set()).add(medium)
            slot = table.slot(key)
            assert owners.get(slot) == key, f"{medium.label}: READY block without its slot"
            if medium in MEMORY:
                assert tiers.slots[medium].get(slot) == key, f"{medium.label} slot {slot} does not hold its block"
            else:
                assert key in tiers.named[medium], f"{medium.label}: READY block {key.hex()[:8]} has no bytes"
    for key, media in ready_where.items():
        assert set(m.where(key)) == media
    assert m.indexed_blocks() == len(ready_where)


# --- scripted ---------------------------------------------------------------------------------


def stored(m: BlockManager, tiers: Bytes, keys, pin=False):
    plan = m.prepare_store(keys)
    assert tiers.carry_out(plan.room, [None] * len(plan.room.victims)) is not None
    m.complete_room(plan.room, [None] * len(plan.room.victims))
    for block in plan.blocks:
        tiers.slots[D][block.slot] = block.key
    return m.complete_store(plan, [None] * len(plan.blocks), pin=pin)


def evicted(m: BlockManager, tiers: Bytes, medium: Medium, n: int) -> Room:
    room = m.prepare_evict(medium, n)
    m.complete_room(room, tiers.carry_out(room, [None] * len(room.victims)))
    return room


def loaded(m: BlockManager, tiers: Bytes, keys, fetch=None, copy=None):
    """A whole load; ``fetch``/``copy``: the failures to report for those legs (None: all move)."""
    plan = m.prepare_load(m.match(keys))
    m.complete_room(plan.room, tiers.carry_out(plan.room, [None] * len(plan.room.victims)))
    fetches = plan.legs(Step.FETCH)
    plan, drops = m.complete_fetch(plan, tiers.move(fetches, fetch or [None] * len(fetches)))
    m.complete_room(drops, tiers.carry_out(drops, [None] * len(drops.victims)))
    copies = plan.legs(Step.COPY)
    if any(tiers.move(copies, copy or [None] * len(copies))):
        m.abandon_load(plan)
        return plan, None
    return plan, m.complete_load(plan)


def test_a_load_plans_each_block_by_where_it_is():
    m, tiers = manager({D: 8, H: 8, K: 8}), Bytes()
    keys = keys_of(1, 3)
    stored(m, tiers, keys)
    evicted(m, tiers, D, 3)  # write-back: demoted to the host
    evicted(m, tiers, H, 1)  # the oldest, block 0, to disk
    stored(m, tiers, keys[2:])  # block 2 back on the device
    assert m.match(keys).media == (K, H, D)
    plan = m.prepare_load(m.match(keys))
    assert [b.step for b in plan.blocks] == [Step.FETCH, Step.COPY, Step.RESIDENT]
    assert [b.route for b in plan.blocks] == [(K, H, D), (H, D), (D,)]
    assert plan.blocks[0].leg.dst.medium is H  # no direct disk path: staged in the host
    assert plan.stopped is None and plan.room == Room()
    assert m.table(D).pins(keys[2]) == 1 and m.table(K).pins(keys[0]) == 1
    check(m, tiers)


@pytest.mark.parametrize("layer_ranges", [True, False])
def test_a_large_load_is_copied_in_layer_ranges_only_where_asked(layer_ranges):
    m = BlockManager(ManagerConfig(LAYOUT, {D: 8, H: 8}, Eviction.LRU, WriteRule(WritePolicy.WRITE_BACK, 1),
                                   workers=2, small_load_bytes=0, layer_ranges=layer_ranges))
    tiers, keys = Bytes(), keys_of(1, 3)
    stored(m, tiers, keys)
    evicted(m, tiers, D, 3)
    plan = m.prepare_load(m.match(keys))
    layers = [layer for span in plan.ranges for layer in span]
    assert layers == list(range(LAYOUT.num_layers))  # every layer once, in order
    assert len(plan.ranges) == (LAYOUT.num_layers if layer_ranges else 1)


def test_a_direct_path_fetches_straight_into_the_device_slot():
    m, tiers = manager({D: 4, K: 4}, direct=frozenset({K})), Bytes()
    keys = keys_of(2, 2)
    stored(m, tiers, keys)
    evicted(m, tiers, D, 2)
    plan, hot = loaded(m, tiers, keys)
    assert [b.step for b in plan.blocks] == [Step.LANDED] * 2 and [b.route for b in plan.blocks] == [(K, D)] * 2
    assert m.match(keys).media == (D, D) and {m.table(D).pins(k) for k in keys} == {1}  # pinned for the caller
    assert m.table(K).pinned() == {}
    check(m, tiers)


@pytest.mark.parametrize("failure", [Failure.CORRUPT, Failure.MISSING])
def test_a_block_that_fails_verification_is_dropped_and_cuts_the_load_before_it(failure):
    m, tiers = manager({D: 8, H: 8, K: 8}), Bytes()
    keys = keys_of(3, 4)
    stored(m, tiers, keys)
    evicted(m, tiers, D, 4)
    evicted(m, tiers, H, 4)
    plan, hot = loaded(m, tiers, keys, fetch=[None, None, failure, None])
    assert (len(plan.blocks), plan.stopped, plan.stopped_at) == (2, failure.stop, K)
    assert m.where(keys[2]) == () and keys[2] not in tiers.named[K]  # dropped: the file deleted
    assert m.where(keys[3]) == (H, K)  # staged alongside: kept on the host
    assert m.table(H).pinned() == {} and m.table(K).pinned() == {}
    check(m, tiers)


def test_a_block_another_reader_holds_is_not_dropped_by_a_failed_read():
    m, tiers = manager({D: 4, K: 4}, direct=frozenset({K})), Bytes()
    keys = keys_of(4, 2)
    stored(m, tiers, keys)
    evicted(m, tiers, D, 2)
    assert m.pin(K, keys[1]) is not None
    plan, _ = loaded(m, tiers, keys, fetch=[None, Failure.CORRUPT])
    assert len(plan.blocks) == 1 and m.table(K).state(keys[1]) is BlockState.READY
    m.unpin(K, [keys[1]])
    plan, _ = loaded(m, tiers, keys[1:], fetch=[Failure.CORRUPT])
    assert m.table(K).state(keys[1]) is None


def test_an_abandoned_fetch_retires_the_device_slot_for_good():
    m, tiers = manager({D: 2, R: 4}, direct=frozenset({R})), Bytes()
    keys = keys_of(5, 1)
    tiers.named[R].add(keys[0])
    assert m.adopt(R, keys) == 1
    plan, _ = loaded(m, tiers, keys, fetch=[Failure.ABANDONED])
    assert (plan.blocks, plan.stopped) == ((), StopReason.ABANDONED)
    device = m.table(D)
    assert (device.quarantined_slots, device.free_blocks) == (1, 1)
    assert m.where(keys[0]) == (R,)  # the pool copy stays: it was not at fault
    check(m, tiers)


def on_host(capacities: dict[Medium, int]) -> tuple[BlockManager, Bytes, list[bytes]]:
    """Two blocks on the host only (device evicted, write-back)."""
    m, tiers = manager(capacities), Bytes()
    keys = keys_of(6, 2)
    stored(m, tiers, keys)
    evicted(m, tiers, D, 2)
    assert m.match(keys).media == (H, H)
    return m, tiers, keys


def test_a_load_of_blocks_nowhere_any_more_stops_as_gone():
    m, tiers, keys = on_host({D: 2, H: 4})
    plan = manager({D: 2, H: 4}).prepare_load(m.match(keys))  # a match from another time
    assert (plan.blocks, plan.stopped) == ((), StopReason.GONE)


def test_a_load_into_a_device_full_of_pinned_blocks_stops_at_once():
    m, tiers, keys = on_host({D: 2, H: 4})
    stored(m, tiers, keys_of(7, 2), pin=True)
    plan = m.prepare_load(m.match(keys))
    assert (plan.blocks, plan.stopped, plan.stopped_at) == ((), StopReason.DEVICE_FULL, H)
    assert m.table(H).pinned() == {}  # the sources it pinned on the way are unpinned


def test_a_block_another_load_is_bringing_in_stops_this_one():
    m, tiers, keys = on_host({D: 2, H: 4})
    first = m.prepare_load(m.match(keys))
    second = m.prepare_load(m.match(keys))
    assert (second.blocks, second.stopped) == ((), StopReason.LOADING_ELSEWHERE)
    m.abandon_load(first)
    check(m, tiers)


def test_room_made_for_one_block_of_a_load_never_evicts_a_later_block_of_it():
    # The device holds block 1 (least recent) and another; block 0 is on the host. Room for
    # block 0 took block 1, the LRU victim, and the load then stopped at block 1 as "loading
    # elsewhere" (seen in the soak: a block READY on the device a moment before).
    m, tiers = manager({D: 2, H: 4}), Bytes()
    keys = keys_of(8, 2)
    stored(m, tiers, keys)
    evicted(m, tiers, D, 2)  # both on the host now
    loaded(m, tiers, keys[1:])  # block 1 back on the device ...
    m.unpin(D, keys[1:])
    stored(m, tiers, keys_of(9, 1))  # ... and a newer block beside it: block 1 is the LRU one
    assert m.match(keys).media == (H, D)
    plan, hot = loaded(m, tiers, keys)
    assert (len(plan.blocks), plan.stopped) == (2, None)
    assert plan.blocks[1].step is Step.RESIDENT and m.table(D).pins(keys[1]) == 1
    check(m, tiers)


def test_a_disk_block_without_a_host_tier_or_a_direct_path_stops_as_no_staging():
    m, tiers = manager({D: 2, K: 4}), Bytes()
    keys = keys_of(6, 1)
    stored(m, tiers, keys)
    evicted(m, tiers, D, 1)
    plan = m.prepare_load(m.match(keys))
    assert (plan.blocks, plan.stopped, plan.stopped_at) == ((), StopReason.NO_STAGING, K)


def test_a_disk_block_with_the_host_full_of_pinned_blocks_stops_as_staging_full():
    m, tiers = manager({D: 2, H: 1, K: 4}), Bytes()
    keys, other = keys_of(6, 1), keys_of(7, 1)
    stored(m, tiers, keys)
    evicted(m, tiers, D, 1)
    evicted(m, tiers, H, 1)  # on disk only
    stored(m, tiers, other)
    evicted(m, tiers, D, 1)  # the host's one slot
    assert m.pin(H, other[0]) is not None
    plan = m.prepare_load(m.match(keys))
    assert (plan.blocks, plan.stopped, plan.stopped_at) == ((), StopReason.STAGING_FULL, K)
    assert m.table(D).owners() == {} and m.table(K).pinned() == {}  # the device slot freed again
    m.unpin(H, other)
    check(m, tiers)


def test_write_back_makes_room_down_the_tiers_in_one_plan_carried_out_deepest_first():
    m, tiers = manager({D: 1, H: 1, K: 2}), Bytes()
    a, b, c = keys_of(8, 1), keys_of(9, 1), keys_of(10, 1)
    stored(m, tiers, a)
    stored(m, tiers, b)  # a -> host
    plan = m.prepare_store(c)  # b -> host, which sends a -> disk first
    assert [(v.key, v.slot.medium, v.demotion.dst.medium) for v in plan.room.victims] == [(a[0], H, K), (b[0], D, H)]
    assert [tuple(v.key for v in stage) for stage in plan.room.stages()] == [(a[0],), (b[0],)]
    # The new block takes the device victim's slot, and the device victim the host victim's.
    assert plan.blocks[0].slot == plan.room.victims[1].slot.index
    assert plan.room.victims[1].demotion.dst.index == plan.room.victims[0].slot.index
    m.complete_room(plan.room, tiers.carry_out(plan.room, [None, None]))
    tiers.slots[D][plan.blocks[0].slot] = c[0]
    m.complete_store(plan, [None], pin=False)
    assert (m.where(a[0]), m.where(b[0]), m.where(c[0])) == ((K,), (H,), (D,))
    check(m, tiers)


def test_a_tier_skipped_gets_no_write_down_its_evictions_drop_and_it_is_written_again_once_not():
    """A disk whose loads do not pay: write-back's evictions drop what they would have sent
    there, write-through's puts and copies leave it out, each counted; blocks already on it stay.
    Once it is no longer skipped, it is written as before."""
    m, tiers = manager({D: 1, H: 1, K: 4}), Bytes()
    a, b, c, d = (keys_of(40 + i, 1) for i in range(4))
    stored(m, tiers, a)
    stored(m, tiers, b)  # a -> host
    stored(m, tiers, c)  # a -> disk, b -> host
    assert m.where(a[0]) == (K,)
    m.skip_writes((K,))
    room = m.prepare_store(d).room  # b leaves the host: dropped, not sent down
    assert [(v.key, v.demotion is None) for v in room.victims] == [(b[0], True), (c[0], False)]
    m.complete_room(room, tiers.carry_out(room, [None] * len(room.victims)))
    assert (m.where(a[0]), m.where(b[0])) == ((K,), ())  # the disk's block stays, servable
    assert m.skipped_writes() == {K: 1}
    put = m.prepare_put(keys_of(50, 1), (H, K))  # write-through's put: the host only
    # c makes room in the host (dropped, not sent down), and the put's own disk copy is left out
    assert [p.slot.medium for p in put.placements] == [H] and m.skipped_writes() == {K: 3}
    m.complete_room(put.room, tiers.carry_out(put.room, [None] * len(put.room.victims)))
    tiers.write(H, put.placements[0].slot.index, put.placements[0].key, put.placements[0].key)
    m.complete_put(put, [None])
    assert m.prepare_copies(keys_of(50, 1), (K,)).legs == () and m.skipped_writes() == {K: 4}
    m.skip_writes(())
    copies = m.prepare_copies(keys_of(50, 1), (K,))
    assert [leg.dst.medium for leg in copies.legs] == [K] and m.skipped_writes() == {K: 4}
    m.complete_copies(copies, tiers.move(copies.legs, [None]))
    check(m, tiers)


def test_a_reservation_undone_before_its_room_ran_leaves_the_victims_slot_to_the_victim():
    m, tiers = manager({D: 1, H: 2, K: 2}), Bytes()
    new, old, blocker, late = (keys_of(11 + i, 1) for i in range(4))
    stored(m, tiers, new)
    evicted(m, tiers, D, 1)
    evicted(m, tiers, H, 1)  # new: on disk only
    stored(m, tiers, old)
    stored(m, tiers, blocker)  # old demoted to the host, the blocker the device's one block
    assert m.pin(H, old[0]) is not None  # a reader holds the host's first slot; one is free
    plan = m.prepare_load(m.match(new))
    # The device slot came from the blocker (demoted into the host's free slot), then staging
    # found the host full: the plan stops, and the slot is the blocker's again, its bytes to copy.
    assert (plan.blocks, plan.stopped) == ((), StopReason.STAGING_FULL)
    (victim,) = plan.room.victims
    assert victim.key == blocker[0] and victim.demotion.dst.medium is H
    assert m.table(D).owners() == {victim.slot.index: blocker[0]}
    # Another store meanwhile finds no slot: none is free while the blocker's bytes are in use.
    assert m.prepare_store(late).stopped is StopReason.DEVICE_FULL
    m.complete_room(plan.room, tiers.carry_out(plan.room, [None]))
    assert m.where(blocker[0]) == (H,) and m.table(D).free_blocks == 1
    m.unpin(H, old)
    check(m, tiers)


def test_write_through_copies_skip_a_full_tier_and_count_one_pin_per_leg():
    m, tiers = manager({D: 4, H: 1, K: 4}, write=WritePolicy.WRITE_THROUGH), Bytes()
    keys = keys_of(14, 2)
    stored(m, tiers, keys[:1], pin=True)
    copies = m.prepare_copies(keys[:1], (H, K))
    assert [leg.dst.medium for leg in copies.legs] == [H, K] and m.table(D).pins(keys[0]) == 3  # store + 2 legs
    landed, drops = m.complete_copies(copies, tiers.move(copies.legs, [None, None]))
    assert (landed, drops) == (2, Room()) and m.table(D).pins(keys[0]) == 1
    m.unpin(D, keys[:1])
    assert m.pin(H, keys[0]) is not None  # the host's one slot: pinned, so the next copy skips it
    stored(m, tiers, keys[1:])
    copies = m.prepare_copies(keys[1:], (H, K))
    assert [leg.dst.medium for leg in copies.legs] == [K]
    m.complete_copies(copies, tiers.move(copies.legs, [None]))
    m.unpin(H, keys[:1])
    check(m, tiers)


def test_adopt_knows_a_leading_run_until_the_view_is_full():
    m = manager({D: 1, R: 2})
    keys = keys_of(15, 3)
    assert m.adopt(R, keys) == 2
    assert m.adopt(R, keys[:2]) == 2  # known already: nothing new
    assert m.match(keys).media == (R, R)


def test_forget_drops_the_pool_view_but_leaves_blocks_plans_hold():
    # The pool came back without these objects: the view forgets them, bytes untouched.
    m, tiers = manager({D: 2, R: 4}), Bytes()
    known, mine = keys_of(16, 3), keys_of(17, 1)
    m.adopt(R, known)
    tiers.named[R].update(known)
    assert m.pin(R, known[0]) is not None  # a reader holds one
    stored(m, tiers, mine)
    copy = m.prepare_copies(mine, (R,))  # one being written into the pool
    assert m.table(R).state(mine[0]) is BlockState.WRITING
    assert m.forget(R, known + mine) == 2
    tiers.named[R].difference_update(known[1:])
    assert m.ready_keys(R) == [known[0]] and m.table(R).free_blocks == 2
    assert m.match(known).media == (R,) and m.where(known[1]) == ()
    m.complete_copies(copy, tiers.move(copy.legs, [None]))  # it lands, and is known
    m.unpin(R, [known[0]])
    assert sorted(m.ready_keys(R)) == sorted([known[0], mine[0]])
    assert m.forget(R, known) == 1 and m.forget(R, known) == 0
    tiers.named[R].discard(known[0])
    check(m, tiers)


def test_a_tier_adopted_past_its_capacity_sheds_one_more_block_a_reservation_in_policy_order():
    # A disk of 3 reopened holding 6: each block written down evicts two (least recently used
    # first) until 3 are left, then one, as a full tier does.
    m, tiers = manager({D: 4, K: 3}, write=WritePolicy.WRITE_THROUGH), Bytes()
    found = keys_of(20, 6)
    assert m.adopt(K, found, past_capacity=True) == 6
    tiers.named[K].update(found)
    assert m.match(found).media == (K,) * 6
    check(m, tiers)
    new = [keys_of(21 + i, 1)[0] for i in range(4)]
    evicted = []
    for key in new:
        plan = m.prepare_store([key])
        m.complete_store(plan, [None], pin=False)
        tiers.slots[D][plan.blocks[0].slot] = key
        copies = m.prepare_copies([key], (K,))
        evicted.append([v.key for v in copies.room.victims])
        m.complete_room(copies.room, tiers.carry_out(copies.room, [None] * len(copies.room.victims)))
        m.complete_copies(copies, tiers.move(copies.legs, [None]))
        check(m, tiers)
    assert evicted == [found[0:2], found[2:4], found[4:6], new[:1]]
    assert sorted(m.ready_keys(K)) == sorted(new[1:]) and m.table(K).excess_blocks == 0


# --- a state machine of plans in flight ----------------------------------------------------------

SEQS = {i: keys_of(100 + i, 3) for i in range(5)}
FAILURES = st.sampled_from([None, None, None, Failure.CORRUPT, Failure.MISSING, Failure.UNAVAILABLE,
                            Failure.ABANDONED, Failure.ERROR])


class ManagerMachine(RuleBasedStateMachine):
    """Loads, stores, copies and evictions as generators, advanced one step at a time in any
    interleaving, with failures drawn per leg; the invariants hold between any two steps."""

    def __init__(self) -> None:
        super().__init__()
        self.m: BlockManager | None = None
        self.tiers = Bytes()
        self.flights: list = []
        self.held: list[tuple[bytes, ...]] = []
        self.readers: list[tuple[Medium, bytes]] = []  # pins outside any plan (a prefetch's read, say)
        self.data = None

    @initialize(write=st.sampled_from(list(WritePolicy)), direct=st.sets(st.sampled_from([K, R])), host=st.integers(0, 3),
                small=st.sampled_from([0, 1 << 20]), recovered=st.sampled_from([0, 0, 3, 9]))
    def start(self, write, direct, host, small, recovered):
        capacities = {D: 3, K: 4, R: 4} | ({H: host} if host else {})
        self.m = manager(capacities, write, frozenset(direct), small_load_bytes=small)
        # A disk reopened holding ``recovered`` blocks of the sequences, past its capacity of 4 at 9.
        found = [key for seq in sorted(SEQS) for key in SEQS[seq]][:recovered]
        self.m.adopt(K, found, past_capacity=True)
        self.tiers.named[K].update(found)

    def failures(self, n: int) -> list[Failure | None]:
        return [None] * n if self.data is None else [self.data.draw(FAILURES) for _ in range(n)]

    def carry_out(self, room: Room) -> None:
        self.m.complete_room(room, self.tiers.carry_out(room, self.failures(len(room.victims))))

    # --- operations, each a generator of steps ---

    def store(self, keys):
        done = 0
        while done < len(keys):
            plan = self.m.prepare_store(keys[done:])
            yield
            self.carry_out(plan.room)
            yield
            failures = [f if f is Failure.ERROR else None for f in self.failures(len(plan.blocks))]
            for block, failure in zip(plan.blocks, failures):
                if failure is None:
                    self.tiers.slots[D][block.slot] = block.key
            through = self.m.config.write.on_store()
            stored = self.m.complete_store(plan, failures, pin=through)
            done += plan.consumed
            for key in stored if through else ():
                yield from self.copy([key], self.m.media[1:])
                self.m.unpin(D, [key])
            if plan.stopped is not None and not plan.blocks:
                return

    def copy(self, keys, to):
        plan = self.m.prepare_copies(keys, to)
        yield
        self.carry_out(plan.room)
        yield
        landed, drops = self.m.complete_copies(plan, self.tiers.move(plan.legs, self.failures(len(plan.legs))))
        self.carry_out(drops)

    def load(self, keys, hold):
        plan = self.m.prepare_load(self.m.match(keys))
        yield
        self.carry_out(plan.room)
        yield
        fetches = plan.legs(Step.FETCH)
        plan, drops = self.m.complete_fetch(plan, self.tiers.move(fetches, self.failures(len(fetches))))
        self.carry_out(drops)
        yield
        copies = plan.legs(Step.COPY)
        copy_failures = [f if f is Failure.ERROR else None for f in self.failures(len(copies))]
        if any(self.tiers.move(copies, copy_failures)):
            self.m.abandon_load(plan)
            return
        for key in self.m.complete_load(plan):
            yield from self.copy([key], self.m.media[1:])
        for block in plan.blocks:  # what the caller reads: its own bytes, whatever happened around it
            assert self.tiers.slots[D][block.device_slot] == block.key
        if hold and len(self.held) < 2:
            self.held.append(plan.keys)
        else:
            self.m.unpin(D, plan.keys)

    def evict(self, medium, n):
        room = self.m.prepare_evict(medium, n)
        yield
        self.carry_out(room)

    def put(self, keys, to):
        """A caller's blocks straight into tiers (no device slot)."""
        plan = self.m.prepare_put(keys, to)
        yield
        self.carry_out(plan.room)
        yield
        failures = self.failures(len(plan.placements))
        for placement, failure in zip(plan.placements, failures):
            slot = placement.slot
            if failure is None:
                self.tiers.write(slot.medium, slot.index, placement.key, placement.key)
            elif failure is Failure.ABANDONED and slot.medium in MEMORY:
                self.tiers.slots[slot.medium][slot.index] = GARBAGE
        self.m.complete_put(plan, failures)

    def get(self, keys):
        """The leading run read straight into a caller's memory: what it gets is its own bytes."""
        plan = self.m.prepare_get(keys)
        yield
        failures, got = [], []
        for placement, drawn in zip(plan.sources, self.failures(len(plan.sources))):
            content = self.tiers.read_slot(placement.key, placement.slot)
            if placement.slot.medium in MEMORY:
                assert content == placement.key, f"{placement.slot} holds {content!r}, not its block"
            elif content is None and drawn is None:
                drawn = Failure.MISSING
            failures.append(drawn)
            got.append(content if drawn is None else None)
        read, drops = self.m.complete_get(plan, failures)
        self.carry_out(drops)
        assert got[:read] == [p.key for p in plan.sources[:read]]
        assert read == len(plan.sources) or failures[read] is not None

    def begin(self, flight, data) -> None:
        self.flights.append(flight)
        self.step(len(self.flights) - 1, data)

    def step(self, i: int, data) -> None:
        self.data = data  # the failures this step reports are drawn from its own rule's data
        try:
            next(self.flights[i])
        except StopIteration:
            del self.flights[i]

    # --- rules ---

    @rule(data=st.data(), seq=st.sampled_from(sorted(SEQS)), blocks=st.integers(1, 3))
    def begin_store(self, data, seq, blocks):
        self.begin(self.store(SEQS[seq][:blocks]), data)

    @rule(data=st.data(), seq=st.sampled_from(sorted(SEQS)), blocks=st.integers(1, 3),
          to=st.sampled_from([(H, K, R), (K, R), (H,), (R,)]))
    def begin_put(self, data, seq, blocks, to):
        self.begin(self.put(SEQS[seq][:blocks], to), data)

    @rule(data=st.data(), seq=st.sampled_from(sorted(SEQS)))
    def begin_get(self, data, seq):
        self.begin(self.get(SEQS[seq]), data)

    @rule(data=st.data(), seq=st.sampled_from(sorted(SEQS)), hold=st.booleans())
    def begin_load(self, data, seq, hold):
        self.begin(self.load(SEQS[seq], hold), data)

    @precondition(lambda self: H in self.m.media)
    @rule(data=st.data(), seq=st.sampled_from(sorted(SEQS)))
    def begin_promote(self, data, seq):
        match = self.m.match(SEQS[seq])
        self.begin(self.copy([k for k, m in zip(match.keys, match.media) if m.value > H.value], (H,)), data)

    @rule(data=st.data(), medium=st.sampled_from([D, H, K, R]), n=st.integers(1, 3))
    def begin_evict(self, data, medium, n):
        if medium in self.m.media:
            self.begin(self.evict(medium, n), data)

    @precondition(lambda self: R in self.m.media)
    @rule(seq=st.sampled_from(sorted(SEQS)))
    def others_wrote(self, seq):
        """Another instance put these blocks in the pool; this one finds and adopts them."""
        self.tiers.named[R].update(SEQS[seq])
        self.m.adopt(R, SEQS[seq])

    @precondition(lambda self: R in self.m.media)
    @rule(seq=st.sampled_from(sorted(SEQS)))
    def pool_lost(self, seq):
        """The pool came back without these objects and the view is reconciled: those READY
        and unpinned are forgotten (their bytes gone); those plans hold are left to them."""
        table = self.m.table(R)
        idle = {k for k in SEQS[seq] if table.state(k) is BlockState.READY and not table.pins(k)}
        assert self.m.forget(R, SEQS[seq]) == len(idle)
        assert not any(table.state(k) or R in self.m.where(k) for k in idle)
        self.tiers.named[R] -= idle

    @precondition(lambda self: self.flights)
    @rule(data=st.data(), which=st.integers(0, 7))
    def advance(self, data, which):
        self.step(which % len(self.flights), data)

    @precondition(lambda self: self.held and not self.flights)
    @rule()
    def release(self):
        self.m.unpin(D, self.held.pop(0))

    @rule(seq=st.sampled_from(sorted(SEQS)), medium=st.sampled_from([H, K, R]))
    def read_elsewhere(self, seq, medium):
        """A reader outside any plan pins a block where it is, for a while."""
        if medium in self.m.media and len(self.readers) < 3:
            for key in SEQS[seq]:
                if self.m.pin(medium, key) is not None:
                    self.readers.append((medium, key))
                    return

    @precondition(lambda self: self.readers)
    @rule()
    def reader_done(self):
        medium, key = self.readers.pop(0)
        self.m.unpin(medium, [key])

    @precondition(lambda self: not self.flights)
    @rule()
    def settled(self):
        """With nothing in flight, only held loads pin anything, and nothing is mid-way."""
        held: dict[bytes, int] = {}
        for keys in self.held:
            for key in keys:
                held[key] = held.get(key, 0) + 1
        readers: dict[tuple[Medium, bytes], int] = {}
        for where in self.readers:
            readers[where] = readers.get(where, 0) + 1
        for medium in self.m.media:
            table = self.m.table(medium)
            expected = dict(held) if medium is D else {}
            for (m, key), n in readers.items():
                if m is medium:
                    expected[key] = expected.get(key, 0) + n
            assert table.pinned() == expected
            assert table.used_blocks == len(table.ready_keys())

    @invariant()
    def consistent(self):
        if self.m is not None:
            check(self.m, self.tiers)

    def teardown(self):
        while self.flights:  # every plan in flight still completes cleanly, nothing failing
            self.step(0, None)
        if self.m is not None:
            check(self.m, self.tiers)


ManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
TestManagerMachine = ManagerMachine.TestCase


def test_a_put_reserves_every_tier_lacking_the_block_and_skips_a_full_one():
    m = manager({D: 2, H: 1, K: 4})
    keys = keys_of(17, 3)
    m.complete_put(m.prepare_put(keys[:1], (K,)), [None])
    assert m.where(keys[0]) == (K,)
    held = m.prepare_put([keys[1]], (H,))  # the host's one slot, WRITING: nothing can leave it
    plan = m.prepare_put(keys, (H, K))
    # keys[0] is on disk already; the host is full of a block on its way in: only the disk's slots
    assert [(p.position, p.slot.medium) for p in plan.placements] == [(1, K), (2, K)]
    assert plan.present == {0, 1} and plan.full == {0, 2}
    m.complete_put(plan, [Failure.UNAVAILABLE, None])
    m.complete_put(held, [None])
    assert [m.where(k) for k in keys] == [(K,), (H,), (K,)]
    check_tables_settled(m)


def test_a_get_pins_the_fastest_copy_of_the_leading_run_and_drops_a_corrupt_source():
    m = manager({D: 2, H: 2, K: 4})
    keys = keys_of(18, 4)
    m.complete_put(m.prepare_put(keys[:3], (K,)), [None] * 3)
    m.complete_put(m.prepare_put(keys[1:2], (H,)), [None])
    plan = m.prepare_get(keys)  # the fourth is nowhere: the run is three
    assert [(p.position, p.slot.medium) for p in plan.sources] == [(0, K), (1, H), (2, K)]
    assert m.table(H).pins(keys[1]) == 1
    read, drops = m.complete_get(plan, [None, Failure.CORRUPT, None])
    assert read == 1 and [v.key for v in drops.victims] == [keys[1]]
    m.complete_room(drops, [None])
    assert m.where(keys[1]) == (K,) and m.match(keys).blocks == 3  # the bad host copy left; the disk's stays
    check_tables_settled(m)


def check_tables_settled(m: BlockManager) -> None:
    for medium in m.media:
        assert m.table(medium).pinned() == {}
        assert m.table(medium).used_blocks == len(m.table(medium).ready_keys())


def test_a_medium_out_of_space_holds_what_it_has_and_makes_room_for_the_next_copies():
    m, tiers = manager({D: 8, K: 8}, write=WritePolicy.WRITE_THROUGH), Bytes()
    keys = keys_of(16, 4)
    stored(m, tiers, keys)
    first = m.prepare_copies(keys[:3], (K,))
    m.complete_copies(first, tiers.move(first.legs, [None, None, Failure.NO_SPACE]))
    disk = m.table(K)
    assert (disk.capacity_blocks, disk.free_blocks, m.where(keys[2])) == (2, 0, (D,))  # the file system is full
    more = m.prepare_copies(keys[3:], (K,))  # makes room: the least recent disk block leaves
    assert [v.key for v in more.room.victims] == [keys[0]] and len(more.legs) == 1
    m.complete_room(more.room, tiers.carry_out(more.room, [None]))
    m.complete_copies(more, tiers.move(more.legs, [None]))
    assert (m.where(keys[0]), m.where(keys[3])) == ((D,), (D, K))
    check(m, tiers)


def test_an_eviction_larger_than_the_tier_below_ends_where_it_is_full_and_drops_nothing():
    """Write-back: 8 device blocks evicted at once into a host of 4. The room takes the 4 the
    host has room for and keeps the other 4 on the device (READY, indexed); a second room, once
    the first has landed, demotes them, making room on the host by demoting its own to disk."""
    m, tiers = manager({D: 8, H: 4, K: 16}), Bytes()
    keys = keys_of(7, 8)
    stored(m, tiers, keys)
    first = evicted(m, tiers, D, 8)
    assert len(first.victims) == 4 and all(v.demotion is not None for v in first.victims)
    assert len(m.table(D).ready_keys()) == 4 and len(m.table(H).ready_keys()) == 4
    check(m, tiers)
    second = evicted(m, tiers, D, 8)
    assert sum(v.slot.medium is D for v in second.victims) == 4
    check(m, tiers)
    assert m.match(keys).blocks == 8  # every block still somewhere
    assert {m.where(k)[0] for k in keys} == {H, K} and not m.table(D).ready_keys()
