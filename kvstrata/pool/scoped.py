"""A pool for the length of one run: the configured one, else an embedded one started for it.

``kvstrata demo`` and ``kvstrata bench remote`` / ``e2e`` use it: with ``--pool FILE`` or
``$KVSTRATA_POOL`` they join that pool (and leave it running); without, a master and a pool
daemon start on loopback in a temporary run directory and stop, the directory removed, when
the run ends, however it ends.
"""

from __future__ import annotations

import enum
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvstrata.pool import embedded
from kvstrata.pool.config import PoolConfig
from kvstrata.report import FLATTEN


class PoolOrigin(enum.Enum):
    CONFIGURED = "configured"  # --pool FILE or $KVSTRATA_POOL: not the run's to stop
    EMBEDDED = "embedded"  # started for the run, stopped at its end


@dataclass(frozen=True)
class PoolSource:
    """Where a run's pool came from, for its report (the config's fields sit beside these).

    Attributes:
        source: configured or embedded.
        config: how the pool is reached.
        segment_bytes, master_pid, daemon_pid: an embedded pool's (None for a configured one).
    """

    source: PoolOrigin
    config: PoolConfig = field(metadata=FLATTEN)
    segment_bytes: int | None = None
    master_pid: int | None = None
    daemon_pid: int | None = None


@contextmanager
def scoped_pool(pool: PoolConfig | None, segment_bytes: int) -> Iterator[PoolSource]:
    """``pool`` if given, else an embedded pool of ``segment_bytes`` in a temporary run
    directory, stopped (and the directory removed) on exit.

    Raises:
        PoolError: the embedded pool did not start.
    """
    if pool is not None:
        yield PoolSource(PoolOrigin.CONFIGURED, pool)
        return
    run_dir = Path(tempfile.mkdtemp(prefix="kvstrata-pool-"))
    try:
        state = embedded.start(segment_bytes, run_dir)
        try:
            yield PoolSource(PoolOrigin.EMBEDDED, state.config, state.segment_bytes, state.master_pid, state.daemon_pid)
        finally:
            embedded.stop(run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
