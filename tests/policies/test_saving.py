"""Save or skip: stores go on while their blocks come back, stop (but for samples) when they never do."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.policies.saving import CONFIDENCE_REQUESTS, MATURE_HORIZONS, SAMPLE_EVERY, SaveOrSkip

BT = 32
PER_TOKEN_S = 100e-6  # a block's prefill: 3.2 ms
COST_S = 0.5e-3  # a stored block's CPU


LAG = 6  # requests between a store and the request its blocks serve


def _run(policy: SaveOrSkip, requests: int, blocks: int = 8, hits_per_request: int = 0,
         repeated: int | None = None, cost_s: float = COST_S) -> list[bool]:
    """``requests`` requests of ``blocks`` new blocks each; each is admitted with
    ``hits_per_request`` blocks from kvstrata if the request ``LAG`` before it was stored (what
    is not stored never comes back) and, unless ``repeated`` is None, observed with its first
    ``repeated`` blocks seen before; the workers report each store's cost (``cost_s`` a block).
    The decisions, in order."""
    decisions: list[bool] = []
    for n in range(requests):
        if n >= LAG and decisions[n - LAG]:
            policy.granted(hits_per_request)
        if repeated is not None:
            policy.observed(blocks, repeated)
        store = policy.save(PER_TOKEN_S)
        decisions.append(store)
        policy.computed(blocks, stored=store)
        if store:
            policy.stored_cost(blocks, blocks * cost_s)
    return decisions


def test_every_request_is_stored_until_cost_and_prefill_are_measured() -> None:
    policy = SaveOrSkip(BT, horizon_blocks=16)
    for _ in range(200):
        assert policy.save(None)
        policy.computed(8, stored=True)
    assert policy.pays(None)
    fresh = SaveOrSkip(BT, horizon_blocks=16)
    for _ in range(200):  # the prefill measured, the cost not
        assert fresh.save(PER_TOKEN_S)
        fresh.computed(8, stored=True)


def test_stores_that_never_come_back_stop_but_for_one_request_in_sample_every() -> None:
    policy = SaveOrSkip(BT, horizon_blocks=16)
    decisions = _run(policy, 600)
    # the rule of three: no hit in about 3 * saving / cost matured requests bounds reuse below cost / saving
    judged = CONFIDENCE_REQUESTS * PER_TOKEN_S * BT / COST_S
    matured_after = MATURE_HORIZONS * 16 // 8
    first_skip = decisions.index(False)
    assert judged < first_skip <= matured_after + 1.5 * judged  # the evidence decays a little meanwhile
    tail = decisions[-SAMPLE_EVERY * 20:]
    assert sum(tail) == 20  # one in SAMPLE_EVERY, still measuring
    assert policy.skipped_blocks == 8 * decisions.count(False)


def test_stores_whose_blocks_come_back_go_on() -> None:
    policy = SaveOrSkip(BT, horizon_blocks=16)
    assert all(_run(policy, 600, hits_per_request=2))  # 1 block in 4 comes back: 0.8 ms saved per 0.5 ms spent
    assert policy.skipped_blocks == 0


def test_reuse_too_rare_for_the_cost_stops_stores() -> None:
    policy = SaveOrSkip(BT, horizon_blocks=16)
    decisions = _run(policy, 2000, blocks=32, hits_per_request=1)  # 1 in 32: 0.1 ms saved per 0.5 ms
    assert decisions[-SAMPLE_EVERY * 10:].count(True) == 10


def test_nothing_is_judged_before_the_engine_could_have_dropped_a_stored_block() -> None:
    policy = SaveOrSkip(BT, horizon_blocks=100_000)  # vLLM holds 100K blocks: no store has matured
    assert all(_run(policy, 1000))


def test_stores_resume_when_their_blocks_come_back_again() -> None:
    policy = SaveOrSkip(BT, horizon_blocks=16)
    assert not all(_run(policy, 400))
    resumed = _run(policy, 3000, hits_per_request=8)  # now every stored block is asked for again
    assert all(resumed[-200:])
    assert not all(resumed[:LAG])  # it took a sample's hits to see it


def test_a_costlier_store_is_judged_sooner() -> None:
    def first_skip(cost_s: float) -> int:
        policy = SaveOrSkip(BT, horizon_blocks=16)
        for n in range(2000):
            store = policy.save(PER_TOKEN_S)
            if not store:
                return n
            policy.computed(8, stored=True)
            policy.stored_cost(8, 8 * cost_s)
        return 2000

    assert first_skip(4 * COST_S) < first_skip(COST_S) < first_skip(COST_S / 4)


def test_the_cpu_of_a_store_may_come_a_report_after_its_blocks() -> None:
    policy = SaveOrSkip(BT, horizon_blocks=16)
    policy.stored_cost(8, 0.0)
    assert policy.cost_per_block_s is None
    policy.stored_cost(0, 8 * COST_S)
    assert policy.cost_per_block_s == pytest.approx(COST_S)


def test_bad_arguments_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="block_tokens > 0"):
        SaveOrSkip(0, 16)


@given(st.integers(1, 64), st.integers(1, 32), st.integers(0, 512))
def test_when_every_stored_block_comes_back_and_saves_more_than_it_costs_nothing_is_skipped(
        blocks: int, extra_hits: int, horizon: int) -> None:
    policy = SaveOrSkip(BT, horizon_blocks=horizon)
    assert all(_run(policy, 300, blocks=blocks, hits_per_request=blocks + extra_hits))


def test_prompts_that_share_nothing_stop_stores_long_before_any_store_could_come_back() -> None:
    horizon = 16
    policy = SaveOrSkip(BT, horizon_blocks=horizon)
    decisions = _run(policy, 400, repeated=0)
    ratio = PER_TOKEN_S * BT / COST_S  # a hit saves this many stores' cost
    warm = MATURE_HORIZONS * horizon // 8  # requests before the engine could have dropped a block
    first_skip = decisions.index(False)
    assert first_skip <= warm + ratio + 1  # the rule of succession: 1 / (n + 1) of repeats at most
    assert first_skip < CONFIDENCE_REQUESTS * ratio  # the hits alone would wait for the rule of three
    assert decisions[-SAMPLE_EVERY * 10:].count(True) == 10


def test_prompts_that_repeat_keep_the_stores_until_their_hits_say_otherwise() -> None:
    with_repeats = _run(SaveOrSkip(BT, horizon_blocks=16), 400, repeated=6)
    without = _run(SaveOrSkip(BT, horizon_blocks=16), 400, repeated=0)
    # repeats bound reuse at 3/4: the store pays by them; only the hits (none came) stop it, later
    assert with_repeats.index(False) > without.index(False)


def test_the_repeats_follow_a_change_of_workload() -> None:
    policy = SaveOrSkip(BT, horizon_blocks=16)
    assert not all(_run(policy, 200, repeated=0))
    low = policy.repeat_share()
    _run(policy, 64, repeated=8)  # 64 prompts that repeat whole
    assert low is not None and low < 0.01 < 0.2 < policy.repeat_share()


def test_a_store_far_cheaper_than_a_hit_still_stops_when_nothing_repeats() -> None:
    policy = SaveOrSkip(BT, horizon_blocks=16)
    cheap = COST_S / 50  # a hit saves 320 stores' cost: beyond what the hits' half-life could ever rule out
    decisions = _run(policy, 1500, repeated=0, cost_s=cheap)
    assert decisions[-SAMPLE_EVERY * 10:].count(True) == 10


def test_no_repeat_is_judged_before_the_engine_could_have_dropped_a_block() -> None:
    policy = SaveOrSkip(BT, horizon_blocks=100_000)
    assert all(_run(policy, 1000, repeated=0))
    assert policy.repeat_share() is None
