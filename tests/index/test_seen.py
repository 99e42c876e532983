"""Seen blocks: a prompt's repeats are its leading blocks an earlier prompt had; the record is bounded."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.index.seen import SeenBlocks


def test_a_prompts_repeats_are_its_leading_blocks_seen_before() -> None:
    seen = SeenBlocks(100)
    assert seen.observe([b"a", b"b", b"c"]) == 0
    assert seen.observe([b"a", b"b", b"x", b"y"]) == 2  # a chain of hashes: the shared prefix
    assert seen.observe([b"a", b"b", b"x", b"y", b"z"]) == 4
    assert seen.observe([b"q", b"b"]) == 0  # a block after a new one is not a repeat of a prefix
    assert seen.observe([]) == 0


def test_past_its_capacity_the_least_recently_seen_block_is_forgotten() -> None:
    seen = SeenBlocks(4)
    seen.observe([1, 2])
    seen.observe([3, 4])
    seen.observe([1])  # seen again: now the most recent
    seen.observe([5])  # 2, the least recently seen, goes
    assert len(seen) == 4
    assert seen.observe([1]) == 1
    assert seen.observe([2]) == 0


def test_bad_capacity_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="capacity > 0"):
        SeenBlocks(0)


@given(st.lists(st.lists(st.integers(0, 5), max_size=6), max_size=30), st.integers(1, 64))
def test_never_more_repeats_than_blocks_nor_more_blocks_kept_than_capacity(prompts: list[list[int]],
                                                                           capacity: int) -> None:
    seen = SeenBlocks(capacity)
    for prompt in prompts:
        assert 0 <= seen.observe(prompt) <= len(prompt)
        assert len(seen) <= capacity
