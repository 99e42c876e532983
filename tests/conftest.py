"""Fixtures shared across the suite: a real shared pool (Mooncake master + pool daemon)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess

import pytest

from kvstrata.pool import embedded
from kvstrata.pool.config import PoolConfig, pool_from_env

POOL_SEGMENT_BYTES = 256 * 1024**2

# The fast loop for edits (README, "Tests"): ``pytest -m fast``, every test marked none of HEAVY.
# A test is marked by what it starts: here from the fixtures it takes, so a new test taking them is
# marked; in its module where it starts something itself or takes a fixture at run time
# (``request.getfixturevalue``, which this scan cannot see).
ENGINE_FIXTURES = frozenset(("tiny_model_dir", "tiny_hybrid_dirs", "tiny_mla_dir"))  # a model in a real engine
POOL_FIXTURES = frozenset(("pool", "private_pool"))  # a Mooncake master and daemon
HEAVY = ("engine", "pool", "server", "netns", "slow")  # pyproject.toml's markers: what each one means


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        names = set(item.fixturenames)
        if names & ENGINE_FIXTURES:
            item.add_marker(pytest.mark.engine)
        if names & POOL_FIXTURES or item.path.parent.name == "pool":
            item.add_marker(pytest.mark.pool)
        if not any(item.get_closest_marker(name) for name in HEAVY):
            item.add_marker(pytest.mark.fast)


@pytest.fixture(scope="session")
def pool(tmp_path_factory) -> PoolConfig:
    """``$KVSTRATA_POOL`` (a pool TOML, or an embedded pool's pool.json) if set, else an
    embedded pool on loopback for this session, stopped at its end."""
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip("the pool engine is not installed (pip install mooncake-transfer-engine-non-cuda)")
    configured = pool_from_env()
    if configured is not None:
        yield configured
        return
    run_dir = tmp_path_factory.mktemp("pool")
    state = embedded.start(POOL_SEGMENT_BYTES, run_dir)
    try:
        yield state.config
    finally:
        embedded.stop(run_dir)


@pytest.fixture
def private_pool(tmp_path):
    """A pool of this test's own (64 MiB segment, so it evicts once full), to stop, hang or
    kill; its processes are resumed, stopped and reaped afterwards, whatever the test did."""
    from process_support import kill_and_reap

    run_dir = tmp_path / "pool"
    state = embedded.start(64 * 1024**2, run_dir)
    try:
        yield state
    finally:
        for pid in (state.daemon_pid, state.master_pid):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        embedded.stop(run_dir)
        for pid in (state.daemon_pid, state.master_pid):
            kill_and_reap(pid)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs: a file system that really runs out of space (needs root)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    command = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)]
    run = subprocess.run(command, capture_output=True, check=False)
    if run.returncode != 0:
        pytest.skip(f"mount not permitted here: {run.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "--lazy", str(mount)], check=True)  # lazy: even if a failed test left a file open


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random-weight Llama model, built offline once per session (a few seconds)."""
    pytest.importorskip("transformers")
    from kvstrata.integrations.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-model"))
