"""Load or recompute: grants follow what was measured, a tier that stops paying is probed and returns."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.media import Medium
from kvstrata.policies.payoff import BUDGET_FACTOR, BUDGET_MIN_S, PROBE_EVERY_S, DecayingFit, LoadOrRecompute, ProbeOutcome

H, D, R = Medium.HOST, Medium.DISK, Medium.REMOTE
BT = 32


def _measured(per_token_s: float = 50e-6, **per_block_s: float) -> LoadOrRecompute:
    """A decision whose prefill costs ``per_token_s`` a token and each tier ``per_block_s`` a block."""
    d = LoadOrRecompute(BT)
    for tokens in (32, 96, 200, 320, 64, 256):
        d.step_computed(tokens, 0.002 + tokens * per_token_s)
    for name, s in per_block_s.items():
        for blocks in (2, 5, 9):
            d.loaded(Medium[name.upper()], blocks, 1e-4 + blocks * s)
    return d


def test_the_fit_finds_the_line() -> None:
    fit = DecayingFit()
    for x in (10, 20, 40, 80):
        fit.add(x, 3 + 0.5 * x)
    assert fit.slope == pytest.approx(0.5)
    assert fit.predict(100) == pytest.approx(53)


def test_one_size_is_predicted_flat_above_and_in_proportion_below() -> None:
    fit = DecayingFit()
    fit.add(4, 2.0)
    fit.add(4, 2.0)
    assert fit.slope is None
    assert fit.predict(8) == pytest.approx(2.0)  # the slope unknown: all of it taken as fixed cost
    assert fit.predict(2) == pytest.approx(1.0)


def test_unmeasured_sides_are_granted_whole() -> None:
    d = LoadOrRecompute(BT)
    assert d.grant((H, H, D), 0.0).blocks == 3  # no prefill fit yet
    d = _measured(host=1e-5)
    assert d.grant((H, D), 0.0).blocks == 2  # the disk never measured: its first load measures it


def test_a_fast_tier_is_loaded_and_a_slow_one_recomputed() -> None:
    d = _measured(host=20e-6, disk=0.5)  # a block: 1.6 ms to compute, 20 us from host, 0.5 s from disk
    assert d.grant((H, H, H), 0.0).blocks == 3
    grant = d.grant((H, H, D, D), 0.0)
    assert grant.blocks == 2
    assert grant.declined == {D: 2}
    assert grant.load_s is not None and grant.saved_s is not None and grant.saved_s > grant.load_s
    assert d.grant((D, D), 0.0).blocks == 0


def test_a_model_with_windows_is_granted_its_whole_hit_or_none() -> None:
    d = _measured(host=20e-6, disk=0.5)
    assert d.grant((H, H, D, D), 0.0).blocks == 2
    assert d.grant((H, H, D, D), 0.0, whole=True).blocks == 0  # no window stored ends at block 2
    assert d.grant((H, H, H), 0.0, whole=True).blocks == 3
    assert d.grant((D, D), 0.0, whole=True).blocks == 0
    assert d.grant((D, D), PROBE_EVERY_S + 0.1, whole=True).blocks == 2  # a probe is the whole hit


def test_a_load_that_costs_about_what_it_saves_is_declined() -> None:
    per_token = 50e-6
    d = _measured(per_token, host=BT * per_token)  # a block loads as slowly as it computes
    assert d.grant((H,) * 4, 0.0).blocks == 0


def test_a_tier_that_stopped_paying_is_probed_with_one_block_and_returns() -> None:
    d = _measured(host=1e-5, disk=0.5)
    assert d.grant((D, D, D), 0.0).blocks == 0
    assert d.grant((D, D, D), PROBE_EVERY_S / 2).blocks == 0
    probe = d.grant((D, D, D), PROBE_EVERY_S + 0.1)
    assert (probe.blocks, probe.probe) == (1, D)
    assert d.grant((D, D, D), PROBE_EVERY_S + 0.2).blocks == 0  # one probe per period
    d.loaded(D, 1, 0.5)  # still slow: the next probe waits twice as long
    assert d.grant((D, D, D), 2 * PROBE_EVERY_S + 0.2).blocks == 0
    assert d.grant((D, D, D), 3 * PROBE_EVERY_S + 0.2).blocks == 1
    d.loaded(D, 1, 2e-5)  # the probe was fast: the cap was lifted
    assert d.grant((D, D, D), 3 * PROBE_EVERY_S + 0.3).blocks == 3


def test_a_tier_whose_loads_are_declined_is_not_written_until_its_probe_is_due() -> None:
    """Nothing written down to a declined tier would be loaded before its next probe; from when
    the probe is due until it is taken, it is written again (so there is something to probe)."""
    d = _measured(host=1e-5, disk=0.5)
    assert d.declined_tiers(0.0) == frozenset()  # nothing declined yet
    assert d.grant((H, D, D), 0.0).blocks == 1  # the host block pays, the disk's do not
    assert d.declined_tiers(0.1) == {D}
    assert d.declined_tiers(PROBE_EVERY_S + 0.1) == frozenset()  # the probe is due: write again
    assert d.grant((D, D), PROBE_EVERY_S + 0.1).probe is D
    assert d.declined_tiers(PROBE_EVERY_S + 0.2) == {D}  # taken: the next in twice the wait
    assert d.declined_tiers(3 * PROBE_EVERY_S + 0.2) == frozenset()
    d.loaded(D, 1, 2e-5)  # the probe was fast
    assert d.grant((D, D), 3 * PROBE_EVERY_S + 0.3).blocks == 2
    assert d.declined_tiers(3 * PROBE_EVERY_S + 0.4) == frozenset()  # granted: written as before
    d.failed(D, 2, 0.5, now_s=100.0)  # a load given up past its budget: declined from then, no request needed
    assert d.declined_tiers(100.1) == {D} and d.declined_tiers(100.0 + PROBE_EVERY_S + 0.1) == frozenset()


def test_failures_count_as_loads_that_saved_nothing() -> None:
    d = _measured(host=1e-5, remote=1e-5)
    assert d.grant((R, R), 0.0).blocks == 2
    for _ in range(2):
        d.failed(R, 2, 0.25)  # a pool that times out at its budget
    assert d.grant((R, R), 1.0).blocks == 0
    assert d.grant((H, R), 1.0).blocks == 1


@given(st.lists(st.sampled_from([H, D, R]), min_size=1, max_size=40),
       st.floats(1e-7, 1e-3), st.floats(1e-7, 1.0), st.floats(1e-7, 1.0), st.floats(1e-7, 1.0))
def test_a_grant_never_costs_more_than_it_saves(tiers, per_token, host, disk, remote) -> None:
    d = _measured(per_token, host=host, disk=disk, remote=remote)
    grant = d.grant(tuple(tiers), 0.0)
    assert 0 <= grant.blocks <= len(tiers)
    if grant.blocks and grant.probe is None:
        assert grant.saved_s >= d.margin * grant.load_s
    assert sum(grant.declined.values()) == len(tiers) - grant.blocks


def test_a_grant_s_budget_is_the_prefill_of_its_blocks_once_the_prefill_is_measured() -> None:
    assert LoadOrRecompute(BT).grant((H, H, D), 0.0).budget_s is None  # nothing measured: no budget
    d = _measured(host=1e-5)  # 50 us a token: a block's prefill takes 1.6 ms
    first = d.grant((H, D, D), 0.0)  # the disk never measured: granted whole, within twice the prefill of its tokens
    assert first.blocks == 3 and first.budget_s == pytest.approx(BUDGET_FACTOR * 3 * BT * 50e-6, rel=0.02)
    assert d.grant((H,) * 8, 0.0).budget_s == pytest.approx(BUDGET_FACTOR * 8 * BT * 50e-6, rel=0.02)
    assert d.grant((H,), 0.0).budget_s == BUDGET_MIN_S  # a stalled thread is not a slow tier
    # the first load ran out its budget and failed: the disk no longer pays, its probe carries a budget too
    d.failed(D, 3, first.budget_s)
    assert d.grant((D, D), 1.0).blocks == 0
    probe = d.grant((D, D), 1.0 + PROBE_EVERY_S)
    assert probe.probe is D and probe.blocks == 1 and probe.budget_s == BUDGET_MIN_S
    assert LoadOrRecompute(BT, budget_factor=None).grant((H,), 0.0).budget_s is None  # no budget asked for


def test_a_load_from_below_memory_runs_off_the_step_where_it_would_hold_others_up_longer_than_a_step() -> None:
    # steps of 2 ms + 50 us a token (a block's prefill: 1.6 ms), their moving average about 10 ms
    d = _measured(host=20e-6, disk=1e-4)
    assert d.step_s is not None and 0.005 < d.step_s < 0.02
    assert not d.grant((H, H, H), 0.0, running=8).off_step  # from memory: a copy, in the step
    short = d.grant((H, D, D), 0.0, running=8)
    assert short.blocks == 3 and not short.off_step  # 0.3 ms, eight others: 2.4 ms in all, under a step
    slow = _measured(host=20e-6, disk=1e-3)  # 1 ms a disk block: 40 of them pay (40 ms against 64 ms)
    long = slow.grant((H,) + (D,) * 40, 0.0, running=1)
    assert long.blocks == 41 and long.load_s > slow.step_s and long.off_step  # one other held up 4 steps
    assert not slow.grant((H,) + (D,) * 40, 0.0).off_step  # alone: it holds nobody up, in the step
    assert slow.grant((D,) * 5, 0.0, running=4).off_step  # 5 ms x 4 others: two steps' worth
    assert not slow.grant((D,) * 5, 0.0, running=1).off_step  # 5 ms x 1: half a step
    # a disk never measured may be slow: off the step when others run, in it alone
    assert LoadOrRecompute(BT).grant((H, D), 0.0, running=1).off_step
    assert not LoadOrRecompute(BT).grant((H, D), 0.0).off_step
    assert not LoadOrRecompute(BT).grant((H, H), 0.0, running=1).off_step


def test_a_failing_tier_is_not_loaded_again_until_a_load_from_it_arrives() -> None:
    """What a capped disk did under vLLM: its first load, 4 blocks, ran out its budget; one size
    seen, the fit priced an 11-block load at the same time and granted it, and a hit that also
    held an unmeasured tier was granted whole. A failing tier now ends the grant at its first block."""
    d = _measured(host=1e-5)
    first = d.grant((D,) * 4, 0.0)
    assert first.blocks == 4 and first.budget_s is not None  # never measured: its load measures it
    d.failed(D, 4, first.budget_s, now_s=0.01)
    assert d.grant((D,) * 11, 1.0).blocks == 0  # the failure is no price for 11 blocks
    mixed = d.grant((Medium.DEVICE,) * 3 + (D,) * 4, 1.5)  # the device tier never measured
    assert (mixed.blocks, mixed.declined) == (3, {D: 4})
    assert d.grant((H, H, D, D), 2.0).blocks == 2
    assert d.grant((H, H, D, D), 2.0, whole=True).blocks == 0  # all or none: none
    probe = d.grant((H, H, D, D), PROBE_EVERY_S + 0.1)  # due: the blocks that pay and one from the disk
    assert (probe.blocks, probe.probe, probe.declined) == (3, D, {D: 1})
    assert d.grant((D, D), PROBE_EVERY_S + 0.2).blocks == 0  # one probe per period
    d.loaded(D, 3, 2e-4)  # it arrived, fast: the disk is judged by its loads again
    assert d.grant((D,) * 6, PROBE_EVERY_S + 0.3).blocks == 6


def test_a_failed_probe_keeps_the_tier_failing_and_doubles_its_wait() -> None:
    d = _measured(host=1e-5)
    d.failed(D, 2, 0.01, now_s=0.0)
    assert d.grant((D, D), PROBE_EVERY_S + 0.1).probe is D
    d.failed(D, 1, 0.01, now_s=PROBE_EVERY_S + 0.2)
    assert d.grant((D, D), 2 * PROBE_EVERY_S + 0.2).blocks == 0
    assert d.grant((D, D), 3 * PROBE_EVERY_S + 0.2).probe is D


def test_a_grant_has_a_budget_from_the_first_measured_step() -> None:
    """Before the prefill's line is trusted (a few steps of spread sizes), the steps' seconds per
    token so far set the budget: a load from a tier never measured (a server just restarted on a
    capped disk) is bounded from the second request on, not waited for however long it takes."""
    d = LoadOrRecompute(BT)
    assert d.grant((D,) * 10, 0.0).budget_s is None  # no step yet: nothing to judge by
    d.step_computed(320, 0.032)  # one step: 0.1 ms a token
    assert d.per_token_s is None
    assert d.grant((D,) * 10, 0.0).budget_s == pytest.approx(BUDGET_FACTOR * 10 * BT * 1e-4)


def test_a_failed_copy_from_memory_is_a_slow_sample_not_a_failing_tier() -> None:
    """A load from the host that fails (a stalled thread past the budget's floor, blocks evicted
    since the lookup) is a hiccup: the host's next hits are judged by its measured loads."""
    d = _measured(host=1e-5)
    d.failed(H, 4, 0.006, now_s=0.0)
    assert d.grant((H,) * 8, 0.1).blocks == 8


