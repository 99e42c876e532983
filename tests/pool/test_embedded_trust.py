"""The embedded pool trusts only its user's run directory, and signals only the processes it
started: a run directory another user made (with a planted ``pool.key``, a ``pool.json`` naming
processes to kill, a ``master.log`` symlink) is refused in one line, and a stale ``pool.json``
whose pids now belong to unrelated processes leaves them running.

Another user is emulated as root does it: the test chowns what it made to ``nobody``. None of
this needs the pool engine: each refusal comes before a process would start."""

from __future__ import annotations

import json
import os
import pwd
import signal
import stat
import subprocess
from dataclasses import replace

import pytest
from process_support import kill_group

from kvstrata.cli import main
from kvstrata.pool import embedded
from kvstrata.pool.config import PoolConfig
from kvstrata.pool.embedded import PoolError, PoolState
from kvstrata.pool.started import ProcessStamp
from kvstrata.trust import Untrusted

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="handing a file to another user needs root")
KEY = "ab" * 32


@pytest.fixture
def bystanders():
    """``make()``: an unrelated process (``sleep 60``) leading a process group of its own."""
    made: list[subprocess.Popen] = []

    def make() -> subprocess.Popen:
        made.append(subprocess.Popen(["sleep", "60"], start_new_session=True))
        return made[-1]

    yield make
    for proc in made:
        kill_group(proc)


def recorded(master: subprocess.Popen, daemon: subprocess.Popen, run_dir, stamped: bool = False) -> dict:
    """A ``pool.json`` naming ``master`` and ``daemon``; ``stamped``: with their own stamps
    (as ``start`` records them), else as a kvstrata before stamps wrote it."""
    port = embedded.free_port()  # nothing answers there
    config = PoolConfig(master=f"127.0.0.1:{port}", daemon=f"127.0.0.1:{port}", secret_file=str(run_dir / "pool.key"))
    state = PoolState(config, master.pid, daemon.pid, embedded.free_port(), 64 * 1024**2, str(run_dir))
    if stamped:
        state = replace(state, master_stamp=ProcessStamp.of(master.pid), daemon_stamp=ProcessStamp.of(daemon.pid))
    doc = state.to_json()
    if not stamped:
        doc.pop("master_stamp", None), doc.pop("daemon_stamp", None)
    return doc


def leave_no_pool(run_dir) -> None:
    """End the pool a refusal that failed started in ``run_dir`` (only ``mooncake`` processes)."""
    try:
        doc = json.loads((run_dir / embedded.STATE).read_text())
        pids = [doc["master_pid"], doc["daemon_pid"]]
    except (OSError, ValueError, KeyError, TypeError):
        return
    for pid in pids:
        try:
            if os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith("mooncake"):
                os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass


def give_to_nobody(*paths) -> None:
    nobody = pwd.getpwnam("nobody")
    for path in paths:
        os.chown(path, nobody.pw_uid, nobody.pw_gid, follow_symlinks=False)


@pytest.fixture
def planted(tmp_path, bystanders):
    """A run directory ``nobody`` made, mode 0777, holding a ``pool.key`` they know, a
    ``pool.json`` naming two unrelated process groups, and ``master.log`` linking to a victim file."""
    run_dir = tmp_path / "pool"
    run_dir.mkdir()
    run_dir.chmod(0o777)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    victim.chmod(0o644)
    (run_dir / "pool.key").write_text(KEY + "\n")
    (run_dir / "pool.key").chmod(0o600)
    master, daemon = bystanders(), bystanders()
    (run_dir / embedded.STATE).write_text(json.dumps(recorded(master, daemon, run_dir)))
    (run_dir / "master.log").symlink_to(victim)
    give_to_nobody(run_dir, run_dir / "pool.key", run_dir / embedded.STATE, run_dir / "master.log")
    yield run_dir, victim, (master, daemon)
    leave_no_pool(run_dir)


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@as_root
@pytest.mark.parametrize("action", ["start", "stop", "status"])
def test_a_run_directory_another_user_made_is_refused_and_nothing_in_it_is_acted_on(planted, capsys, monkeypatch,
                                                                                      action):
    run_dir, victim, processes = planted
    monkeypatch.setenv("KVSTRATA_POOL_DIR", str(run_dir))
    err = one_line_error(capsys, ["pool", action] + (["--segment-size", "64MB"] if action == "start" else []))
    assert f"pool run directory {run_dir} is owned by nobody, not root" in err
    assert all(proc.poll() is None for proc in processes)  # no process group it names was signalled
    assert victim.read_text() == "precious" and stat.S_IMODE(victim.stat().st_mode) == 0o644
    assert (run_dir / "pool.key").read_text() == KEY + "\n"
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o777  # not chmodded: not ours to change
    assert (run_dir / embedded.STATE).exists()


