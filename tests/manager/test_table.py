"""A tier's block table: checked two-step transitions, pins, slots and eviction order."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstrata.policies.eviction import LFU, LRU, Eviction
from kvstrata.manager.table import (
    Adopted,
    BlockState,
    BlockTable,
    InvalidTransition,
    Reservation,
    TableCounts,
    TierFull,
)

W, R, E = BlockState.WRITING, BlockState.READY, BlockState.EVICTING
KEYS = [bytes([i]) * 16 for i in range(8)]
A, B, C, D = KEYS[:4]


def table(capacity: int = 4, policy: Eviction = Eviction.LRU) -> BlockTable:
    return BlockTable(capacity, policy.make(), name="t")


def stored(t: BlockTable, *keys: bytes) -> None:
    for key in keys:
        assert t.prepare_store(key) is not None
        t.complete_store(key, ok=True)


def in_state(state: BlockState | None, pinned: bool = False) -> BlockTable:
    """A table holding key A in ``state`` (and nothing else)."""
    t = table()
    if state is not None:
        t.prepare_store(A)
    if state in (R, E):
        t.complete_store(A, ok=True)
    if state is E:
        assert t.choose_victims(1) == [Reservation(A, t.slot(A))]
    if pinned:
        assert t.pin(A) is not None
    assert t.state(A) is state
    return t


# --- the whole transition matrix -------------------------------------------------------------------

OPERATIONS = {
    "prepare_store": lambda t: t.prepare_store(A),
    "complete_ok": lambda t: t.complete_store(A, ok=True),
    "complete_fail": lambda t: t.complete_store(A, ok=False),
    "choose_victims": lambda t: t.choose_victims(4),
    "release": lambda t: t.release(A),
    "restore": lambda t: t.restore(A),
    "take": lambda t: t.take(A),
    "pin": lambda t: t.pin(A),
}
RAISES = "raises InvalidTransition"


# (state of A, pinned?, operation) -> the state A is left in, or RAISES (state unchanged).
MATRIX = [
    (None, False, "prepare_store", W),
    (None, False, "complete_ok", RAISES),
    (None, False, "complete_fail", RAISES),
    (None, False, "choose_victims", None),
    (None, False, "release", RAISES),
    (None, False, "restore", RAISES),
    (None, False, "take", None),
    (None, False, "pin", None),
    (W, False, "prepare_store", W),
    (W, False, "complete_ok", R),
    (W, False, "complete_fail", None),
    (W, False, "choose_victims", W),
    (W, False, "release", RAISES),
    (W, False, "restore", RAISES),
    (W, False, "take", W),
    (W, False, "pin", W),
    (R, False, "prepare_store", R),
    (R, False, "complete_ok", RAISES),
    pytest.param(R, False, "complete_fail", RAISES),
    (R, False, "choose_victims", E),
    (R, False, "release", RAISES),
    (R, False, "restore", RAISES),
    (R, False, "take", E),
    (R, False, "pin", R),
    (R, True, "prepare_store", R),
    (R, True, "complete_ok", RAISES),
    (R, True, "complete_fail", RAISES),
    (R, True, "choose_victims", R),
    (R, True, "release", RAISES),
    (R, True, "restore", RAISES),
    (R, True, "take", R),
    (R, True, "pin", R),
    (E, False, "prepare_store", E),
    pytest.param(E, False, "complete_ok", RAISES),
    pytest.param(E, False, "complete_fail", RAISES),
    (E, False, "choose_victims", E),
    (E, False, "release", None),
    (E, False, "restore", R),
    (E, False, "take", E),
    (E, False, "pin", E),
]


def _id(value) -> str:
    if isinstance(value, BlockState):
        return value.name
    if value is None:
        return "absent"
    if isinstance(value, bool):
        return "pinned" if value else "unpinned"
    return "RAISES" if value == RAISES else str(value)


@pytest.mark.parametrize(("state", "pinned", "operation", "expected"), MATRIX, ids=_id)
def test_transition_matrix(state, pinned, operation, expected):
    t = in_state(state, pinned)
    if expected == RAISES:
        with pytest.raises(InvalidTransition):
            OPERATIONS[operation](t)
        assert t.state(A) is state  # a refused transition changes nothing
        assert t.pins(A) == int(pinned)
    else:
        OPERATIONS[operation](t)
        assert t.state(A) is expected
    assert t.used_blocks + t.free_blocks == t.capacity_blocks
    assert t.used_blocks == (t.state(A) is not None)


def test_the_matrix_covers_every_state_and_operation():
    cells = {(p.values[:3] if hasattr(p, "values") else p[:3]) for p in MATRIX}
    states = [(None, False), (W, False), (R, False), (R, True), (E, False)]
    assert cells == {(s, pinned, op) for s, pinned in states for op in OPERATIONS}


# --- scripted scenarios ----------------------------------------------------------------------------


def test_prepare_store_twice_returns_none_the_second_time():
    t = table()
    first = t.prepare_store(A)
    assert isinstance(first, Reservation) and first.key == A
    assert t.prepare_store(A) is None
    t.complete_store(A, ok=True)
    assert t.prepare_store(A) is None
    assert t.used_blocks == 1


@pytest.mark.parametrize("policy", list(Eviction))
def test_adopt_is_prepare_then_complete_store_of_each_key_not_here_until_full(policy):
    one, many = table(3, policy), table(3, policy)
    for t in (one, many):
        stored(t, B)
    for key in (A, C):  # what adopt([A, B, C, D]) should do: B is here, D finds no room
        one.prepare_store(key)
        one.complete_store(key, ok=True)
    adopted = many.adopt([A, B, C, D])
    assert (adopted.known, adopted.new) == (3, [A, C])  # a leading run: it stopped at D
    assert [many.state(k) for k in KEYS[:4]] == [R, R, R, None]
    assert sorted(many.slot(k) for k in (A, B, C)) == [0, 1, 2]
    assert many.free_blocks == 0 and many.used_blocks == 3
    assert list(many.choose_victims(3)) == list(one.choose_victims(3))  # same eviction order, same slots


def test_adopt_reuses_released_slots_and_adopts_nothing_twice():
    t = table(2)
    stored(t, A)
    t.take(A)
    t.release(A)
    assert t.adopt([B, B, C]) == Adopted(3, [B, C])
    assert sorted(t.slot(k) for k in (B, C)) == [0, 1]


def test_adopt_past_capacity_takes_every_key_and_never_reuses_a_slot_past_it():
    # A disk tier reopened at 2 with 5 blocks: all READY, in slots past the capacity where
    # needed; full (and by how much) until enough have left; then only slots below 2 serve.
    t = table(2)
    assert t.adopt(KEYS[:5], past_capacity=True) == Adopted(5, KEYS[:5])
    assert [t.state(k) for k in KEYS[:5]] == [R] * 5 and sorted(t.slot(k) for k in KEYS[:5]) == [0, 1, 2, 3, 4]
    assert (t.free_blocks, t.excess_blocks, t.counts()) == (0, 3, TableCounts(5, 2, 0))
    with pytest.raises(TierFull):
        t.prepare_store(KEYS[5])
    victims = t.choose_victims(4)
    assert [v.key for v in victims] == KEYS[:4]  # LRU: in the order adopted
    for victim in victims:
        t.release(victim.key)
    assert (t.free_blocks, t.excess_blocks) == (1, 0)
    slots = [t.prepare_store(k).slot for k in KEYS[5:6]]
    with pytest.raises(TierFull):
        t.prepare_store(KEYS[6])
    assert slots[0] < 2 and t.slot(KEYS[4]) == 4  # the block past the capacity keeps its slot until it leaves


def test_complete_store_with_pin_is_ready_and_pinned_at_once():
    t = table()
    stored(t, B)
    t.prepare_store(A)
    t.complete_store(A, ok=True, pin=True)
    assert (t.state(A), t.pins(A), t.hits(A)) == (R, 1, 0)  # pinned for the writer, not a hit
    assert t.choose_victims(2) == [Reservation(B, t.slot(B))]
    assert t.take(A) is None
    t.unpin(A)
    assert t.choose_victims(1) == [Reservation(A, t.slot(A))]


def test_a_failed_store_with_pin_leaves_nothing_pinned():
    t = table()
    t.prepare_store(A)
    t.complete_store(A, ok=False, pin=True)
    assert (t.state(A), t.pins(A), t.free_blocks) == (None, 0, 4)


def test_a_failed_store_frees_the_slot():
    t = table(capacity=1)
    slot = t.prepare_store(A).slot
    t.complete_store(A, ok=False)
    assert t.state(A) is None and t.free_blocks == 1
    assert t.prepare_store(B).slot == slot


def test_tier_full_when_every_slot_is_taken():
    t = table(capacity=2)
    stored(t, A)
    t.prepare_store(B)
    with pytest.raises(TierFull, match="2 slots"):
        t.prepare_store(C)
    assert t.prepare_store(A) is None  # a key already here is not a new store, full or not


def test_a_zero_capacity_table_is_always_full():
    with pytest.raises(TierFull):
        table(capacity=0).prepare_store(A)


def test_negative_capacity_is_refused():
    with pytest.raises(ValueError, match="capacity_blocks"):
        table(capacity=-1)


def test_slots_are_distinct_and_in_range():
    t = table(capacity=4)
    slots = [t.prepare_store(k).slot for k in KEYS[:4]]
    assert sorted(slots) == [0, 1, 2, 3]


def test_slot_is_hidden_while_writing():
    t = table()
    reservation = t.prepare_store(A)
    assert t.slot(A) is None
    t.complete_store(A, ok=True)
    assert t.slot(A) == reservation.slot
    t.choose_victims(1)
    assert t.slot(A) == reservation.slot  # still readable, so a demotion can copy it down


def test_release_returns_the_slot_to_the_free_list():
    t = table(capacity=3)
    stored(t, A, B, C)
    assert t.free_blocks == 0
    [victim] = t.choose_victims(1)
    assert victim == Reservation(A, t.slot(A))
    t.release(A)
    assert (t.free_blocks, t.used_blocks, t.state(A)) == (1, 2, None)
    assert t.prepare_store(D).slot == victim.slot


def test_restore_puts_an_evicting_block_back_to_ready():
    t = table()
    stored(t, A, B)
    t.choose_victims(1)
    t.restore(A)
    assert t.state(A) is R
    assert t.pin(A) is not None
    t.unpin(A)
    assert [v.key for v in t.choose_victims(2)] == [B, A]  # A was pinned after B was stored


def test_counts_are_the_slots_not_free_and_the_victims_that_left():
    t = table(capacity=3)
    stored(t, A, B)
    assert t.counts() == TableCounts(used_slots=2, capacity_blocks=3, evicted_blocks=0)
    t.choose_victims(2)
    t.restore(B)  # a victim that stays was not evicted
    t.release(A)
    assert t.counts() == TableCounts(used_slots=1, capacity_blocks=3, evicted_blocks=1)
    t.take(B)  # a named block leaving (a bad copy) is no eviction
    t.release(B)
    assert t.counts() == TableCounts(used_slots=0, capacity_blocks=3, evicted_blocks=1)


def test_victims_are_only_ready_and_unpinned_blocks_in_lru_order():
    t = table(capacity=6)
    stored(t, A, B, C, D)
    t.prepare_store(KEYS[4])  # WRITING: never a victim
    t.pin(A)  # pinned: never a victim, and now the most recently used
    t.pin(C)
    t.unpin(C)  # used, then unpinned: a victim again, after B and D
    assert [v.key for v in t.choose_victims(2)] == [B, D]
    assert [v.key for v in t.choose_victims(10)] == [C]  # B and D are EVICTING already
    assert t.choose_victims(10) == []
    assert t.state(A) is R and t.state(KEYS[4]) is W


def test_victims_in_lfu_order():
    t = table(capacity=6, policy=Eviction.LFU)
    stored(t, A, B, C, D)
    for key, uses in ((A, 3), (B, 1), (C, 0), (D, 1)):
        for _ in range(uses):
            t.pin(key)
            t.unpin(key)
    # C (1 use: its store), then B and D (2 each; B reached 2 first), then A (4).
    assert [v.key for v in t.choose_victims(4)] == [C, B, D, A]


def test_choose_victims_of_zero_chooses_nothing():
    t = table()
    stored(t, A)
    assert t.choose_victims(0) == []
    assert t.state(A) is R


def test_choose_victims_of_a_negative_count_is_refused():
    t = table()
    stored(t, A, B)
    with pytest.raises(ValueError):
        t.choose_victims(-1)


def test_pin_refuses_writing_evicting_and_absent_blocks():
    t = table()
    t.prepare_store(A)
    stored(t, B)
    t.choose_victims(1)
    assert t.pin(A) is None  # WRITING
    assert t.pin(B) is None  # EVICTING
    assert t.pin(C) is None  # absent
    assert (t.pins(A), t.pins(B), t.pins(C)) == (0, 0, 0)
    assert (t.hits(A), t.hits(B), t.hits(C)) == (0, 0, 0)


def test_pins_are_counted_and_unpin_without_pin_raises():
    t = table()
    stored(t, A)
    assert t.pin(A) == t.pin(A) == t.slot(A)
    assert t.pins(A) == 2
    t.unpin(A)
    t.unpin(A)
    with pytest.raises(InvalidTransition, match="not pinned"):
        t.unpin(A)
    with pytest.raises(InvalidTransition, match="not pinned"):
        t.unpin(B)


def test_a_pinned_block_cannot_be_taken_or_evicted():
    t = table()
    stored(t, A)
    t.pin(A)
    assert t.take(A) is None
    assert t.choose_victims(1) == []
    t.unpin(A)
    assert t.take(A) == Reservation(A, t.slot(A))
    t.release(A)
    assert t.state(A) is None and t.free_blocks == 4


def test_hits_are_counted_by_pin_and_reset_when_the_block_leaves():
    t = table()
    stored(t, A)
    for _ in range(3):
        t.pin(A)
        t.unpin(A)
    assert t.hits(A) == 3
    t.take(A)
    t.release(A)
    assert t.hits(A) == 0
    stored(t, A)
    assert t.hits(A) == 0


def test_ready_keys_lists_only_ready_blocks():
    t = table()
    stored(t, A, B, C)
    t.prepare_store(D)
    t.choose_victims(1)
    assert sorted(t.ready_keys()) == sorted([B, C])


def test_a_taken_block_leaves_the_eviction_order():
    t = table()
    stored(t, A, B)
    t.take(A)
    t.release(A)
    stored(t, A)  # A comes back as the most recent, not at its old place
    assert [v.key for v in t.choose_victims(2)] == [B, A]


# --- a model-based state machine -------------------------------------------------------------------

CAPACITY = 3
POOL = KEYS[:4]


class BlockTableMachine(RuleBasedStateMachine):
    """BlockTable against a model: per key its state, slot, pins, hits and eviction rank.

    Only valid calls and the invalid calls the table refuses are made; the matrix above covers
    every invalid transition.
    """

    policy = Eviction.LRU

    def __init__(self) -> None:
        super().__init__()
        self.order = self.policy.make()
        self.table = BlockTable(CAPACITY, self.order, name="m")
        self.state: dict[bytes, BlockState] = {}
        self.slot: dict[bytes, int] = {}
        self.pins: dict[bytes, int] = {}
        self.hits: dict[bytes, int] = {}
        self.uses: dict[bytes, int] = {}  # LFU count: 1 at store, +1 per pin
        self.touched: dict[bytes, int] = {}  # tick of the last store or pin
        self.tick = 0

    def _touch(self, key: bytes, store: bool) -> None:
        self.tick += 1
        self.touched[key] = self.tick
        self.uses[key] = 1 if store else self.uses[key] + 1

    def _forget(self, key: bytes) -> None:
        for table in (self.state, self.slot, self.pins, self.hits, self.uses, self.touched):
            table.pop(key, None)

    def _rank(self, key: bytes) -> tuple[int, ...]:
        if self.policy is Eviction.LFU:
            return (self.uses[key], self.touched[key])
        return (self.touched[key],)

    @rule(key=st.sampled_from(POOL))
    def prepare_store(self, key):
        if key in self.state:
            assert self.table.prepare_store(key) is None
        elif len(self.state) == CAPACITY:
            with pytest.raises(TierFull):
                self.table.prepare_store(key)
        else:
            reservation = self.table.prepare_store(key)
            assert reservation.key == key
            assert 0 <= reservation.slot < CAPACITY
            assert reservation.slot not in self.slot.values()  # never a slot another block holds
            self.state[key], self.slot[key], self.pins[key], self.hits[key] = W, reservation.slot, 0, 0

    @rule(key=st.sampled_from(POOL), ok=st.booleans(), pin=st.booleans())
    def complete_store(self, key, ok, pin=False):
        state = self.state.get(key)
        if state is W:
            self.table.complete_store(key, ok, pin=pin)
            if ok:
                self.state[key] = R
                self.pins[key] = int(pin)  # a pin taken with the store is not a hit
                self._touch(key, store=True)
            else:
                self._forget(key)
        elif state is None or (state is R and ok):
            with pytest.raises(InvalidTransition):
                self.table.complete_store(key, ok, pin=pin)

    @rule(key=st.sampled_from(POOL))
    def store(self, key):
        """prepare_store then complete_store(ok=True): the common path, so the search reaches
        full tables and interesting eviction orders quickly."""
        self.prepare_store(key)
        if self.state.get(key) is W:
            self.complete_store(key, ok=True)

    @rule(key=st.sampled_from(POOL))
    def use(self, key):
        """pin then unpin: a read that ends, so the block is evictable again but more recent."""
        self.pin(key)
        if self.pins.get(key):
            self.unpin(key)

    @rule(key=st.sampled_from(POOL))
    def pin(self, key):
        slot = self.table.pin(key)
        if self.state.get(key) is R:
            assert slot == self.slot[key]
            self.pins[key] += 1
            self.hits[key] += 1
            self._touch(key, store=False)
        else:
            assert slot is None

    @rule(key=st.sampled_from(POOL))
    def unpin(self, key):
        if self.pins.get(key, 0):
            self.table.unpin(key)
            self.pins[key] -= 1
        else:
            with pytest.raises(InvalidTransition):
                self.table.unpin(key)

    @rule(count=st.integers(0, CAPACITY + 1))
    def choose_victims(self, count):
        candidates = [k for k, s in self.state.items() if s is R and self.pins[k] == 0]
        expected = sorted(candidates, key=self._rank)[:count]
        assert self.table.choose_victims(count) == [Reservation(k, self.slot[k]) for k in expected]
        for key in expected:
            self.state[key] = E

    @rule(key=st.sampled_from(POOL))
    def release(self, key):
        if self.state.get(key) is E:
            self.table.release(key)
            self._forget(key)
        else:
            with pytest.raises(InvalidTransition):
                self.table.release(key)

    @rule(key=st.sampled_from(POOL))
    def restore(self, key):
        state = self.state.get(key)
        if state is E:
            self.table.restore(key)
            self.state[key] = R  # keeps its place in the eviction order
        elif state is not W:
            with pytest.raises(InvalidTransition):
                self.table.restore(key)

    @rule(key=st.sampled_from(POOL))
    def take(self, key):
        takeable = self.state.get(key) is R and self.pins[key] == 0
        taken = self.table.take(key)
        assert (taken is not None) is takeable
        if takeable:
            assert taken == Reservation(key, self.slot[key])
            self.state[key] = E

    @invariant()
    def slots_are_unique_and_accounted_for(self):
        assert len(set(self.slot.values())) == len(self.slot)
        assert self.table.used_blocks == len(self.state)
        assert self.table.used_blocks + self.table.free_blocks == CAPACITY

    @invariant()
    def every_block_agrees_with_the_model(self):
        for key in POOL:
            state = self.state.get(key)
            assert self.table.state(key) is state
            assert self.table.slot(key) == (self.slot[key] if state in (R, E) else None)
            assert self.table.pins(key) == self.pins.get(key, 0)
            assert self.table.hits(key) == self.hits.get(key, 0)
        assert sorted(self.table.ready_keys()) == sorted(k for k, s in self.state.items() if s is R)

    @invariant()
    def the_policy_orders_exactly_the_readable_blocks(self):
        # READY and EVICTING blocks, least valuable first; WRITING and dropped blocks never.
        readable = [k for k, s in self.state.items() if s is not W]
        assert list(self.order.order()) == sorted(readable, key=self._rank)

    @invariant()
    def pinned_blocks_are_never_evicting(self):
        for key in POOL:
            if self.table.pins(key):
                assert self.table.state(key) is R


class BlockTableLFUMachine(BlockTableMachine):
    policy = Eviction.LFU


_settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
BlockTableMachine.TestCase.settings = _settings
BlockTableLFUMachine.TestCase.settings = _settings
TestBlockTableLRU = BlockTableMachine.TestCase
TestBlockTableLFU = BlockTableLFUMachine.TestCase


def test_policies_are_the_expected_classes():
    assert isinstance(Eviction.LRU.make(), LRU) and isinstance(Eviction.LFU.make(), LFU)


def test_quarantine_retires_the_slot_for_good_and_frees_the_key():
    t = table()
    reservation = t.prepare_store(A)
    t.quarantine(A)  # a transfer into the slot was abandoned: it may still land there
    assert t.state(A) is None and t.quarantined_slots == 1
    assert t.used_blocks + t.free_blocks == t.capacity_blocks - 1
    again = t.prepare_store(A)  # the key can be stored again, never into the retired slot
    assert again.slot != reservation.slot
    stored(t, B)
    with pytest.raises(InvalidTransition):
        t.quarantine(B)  # only a block being written can be quarantined


# --- handing a victim's slot over ----------------------------------------------------------------


def full_with_victim() -> tuple[BlockTable, Reservation]:
    """A table of capacity 1 holding A, chosen as a victim (EVICTING)."""
    t = table(capacity=1)
    stored(t, A)
    (victim,) = t.choose_victims(1)
    return t, victim


def test_a_victims_slot_goes_to_the_new_block_and_stays_taken_when_the_victim_leaves():
    t, victim = full_with_victim()
    with pytest.raises(TierFull):
        t.prepare_store(B)
    reservation = t.hand_over(victim, B)
    assert reservation == Reservation(B, victim.slot)
    assert (t.state(A), t.state(B)) == (E, W)  # the victim's bytes still to be copied down
    t.release(A)
    assert t.free_blocks == 0 and t.owners() == {victim.slot: B}
    t.complete_store(B, ok=True)
    assert t.ready_keys() == [B]


def test_a_handed_over_store_that_fails_gives_the_slot_back_to_its_victim():
    t, victim = full_with_victim()
    t.hand_over(victim, B)
    t.complete_store(B, ok=False)  # e.g. the plan stopped before the victim was carried out
    assert t.free_blocks == 0 and t.owners() == {victim.slot: A}
    t.release(A)  # only now is nobody using the slot's bytes
    assert t.free_blocks == 1 and t.owners() == {}


def test_a_handed_over_store_that_fails_after_its_victim_left_frees_the_slot():
    t, victim = full_with_victim()
    t.hand_over(victim, B)
    t.release(A)
    t.complete_store(B, ok=False)
    assert t.free_blocks == 1 and t.owners() == {}


def test_a_handed_over_slot_that_is_quarantined_stays_retired_when_the_victim_leaves():
    t, victim = full_with_victim()
    t.hand_over(victim, B)
    t.quarantine(B)
    t.release(A)
    assert (t.free_blocks, t.quarantined_slots, t.owners()) == (0, 1, {})


def test_hand_over_needs_an_evicting_owner_and_an_absent_key():
    t = table(capacity=2)
    stored(t, A, B)
    with pytest.raises(InvalidTransition):
        t.hand_over(Reservation(A, t.slot(A)), C)  # A is READY, not evicting
    (victim,) = t.choose_victims(1)
    with pytest.raises(InvalidTransition):
        t.hand_over(victim, B)  # B is here already
    t.hand_over(victim, C)
    with pytest.raises(InvalidTransition):
        t.hand_over(victim, D)  # the slot is C's now
    with pytest.raises(InvalidTransition):
        t.restore(victim.key)  # nor can the victim come back to it


def test_memory_grows_with_the_blocks_held_not_with_the_capacity():
    """A disk tier of 100 GB in 4 KiB blocks is 24 million slots: listing them free up front
    cost ~0.9 GB before holding a block. Held blocks cost their entry alone, bounded."""
    import tracemalloc

    keys = [i.to_bytes(16, "little") for i in range(20_000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        t = BlockTable(25_000_000, Eviction.LRU.make(), name="disk")
        empty = tracemalloc.get_traced_memory()[0] - before
        for key in keys:
            t.prepare_store(key)
            t.complete_store(key, ok=True)
        per_block = (tracemalloc.get_traced_memory()[0] - before - empty) / len(keys)
    finally:
        tracemalloc.stop()
    assert empty < 64 * 1024, f"an empty table of 25M slots takes {empty} bytes"
    assert per_block < 320, f"{per_block:.0f} bytes per block held (keys excluded)"
    assert t.free_blocks == 25_000_000 - len(keys)
