"""vLLM v1's prefix-caching block pool as the serving simulator keeps it: chained keys, the free
queue's eviction order, hits taken out of the queue, and what ``can_take`` counts."""

from __future__ import annotations

import pytest

from kvstrata.sim.serving.blocks import PrefixBlocks, chain_keys

BT = 4  # tokens per block


def _held(blocks: PrefixBlocks, prompt: tuple[int, ...]) -> list[int]:
    """A request's blocks for ``prompt``: fresh ones, each full block cached under its key."""
    keys = chain_keys(prompt, BT)
    taken = blocks.take(-(-len(prompt) // BT))
    for block, key in zip(taken, keys):
        blocks.cache(block, key)
    return taken


def _released(capacity: int, tokens: int) -> tuple[PrefixBlocks, list]:
    """``capacity`` blocks after one request held a prompt of ``tokens`` and let it go (its full
    blocks free and still cached), and the prompt's keys."""
    blocks = PrefixBlocks(capacity)
    prompt = tuple(range(tokens))
    blocks.release(_held(blocks, prompt))
    return blocks, chain_keys(prompt, BT)


# --- keys -----------------------------------------------------------------------------------------


def test_equal_prefixes_give_equal_keys_and_a_different_block_changes_every_key_after_it():
    a = chain_keys((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12), BT)
    b = chain_keys((1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0), BT)
    assert a[:2] == b[:2] and a[2] != b[2]
    # the same second block after another first block: a key names the whole prefix, not its block
    c = chain_keys((9, 9, 9, 9, 5, 6, 7, 8), BT)
    assert c[1] != a[1]
    assert len(set(a)) == 3


def test_a_partial_block_has_no_key():
    assert len(chain_keys(tuple(range(11)), BT)) == 2
    assert len(chain_keys(tuple(range(12)), BT)) == 3
    assert chain_keys((1, 2, 3), BT) == ()


def test_start_is_extended_not_recomputed():
    tokens = tuple(range(100, 120))
    assert chain_keys(tokens, BT, chain_keys(tokens[:8], BT)) == chain_keys(tokens, BT)
    # keys given as the start are kept as they are, and the rest chain from the last of them
    extended = chain_keys(tokens, BT, (111, 222))
    assert extended[:2] == (111, 222)
    assert extended[2:] != chain_keys(tokens, BT)[2:]
    assert chain_keys(tokens, BT, extended) == extended  # nothing left to chain


# --- the pool -------------------------------------------------------------------------------------


def test_usable_blocks_are_what_the_caller_gives_and_none_is_refused():
    blocks = PrefixBlocks(3)  # the caller leaves vLLM's null block out
    assert blocks.free == 3
    assert sorted(blocks.take(3)) == [0, 1, 2]
    assert blocks.free == 0
    with pytest.raises(ValueError, match="at least one"):
        PrefixBlocks(0)


def test_a_released_requests_tail_is_evicted_before_its_head():
    blocks = PrefixBlocks(4)
    prompt = tuple(range(12))  # three full blocks
    keys = chain_keys(prompt, BT)
    held = _held(blocks, prompt)
    assert held == [0, 1, 2]
    blocks.release(held)
    assert blocks.free == 4 and blocks.cached_run(keys) == 3
    assert blocks.take(1) == [3]  # never used: freed before the request's blocks were
    assert blocks.take(1) == [2]  # the prompt's last block goes first
    assert blocks.cached_run(keys) == 2
    assert blocks.take(1) == [1]
    assert blocks.cached_run(keys) == 1
    assert blocks.take(1) == [0]
    assert blocks.cached_run(keys) == 0


def test_a_freed_block_holding_no_cached_prefix_is_reused_first():
    blocks = PrefixBlocks(5)
    prompt = tuple(range(10))  # two full blocks and a partial one
    keys = chain_keys(prompt, BT)
    held = _held(blocks, prompt)
    assert held == [0, 1, 2]
    blocks.release(held)
    assert blocks.take(1) == [2]  # the partial block, before the blocks never used
    assert blocks.take(2) == [3, 4]
    assert blocks.cached_run(keys) == 2  # the cached ones wait at the tail
    assert blocks.take(1) == [1]


def test_the_least_recently_freed_request_is_evicted_first():
    blocks = PrefixBlocks(4)
    a, b = tuple(range(8)), tuple(range(50, 58))
    held_a, held_b = _held(blocks, a), _held(blocks, b)
    blocks.release(held_b)  # b freed first, a after it
    blocks.release(held_a)
    taken = blocks.take(2)
    assert taken == [held_b[1], held_b[0]]
    assert blocks.cached_run(chain_keys(b, BT)) == 0
    assert blocks.cached_run(chain_keys(a, BT)) == 2


def test_a_hit_block_leaves_the_free_queue_and_is_never_taken_while_held():
    blocks, keys = _released(4, 12)
    hit = blocks.hit(keys[:2])
    assert hit == [0, 1]
    assert blocks.free == 2
    rest = blocks.take(2)
    assert set(rest).isdisjoint(hit)
    assert blocks.cached_run(keys) == 2  # the held blocks keep their prefix
    with pytest.raises(ValueError, match="1 blocks asked for, 0 free"):
        blocks.take(1)


def test_a_block_two_requests_hit_is_freed_when_both_let_go():
    blocks, keys = _released(2, 8)
    first, second = blocks.hit(keys[:1]), blocks.hit(keys[:1])
    assert first == second == [0]
    blocks.release(first)
    assert blocks.free == 1  # still held by the second
    blocks.release(second)
    assert blocks.free == 2


def test_can_take_counts_the_hit_blocks_that_sit_in_the_free_queue():
    blocks, keys = _released(4, 12)
    cached = blocks.blocks_of(keys[:2])
    # four free, two of them the hit's own: two more fit, not three
    assert blocks.can_take(cached, 2)
    assert not blocks.can_take(cached, 3)
    assert blocks.can_take((), 4)
    # once another request holds them they are out of the queue and cost nothing more
    blocks.hit(keys[:2])
    assert blocks.free == 2
    assert blocks.can_take(cached, 2)
    assert not blocks.can_take(cached, 3)


def test_the_first_copy_of_a_key_is_kept():
    blocks = PrefixBlocks(4)
    prompt = tuple(range(4))
    key = chain_keys(prompt, BT)[0]
    one, two = blocks.take(2)
    blocks.cache(one, key)
    blocks.cache(two, key)  # a second request computed the same block: vLLM keeps the first
    assert blocks.blocks_of([key]) == [one]
    blocks.release([two])
    blocks.take(blocks.free)  # the copy's block reused: the key still names the first
    assert blocks.cached_run([key]) == 1
