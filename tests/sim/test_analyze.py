"""The trace replay: exact against a naive LRU written here, monotone in cache size, fast."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.sim.analyze import analyze, hit_tokens
from kvstrata.sim.synthetic import Mix, SyntheticConfig, TraceKind, generate
from kvstrata.sim.trace import Request
from kvstrata.sim.traceio import read_trace

REAL_TRACE = (
    Path(__file__).resolve().parents[2].parent
    / "shared/data/traces/mooncake_synthetic_trace.jsonl"
)
needs_real_trace = pytest.mark.skipif(
    not REAL_TRACE.is_file(), reason=f"the Mooncake trace is not at {REAL_TRACE}"
)


def naive_hit_tokens(requests: list[Request], cache_tokens: float) -> int:
    """The replay spelled out on a plain list: index 0 least recent, the end most recent."""
    if cache_tokens == float("inf"):
        return naive_unlimited_hit_tokens(requests)
    capacity = cache_tokens // 512
    cache: list[int] = []
    hits = 0
    for r in sorted(requests, key=lambda r: r.timestamp_ms):
        leading = 0
        while leading < len(r.hash_ids) and r.hash_ids[leading] in cache:
            leading += 1
        hits += min(512 * leading, r.input_length)
        for block in r.hash_ids:
            if block in cache:
                cache.remove(block)
            cache.append(block)
            while len(cache) > capacity:
                cache.pop(0)
    return hits


def naive_unlimited_hit_tokens(requests: list[Request]) -> int:
    """With no capacity nothing leaves, so recency is moot: a block is present once seen."""
    seen: set[int] = set()
    hits = 0
    for r in sorted(requests, key=lambda r: r.timestamp_ms):
        present = [block in seen for block in r.hash_ids] + [False]
        hits += min(512 * present.index(False), r.input_length)
        seen |= set(r.hash_ids)
    return hits


@pytest.fixture(scope="module")
def real_trace() -> list[Request]:
    if not REAL_TRACE.is_file():
        pytest.skip(f"the Mooncake trace is not at {REAL_TRACE}")
    return read_trace(REAL_TRACE)


@needs_real_trace
@pytest.mark.parametrize("cache_tokens", [0, 511, 512, 5000, 65536, 262144])
def test_real_trace_matches_the_naive_replay(real_trace, cache_tokens):
    assert hit_tokens(real_trace, cache_tokens) == naive_hit_tokens(
        real_trace, cache_tokens
    )


@needs_real_trace
def test_real_trace_matches_the_naive_replay_at_1m_and_unlimited(real_trace):
    assert hit_tokens(real_trace, 1 << 20) == naive_hit_tokens(
        real_trace, 1 << 20
    )  # ~2 s naive
    assert hit_tokens(real_trace, None) == naive_hit_tokens(real_trace, float("inf"))


@needs_real_trace
def test_real_trace_figures(real_trace):
    # Speed is a benchmark's business, not a test's: no timing here.
    result = analyze(real_trace, [65536, 262144, 1 << 20, None])
    assert result.requests == 3993
    assert result.input_tokens == sum(r.input_length for r in real_trace)
    assert result.unique_blocks == len({b for r in real_trace for b in r.hash_ids})
    ratios = [c.hit_ratio for c in result.capacities]
    assert ratios == sorted(ratios) and 0 < ratios[0] and ratios[-1] < 1


@pytest.mark.parametrize("kind", list(TraceKind))
@pytest.mark.parametrize("cache_tokens", [1024, 20000, 100000, None])
def test_generated_traces_match_the_naive_replay(kind, cache_tokens):
    trace = generate(SyntheticConfig(requests=300, seed=11, rate=5.0, mix=Mix.of(kind)))
    naive = naive_hit_tokens(
        trace, float("inf") if cache_tokens is None else cache_tokens
    )
    assert hit_tokens(trace, cache_tokens) == naive


def test_a_scripted_replay():
    # A: blocks 1,2 (1000 tokens); B shares block 1 then diverges; C repeats A after B evicted 2?
    a = Request(0, 1000, 1, (1, 2))
    b = Request(1, 1100, 1, (1, 3, 4))
    c = Request(2, 1000, 1, (1, 2))
    # cache of 3 blocks: after A [1,2]; B hits 512 (block 1), cache -> [2,1,3,4] -> evict 2 -> [1,3,4]
    # C: block 1 present, block 2 gone -> 512 hit tokens.
    assert hit_tokens([a, b, c], 3 * 512) == 0 + 512 + 512
    # unlimited: C hits both blocks, capped at its 1000 input tokens.
    assert hit_tokens([a, b, c], None) == 0 + 512 + 1000
    # requests are replayed in timestamp order, not list order
    assert analyze([c, b, a], [3 * 512]).capacities[0].hit_tokens == 1024


def test_a_leading_miss_hides_later_present_blocks():
    assert (
        hit_tokens([Request(0, 1024, 1, (1, 2)), Request(1, 1024, 1, (9, 2))], None)
        == 0
    )


def test_json_shape_and_empty_trace():
    result = analyze([], [0, None])
    assert result.to_json() == {
        "requests": 0,
        "mean_input": 0.0,
        "mean_output": 0.0,
        "unique_blocks": 0,
        "capacities": [
            {"cache_tokens": 0, "hit_ratio": 0.0},
            {"cache_tokens": "inf", "hit_ratio": 0.0},
        ],
    }
    with pytest.raises(ValueError, match="non-negative"):
        hit_tokens([], -1)


@st.composite
def small_traces(draw) -> list[Request]:
    n = draw(st.integers(0, 25))
    out = []
    for _ in range(n):
        ids = draw(st.lists(st.integers(0, 12), max_size=6, unique=True))
        input_length = draw(
            st.integers(
                max(0, 512 * (len(ids) - 1) + 1) if ids else 0, 512 * len(ids) + 700
            )
        )
        out.append(
            Request(
                draw(st.integers(0, 50)),
                input_length,
                draw(st.integers(0, 9)),
                tuple(ids),
            )
        )
    return out


@settings(max_examples=200, deadline=None)
@given(small_traces(), st.lists(st.integers(0, 10 * 512), min_size=2, max_size=5))
def test_a_larger_cache_never_lowers_the_hit_ratio(trace, sizes):
    sizes = sorted(sizes)
    result = analyze(trace, [*sizes, None])
    hits = [c.hit_tokens for c in result.capacities]
    assert hits == sorted(hits)  # monotone, and unlimited (last) >= every finite size
    assert all(c.hit_tokens <= result.input_tokens for c in result.capacities)
    assert [
        hit_tokens(sorted(trace, key=lambda r: r.timestamp_ms), s) for s in sizes
    ] == [naive_hit_tokens(trace, s) for s in sizes]
