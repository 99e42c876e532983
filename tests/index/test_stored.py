"""What a scheduler knows it stored: the first blocks of prompts sent to store, bounded, most recent kept."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.index.stored import StoredFirstBlocks


def test_only_a_prompt_whose_first_block_was_stored_may_hold_blocks():
    firsts = StoredFirstBlocks(block_tokens=4, capacity=8)
    firsts.stored([1, 2, 3, 4, 5, 6])
    assert firsts.may_hold([1, 2, 3, 4])  # the same first block: its later blocks may be anything
    assert firsts.may_hold([1, 2, 3, 4, 9, 9, 9, 9])
    assert not firsts.may_hold([1, 2, 3, 5, 5, 6])  # one token of the first block differs
    assert not firsts.may_hold([1, 2, 3])  # no full block: nothing is cached
    firsts.stored([7, 7])  # a prompt shorter than a block stores nothing
    assert len(firsts) == 1


def test_past_capacity_the_least_recently_stored_or_asked_is_forgotten():
    firsts = StoredFirstBlocks(block_tokens=2, capacity=2)
    a, b, c = [1, 1], [2, 2], [3, 3]
    firsts.stored(a)
    firsts.stored(b)
    assert firsts.may_hold(a)  # asked for: now the most recent
    firsts.stored(c)  # b goes
    assert (firsts.may_hold(a), firsts.may_hold(b), firsts.may_hold(c)) == (True, False, True)
    assert len(firsts) == 2


@pytest.mark.parametrize(("block_tokens", "capacity"), [(0, 4), (4, 0), (-1, 1)])
def test_a_bad_size_is_refused(block_tokens, capacity):
    with pytest.raises(ValueError, match="StoredFirstBlocks needs block_tokens > 0 and capacity > 0"):
        StoredFirstBlocks(block_tokens, capacity)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=3, max_size=6), min_size=1, max_size=30),
       st.integers(1, 8))
def test_never_a_miss_for_a_first_block_among_the_last_stored(prompts, capacity):
    """No false miss: the first blocks of the last ``capacity`` distinct prompts stored all may hold."""
    firsts = StoredFirstBlocks(block_tokens=3, capacity=capacity)
    recent: list[tuple[int, ...]] = []
    for p in prompts:
        firsts.stored(p)
        head = tuple(p[:3])
        if head in recent:
            recent.remove(head)
        recent.append(head)
    for head in recent[-capacity:]:
        assert firsts.may_hold(list(head))
    assert len(firsts) <= capacity
