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
import torch

from kvstrata.cache import CacheConfig, TieredCache
from kvstrata.cli import main
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.media import Medium
from kvstrata.policies.write import WritePolicy, WriteRule
from kvstrata.pool import embedded, ops, processes
from kvstrata.pool import network as netns
from kvstrata.pool.client import PoolClient
from kvstrata.pool.config import ENV as POOL_ENV
from kvstrata.pool.config import load_pool_config, pool_from_env, read_secret
from kvstrata.tiers import poolvalue

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
        network = f'network = "{state.config.network}"\n' if state.config.network else ""
        toml.write_text(f'[pool]\nmaster = "{state.config.master}"\ndaemon = "{state.config.daemon}"\n{network}')
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
    # Bound, not listening, where the pool will run: the daemon cannot bind it, and nothing accepts on it.
    network = None if netns.unavailable() else netns.name_for_user()
    if network:
        netns.create(network)
    taken = netns.run_in(network, socket.socket)
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


def test_a_daemon_that_fails_on_both_ports_is_started_again_with_a_fresh_master(tmp_path, monkeypatch):
    # Its first two daemons are given a master that is not there, so neither serves: the start
    # ends that master and starts a fresh master and daemon, which serve.
    monkeypatch.setattr(processes, "START_TIMEOUT_S", 3.0)  # wait_for reads it there
    real, masters, calls = embedded.launch_daemon, [], []
    real_master = embedded.launch_master

    def master(*args, **kwargs):
        proc = real_master(*args, **kwargs)
        masters.append(proc)
        return proc

    def daemon(host, port, master_address, *args, **kwargs):
        calls.append(port)
        return real(host, port, master_address if len(calls) > 2 else "127.0.0.1:1", *args, **kwargs)

    monkeypatch.setattr(embedded, "launch_master", master)
    monkeypatch.setattr(embedded, "launch_daemon", daemon)
    run_dir = tmp_path / "pool"
    state = embedded.start(64 * 1024**2, run_dir)
    try:
        assert len(calls) == 3 and len(masters) == 2
        assert masters[0].wait(timeout=10) is not None  # the first master was ended
        assert state.master_pid == masters[1].pid and embedded.status(run_dir)["running"]
    finally:
        embedded.stop(run_dir)


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


def test_pool_start_makes_a_private_secret_that_clients_of_its_state_file_seal_with(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "pool"
    assert main(["pool", "start", "--segment-size", "64MiB", "--dir", str(run_dir), "--json"]) == 0
    try:
        key_file = run_dir / embedded.SECRET
        made = key_file.lstat()
        assert stat.S_ISREG(made.st_mode) and stat.S_IMODE(made.st_mode) == 0o600 and made.st_uid == os.getuid()
        monkeypatch.setenv(POOL_ENV, json.loads(capsys.readouterr().out)["state_file"])
        config = pool_from_env()  # what a client is pointed at: the pool's state file
        assert read_secret(config) == bytes.fromhex(key_file.read_text().strip())
        layout = KVLayout(num_layers=2, block_tokens=16, kv_heads=2, head_dim=32, dtype=DType.BF16)
        cache_config = CacheConfig(layout, "secret-test", device_bytes=4 * layout.block_bytes, host_bytes=0,
                                   device="cpu", write=WriteRule(WritePolicy.WRITE_THROUGH), pool=config,
                                   remote_bytes=4 * layout.block_bytes)
        with TieredCache(cache_config) as cache:
            toks = list(range(layout.block_tokens))
            kv = torch.zeros(layout.num_layers, 2, layout.block_tokens, 2, 32, dtype=torch.bfloat16)
            assert cache.store(toks, kv).result(timeout=10).new_blocks == 1
            (key,) = cache.keys(toks)
            tier = cache.tier(Medium.REMOTE)
            assert tier.object_name(key) != f"kvstrata/{tier.namespace_tag}/{key.hex()}"  # keyed with the secret
            client = PoolClient(config)
            try:
                head = client.allocate(poolvalue.HEADER_BYTES + layout.block_bytes)
                (got,) = client.call("raw get", ops.BATCH_GET, [tier.object_name(key)], [head.data_ptr()],
                                     [head.numel()])
                assert got == head.numel()
                assert poolvalue.decode_header(head[: poolvalue.HEADER_BYTES].numpy().tobytes()).nonce is not None
            finally:
                client.close()
    finally:
        embedded.stop(run_dir)


def test_pool_start_uses_a_secret_it_is_given_and_refuses_a_weak_one_before_starting(tmp_path, capsys):
    run_dir, given = tmp_path / "pool", tmp_path / "deploy.key"
    given.write_text("ab" * 32 + "\n")
    given.chmod(0o644)
    assert main(["pool", "start", "--segment-size", "64MiB", "--dir", str(run_dir), "--secret-file", str(given)]) == 2
    assert "readable by others" in capsys.readouterr().err and not (run_dir / embedded.STATE).exists()
    given.chmod(0o600)
    assert main(["pool", "start", "--segment-size", "64MiB", "--dir", str(run_dir), "--secret-file", str(given),
                 "--json"]) == 0
    try:
        config = load_pool_config(json.loads(capsys.readouterr().out)["state_file"])
        assert config.secret_file == str(given) and read_secret(config) == bytes.fromhex("ab" * 32)
        assert not (run_dir / embedded.SECRET).exists()  # none made: one was given
    finally:
        embedded.stop(run_dir)
