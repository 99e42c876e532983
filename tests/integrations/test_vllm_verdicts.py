"""The scheduler's verdicts on steps that loaded and saved with TP > 1: a step's saves may be
stored once every load of it is known to have arrived on every rank, and never if one failed."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvstrata.integrations.vllm.verdicts import StepVerdicts  # noqa: E402


def test_a_step_is_judged_once_every_load_of_it_reported():
    v = StepVerdicts()
    v.track(1, ["a", "b"])
    v.reported("a", True)
    assert v.take() == {}  # b's outcome still unknown
    v.reported("b", True)
    assert v.take() == {1: True} and v.take() == {}  # each verdict sent once


def test_one_failed_load_condemns_the_steps_saves():
    v = StepVerdicts()
    v.track(4, ["a", "b"])
    v.reported("a", False)  # ANDed over the ranks: some rank's part of a's hit did not arrive
    v.reported("b", True)
    assert v.take() == {4: False}


def test_steps_are_judged_in_the_order_their_loads_report_not_the_order_they_ran():
    v = StepVerdicts()
    v.track(1, ["a"])
    v.track(2, ["b"])
    v.reported("b", True)  # step 2's output came first (vLLM overlapping steps)
    assert v.take() == {2: True}
    v.reported("a", False)
    assert v.take() == {1: False}


def test_reports_of_loads_not_tracked_are_ignored_and_a_load_reports_once():
    v = StepVerdicts()
    v.reported("ghost", False)
    assert v.take() == {}
    v.track(5, ["a"])
    v.reported("a", True)
    v.reported("a", False)  # a second report of the same load changes nothing
    assert v.take() == {5: True}
