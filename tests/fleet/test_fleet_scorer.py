"""Routing by predicted TTFT against fixed tier weights and round robin: scripted fleets with the
expected winner, the arithmetic behind each, and the connector's own decision as the model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.fleet.cost import RestoreLine, ServerCost
from kvstrata.fleet.events import Batch, Stored
from kvstrata.fleet.index import FleetIndex, UnknownServer
from kvstrata.fleet.scorer import (DYNAMO, LLM_D, OverlapWeights, PredictedTTFT, Request, RoundRobin, ServerState,
                                   predict)
from kvstrata.media import Medium
from kvstrata.plan.calpaths import CalPath
from kvstrata.plan.host import HostCalibration, PathFit, PrefillFit
from kvstrata.plan.loadtime import calibrated_load_time
from kvstrata.policies.payoff import LoadOrRecompute
from kvstrata.slo import Slo

D, H, S, P = Medium.DEVICE, Medium.HOST, Medium.DISK, Medium.REMOTE
B = 16  # tokens per block
PER_TOKEN_S = 1e-3  # 16 ms to compute a block
LINES = {H: RestoreLine(0.001, 0.0005), S: RestoreLine(0.002, 0.004), P: RestoreLine(0.003, 0.002)}
COST = ServerCost(B, PER_TOKEN_S, LINES)
PREFIX = tuple(range(100, 108))  # vLLM's hashes of a prompt's 8 full blocks
REQUEST = Request(PREFIX, 8 * B + 10)  # and 10 tokens more
TTFT = PredictedTTFT()


def fleet(*servers: str, **held: tuple[tuple[tuple[int, ...], Medium], ...]) -> FleetIndex:
    index = FleetIndex(servers)
    for server, stored in held.items():
        index.apply(server, Batch(0.0, tuple(Stored(hashes, medium) for hashes, medium in stored)))
    return index


def test_the_prefix_on_host_beats_it_only_in_a_slower_pool_where_fixed_weights_tie():
    index = fleet("b", "a", a=((PREFIX, H), (PREFIX, P)))  # a's host copy, and the pool every server reaches
    servers = [ServerState("b", COST), ServerState("a", COST)]
    a, b = predict(REQUEST, servers[1], index), predict(REQUEST, servers[0], index)
    assert a.restore.loaded_blocks == b.restore.loaded_blocks == 8
    assert a.ttft_s == pytest.approx(0.001 + 8 * 0.0005 + 10 * PER_TOKEN_S)  # 15 ms
    assert b.ttft_s == pytest.approx(0.003 + 8 * 0.002 + 10 * PER_TOKEN_S)  # 29 ms
    assert TTFT.choose(REQUEST, servers, index).server == "a"
    # a medium-only reader credits the pool as host memory: a tie, to the first listed
    assert DYNAMO.choose(REQUEST, servers, index).server == "b"
    assert LLM_D.choose(REQUEST, servers, index).server == "b"


def test_a_loaded_queue_outweighs_a_cached_prefix_when_the_math_says_so():
    index = fleet("cached", "cold", cached=((PREFIX, H),))
    cold = ServerState("cold", COST)
    cold_s = REQUEST.prompt_tokens * PER_TOKEN_S  # 138 ms: it computes the whole prompt
    cached_s = 0.001 + 8 * 0.0005 + 10 * PER_TOKEN_S  # 15 ms
    busy = ServerState("cached", COST, queued_tokens=2000)  # 2 s of prefill ahead
    assert predict(REQUEST, busy, index).ttft_s == pytest.approx(2.0 + cached_s)
    assert TTFT.choose(REQUEST, [busy, cold], index).server == "cold"
    short = ServerState("cached", COST, queued_tokens=100)  # 100 ms ahead: 115 ms < 138 ms
    assert predict(REQUEST, short, index).ttft_s == pytest.approx(0.1 + cached_s)
    assert 0.1 + cached_s < cold_s
    assert TTFT.choose(REQUEST, [cold, short], index).server == "cached"
    queued_even = ServerState("cached", COST, queued_tokens=130)  # 145 ms > 138 ms
    assert TTFT.choose(REQUEST, [queued_even, cold], index).server == "cold"


def test_the_pool_is_reachable_by_every_server_even_one_that_never_published():
    index = fleet("a", "silent", a=((PREFIX, P),))
    p = predict(REQUEST, ServerState("silent", COST), index)
    assert (p.restore.reached_blocks, p.restore.loaded_blocks) == (8, 8)
    assert p.restore.load_s == pytest.approx(0.003 + 8 * 0.002)


def test_a_tier_too_slow_to_pay_is_not_loaded_and_the_prompt_is_computed():
    slow_disk = ServerCost(B, PER_TOKEN_S, {S: RestoreLine(0.05, 0.05)})  # 50 ms a block > 16 ms to compute it
    index = fleet("a", a=((PREFIX, S),))
    p = predict(REQUEST, ServerState("a", slow_disk), index)
    assert (p.restore.reached_blocks, p.restore.loaded_blocks, p.restore.load_s) == (8, 0, 0.0)
    assert p.ttft_s == pytest.approx(REQUEST.prompt_tokens * PER_TOKEN_S)


def test_device_blocks_cost_nothing_and_a_hit_never_reaches_the_last_token():
    index = fleet("a", a=((PREFIX, D),))
    p = predict(Request(PREFIX, 8 * B), ServerState("a", COST), index)  # exactly 8 blocks
    assert (p.restore.reached_blocks, p.restore.loaded_blocks, p.restore.load_s) == (7, 7, 0.0)
    assert p.restore.prefill_tokens == B and p.ttft_s == pytest.approx(B * PER_TOKEN_S)


def test_a_tier_the_server_cannot_price_ends_what_it_can_use():
    no_disk = ServerCost(B, PER_TOKEN_S, {H: LINES[H]})
    index = fleet("a", a=((PREFIX[:2], H), (PREFIX[2:3], S), (PREFIX[3:], H)))
    assert index.reach("a", PREFIX) == (H, H, S, H, H, H, H, H)
    assert predict(REQUEST, ServerState("a", no_disk), index).restore.reached_blocks == 2


def test_ties_go_to_the_first_listed_and_round_robin_takes_turns():
    index = fleet("a", "b", "c")
    servers = [ServerState(s, COST) for s in ("b", "a", "c")]
    assert TTFT.choose(REQUEST, servers, index).server == "b"
    rr = RoundRobin()
    assert [rr.choose(REQUEST, servers, index).server for _ in range(4)] == ["b", "a", "c", "b"]


SLO = Slo(ttft_s=0.2, tpot_s=0.05)  # headroom 0.6: a server decoding at more than 30 ms a token is full


def test_a_tpot_target_sends_the_request_from_a_crowded_prefix_holder_to_a_server_that_keeps_pace():
    index = fleet("a", "b", a=((PREFIX, H),))  # a holds the prefix: its TTFT is the least (15 ms vs 138)
    crowded = [ServerState("a", COST, tpot_s=0.031), ServerState("b", COST, tpot_s=0.010)]
    assert TTFT.choose(REQUEST, crowded, index).server == "a"  # no target: TTFT alone
    guarded = PredictedTTFT(SLO)
    choice = guarded.choose(REQUEST, crowded, index)
    assert choice.server == "b"
    assert [s.predicted_s for s in choice.scores] == pytest.approx([0.015, 0.138])  # the predictions unchanged
    # a's decode within the headroom (or idle): a takes it again
    for pace in (0.029, None):
        assert guarded.choose(REQUEST, [ServerState("a", COST, tpot_s=pace), crowded[1]], index).server == "a"


def test_with_no_server_in_the_headroom_the_target_itself_then_the_least_ttft_decide():
    index = fleet("a", "b", a=((PREFIX, H),))
    guarded = PredictedTTFT(SLO)
    # both past the headroom: a server still under the target wins over one past it
    past = [ServerState("a", COST, tpot_s=0.06), ServerState("b", COST, tpot_s=0.04)]
    assert guarded.choose(REQUEST, past, index).server == "b"
    # both past the target: the least TTFT (the request misses anyway; its first token soonest)
    both = [ServerState("a", COST, tpot_s=0.2), ServerState("b", COST, tpot_s=0.06)]
    assert guarded.choose(REQUEST, both, index).server == "a"
    # a server whose predicted TTFT misses its target is no candidate while one meets both
    queued = [ServerState("a", COST, queued_tokens=200, tpot_s=0.01), ServerState("b", COST, tpot_s=0.02)]
    assert predict(REQUEST, queued[0], index).ttft_s > SLO.ttft_s >= predict(REQUEST, queued[1], index).ttft_s
    assert guarded.choose(REQUEST, queued, index).server == "b"


def test_a_pace_or_headroom_that_cannot_be_is_refused():
    with pytest.raises(ValueError, match="tpot_s must be finite and >= 0 s"):
        ServerState("a", COST, tpot_s=-0.01)
    with pytest.raises(ValueError, match="headroom must be in"):
        PredictedTTFT(SLO, headroom=1.5)


def test_every_policy_scores_every_server_in_order():
    index = fleet("a", "b", a=((PREFIX[:4], H),))
    servers = [ServerState("a", COST), ServerState("b", COST, queued_tokens=32)]
    for policy in (TTFT, DYNAMO, LLM_D, RoundRobin()):
        choice = policy.choose(REQUEST, servers, index)
        assert [s.server for s in choice.scores] == ["a", "b"]
        assert choice.server == min(choice.scores, key=lambda s: s.cost).server
    dynamo = DYNAMO.choose(REQUEST, servers, index)
    assert [s.cost for s in dynamo.scores] == pytest.approx([138 / 16 - 4 * 0.75, 138 / 16 + 2])
    assert [s.reached_blocks for s in dynamo.scores] == [4, 0]


def test_an_unknown_server_or_none_is_one_clear_error_for_every_policy():
    index = fleet("a", "b")
    for policy in (TTFT, DYNAMO, LLM_D, RoundRobin()):
        with pytest.raises(UnknownServer, match=r"unknown server 'z' \(known: a, b\)"):
            policy.choose(REQUEST, [ServerState("a", COST), ServerState("z", COST)], index)
        with pytest.raises(ValueError, match="no servers"):
            policy.choose(REQUEST, [], index)


def test_costs_refuse_what_cannot_be_a_cost():
    with pytest.raises(ValueError, match="per_token_s"):
        ServerCost(B, 0.0, {})
    with pytest.raises(ValueError, match="per_block_s"):
        RestoreLine(0.0, -1.0)
    with pytest.raises(ValueError, match="queued_tokens"):
        ServerState("a", COST, queued_tokens=-1)
    with pytest.raises(ValueError, match="not measured yet"):
        ServerCost.from_decision(LoadOrRecompute(B))


def _measured_decision() -> LoadOrRecompute:
    """A connector's decision that has measured its prefill (1 ms a token), host loads (1 ms +
    0.5 ms a block) and disk loads (4 ms + 50 ms a block: slower than computing)."""
    decision = LoadOrRecompute(B)
    for tokens in (16, 64, 128, 256):
        decision.step_computed(tokens, 0.002 + PER_TOKEN_S * tokens)
    decision.loaded(H, 1, 0.0015)
    decision.loaded(H, 4, 0.003)
    decision.loaded(S, 1, 0.054)
    decision.loaded(S, 2, 0.104)
    return decision


def test_the_cost_is_the_connectors_own_measurements():
    cost = ServerCost.from_decision(_measured_decision())
    assert cost.per_token_s == pytest.approx(PER_TOKEN_S)
    assert cost.restore[H].fixed_s == pytest.approx(0.001) and cost.restore[H].per_block_s == pytest.approx(0.0005)
    assert cost.restore[S].fixed_s == pytest.approx(0.004) and cost.restore[S].per_block_s == pytest.approx(0.05)


def _warming_decision() -> LoadOrRecompute:
    """A connector that has measured its prefill and one host load of one block, slow (20 ms):
    its fit has no slope yet, so it takes larger loads to cost the same (not 20 ms a block)."""
    decision = LoadOrRecompute(B)
    for tokens in (16, 64, 128, 256):
        decision.step_computed(tokens, 0.002 + PER_TOKEN_S * tokens)
    decision.loaded(H, 1, 0.020)
    return decision


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from((H, S)), min_size=1, max_size=10), st.booleans())
def test_the_blocks_predicted_loaded_are_what_the_connector_grants(tiers, warming):
    decision = _warming_decision() if warming else _measured_decision()
    if warming:
        tiers = [H] * len(tiers)  # the disk is unmeasured there: the connector would probe it
    cost = ServerCost.from_decision(decision)
    plan = cost.plan(tuple(tiers), len(tiers) * B + 1)
    assert plan.loaded_blocks == decision.grant(tuple(tiers), now_s=0.0).blocks


def test_the_cost_from_a_calibration_is_the_planners_load_time():
    calibration = HostCalibration(
        "test", "cpu", 2,
        {CalPath.MEMCPY_1T: PathFit(0.0, 10.0), CalPath.DISK_READ_COLD: PathFit(0.0, 1.0),
         CalPath.DISK_READ_WARM: PathFit(0.0, 4.0)},
        prefill={"m": PrefillFit(0.0, 1000.0)},
    )
    block_bytes = 1_000_000
    cost = ServerCost.from_calibration(calibration, "m", B, block_bytes)
    assert cost.per_token_s == pytest.approx(1e-3)
    assert P not in cost.restore  # the pool's paths were not calibrated here
    media = (H, S, S)
    planner = calibrated_load_time(calibration, media, block_bytes, workers=1)
    assert cost.load_s({H: 1, S: 2}) == pytest.approx(planner(3))
    with pytest.raises(ValueError, match="no prefill calibrated for 'other'"):
        ServerCost.from_calibration(calibration, "other", B, block_bytes)


def test_fixed_weights_refuse_a_negative_weight():
    with pytest.raises(ValueError, match="weights must be >= 0"):
        OverlapWeights("bad", {H: -0.5})
