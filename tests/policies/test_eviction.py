"""Eviction policies: the order in which keys leave, in scripted scenarios."""

from __future__ import annotations

import pytest

from kvstrata.policies.eviction import LFU, LRU, Eviction

A, B, C, D = (bytes([i]) * 16 for i in range(4))


def order(policy) -> list[bytes]:
    return list(policy.order())


@pytest.mark.parametrize("make", [LRU, LFU])
def test_an_empty_policy_orders_nothing(make):
    assert order(make()) == []


@pytest.mark.parametrize("make", [LRU, LFU])
def test_insertion_order_without_accesses(make):
    policy = make()
    for key in (C, A, B):
        policy.inserted(key)
    assert order(policy) == [C, A, B]


# --- LRU -------------------------------------------------------------------------------------------


def test_lru_access_moves_a_key_to_the_back():
    policy = LRU()
    for key in (A, B, C):
        policy.inserted(key)
    policy.accessed(A)
    assert order(policy) == [B, C, A]
    policy.accessed(C)
    policy.accessed(B)
    assert order(policy) == [A, C, B]


def test_lru_counts_recency_not_frequency():
    policy = LRU()
    for key in (A, B):
        policy.inserted(key)
    for _ in range(5):
        policy.accessed(A)
    policy.accessed(B)
    assert order(policy) == [A, B]


def test_lru_reinsertion_counts_as_most_recent():
    policy = LRU()
    for key in (A, B, C):
        policy.inserted(key)
    policy.inserted(A)
    assert order(policy) == [B, C, A]


def test_lru_batch_insert_within_a_capacity_pushes_out_the_least_recent():
    policy = LRU()
    assert policy.inserted_all([A, B], capacity=2) == []
    # C pushes out A; A comes back and pushes out B: an earlier key of the same call can go too.
    assert policy.inserted_all([C, A], capacity=2) == [A, B]
    assert order(policy) == [C, A] and len(policy) == 2 and B not in policy
    assert policy.inserted_all([D, C, B]) == []  # no capacity: nothing leaves
    assert order(policy) == [A, D, C, B]


def test_lru_batch_access_refreshes_present_keys_only():
    policy = LRU()
    policy.inserted_all([A, B, C])
    policy.accessed_all([D, A, B])
    assert order(policy) == [C, A, B]


# --- LFU -------------------------------------------------------------------------------------------


def test_lfu_fewest_uses_first():
    policy = LFU()
    for key in (A, B, C):
        policy.inserted(key)
    for key, uses in ((A, 2), (B, 0), (C, 1)):
        for _ in range(uses):
            policy.accessed(key)
    assert order(policy) == [B, C, A]


def test_lfu_ties_go_to_the_least_recently_used():
    policy = LFU()
    for key in (A, B, C, D):
        policy.inserted(key)
    policy.accessed(C)
    policy.accessed(A)  # A and C both at 2 uses; C got there first
    assert order(policy) == [B, D, C, A]
    policy.accessed(B)  # B joins the 2-use tie as its most recent member
    assert order(policy) == [D, C, A, B]


def test_lfu_a_frequent_key_outlasts_a_recent_one():
    policy = LFU()
    policy.inserted(A)
    for _ in range(3):
        policy.accessed(A)
    policy.inserted(B)
    policy.accessed(B)
    assert order(policy) == [B, A]


def test_lfu_reinsertion_resets_the_count():
    policy = LFU()
    for key in (A, B):
        policy.inserted(key)
    for _ in range(3):
        policy.accessed(A)
    policy.inserted(A)  # stored again: a fresh block, one use
    assert order(policy) == [B, A]
    policy.accessed(B)
    assert order(policy) == [A, B]


# --- both ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [LRU, LFU])
def test_removed_keys_leave_the_order(make):
    policy = make()
    for key in (A, B, C):
        policy.inserted(key)
    policy.accessed(B)
    policy.removed(B)
    assert order(policy) == [A, C]
    policy.removed(A)
    policy.removed(C)
    assert order(policy) == []


@pytest.mark.parametrize("make", [LRU, LFU])
def test_a_removed_key_that_comes_back_starts_afresh(make):
    policy = make()
    for key in (A, B):
        policy.inserted(key)
    policy.accessed(A)
    policy.accessed(A)
    policy.removed(A)
    policy.inserted(A)
    assert order(policy) == [B, A]  # newest (LRU) / tied at one use, newer (LFU)


@pytest.mark.parametrize("make", [LRU, LFU])
def test_accessing_or_removing_an_unknown_key_is_a_no_op(make):
    policy = make()
    policy.inserted(A)
    policy.accessed(B)
    policy.removed(C)
    assert order(policy) == [A]
    policy.inserted(B)
    assert order(policy) == [A, B]  # B was not counted or placed by the stray access


@pytest.mark.parametrize("make", [LRU, LFU])
def test_order_is_a_snapshot_safe_to_iterate_while_evicting(make):
    policy = make()
    for key in (A, B, C):
        policy.inserted(key)
    seen = []
    for key in policy.order():
        seen.append(key)
        policy.removed(key)
    assert seen == [A, B, C]
    assert order(policy) == []


@pytest.mark.parametrize(("choice", "cls"), [(Eviction.LRU, LRU), (Eviction.LFU, LFU)])
def test_eviction_enum_makes_the_right_class(choice, cls):
    policy = choice.make()
    assert type(policy) is cls
    assert policy is not choice.make()  # a fresh policy per table


def test_eviction_enum_parses_its_values():
    assert Eviction("lru") is Eviction.LRU
    assert Eviction("lfu") is Eviction.LFU
    with pytest.raises(ValueError):
        Eviction("fifo")
