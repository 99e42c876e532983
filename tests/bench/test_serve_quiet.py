"""bench serve waits for a quiet host before a phase, and never longer than its budget."""

from __future__ import annotations

import threading
import time

import pytest

serve = pytest.importorskip("kvstrata.bench.serve")


def test_the_host_s_cpu_ticks_count_up():
    first = serve._cpu_ticks()
    if first is None:
        pytest.skip("no /proc/stat here")
    time.sleep(0.05)
    second = serve._cpu_ticks()
    assert second[1] >= first[1] and second[0] >= first[0]
    assert 0 <= second[0] <= second[1]


def test_a_busy_host_is_waited_on_no_longer_than_the_budget(monkeypatch):
    if serve._cpu_ticks() is None:
        pytest.skip("no /proc/stat here")
    monkeypatch.setattr(serve, "QUIET_WAIT_S", 1.0)
    monkeypatch.setattr(serve, "QUIET_BUSY", 0.0)  # nothing is ever quiet enough: only the budget ends it
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        waited = serve.wait_quiet()
    finally:
        stop.set()
        worker.join()
    assert 1.0 <= waited < 1.0 + 2 * serve.QUIET_WINDOW_S + 0.5


def test_a_quiet_enough_host_is_not_waited_on(monkeypatch):
    if serve._cpu_ticks() is None:
        pytest.skip("no /proc/stat here")
    monkeypatch.setattr(serve, "QUIET_BUSY", 1.0)  # any host is quiet enough
    assert serve.wait_quiet() < serve.QUIET_WINDOW_S + 0.5
