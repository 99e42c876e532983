"""Mooncake's native log (kvstrata.pool.native_log): nothing on the terminal of a process that
used the pool and succeeded; a real failure's Mooncake error lines in kvstrata's own log.

Each child is a fresh process as a user runs it (no MC_LOG_* or GLOG_* set, its own cache
directory), with a pool of its own on loopback that it starts, uses, and kills or stops.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvstrata.pool import native_log

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="the pool engine is not installed")

CHILD = r"""
import logging, os, signal, sys, time, uuid
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
import torch
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.pool import embedded
from kvstrata.pool.client import PoolUnavailable
from kvstrata.pool.config import RemoteMode
from kvstrata.tiers.remote import RemoteTier

run_dir, scenario, modes = sys.argv[1], sys.argv[2], [RemoteMode(m) for m in sys.argv[3].split(",")]
layout = KVLayout(2, 16, 2, 32, DType.BF16)
state = embedded.start(64 << 20, run_dir)
tiers = []
for mode in modes:
    tier = RemoteTier(layout, 16 * layout.block_bytes, state.config, mode, namespace_tag="t" + uuid.uuid4().hex[:8],
                      op_timeout_s=1.0, backoff_s=0.2)
    key = uuid.uuid4().bytes
    block = torch.randint(0, 256, (layout.num_layers, layout.layer_bytes), dtype=torch.uint8)
    tier.write(0, key, block)
    back = torch.zeros_like(block)
    tier.read_into(0, key, back)
    assert torch.equal(back, block)
    print("STORED AND LOADED", mode.value, flush=True)
    tiers.append((tier, key, back))
if scenario == "kill":
    os.kill(state.daemon_pid, signal.SIGKILL)  # the daemon holds every object
    time.sleep(0.3)
    for tier, key, back in tiers:
        try:
            tier.read_into(0, key, back)
        except PoolUnavailable as error:
            print("READ FAILED", error, flush=True)
for tier, _, _ in tiers:
    tier.close()
embedded.stop(run_dir)  # then exit: Mooncake tears its stores down after the pool has gone
"""

# Lines glog writes (severity, mmdd, time, thread, file:line]) and its pre-init warning.
GLOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+\] ", re.MULTILINE)
NOISE = ("Logging before InitGoogleLogging", "Failed to connect IPC socket", "Dummy Client not connected",
         "Local segment descriptor not found", "Failed to receive hot cache fd")


def run_child(tmp_path: Path, scenario: str, modes: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MC_", "GLOG_"))}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # the child's kvstrata cache: its Mooncake log files
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])  # this checkout's kvstrata
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "pool"), scenario, modes],
                          capture_output=True, text=True, env=env, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def log_files(tmp_path: Path) -> str:
    directory = tmp_path / "cache" / "kvstrata" / "mooncake-logs"
    return "".join(p.read_text(errors="replace") for p in sorted(directory.glob("*.log.ERROR.*")))


def test_a_process_that_stored_and_loaded_through_the_pool_prints_nothing_of_mooncakes(tmp_path):
    done = run_child(tmp_path, "ok", "tcp,shm")
    assert done.stdout.count("STORED AND LOADED") == 2, done.stdout
    assert GLOG.findall(done.stderr) == [] and not [n for n in NOISE if n in done.stderr], done.stderr[-3000:]
    assert "WARNING kvstrata.pool" not in done.stdout and "ERROR" not in done.stdout, done.stdout
    # Not lost: Mooncake's own lines are in the child's log files, each setup's benign error.
    files = log_files(tmp_path)
    assert "Local segment descriptor not found" in files and "Failed to receive hot cache fd" in files, files


@pytest.mark.parametrize("mode, said", [("tcp", "Transfer failed for key"), ("shm", "RPC call failed")])
def test_a_real_failure_reaches_kvstratas_log_with_what_mooncake_said(tmp_path, mode, said):
    done = run_child(tmp_path, "kill", mode)
    assert "READ FAILED" in done.stdout, done.stdout
    assert GLOG.findall(done.stderr) == [], done.stderr[-3000:]
    lines = done.stdout.splitlines()
    down = next(i for i, line in enumerate(lines) if "kvstrata.pool: pool" in line and "is down" in line)
    forwarded = [line for line in lines[:down] if line.startswith("WARNING kvstrata.pool: mooncake: ")]
    assert any(said in line for line in forwarded), done.stdout
    assert not any(native_log.benign(line) for line in forwarded), forwarded  # setup's benign lines: DEBUG


def test_pool_processes_log_warnings_and_errors_to_their_own_files(monkeypatch):
    monkeypatch.delenv("MC_LOG_LEVEL", raising=False)
    monkeypatch.setenv("MC_LOG_DIR", str(native_log.default_log_dir()))  # as this process sets it
    env = native_log.pool_process_env()
    assert "MC_LOG_DIR" not in env and env["MC_LOG_LEVEL"] == "WARNING"
    monkeypatch.setenv("MC_LOG_DIR", "/var/log/mine")  # the user's own choice stands
    monkeypatch.setenv("MC_LOG_LEVEL", "INFO")
    assert native_log.pool_process_env()["MC_LOG_DIR"] == "/var/log/mine"
    assert native_log.pool_process_env()["MC_LOG_LEVEL"] == "INFO"


def _mooncake_imports(path: Path) -> list[str]:
    """Where ``path`` loads a ``mooncake`` module itself: imports, and ``importorskip`` of one
    (code only: scripts held in strings, run in processes of their own, are theirs)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip" and node.args:
            names = [getattr(node.args[0], "value", "")]
        else:
            continue
        found += [f"{path}:{node.lineno} {name}" for name in names if str(name).split(".")[0] == "mooncake"]
    return found


def test_mooncake_is_loaded_only_through_native_log():
    # Loaded before native_log sets MC_LOG_DIR, Mooncake never initializes glog, which then writes
    # every line to stderr: 85 lines of "Reconnection attempt failed" after pytest's summary, when a
    # test module's importorskip("mooncake.store") ran first.
    root = Path(__file__).resolve().parents[2]
    found = [hit for folder in ("kvstrata", "tests") for path in sorted((root / folder).rglob("*.py"))
             if path.name != "native_log.py" for hit in _mooncake_imports(path)]
    assert found == []
