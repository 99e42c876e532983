"""The prefix index: the longest cached prefix across media, and the fastest medium per block."""

from __future__ import annotations

import sys
import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstrata.index.keys import Namespace, block_keys
from kvstrata.index.prefix import Match, PrefixIndex
from kvstrata.media import Medium

D, H, K, R = Medium.DEVICE, Medium.HOST, Medium.DISK, Medium.REMOTE


def keys(n: int, seed: int = 0) -> list[bytes]:
    return block_keys([seed] * 4 + list(range(4 * n - 4)), Namespace("m", "bf16", "lkthd", 4))


def index_with(placement: dict[bytes, tuple[Medium, ...]]) -> PrefixIndex:
    index = PrefixIndex()
    for key, media in placement.items():
        for medium in media:
            index.add(key, medium)
    return index


# --- Medium ----------------------------------------------------------------------------------------


def test_media_are_ordered_fastest_first_with_one_bit_each():
    assert list(Medium) == [D, H, K, R]
    assert [m.bit for m in Medium] == [1, 2, 4, 8]
    assert [m.label for m in Medium] == ["device", "host", "disk", "remote"]


@pytest.mark.parametrize(
    ("mask", "media", "fastest"),
    [
        (0b0001, (D,), D),
        (0b0010, (H,), H),
        (0b0100, (K,), K),
        (0b1000, (R,), R),
        (0b0110, (H, K), H),
        (0b1100, (K, R), K),
        (0b1010, (H, R), H),
        (0b1111, (D, H, K, R), D),
    ],
)
def test_from_mask_and_fastest(mask, media, fastest):
    assert Medium.from_mask(mask) == media
    assert Medium.fastest(mask) is fastest


def test_from_mask_of_zero_is_empty():
    assert Medium.from_mask(0) == ()


def test_every_mask_round_trips():
    for mask in range(16):
        assert sum(m.bit for m in Medium.from_mask(mask)) == mask
        if mask:
            assert Medium.fastest(mask) is Medium.from_mask(mask)[0]


# --- match -----------------------------------------------------------------------------------------


def test_match_on_an_empty_index_is_empty():
    seq = keys(5)
    match = PrefixIndex().match(seq, 16)
    assert match == Match((), (), 16, 5)
    assert (match.blocks, match.tokens, match.total_blocks) == (0, 0, 5)


def test_match_of_no_keys():
    assert PrefixIndex().match([], 16) == Match((), (), 16, 0)


def test_match_spans_media_and_reports_the_fastest_per_block():
    seq = keys(6)
    index = index_with({seq[0]: (D, H), seq[1]: (H,), seq[2]: (K, H), seq[3]: (R,), seq[4]: (R, K, D)})
    match = index.match(seq, 16)
    assert match.keys == tuple(seq[:5])
    assert match.media == (D, H, H, R, D)
    assert (match.blocks, match.tokens, match.total_blocks) == (5, 80, 6)
    assert [match.count(m) for m in Medium] == [2, 2, 0, 1]


def test_a_hole_in_the_middle_stops_the_match():
    seq = keys(6)
    index = index_with({k: (H,) for i, k in enumerate(seq) if i != 2})
    match = index.match(seq, 32)
    assert match.keys == tuple(seq[:2])
    assert match.tokens == 64


def test_a_missing_first_block_matches_nothing_even_if_later_blocks_are_cached():
    seq = keys(4)
    index = index_with({k: (D,) for k in seq[1:]})
    assert index.match(seq, 16).blocks == 0


def test_a_key_repeated_after_the_first_miss_ends_the_match_at_the_first_miss():
    seq = keys(4)
    index = index_with({seq[0]: (H,), seq[2]: (D,)})
    assert index.match([seq[0], seq[1], seq[2], seq[1]], 16).keys == (seq[0],)


@pytest.mark.parametrize("pattern", ["one run", "a few runs", "runs ending as they began", "interleaved block by block"])
def test_counts_are_the_blocks_per_fastest_medium(pattern):
    media = {"one run": [H] * 300, "a few runs": [D] * 5 + [H] * 200 + [K] * 7 + [H] * 3,
             "runs ending as they began": [H] * 3 + [D] * 2 + [H] * 4,
             "interleaved block by block": [D, H, K, R, H] * 60}[pattern]
    match = Match(tuple(keys(len(media))), tuple(media), 16, len(media))
    expected = {m: media.count(m) for m in Medium if m in media}
    assert match.counts == expected
    assert [match.count(m) for m in Medium] == [media.count(m) for m in Medium]


def test_add_many_is_add_of_each():
    seq = keys(5)
    one, many = index_with({k: (K,) for k in seq}), index_with({k: (K,) for k in seq})
    for key in seq[1:4]:
        one.add(key, H)
    many.add_many(seq[1:4], H)
    assert [one.media(k) for k in seq] == [many.media(k) for k in seq]
    assert one.match(seq, 16) == many.match(seq, 16)
    assert len(many) == 5


