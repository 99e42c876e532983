"""The load-or-recompute decision: load when loading is much faster, recompute when computing
is, otherwise a split whose compute and load meet within one block."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.plan.host import PathFit, PrefillFit
from kvstrata.plan.recompute import PlanKind, choose, path_load_time

BYTES_PER_TOKEN = 2048

blocks_ = st.integers(1, 256)
block_tokens_ = st.sampled_from([16, 32, 64, 256])
tails = st.integers(1, 512)
prefills = st.builds(
    PrefillFit,
    latency_s=st.floats(0.0, 0.01),
    tokens_per_s=st.floats(1e3, 1e6),
    attn_s=st.floats(0.0, 1e-7),
)
paths = st.builds(PathFit, latency_s=st.floats(0.0, 1e-3), gbps=st.floats(1e-4, 1e3))


@settings(max_examples=300, deadline=None)
@given(blocks_, block_tokens_, tails, prefills, paths)
def test_the_plan_is_never_predicted_slower_than_either_pure_plan(blocks, block, tail, prefill, path):
    plan = choose(blocks * block, tail, block, BYTES_PER_TOKEN, path, prefill)
    assert plan.predicted_s <= min(plan.load_only_s, plan.recompute_s) + 1e-12
    assert plan.hit_tokens == blocks * block and plan.tail_tokens == tail
    assert plan.compute_tokens % block == 0 and 0 <= plan.compute_tokens <= plan.hit_tokens


@settings(max_examples=300, deadline=None)
@given(blocks_, block_tokens_, tails, prefills, paths)
def test_a_split_balances_compute_and_load_within_one_block(blocks, block, tail, prefill, path):
    plan = choose(blocks * block, tail, block, BYTES_PER_TOKEN, path, prefill)
    if plan.kind is not PlanKind.SPLIT:
        return
    k, n = plan.compute_tokens, plan.hit_tokens
    assert 0 < k < n
    load = path_load_time(path, block * BYTES_PER_TOKEN)

    def gap(tokens: int) -> float:  # compute [0, tokens) minus load [tokens, n): grows with tokens
        return prefill.seconds(tokens, 0) - load((n - tokens) // block)

    # Where compute and load meet lies within one block of k on either side.
    assert gap(k - block) <= 1e-12 and gap(k + block) >= -1e-12
    assert plan.predicted_s == pytest.approx(max(plan.compute_s, plan.load_s) + prefill.seconds(tail, n))


@settings(max_examples=200, deadline=None)
@given(blocks_, block_tokens_, tails, prefills)
def test_load_only_when_loading_is_much_faster(blocks, block, tail, prefill):
    fast = PathFit(0.0, 1e6)  # a PB/s link: loading costs ~nothing
    plan = choose(blocks * block, tail, block, BYTES_PER_TOKEN, fast, prefill)
    assert plan.kind is PlanKind.LOAD and plan.compute_tokens == 0 and plan.loaded_tokens == blocks * block


@settings(max_examples=200, deadline=None)
@given(blocks_, block_tokens_, tails, prefills)
def test_recompute_only_when_computing_is_much_faster(blocks, block, tail, prefill):
    slow = PathFit(1.0, 1e-6)  # a second per block
    plan = choose(blocks * block, tail, block, BYTES_PER_TOKEN, slow, prefill)
    if prefill.seconds(blocks * block + tail) >= 1.0:
        return  # the prompt takes seconds to compute too: not "much faster"
    assert plan.kind is PlanKind.RECOMPUTE and plan.compute_tokens == plan.hit_tokens and plan.loaded_tokens == 0


def test_a_concrete_split():
    # 100k tokens/s, no latency, no attention term; load 10 ms per 32-token block: computing a
    # block takes 0.32 ms, so computing k and loading the rest meet near k = n * 10 / 10.32.
    prefill = PrefillFit(0.0, 1e5)
    plan = choose(32 * 100, 1, 32, BYTES_PER_TOKEN, lambda b: 0.01 * b, prefill, split_margin=0)
    assert plan.kind is PlanKind.SPLIT
    assert abs(plan.compute_tokens - 3200 * 10 / 10.32) <= 32
    assert plan.predicted_s < min(plan.load_only_s, plan.recompute_s)
    # Only 3% better than recomputing: with the default margin the split is not worth its risk.
    assert choose(32 * 100, 1, 32, BYTES_PER_TOKEN, lambda b: 0.01 * b, prefill).kind is PlanKind.RECOMPUTE


def test_a_split_that_halves_the_wait_is_chosen_with_the_default_margin():
    # Loading everything takes as long as computing everything: the split meets halfway.
    prefill = PrefillFit(0.0, 1e5)
    plan = choose(32 * 100, 1, 32, BYTES_PER_TOKEN, lambda b: 0.032 / 100 * b, prefill)
    assert plan.kind is PlanKind.SPLIT
    assert plan.predicted_s == pytest.approx(min(plan.load_only_s, plan.recompute_s) / 2, rel=0.05)


def test_nothing_cached_is_the_load_plan_with_nothing_to_load():
    plan = choose(0, 100, 32, BYTES_PER_TOKEN, PathFit(0.0, 1.0), PrefillFit(0.0, 1e4))
    assert plan.kind is PlanKind.LOAD and plan.loaded_tokens == 0 and plan.load_s == 0.0


@pytest.mark.parametrize(
    ("hit", "tail", "block", "match"),
    [(33, 1, 32, "multiple of block_tokens"), (-32, 1, 32, "multiple of block_tokens"),
     (64, 0, 32, "tail_tokens must be >= 1"), (64, 1, 0, "block_tokens must be positive")],
)
def test_bad_sizes_are_named(hit, tail, block, match):
    with pytest.raises(ValueError, match=match):
        choose(hit, tail, block, BYTES_PER_TOKEN, PathFit(0.0, 1.0), PrefillFit(0.0, 1e4))


def test_a_bad_load_time_is_named():
    with pytest.raises(ValueError, match="load time of 2 blocks"):
        choose(64, 1, 32, BYTES_PER_TOKEN, lambda b: float("nan"), PrefillFit(0.0, 1e4))


def test_the_relative_fit_recovers_a_prefill_dominated_by_attention():
    from kvstrata.plan.host import fit_prefill

    truth = PrefillFit(0.002, 80_000.0, 3e-8)
    points = [(n, c, truth.seconds(n, c)) for n, c in [(128, 0), (512, 0), (1024, 0), (4096, 0), (64, 4096)]]
    fit = fit_prefill(points)
    assert fit.tokens_per_s == pytest.approx(80_000.0, rel=1e-6)
    assert fit.latency_s == pytest.approx(0.002, rel=1e-6) and fit.attn_s == pytest.approx(3e-8, rel=1e-6)
