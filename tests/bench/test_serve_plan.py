"""bench serve's workload as data: a trace's requests as conversations of token ids, each turn
extending the last, and the schedule (pure: no server, no network)."""

from __future__ import annotations

import re

import pytest

from kvstrata.bench.serve_plan import (
    FIRST_TOKEN_ID,
    ServeWorkload,
    alternate,
    arrival_s,
    hit_blocks,
    plan_conversations,
    replay_plans,
)
from kvstrata.sim.trace import Request

VOCAB = 4096


def trace() -> list[Request]:
    # request 1 shares request 0's first two blocks (a system prompt); request 2 shares nothing
    return [
        Request(0, 4 * 512, 10, (0, 1, 2, 3)),
        Request(5, 3 * 512 + 100, 10, (0, 1, 7, 8)),
        Request(9, 40_000, 10, tuple(range(100, 179))),
    ]


def test_trace_blocks_become_token_blocks_and_shared_ids_shared_prompts():
    w = ServeWorkload(conversations=3, turns=2, max_tokens=8, user_tokens=16, block_tokens=32, max_model_len=512)
    a, b, c = plan_conversations(trace(), w, VOCAB)
    assert len(a.opener) == 4 * 32 and len(b.opener) == 3 * 32 + 7  # 100 of 512 tokens -> ceil(100 / 16) = 7
    assert a.opener[:64] == b.opener[:64] and a.opener[64:96] != b.opener[64:96]  # two shared ids, then apart
    assert (a.shared_blocks, b.shared_blocks, c.shared_blocks) == (0, 2, 0)
    assert len(c.opener) == w.opener_max_tokens == (512 - 24 - 8) // 32 * 32  # 40K tokens cut to fit
    assert all(FIRST_TOKEN_ID <= t < VOCAB for p in (a, b, c) for t in p.opener + p.user[0])
    assert plan_conversations(trace(), w, VOCAB) == (a, b, c)  # seeded: the same every time
    fresh = plan_conversations(trace(), w, VOCAB, variant=1)
    assert [len(p.opener) for p in fresh] == [len(p.opener) for p in (a, b, c)]
    assert fresh[0].opener != a.opener  # same shapes, other tokens: no round finds another's KV


def test_each_turn_extends_the_last_with_its_answer_and_new_user_tokens():
    w = ServeWorkload(conversations=1, turns=3, max_tokens=4, user_tokens=5, max_model_len=512)
    (plan,) = plan_conversations(trace(), w, VOCAB)
    answers = [(1, 2, 3, 4), (5, 6, 7, 8)]
    second = plan.prompt(1, answers)
    third = plan.prompt(2, answers)
    assert second == plan.opener + answers[0] + plan.user[0]
    assert third[: len(second)] == second and third[len(second):] == answers[1] + plan.user[1]
    assert len(third) + w.max_tokens <= w.max_model_len
    assert replay_plans([second])[0].prompt(0, []) == second


def test_the_schedule_is_turn_by_turn_at_the_rate_and_turns_alternate_servers():
    assert [arrival_s(c, t, 3, 2.0) for t in range(2) for c in range(3)] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert [alternate(0, t) for t in range(4)] == [0, 1, 0, 1]
    assert [alternate(c, 0) for c in range(4)] == [0, 1, 0, 1]  # conversations staggered
    assert (hit_blocks(97, 32), hit_blocks(96, 32), hit_blocks(1, 32)) == (3, 2, 0)  # the last token is computed


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"rate_per_s": 0}, "rate must be a number of requests/s > 0, got 0"),
    ({"rate_per_s": -2.0}, "rate must be"),
    ({"conversations": 0}, "conversations must be a whole number >= 1, got 0"),
    ({"turns": 20}, "20 turns of 16 answer + 48 user tokens leave no room"),
])
def test_a_bad_workload_is_one_line_naming_it(kwargs, named):
    with pytest.raises(ValueError, match=re.escape(named)) as info:
        ServeWorkload(**kwargs)
    assert "\n" not in str(info.value)


def test_a_trace_shorter_than_the_conversations_is_refused():
    with pytest.raises(ValueError, match="the trace has 3 requests; 4 conversations need one each"):
        plan_conversations(trace(), ServeWorkload(conversations=4), VOCAB)