def test_match_accepts_a_tuple_of_keys():
    seq = keys(3)
    index = index_with({k: (H,) for k in seq})
    assert index.match(tuple(seq), 16).keys == tuple(seq)


def test_discard_of_one_medium_keeps_the_others():
    seq = keys(3)
    index = index_with({k: (D, K) for k in seq})
    index.discard(seq[1], D)
    assert index.media(seq[1]) == (K,)
    assert index.match(seq, 16).media == (D, K, D)
    index.discard(seq[1], K)
    assert index.media(seq[1]) == ()
    assert index.match(seq, 16).blocks == 1


def test_discard_of_an_absent_key_or_medium_is_a_no_op():
    seq = keys(2)
    index = index_with({seq[0]: (H,)})
    index.discard(seq[1], H)
    index.discard(seq[0], R)
    assert index.media(seq[0]) == (H,)
    assert len(index) == 1


def test_len_counts_keys_on_any_medium_once():
    seq = keys(3)
    index = index_with({seq[0]: (D, H, K), seq[1]: (R,)})
    assert len(index) == 2
    index.discard(seq[1], R)
    assert len(index) == 1


def test_adding_twice_is_idempotent():
    seq = keys(1)
    index = index_with({seq[0]: (H, H)})
    index.discard(seq[0], H)
    assert len(index) == 0


# --- threads ---------------------------------------------------------------------------------------


def test_concurrent_add_discard_and_match_lose_no_updates():
    shared = keys(64, seed=1)
    index = PrefixIndex()
    errors: list[BaseException] = []
    start = threading.Barrier(len(Medium) + 2)

    def writer(medium: Medium) -> None:
        try:
            start.wait()
            for _ in range(30):
                for key in shared:
                    index.add(key, medium)
                for key in shared[::2]:
                    index.discard(key, medium)
            for key in shared:
                index.add(key, medium)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    def reader() -> None:
        try:
            start.wait()
            for _ in range(300):
                match = index.match(shared, 16)
                # Whatever it sees, a match is a well-formed prefix with a medium per block.
                assert match.keys == tuple(shared[: match.blocks])
                assert len(match.media) == match.blocks
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so read-modify-writes interleave
    try:
        threads = [threading.Thread(target=writer, args=(m,)) for m in Medium]
        threads += [threading.Thread(target=reader) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    finally:
        sys.setswitchinterval(interval)
    assert not errors
    # Every writer's bit survived every other writer's concurrent read-modify-write.
    assert all(index.media(key) == (D, H, K, R) for key in shared)
    assert index.match(shared, 16).media == (D,) * 64


# --- a model-based state machine -------------------------------------------------------------------

POOL = keys(6, seed=2)


class PrefixIndexMachine(RuleBasedStateMachine):
    """PrefixIndex against a plain dict of sets."""

    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex()
        self.model: dict[bytes, set[Medium]] = {}

    @rule(key=st.sampled_from(POOL), medium=st.sampled_from(Medium))
    def add(self, key, medium):
        self.index.add(key, medium)
        self.model.setdefault(key, set()).add(medium)

    @rule(key=st.sampled_from(POOL), medium=st.sampled_from(Medium))
    def discard(self, key, medium):
        self.index.discard(key, medium)
        self.model.get(key, set()).discard(medium)

    @rule(seq=st.lists(st.sampled_from(POOL), max_size=8), block_size=st.sampled_from([16, 256]))
    def match(self, seq, block_size):
        expected = []
        for key in seq:
            if not self.model.get(key):
                break
            expected.append(key)
        match = self.index.match(seq, block_size)
        assert match.keys == tuple(expected)
        assert match.media == tuple(min(self.model[k], key=lambda m: m.value) for k in expected)
        assert match.tokens == len(expected) * block_size
        assert match.total_blocks == len(seq)
        assert match.counts == {m: match.media.count(m) for m in Medium if m in match.media}

    @rule(seq=st.lists(st.sampled_from(POOL), max_size=4, unique=True), medium=st.sampled_from(Medium))
    def add_many(self, seq, medium):
        self.index.add_many(seq, medium)
        for key in seq:
            self.model.setdefault(key, set()).add(medium)

    @rule(key=st.sampled_from(POOL))
    def media(self, key):
        assert self.index.media(key) == tuple(sorted(self.model.get(key, ()), key=lambda m: m.value))

    @invariant()
    def same_keys(self):
        assert len(self.index) == sum(1 for media in self.model.values() if media)


PrefixIndexMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestPrefixIndexMachine = PrefixIndexMachine.TestCase
