"""bench serve's workload as data: a trace's requests as conversations of token ids, each turn
extending the last, and the schedule (pure: no server, no network)."""

from __future__ import annotations

import re

import pytest

from kvstrata.calibrate.serving.workload import (
    FIRST_TOKEN_ID,
    ServeWorkload,
    WorkloadKind,
    alternate,
    arrival_s,
    hit_blocks,
    plan_conversations,
    plan_no_reuse,
    replay_plans,
    round_plans,
    workload_of,
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


def full_block_prefixes(prompt: tuple[int, ...], block_tokens: int) -> set[tuple[int, ...]]:
    """Every prefix of ``prompt`` that ends on a block boundary: what a chained block key names."""
    return {prompt[: b * block_tokens] for b in range(1, len(prompt) // block_tokens + 1)}


def test_no_reuse_prompts_share_no_block_across_turns_conversations_rounds_and_servers():
    # a two-letter vocabulary and 8-token blocks: random draws alone would likely collide (256
    # possible first blocks for 2 rounds x 2 servers x 3 conversations x 3 turns = 36 prompts), so
    # the tag (6 binary digits) is what keeps the prompts apart
    w = ServeWorkload(conversations=3, turns=3, max_tokens=2, user_tokens=3, block_tokens=8, max_model_len=64,
                      kind=WorkloadKind.NO_REUSE)
    rounds = round_plans(trace(), w, FIRST_TOKEN_ID + 2, rounds=2)
    assert [len(servers) for servers in rounds] == [2, 2]
    prompts = [plan.prompt(t, []) for servers in rounds for plans in servers for plan in plans
               for t in range(plan.turns)]
    assert len(prompts) == 36 and all(len(p) >= w.block_tokens for p in prompts)
    seen: set[tuple[int, ...]] = set()
    for prompt in prompts:
        blocks = full_block_prefixes(prompt, w.block_tokens)
        assert not blocks & seen, "two requests of the run share a prefix block"
        seen |= blocks
    assert all(FIRST_TOKEN_ID <= t < FIRST_TOKEN_ID + 2 for p in prompts for t in p)


def test_no_reuse_has_the_conversations_shapes_and_is_seeded():
    shaped = ServeWorkload(conversations=3, turns=3, max_tokens=8, user_tokens=16, max_model_len=512)
    fresh = ServeWorkload(conversations=3, turns=3, max_tokens=8, user_tokens=16, max_model_len=512,
                          kind=WorkloadKind.NO_REUSE)
    twins = plan_conversations(trace(), shaped, VOCAB)
    (plans,) = plan_no_reuse(trace(), fresh, VOCAB, streams=1)
    answers = [(1,) * 8, (2,) * 8]
    for twin, plan in zip(twins, plans, strict=True):
        assert plan.index == twin.index and plan.turns == twin.turns == 3
        assert [len(plan.prompt(t, answers)) for t in range(3)] == [len(twin.prompt(t, answers)) for t in range(3)]
        assert plan.prompt(1, answers)[: len(plan.opener)] != plan.opener  # a later turn does not extend the last
    assert plan_no_reuse(trace(), fresh, VOCAB, streams=1) == (plans,)
    same = round_plans(trace(), shaped, VOCAB, rounds=2)  # conversations: both servers of a round, the same
    assert same[0][0] == same[0][1] == twins and same[1][0] != twins


def test_no_reuse_that_a_block_cannot_tell_apart_is_one_line():
    w = ServeWorkload(conversations=3, turns=3, max_tokens=2, user_tokens=3, block_tokens=2, max_model_len=64,
                      kind=WorkloadKind.NO_REUSE)
    with pytest.raises(ValueError, match="36 new prompts cannot be told apart within a 2-token block") as info:
        round_plans(trace(), w, FIRST_TOKEN_ID + 2, rounds=2)  # 36 numbers need 6 binary digits
    assert "\n" not in str(info.value)


def test_the_workload_from_a_reports_json():
    assert workload_of({"conversations": 2, "kind": "no-reuse"}) == ServeWorkload(conversations=2,
                                                                                kind=WorkloadKind.NO_REUSE)
    assert workload_of({"turns": 2}).kind is WorkloadKind.CONVERSATIONS  # a report from before kinds
    with pytest.raises(ValueError, match="workload kind must be one of conversations, no-reuse, got 'x'"):
        workload_of({"kind": "x"})


def test_the_traffic_kind_shapes_the_generated_trace_and_reads_back_from_json():
    from kvstrata.calibrate.serving.workload import generated_trace
    from kvstrata.sim.synthetic import TraceKind

    agents = generated_trace(ServeWorkload(conversations=6, traffic=TraceKind.AGENT))
    firsts = {r.hash_ids[0] for r in agents}
    assert len(agents) == 6 and len(firsts) < 6  # agents loop over a long prefix: openers share leading blocks
    assert generated_trace(ServeWorkload(conversations=6)) != agents  # the mix is another trace
    assert workload_of({"turns": 2}).traffic is TraceKind.MIX  # a report from before traffic kinds
    assert workload_of({"traffic": "agent"}).traffic is TraceKind.AGENT
    with pytest.raises(ValueError, match="workload traffic must be one of chat, system, agent, mix, got 'rag'"):
        workload_of({"traffic": "rag"})
