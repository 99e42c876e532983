"""The lab for real: namespaces, veth links shaped by tbf, a pool on one emulated host and the cache
on another; and that nothing of it outlives the lab (an error, SIGTERM, Ctrl-C, a killed run)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kvstrata.lab import netns, spec
from kvstrata.lab.hosts import start_pool
from kvstrata.lab.spec import tcp_efficiency
from kvstrata.pool import embedded
from tests.process_support import wait_until

WHY = netns.unavailable() or (None if importlib.util.find_spec("mooncake") else "the pool engine is not installed")
pytestmark = [pytest.mark.netns, pytest.mark.pool,  # emulated hosts in namespaces, a pool in one
              pytest.mark.skipif(WHY is not None, reason=f"no lab here: {WHY}")]


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


def _namespaces_of(pid: int) -> list[str]:
    return [n for n in netns.lab_namespaces() if n.startswith(f"{netns.PREFIX}{pid}-")]


def _lab_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvstrata", "lab", *args]


def test_a_small_lab_names_the_bound_it_shapes_and_predicts_the_restore_within_its_noise():
    links = _root_links()
    started = time.monotonic()
    proc = subprocess.Popen(_lab_cli("--rates", "2.5", "--sizes-mib", "16", "64", "--repeats", "3", "--phases", "link",
                                     "--json"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    seconds = time.monotonic() - started
    assert proc.returncode == 0, err[-2000:]
    report = json.loads(out)
    rows = report["link"]
    assert {(r["rate_gbit"], r["path"], r["nbytes"] >> 20) for r in rows} == {
        (rate, path, size) for rate in (None, 2.5) for path in ("direct", "staged") for size in (16, 64)}
    payload_gbps = 2.5 / 8 * tcp_efficiency()
    for r in rows:
        measured_gbps = r["nbytes"] / r["measured_s"] / 1e9
        if r["rate_gbit"] is None:  # unshaped: the host's own paths bound it, and no shaper saw it
            assert r["predicted_bound"] == r["observed_bound"] == "memory path"
            assert measured_gbps > payload_gbps  # this lab's premise: the host outruns the shaped link
        else:
            assert r["predicted_bound"] == r["observed_bound"] == "link", r
            assert measured_gbps <= payload_gbps * 1.05  # a shaped link is never beaten
            assert r["bottleneck"].startswith("inf port 0 (2.5 Gbit/s)")
            if r["nbytes"] >= 64 << 20:
                assert abs(r["error"]) < 0.2, r  # the goal is 10%; a median of 3 rounds on a shared CI box (one round strayed 40% once)
    assert seconds < 60
    assert not _namespaces_of(proc.pid)
    assert _root_links() == links  # no veth, bridge or qdisc ever reached this namespace


def test_an_error_inside_the_lab_ends_its_pool_and_removes_every_namespace(tmp_path):
    lab = netns.Lab(spec.two_ports(1.0))
    pids: list[int] = []
    with pytest.raises(RuntimeError, match="boom"):
        with lab:
            pool = start_pool(lab, tmp_path, 64 << 20)
            assert len(pool.segments) == 2
            pids = [int(p) for p in subprocess.run(["ip", "netns", "pids", lab.namespace("pool")], capture_output=True,
                                                   text=True).stdout.split()]
            assert len(pids) == 3  # a master and a daemon per port
            raise RuntimeError("boom")
    assert not _namespaces_of(os.getpid())
    assert all(not embedded.process_alive(p) for p in pids)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_lab_stopped_by_a_signal_leaves_no_namespace_or_process(sig):
    links = _root_links()
    proc = subprocess.Popen(_lab_cli("--quick"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        pool_ns = f"{netns.PREFIX}{proc.pid}-pool"
        assert wait_until(lambda: len(_pids(pool_ns)) >= 2, 60), "the lab's pool never started"
        running = _pids(pool_ns)
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not _namespaces_of(proc.pid)
    assert all(not embedded.process_alive(p) for p in running)
    assert _root_links() == links


def _pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_clean_removes_the_namespaces_of_a_lab_that_was_killed():
    gone = subprocess.Popen(["true"])
    gone.wait()
    name = f"{netns.PREFIX}{gone.pid}-inf"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        done = subprocess.run(_lab_cli("clean"), capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert name in done.stdout
        assert name not in netns.lab_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_a_link_delay_is_refused_in_one_line_where_the_kernel_has_no_netem():
    lab = netns.Lab(spec.one_link(1.0, delay_s=0.001))
    if netns.netem_available():
        with lab:
            shown = subprocess.run(["tc", "-n", lab.namespace("inf"), "qdisc", "show", "dev", "p0"], capture_output=True,
                                   text=True).stdout
            assert "netem" in shown and "tbf" in shown
    else:
        with pytest.raises(netns.LabError, match="link delay needs netem") as raised:
            lab.start()
        assert "\n" not in str(raised.value)
    assert not _namespaces_of(os.getpid())
