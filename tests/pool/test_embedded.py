"""The embedded pool's files are its owner's (the run directory 0700, its state and logs 0600), and
its status says up only for processes that answer."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import stat
from pathlib import Path

import pytest

from kvstrata.cli import main
from kvstrata.pool import embedded

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="the pool engine is not installed")


def test_the_pool_run_directory_state_and_logs_are_private(tmp_path):
    run_dir = tmp_path / "pool"
    run_dir.mkdir(mode=0o755)
    (run_dir / "master.log").write_text("an old log, once world-readable")
    (run_dir / "master.log").chmod(0o644)
    embedded.start(64 * 1024**2, run_dir)
    try:
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
        for name in (embedded.STATE, "master.log", "daemon.log"):
            assert stat.S_IMODE((run_dir / name).stat().st_mode) == 0o600, name
    finally:
        embedded.stop(run_dir)


def test_a_stopped_process_is_not_up_and_a_dead_daemon_is_not_up_for_a_configured_pool(tmp_path, capsys):
    run_dir = tmp_path / "pool"
    state = embedded.start(64 * 1024**2, run_dir)
    try:
        assert embedded.status(run_dir)["running"]
        os.kill(state.master_pid, signal.SIGSTOP)  # accepts connections, answers nothing
        try:
            doc = embedded.status(run_dir)
            assert not doc["running"] and not doc["master"]["up"] and doc["daemon"]["up"]
        finally:
            os.kill(state.master_pid, signal.SIGCONT)
        toml = tmp_path / "pool.toml"
        toml.write_text(f'[pool]\nmaster = "{state.config.master}"\ndaemon = "{state.config.daemon}"\n')
        assert main(["pool", "status", "--config", str(toml), "--json"]) == 0
        capsys.readouterr()
        os.kill(state.daemon_pid, signal.SIGKILL)  # the master still answers; the objects are gone
        os.waitpid(state.daemon_pid, 0)  # dead, its port closed (a dying one may still reset)
        assert main(["pool", "status", "--config", str(toml), "--json"]) == 1
        doc = json.loads(capsys.readouterr().out)
        assert (doc["running"], doc["master"]["up"], doc["daemon"]["up"]) == (False, True, False)
        assert state.config.config_file == run_dir / embedded.STATE  # clients built on it follow a restart
    finally:
        embedded.stop(run_dir)


def test_a_daemon_that_cannot_take_its_port_is_started_again_on_another(tmp_path, monkeypatch):
    taken = socket.socket()  # bound, not listening: the daemon cannot bind it, and nothing accepts on it
    taken.bind(("127.0.0.1", 0))
    ports = iter([embedded.free_port(), embedded.free_port(), taken.getsockname()[1]])
    chooser = embedded.free_port
    monkeypatch.setattr(embedded, "free_port", lambda: next(ports, None) or chooser())
    run_dir = tmp_path / "pool"
    try:
        state = embedded.start(64 * 1024**2, run_dir)
        try:
            assert state.config.daemon != f"127.0.0.1:{taken.getsockname()[1]}"
            assert embedded.status(run_dir)["running"]
        finally:
            embedded.stop(run_dir)
    finally:
        taken.close()


def test_stop_ends_the_processes_start_recorded_by_their_stamps(tmp_path):
    run_dir = tmp_path / "pool"
    state = embedded.start(64 * 1024**2, run_dir)
    try:
        recorded = embedded.read_state(run_dir)
        assert (recorded.master_stamp, recorded.daemon_stamp) == (state.master_stamp, state.daemon_stamp)
        assert Path(state.master_stamp.exe).name == "mooncake_master" and state.master_stamp.holds(state.master_pid)
        assert Path(state.daemon_stamp.exe).name == "mooncake_client" and state.daemon_stamp.holds(state.daemon_pid)
    finally:
        stopped = embedded.stop(run_dir)
    assert stopped == embedded.Stopped(True)
    assert not state.master_stamp.holds(state.master_pid) and not state.daemon_stamp.holds(state.daemon_pid)
