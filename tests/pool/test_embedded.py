"""The embedded pool's files are its owner's: the run directory 0700, its state and logs 0600."""

from __future__ import annotations

import importlib.util
import stat

import pytest

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
