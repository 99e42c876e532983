"""A ``pool start`` killed with SIGKILL midway leaves no Mooncake process of its own running once
``pool stop`` or the next ``pool start`` has run, and neither signals a process that is not one
of that start's.

Each case runs ``kvstrata pool start`` as a real process on a private run directory, waits until
it has spawned the master (or the daemon too: the master then listens), freezes it, notes the
pool processes it has spawned so far, and kills it with SIGKILL: those processes outlive it,
named in no ``pool.json``. Bystanders run meanwhile: a process whose command line names
``mooncake_master``, and one carrying another start's token in its environment."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from process_support import children_running, kill_group, wait_until

from kvstrata.cli import main
from kvstrata.pool import embedded
from kvstrata.pool.started import TOKEN_ENV

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="the pool engine is not installed")
SEGMENT = "64MB"
# What a spawned pool process's command line holds: its flags, not the program's name (``start``
# runs ``ldd`` on the programs first, a child naming them too).
MASTER, DAEMON = "--rpc_port=", "--global_segment_size="


@pytest.fixture
def bystanders():
    """Unrelated processes, each leading a process group of its own: one whose command line
    names the pool's master, one launched with another (made-up) start's token."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    made = [subprocess.Popen([*sleeper, "mooncake_master"], start_new_session=True),
            subprocess.Popen(sleeper, start_new_session=True, env=os.environ | {TOKEN_ENV: "0" * 32})]
    yield made
    for proc in made:
        kill_group(proc)


def killed_start(run_dir, point: str | None, delay_s: float = 0.0) -> list[int]:
    """Run ``pool start`` until it has spawned ``point`` (``MASTER`` or ``DAEMON``; None: until
    ``delay_s`` after it made the master's log, just before launching the master), SIGKILL it
    there; returns the pids of the pool processes running then."""
    starter = subprocess.Popen([sys.executable, "-m", "kvstrata", "pool", "start", "--segment-size", SEGMENT,
                                "--dir", str(run_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if point is None:
            assert wait_until(lambda: (run_dir / "master.log").exists(), 60), "the start never got to the master"
            time.sleep(delay_s)
        else:
            assert wait_until(lambda: children_running(point, parent=starter.pid), 60), f"{point} never started"
        os.kill(starter.pid, signal.SIGSTOP)  # frozen: nothing more starts
        spawned = logging_to(run_dir)
    finally:
        starter.kill()
        starter.wait()
    if point is not None:  # the kill left them running, recorded in no pool.json
        assert spawned and all(embedded.process_alive(pid) for pid in spawned), f"not running: {spawned}"
        assert not (run_dir / embedded.STATE).exists(), "the start got to pool.json before it was killed"
    return spawned


def logging_to(run_dir) -> list[int]:
    """Live processes whose output goes to a log of ``run_dir``: the pool's, whoever their parent."""
    logs = {str(run_dir / "master.log"), str(run_dir / "daemon.log")}
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/fd/1") in logs:
                found.append(int(pid))
        except OSError:
            continue
    return found


def gone(pids: list[int]) -> bool:
    return not any(embedded.process_alive(pid) for pid in pids)


@pytest.mark.parametrize("point", [MASTER, DAEMON], ids=["master-spawned", "daemon-spawned"])
def test_pool_stop_ends_the_processes_of_a_start_killed_midway_and_no_other(tmp_path, bystanders, point, capsys):
    run_dir = tmp_path / "pool"
    orphans = killed_start(run_dir, point)
    try:
        assert main(["pool", "stop", "--dir", str(run_dir)]) == 0
        assert wait_until(lambda: gone(orphans), 10), f"left running: {[p for p in orphans if embedded.process_alive(p)]}"
        assert capsys.readouterr().out.splitlines() == [
            "no pool was running", f"stopped {len(orphans)} process(es) a killed `pool start` had left running"]
        assert all(proc.poll() is None for proc in bystanders)  # never signalled
        assert embedded.stop(run_dir) == embedded.Stopped(False)  # nothing left to stop
    finally:
        for pid in orphans:  # on the old code, end what it left (only mooncake processes)
            if embedded.process_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_next_pool_start_ends_the_processes_of_a_start_killed_midway_and_starts_its_own(tmp_path, bystanders):
    run_dir = tmp_path / "pool"
    orphans = killed_start(run_dir, DAEMON)
    try:
        state = embedded.start(64 * 1024**2, run_dir)
        try:
            assert wait_until(lambda: gone(orphans), 10), f"left running: {[p for p in orphans if embedded.process_alive(p)]}"
            assert embedded.status(run_dir)["running"] and not {state.master_pid, state.daemon_pid} & set(orphans)
            assert all(proc.poll() is None for proc in bystanders)
        finally:
            embedded.stop(run_dir)
        assert not state.master_stamp.holds(state.master_pid) and not state.daemon_stamp.holds(state.daemon_pid)
    finally:
        for pid in orphans:
            if embedded.process_alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("delay_s", [0.0, 0.03, 0.06, 0.1, 0.15, 0.2, 0.3, 1.0])
def test_a_start_killed_at_any_moment_leaves_nothing_running_once_stopped(tmp_path, bystanders, delay_s):
    # The start takes ~0.2 s from the master's log to pool.json here (the master listens ~0.1 s
    # after it is launched, the daemon ~0.1 s after that): wherever the kill lands (as either
    # starts, after pool.json is written, after the start returned), a stop leaves none of its
    # processes running. Run with -s to see where each landed.
    run_dir = tmp_path / "pool"
    spawned = killed_start(run_dir, None, delay_s)
    print(f"killed {delay_s} s after the master's log: {len(spawned)} pool processes running, pool.json {(run_dir / embedded.STATE).exists()}")
    try:
        embedded.stop(run_dir)
        assert wait_until(lambda: gone(spawned), 10), f"left running: {[p for p in spawned if embedded.process_alive(p)]}"
        assert logging_to(run_dir) == []
        assert all(proc.poll() is None for proc in bystanders)
        assert not (run_dir / embedded.STATE).exists() and not (run_dir / embedded.STARTING).exists()
    finally:
        for pid in spawned:
            if embedded.process_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_two_starts_at_once_in_one_run_directory_start_one_pool(tmp_path):
    # They take turns: the second finds the first's pool running and returns it, rather than
    # ending the processes of a start under way (or, before the turns, starting a second pool
    # that pool.json no longer named).
    run_dir = tmp_path / "pool"
    argv = [sys.executable, "-m", "kvstrata", "pool", "start", "--segment-size", SEGMENT, "--dir", str(run_dir), "--json"]
    starts = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(2)]
    try:
        docs = [json.loads(proc.communicate(timeout=120)[0]) for proc in starts]
        assert {(doc["master_pid"], doc["daemon_pid"]) for doc in docs} == {(docs[0]["master_pid"], docs[0]["daemon_pid"])}
        assert sorted(logging_to(run_dir)) == sorted([docs[0]["master_pid"], docs[0]["daemon_pid"]])
    finally:
        for proc in starts:
            proc.kill()
            proc.wait()
        embedded.stop(run_dir)
        leftover = logging_to(run_dir)
        for pid in leftover:  # on the old code, the pool no pool.json names
            os.kill(pid, signal.SIGKILL)
    assert leftover == []
