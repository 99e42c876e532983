"""Parsing Mooncake-format trace lines, reading and writing trace files, and the generator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.sim.synthetic import Mix, SyntheticConfig, TraceKind, generate
from kvstrata.sim.trace import (
    BLOCK_TOKENS,
    Request,
    TraceFormatError,
    parse_line,
    sort_by_time,
)
from kvstrata.sim.traceio import read_trace, write_trace

REAL_TRACE = (
    Path(__file__).resolve().parents[2].parent
    / "shared/data/traces/mooncake_synthetic_trace.jsonl"
)


def line(**fields) -> str:
    doc = {
        "timestamp": 10,
        "input_length": 1100,
        "output_length": 7,
        "hash_ids": [4, 5, 6],
    }
    doc.update(fields)
    return json.dumps({k: v for k, v in doc.items() if v is not ...})


def test_a_good_line_becomes_a_request():
    assert parse_line(line(), 3) == Request(10, 1100, 7, (4, 5, 6))


@pytest.mark.parametrize(
    "text, field, why",
    [
        ("{not json", None, "not valid JSON"),
        ("[1, 2]", None, "expected a JSON object"),
        (line(timestamp=...), "timestamp", "missing"),
        (line(input_length=...), "input_length", "missing"),
        (line(output_length=...), "output_length", "missing"),
        (line(hash_ids=...), "hash_ids", "missing"),
        (line(input_length=-1, hash_ids=[]), "input_length", "non-negative"),
        (line(output_length=-3), "output_length", "non-negative"),
        (line(timestamp=-1), "timestamp", "non-negative"),
        (line(timestamp=1.5), "timestamp", "integer"),
        (line(input_length="1100"), "input_length", "integer"),
        (line(output_length=True), "output_length", "integer"),
        (line(hash_ids="4,5"), "hash_ids", "list"),
        (line(hash_ids=[4, "5"]), "hash_ids", "element 1"),
        (line(hash_ids=[4, 5.0]), "hash_ids", "element 1"),
        (
            line(hash_ids=[1, 2, 3, 4]),
            "hash_ids",
            "4 ids but input_length 1100 fills at most 3",
        ),
        (line(hash_ids=[1, 2, 1]), "hash_ids", "id 1 repeats"),
    ],
)
def test_a_bad_line_names_its_line_and_field(text, field, why):
    with pytest.raises(TraceFormatError) as info:
        parse_line(text, 42)
    message = str(info.value)
    assert message.startswith("line 42")
    if field:
        assert f"field {field!r}" in message
    assert why in message


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            line(hash_ids=[]),
            Request(10, 1100, 7, ()),
        ),  # fewer ids than blocks: tail never hits
        (
            line(input_length=1024, hash_ids=[1, 2]),
            Request(10, 1024, 7, (1, 2)),
        ),  # exact fit
        (line(input_length=0, hash_ids=[]), Request(10, 0, 7, ())),
        (
            line(output_length=0, hash_ids=[-3]),
            Request(10, 1100, 0, (-3,)),
        ),  # ids are opaque
        (line(extra="ignored"), Request(10, 1100, 7, (4, 5, 6))),
    ],
)
def test_allowed_lines(text, expected):
    assert parse_line(text, 1) == expected


def test_request_checks_its_own_invariants():
    with pytest.raises(ValueError, match="fills at most 1"):
        Request(0, BLOCK_TOKENS, 1, (1, 2))
    with pytest.raises(ValueError, match="non-negative"):
        Request(-1, 10, 1, ())


def test_sort_by_time_is_stable():
    a, b, c = Request(5, 1, 1, (1,)), Request(2, 1, 1, (2,)), Request(5, 1, 1, (3,))
    assert sort_by_time([a, b, c]) == [b, a, c]


def test_read_trace_names_the_file_and_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(line() + "\n\n" + line(hash_ids=[1, "x"]) + "\n")
    with pytest.raises(TraceFormatError, match=r"t\.jsonl'.*line 3: field 'hash_ids'"):
        read_trace(path)
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_trace(tmp_path / "absent.jsonl")


def test_write_then_read_round_trips_in_mooncake_field_order(tmp_path):
    requests = [Request(0, 1100, 7, (4, 5, 6)), Request(3, 10, 0, ())]
    path = tmp_path / "t.jsonl"
    assert write_trace(path, requests) == 2
    assert read_trace(path) == requests
    first = path.read_text().splitlines()[0]
    assert list(json.loads(first)) == [
        "timestamp",
        "input_length",
        "output_length",
        "hash_ids",
    ]


@pytest.mark.skipif(
    not REAL_TRACE.is_file(), reason=f"the Mooncake trace is not at {REAL_TRACE}"
)
def test_the_real_trace_parses():
    requests = read_trace(REAL_TRACE)
    assert len(requests) == 3993
    assert requests == sort_by_time(requests)


# --- the synthetic generator -------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(TraceKind))
def test_generator_is_deterministic_per_seed_and_round_trips(kind, tmp_path):
    config = SyntheticConfig(requests=300, seed=7, mix=Mix.of(kind))
    trace = generate(config)
    assert trace == generate(config)
    assert trace != generate(SyntheticConfig(requests=300, seed=8, mix=Mix.of(kind)))
    assert len(trace) == 300
    assert [r.timestamp_ms for r in trace] == sorted(r.timestamp_ms for r in trace)
    path = tmp_path / "g.jsonl"
    write_trace(path, trace)
    assert read_trace(path) == trace


def _chain_consistent(trace: list[Request]) -> bool:
    """A chained id must always stand for the same prefix: same position, same predecessor."""
    seen: dict[int, tuple[int, int | None]] = {}
    for r in trace:
        for k, block_id in enumerate(r.hash_ids):
            key = (k, r.hash_ids[k - 1] if k else None)
            if seen.setdefault(block_id, key) != key:
                return False
    return True


def test_chat_turns_extend_the_previous_turn():
    trace = generate(SyntheticConfig(requests=400, seed=1, mix=Mix.of(TraceKind.CHAT)))
    assert _chain_consistent(trace)
    # every continuing turn starts with the full blocks of an earlier request
    by_first: dict[int, list[Request]] = {}
    extended = 0
    for r in trace:
        earlier = by_first.get(r.hash_ids[0], []) if r.hash_ids else []
        if any(
            r.hash_ids[: e.input_length // BLOCK_TOKENS]
            == e.hash_ids[: e.input_length // BLOCK_TOKENS]
            and r.input_length > e.input_length
            for e in earlier
        ):
            extended += 1
        if r.hash_ids:
            by_first.setdefault(r.hash_ids[0], []).append(r)
    assert extended > 100


def test_system_prompts_are_shared_across_users():
    trace = generate(
        SyntheticConfig(
            requests=400, seed=2, mix=Mix.of(TraceKind.SYSTEM), system_prompts=4
        )
    )
    assert _chain_consistent(trace)
    firsts = {r.hash_ids[0] for r in trace}
    assert (
        len(firsts) <= 4
    )  # every prompt is at least one full block, so starts with a prompt id


def test_agent_loops_repeat_long_prefixes_with_short_steps():
    trace = generate(SyntheticConfig(requests=400, seed=3, mix=Mix.of(TraceKind.AGENT)))
    assert _chain_consistent(trace)
    assert sum(r.input_length for r in trace) / len(trace) > 4000
    firsts = [r.hash_ids[0] for r in trace]
    assert len(set(firsts)) < len(firsts) / 2  # loops take several steps each
    assert max(firsts.count(f) for f in set(firsts)) >= 5


def test_generator_rejects_bad_parameters():
    with pytest.raises(ValueError, match="rate"):
        SyntheticConfig(rate=0)
    with pytest.raises(ValueError, match="requests"):
        SyntheticConfig(requests=-1)
    with pytest.raises(ValueError, match="mix"):
        Mix(0, 0, 0)