@as_root
def test_a_run_directory_that_is_a_symlink_is_refused(tmp_path, capsys):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / "pool"
    link.symlink_to(target)
    try:
        err = one_line_error(capsys, ["pool", "start", "--dir", str(link)])
    finally:
        leave_no_pool(target)
    assert f"pool run directory {link} is a symlink" in err
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("launch", ["master", "daemon"])
def test_a_log_planted_as_a_symlink_in_the_run_directory_is_not_written_through(tmp_path, launch):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    victim.chmod(0o644)
    log = tmp_path / f"{launch}.log"
    log.symlink_to(victim)
    with pytest.raises(Untrusted, match=f"file {log} is a symlink"):
        if launch == "master":
            proc = embedded.launch_master("127.0.0.1", embedded.free_port(), embedded.free_port(), log)
        else:
            proc = embedded.launch_daemon("127.0.0.1", embedded.free_port(), "127.0.0.1:1", 1 << 20, log)
        proc.kill()  # it started (wrongly): leave nothing running
        proc.wait()
    assert victim.read_text() == "precious" and stat.S_IMODE(victim.stat().st_mode) == 0o644


@as_root
def test_a_state_file_another_user_put_in_this_users_run_directory_is_refused(tmp_path, bystanders):
    run_dir = tmp_path / "pool"
    run_dir.mkdir(mode=0o700)
    master, daemon = bystanders(), bystanders()
    (run_dir / embedded.STATE).write_text(json.dumps(recorded(master, daemon, run_dir)))
    give_to_nobody(run_dir / embedded.STATE)
    with pytest.raises(Untrusted, match=f"pool state file {run_dir / embedded.STATE} is owned by nobody"):
        embedded.stop(run_dir)
    assert master.poll() is None and daemon.poll() is None


def test_a_stale_state_file_from_before_stamps_signals_nobody_and_says_so(tmp_path, bystanders, capsys):
    run_dir = tmp_path / "pool"
    run_dir.mkdir(mode=0o700)
    master, daemon = bystanders(), bystanders()  # hold the pids an old pool.json names
    (run_dir / embedded.STATE).write_text(json.dumps(recorded(master, daemon, run_dir)))
    assert not embedded.status(run_dir)["running"]
    assert main(["pool", "stop", "--dir", str(run_dir)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "pool stopped"
    assert len(err.strip().splitlines()) == 1
    assert f"not signalled: pid(s) {daemon.pid}, {master.pid}, recorded by an older kvstrata" in err
    assert master.poll() is None and daemon.poll() is None
    assert not (run_dir / embedded.STATE).exists()  # forgotten: the next start starts afresh


def test_a_stamped_pid_now_held_by_another_process_is_not_signalled(tmp_path, bystanders):
    run_dir = tmp_path / "pool"
    run_dir.mkdir(mode=0o700)
    master, daemon = bystanders(), bystanders()
    doc = recorded(master, daemon, run_dir, stamped=True)
    doc["master_stamp"]["start_ticks"] -= 1  # the pool's master started earlier: this is another process
    doc["daemon_stamp"]["exe"] = "/usr/bin/mooncake_client"  # the pool's daemon ran another program
    (run_dir / embedded.STATE).write_text(json.dumps(doc))
    stopped = embedded.stop(run_dir)
    assert stopped == embedded.Stopped(True)  # the recorded processes are gone: nothing to say
    assert master.poll() is None and daemon.poll() is None


def test_start_over_a_stale_state_file_leaves_the_processes_holding_its_pids_alone(tmp_path, bystanders):
    run_dir = tmp_path / "pool"
    run_dir.mkdir(mode=0o700)
    master, daemon = bystanders(), bystanders()
    (run_dir / embedded.STATE).write_text(json.dumps(recorded(master, daemon, run_dir)))
    try:
        embedded.start(64 * 1024**2, run_dir)
    except PoolError:
        pass  # the pool engine is not installed here: the stale state was dealt with before that
    finally:
        embedded.stop(run_dir)  # the pool it started, if it did: stamped, so stopped
    assert master.poll() is None and daemon.poll() is None


def test_the_processes_stop_records_are_signalled_while_they_are_the_ones_started(tmp_path, bystanders):
    run_dir = tmp_path / "pool"
    run_dir.mkdir(mode=0o700)
    master, daemon = bystanders(), bystanders()
    (run_dir / embedded.STATE).write_text(json.dumps(recorded(master, daemon, run_dir, stamped=True)))
    assert embedded.stop(run_dir) == embedded.Stopped(True)
    assert (master.wait(5), daemon.wait(5)) == (-signal.SIGTERM, -signal.SIGTERM)


def test_a_state_file_round_trips_its_stamps(tmp_path, bystanders):
    run_dir = tmp_path / "pool"
    run_dir.mkdir(mode=0o700)
    doc = recorded(bystanders(), bystanders(), run_dir, stamped=True)
    (run_dir / embedded.STATE).write_text(json.dumps(doc))
    state = embedded.read_state(run_dir)
    assert state.to_json() == doc and state.master_stamp == ProcessStamp.of(state.master_pid)
