"""What the workers measure for the scheduler: a step's compute less the connector's hooks, each
load's own stretches, and TP ranks merged as the slower of them."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm")

from kvstrata.integrations.vllm.feedback import (  # noqa: E402
    KVStrataWorkerMeta,
    LoadOutcome,
    LoadTiming,
    ProbeTiming,
    StepClock,
)
from kvstrata.media import Medium  # noqa: E402


def test_a_step_s_compute_leaves_out_what_the_hooks_took():
    clock = StepClock()
    assert clock.take() is None  # nothing measured yet
    clock.begin(tokens=300)
    time.sleep(0.05)
    clock.hooked(0.03)  # of those 50 ms, 30 were the connector's
    clock.charge("r1", 0.01)
    clock.charge("r1", 0.02)
    clock.end()
    clock.load_done("r1", LoadOutcome.ARRIVED)
    meta = clock.take()
    assert meta.computed_tokens == 300
    assert 0.015 <= meta.compute_s < 0.045
    assert meta.loads == [LoadTiming("r1", pytest.approx(0.03), LoadOutcome.ARRIVED)]
    assert clock.take() is None  # handed over once


def test_a_step_with_no_tokens_measures_no_compute():
    clock = StepClock()
    clock.begin(tokens=0)
    clock.end()
    assert clock.take() is None


def test_tp_ranks_merge_as_the_slower_and_a_load_failed_on_any_rank_failed():
    arrived, left, failed = LoadOutcome.ARRIVED, LoadOutcome.LEFT, LoadOutcome.FAILED
    a = KVStrataWorkerMeta(64, 0.010, [LoadTiming("r1", 0.002, arrived), LoadTiming("r2", 0.004, arrived),
                                       LoadTiming("r3", 0.001, failed)])
    b = KVStrataWorkerMeta(64, 0.012, [LoadTiming("r1", 0.003, left), LoadTiming("r3", 0.001, left)])
    merged = a.aggregate(b)
    assert (merged.computed_tokens, merged.compute_s) == (64, 0.012)
    assert sorted(merged.loads, key=lambda t: t.req_id) == [
        LoadTiming("r1", 0.003, left), LoadTiming("r2", 0.004, arrived), LoadTiming("r3", 0.001, failed)]
    assert [t.ok for t in sorted(merged.loads, key=lambda t: t.req_id)] == [False, True, False]


def test_a_store_s_cpu_from_the_save_thread_comes_with_a_later_step_and_ranks_keep_the_costlier():
    clock = StepClock()
    clock.saved(9)  # a step sends 9 blocks to store
    first = clock.take()
    assert (first.saved_blocks, first.save_cpu_s) == (9, 0.0)
    worker = threading.Thread(target=clock.save_cpu, args=(0.004,))  # the save thread, after the step
    worker.start()
    worker.join()
    later = clock.take()
    assert (later.saved_blocks, later.save_cpu_s) == (0, pytest.approx(0.004))
    assert clock.take() is None
    merged = KVStrataWorkerMeta(saved_blocks=9, save_cpu_s=0.004).aggregate(KVStrataWorkerMeta(saved_blocks=9,
                                                                                              save_cpu_s=0.006))
    assert (merged.saved_blocks, merged.save_cpu_s) == (9, 0.006)


def test_whether_the_caches_started_empty_is_said_once_and_ranks_merge_as_all_of_them():
    clock = StepClock()
    clock.started(empty=True)
    first = clock.take()  # said even with nothing measured yet
    assert first is not None and first.caches_started_empty is True
    assert clock.take() is None
    clock.saved(1)
    assert clock.take().caches_started_empty is None  # not said again
    said, kept, unsaid = (KVStrataWorkerMeta(caches_started_empty=True), KVStrataWorkerMeta(caches_started_empty=False),
                          KVStrataWorkerMeta())
    assert said.aggregate(kept).caches_started_empty is False  # one rank recovered blocks from its disk
    assert said.aggregate(unsaid).caches_started_empty is True and unsaid.aggregate(unsaid).caches_started_empty is None


def test_a_probe_read_from_the_probe_thread_comes_with_a_later_step_and_ranks_merge_as_the_worse():
    clock = StepClock()
    clock.probed(ProbeTiming(Medium.DISK, 0.002, True))  # the probe thread, between steps
    meta = clock.take()
    assert meta is not None and meta.probes == [ProbeTiming(Medium.DISK, 0.002, True)]
    assert clock.take() is None  # reported once
    fast_probe = ProbeTiming(Medium.DISK, 0.002, True)
    fast, slow = KVStrataWorkerMeta(probes=[fast_probe]), KVStrataWorkerMeta(probes=[ProbeTiming(Medium.DISK, 0.09, False)])
    assert fast.aggregate(slow).probes == [ProbeTiming(Medium.DISK, 0.09, False)]
    none_there = KVStrataWorkerMeta(probes=[ProbeTiming(Medium.DISK, 0.0, False, read=False)])
    assert fast.aggregate(none_there).probes[0].read is False
    assert fast.aggregate(KVStrataWorkerMeta()).probes == [fast_probe]
