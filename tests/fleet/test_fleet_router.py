"""The router's fleet state: queued prefill per server, in-flight limits, servers down and back."""

from __future__ import annotations

import pytest

from kvstrata.fleet.cost import ServerCost
from kvstrata.fleet.events import Batch, Stored
from kvstrata.fleet.router import Busy, Health, Limits, NoServer, Router, TicketState
from kvstrata.fleet.scorer import Policy, PredictedTTFT, Request, RoundRobin
from kvstrata.media import Medium
from kvstrata.slo import Slo

COST = ServerCost(block_tokens=16, per_token_s=1e-3, restore={})


def router(policy=None, limits=Limits(), names=("a", "b")) -> Router:
    return Router([(n, COST) for n in names], policy or PredictedTTFT(), limits)


def test_a_prompt_waits_in_its_servers_queue_until_its_first_token():
    r = router()
    t = r.pick(Request((), 100))
    assert t.server == "a" and t.predicted_ttft_s == pytest.approx(0.1)
    assert [(v.inflight, v.queued_tokens) for v in r.view()] == [(1, 100), (0, 0)]
    second = r.pick(Request((), 100))  # a's queue now costs 0.1 s more: b is predicted sooner
    assert second.server == "b"
    r.started(t)
    assert [(v.inflight, v.queued_tokens) for v in r.view()] == [(1, 0), (1, 100)]
    r.done(t)
    r.done(second)  # ended without a first token (not streamed, or failed): both counts drop
    r.done(second)  # idempotent
    assert [(v.inflight, v.queued_tokens) for v in r.view()] == [(0, 0), (0, 0)]
    assert second.state is TicketState.DONE
    with pytest.raises(ValueError, match="started twice or after it ended"):
        r.started(t)


def test_a_cached_prefix_draws_the_request_despite_a_shorter_queue_elsewhere():
    r = router()
    hashes = tuple(range(6))
    r.index.apply("b", Batch(0.0, (Stored(hashes, Medium.DEVICE),)))
    assert r.pick(Request(hashes, 6 * 16 + 1)).server == "b"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_pace_of_a_servers_streams_keeps_new_requests_off_it_past_the_tpot_target():
    clock = Clock()
    r = Router([(n, COST) for n in ("a", "b")], PredictedTTFT(Slo(ttft_s=1.0, tpot_s=0.05)), index=None, clock=clock)
    hashes = tuple(range(6))
    r.index.apply("a", Batch(0.0, (Stored(hashes, Medium.DEVICE),)))  # a holds the prefix
    prompt = Request(hashes, 6 * 16 + 1)
    first = r.pick(prompt)
    assert first.server == "a"
    r.started(first)
    for _ in range(10):  # its answer comes at 40 ms a token (one chunk of two tokens at a time)
        clock.now += 0.08
        r.tokens(first, 2)
    assert [v.tpot_s for v in r.view()] == [pytest.approx(0.04), None]
    assert r.pick(prompt).server == "b"  # past 0.6 x 50 ms: the prefix's next request goes to b
    r.done(first)
    assert [v.tpot_s for v in r.view()] == [None, None]  # nothing decodes on a: no pace to weigh
    assert r.pick(prompt).server == "a"
    with pytest.raises(ValueError, match="not decoding"):
        r.tokens(first, 1)


def test_limits_refuse_at_once_rather_than_queue():
    r = router(RoundRobin(), Limits(per_server=1, total=3))
    a, b = r.pick(Request((), 10)), r.pick(Request((), 10))
    assert {a.server, b.server} == {"a", "b"}
    with pytest.raises(Busy, match="every server up has 1 requests in flight"):
        r.pick(Request((), 10))
    r.done(a)
    assert r.pick(Request((), 10)).server == "a"
    small = router(RoundRobin(), Limits(per_server=5, total=1))
    small.pick(Request((), 10))
    with pytest.raises(Busy, match="the router's limit"):
        small.pick(Request((), 10))


def test_a_server_down_is_skipped_and_comes_back_holding_nothing():
    r = router(RoundRobin())
    r.index.apply("b", Batch(0.0, (Stored((1, 2), Medium.DEVICE), Stored((3,), Medium.REMOTE))))
    assert r.mark_down("b") and not r.mark_down("b")
    assert [r.pick(Request((), 1)).server for _ in range(3)] == ["a", "a", "a"]
    assert r.mark_up("b") and not r.mark_up("b")
    assert r.health("b") is Health.UP
    assert r.index.count("b", Medium.DEVICE) == 0  # its own blocks reset; the pool's stay
    assert r.index.count("b", Medium.REMOTE) == 1


def test_a_request_failed_everywhere_finds_no_server():
    r = router()
    with pytest.raises(NoServer, match=r"no server is up to take the request \(2 tried already\)"):
        r.pick(Request((), 1), exclude=("a", "b"))
    r.mark_down("a")
    r.mark_down("b")
    with pytest.raises(NoServer, match="no server is up to take the request$"):
        r.pick(Request((), 1))


def test_policies_by_name_and_bad_configurations_one_line():
    assert [p.make().name for p in Policy] == ["predicted-ttft", "dynamo", "llm-d", "round-robin"]
    with pytest.raises(ValueError, match=r"unknown routing policy 'fastest' \(known: predicted-ttft, dynamo"):
        Policy.parse("fastest")
    with pytest.raises(ValueError, match="no servers to route to"):
        Router([], RoundRobin())
    with pytest.raises(ValueError, match="listed twice"):
        Router([("a", COST), ("a", COST)], RoundRobin())
    with pytest.raises(ValueError, match="in-flight limits must be >= 1"):
        Limits(per_server=0)