def test_a_failing_tier_is_probed_off_the_step_when_its_probe_falls_due() -> None:
    """No request need hit a failing tier for it to be probed: when the probe falls due the
    workers read one of its blocks, and the read's time judges it like a load's."""
    d = _measured(host=1e-5)
    d.failed(D, 4, 0.02, now_s=0.0)
    assert d.probes_due(1.0) == ()
    assert d.probes_due(PROBE_EVERY_S + 0.1) == (D,)
    assert d.probes_due(PROBE_EVERY_S + 0.2) == ()  # taken: the next in twice the wait
    assert d.grant((D, D), PROBE_EVERY_S + 0.3).blocks == 0  # nor a request's probe meanwhile
    assert d.declined_tiers(PROBE_EVERY_S + 0.3) == {D}  # and nothing written to it
    assert d.probed(D, 0.06, True, now_s=PROBE_EVERY_S + 0.4) is ProbeOutcome.SLOW  # past a block's budget: still failing
    assert d.probes_due(2 * PROBE_EVERY_S + 0.2) == ()
    assert d.probes_due(3 * PROBE_EVERY_S + 0.2) == (D,)
    assert d.probed(D, 2e-5, True, now_s=3 * PROBE_EVERY_S + 0.25) is ProbeOutcome.PAYS  # the cap was lifted
    assert d.declined_tiers(3 * PROBE_EVERY_S + 0.26) == frozenset()  # written to again at once
    assert d.probes_due(10 * PROBE_EVERY_S) == ()
    assert d.grant((D,) * 6, 3 * PROBE_EVERY_S + 0.3).blocks == 6


def test_a_failing_tier_with_no_block_to_probe_is_written_again() -> None:
    d = _measured(host=1e-5)
    d.failed(D, 4, 0.02, now_s=0.0)
    assert d.probes_due(PROBE_EVERY_S + 0.1) == (D,)
    assert d.unprobed(D) is ProbeOutcome.EMPTY  # every block it held is on the host too, or it held none
    assert d.declined_tiers(PROBE_EVERY_S + 0.2) == frozenset()  # written again: something to probe next time
    assert d.grant((D, D), PROBE_EVERY_S + 0.3).blocks == 0  # still failing: not loaded from
    assert d.probes_due(3 * PROBE_EVERY_S + 0.2) == (D,)
    assert d.probed(D, 0.06, False, now_s=3 * PROBE_EVERY_S + 0.3) is ProbeOutcome.FAILED  # the read failed
    assert d.declined_tiers(3 * PROBE_EVERY_S + 0.4) == {D}
