"""The ballast of ``bench cache`` and ``validate``: a file of a step's size plus headroom, read and dropped before
each disk step (``Sides.disk``), so the step's page cache comes from memory just freed."""

from __future__ import annotations

import os

import pytest

from kvstrata.bench.cache import Sides
from kvstrata.calibrate import ballast as ballast_module
from kvstrata.calibrate.ballast import HEADROOM_BYTES, Ballast
from tests.test_timing import PAGE, cached_pages


def test_the_ballast_holds_the_step_size_and_headroom_and_release_leaves_it_out_of_the_page_cache(tmp_path):
    ballast = Ballast(tmp_path / "ballast.bin", 3 << 20)
    size = (3 << 20) + HEADROOM_BYTES
    assert ballast.path.stat().st_size == size
    assert ballast.path.read_bytes() == bytes(size)
    if hasattr(os, "RWF_NOWAIT"):
        pages = size // PAGE
        ballast.release()
        cached = cached_pages(ballast.path, pages)
        if cached == pages:
            pytest.skip("this file system keeps files in memory (tmpfs): nothing to drop")
        assert cached < pages
    ballast.remove()
    assert not ballast.path.exists()


def test_release_reads_the_whole_ballast_then_drops_it(tmp_path, monkeypatch):
    ballast = Ballast(tmp_path / "ballast.bin", 1 << 20)
    calls = []
    monkeypatch.setattr(ballast_module, "warm_page_cache", lambda paths: calls.append(("warm", list(paths))))
    monkeypatch.setattr(ballast_module, "drop_page_cache", lambda paths: calls.append(("drop", list(paths))))
    ballast.release()
    assert calls == [("warm", [ballast.path]), ("drop", [ballast.path])]


def test_a_ballast_that_cannot_be_written_leaves_no_file(tmp_path):
    with pytest.raises(OSError):
        Ballast(tmp_path / "missing" / "ballast.bin", 1 << 20)
    assert not (tmp_path / "missing").exists()


class _Recorder:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def release(self) -> None:
        self.log.append("release")


def test_a_disk_step_runs_after_the_ballast_is_released_and_keeps_its_own_seconds():
    log: list[str] = []
    sides = Sides(ours=None, buffers=None, raw=None, lmc=None, ballast=_Recorder(log))

    def step() -> float:
        log.append("step")
        return 0.25

    wrapped = sides.disk(step)
    assert log == []  # building the phase's steps releases nothing
    assert wrapped() == 0.25
    assert wrapped() == 0.25
    assert log == ["release", "step", "release", "step"]
