"""A serving run (bench serve before a phase, calibrate --engine vllm before its points) waits for a
quiet host, and never longer than its budget."""

from __future__ import annotations

import threading
import time

import pytest

from kvstrata.calibrate.serving import host


def test_the_host_s_cpu_ticks_count_up():
    first = host._cpu_ticks()
    if first is None:
        pytest.skip("no /proc/stat here")
    time.sleep(0.05)
    second = host._cpu_ticks()
    assert second[1] >= first[1] and second[0] >= first[0]
    assert 0 <= second[0] <= second[1]


def test_a_busy_host_is_waited_on_no_longer_than_the_budget(monkeypatch):
    if host._cpu_ticks() is None:
        pytest.skip("no /proc/stat here")
    monkeypatch.setattr(host, "QUIET_WAIT_S", 1.0)
    monkeypatch.setattr(host, "QUIET_BUSY", 0.0)  # nothing is ever quiet enough: only the budget ends it
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        waited = host.wait_quiet()
    finally:
        stop.set()
        worker.join()
    assert 1.0 <= waited < 1.0 + 2 * host.QUIET_WINDOW_S + 0.5


def test_a_quiet_enough_host_is_not_waited_on(monkeypatch):
    if host._cpu_ticks() is None:
        pytest.skip("no /proc/stat here")
    monkeypatch.setattr(host, "QUIET_BUSY", 1.0)  # any host is quiet enough
    assert host.wait_quiet() < host.QUIET_WINDOW_S + 0.5
