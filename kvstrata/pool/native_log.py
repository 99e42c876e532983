"""Mooncake's own log in a process that loads the pool client: to files, not the terminal.

Mooncake logs from C++ through glog, to stderr, and a successful run prints ERROR lines that
are no errors (``Local segment descriptor not found`` at every TCP setup, ``Failed to receive
hot cache fd`` at every SHM one; ``Failed to connect IPC socket`` / ``Dummy Client not
connected`` as a process exits after its pool daemon stopped) and ``WARNING: Logging before
InitGoogleLogging()``. Measured with mooncake-transfer-engine 0.3.13:

* ``MC_LOG_LEVEL`` (INFO, WARNING or ERROR; read at the first store's setup) sets glog's
  minimum level; ``GLOG_minloglevel`` is overwritten by it.
* ``MC_LOG_DIR`` makes Mooncake initialize glog, which then writes files there (one per
  severity and process: ``mooncake-transfer-engine.<host>.<user>.log.ERROR.<time>.<pid>``)
  and copies to stderr what reaches its ``stderrthreshold`` (ERROR by default). That flag has
  no environment variable in the glog Mooncake bundles: it is set through the flag glog
  exports (``fLI::FLAGS_stderrthreshold``), to FATAL, once the library is loaded.

So :func:`store_class` (every import of Mooncake's store goes through it) leaves the terminal
to FATAL lines only, and nothing is lost: Mooncake's WARNING and ERROR lines are in this
process's files under :func:`log_dir`, and kvstrata's own log (``kvstrata.pool``) gets its
ERROR lines when a pool call fails (:func:`forward`): a failure kvstrata reports
(``pool ... is down: ...``, a setup that failed) is preceded by what Mooncake said about it.
The user's own ``MC_LOG_LEVEL`` / ``MC_LOG_DIR`` win. Pool processes kvstrata launches
(:mod:`kvstrata.pool.embedded`) write to their own log files instead (:func:`pool_process_env`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger("kvstrata.pool")

LEVEL = "WARNING"  # Mooncake's INFO logs every connect; warnings and errors are worth a file
FATAL = 3  # glog's severity numbers: INFO 0, WARNING 1, ERROR 2, FATAL 3
KEEP_FILES = 300  # glog files kept in log_dir (3 per process that logged an error)
KEEP_S = 7 * 86400
FORWARD_LINES = 8  # per failure kvstrata reports: the rest stay in the file

# Logged on every successful setup: no error (forwarded at DEBUG only).
BENIGN = ("Local segment descriptor not found", "Failed to receive hot cache fd", "Hot cache shm not available")
_GLOG_LINE = re.compile(r"^([EF])\d{4} [\d:.]+\s+\d+ (\S+)\] (.*)$")

_lock = threading.Lock()
_configured = False
_read: dict[Path, int] = {}  # this process's glog ERROR files: bytes already forwarded


def log_dir() -> Path:
    """Where this process's Mooncake log files go (``$MC_LOG_DIR``, or kvstrata's cache)."""
    if os.environ.get("MC_LOG_DIR"):
        return Path(os.environ["MC_LOG_DIR"])
    return default_log_dir()


def default_log_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvstrata" / "mooncake-logs"


def store_class() -> type:
    """``mooncake.store.MooncakeDistributedStore``, imported as :func:`store_module` does.

    Raises:
        ImportError: the pool client is not installed, or its native libraries are missing.
    """
    return store_module().MooncakeDistributedStore


def store_module() -> ModuleType:
    """``mooncake.store``, imported with Mooncake's log configured (module text). Idempotent.
    Every import of it goes through here: loaded before ``MC_LOG_DIR`` is set, Mooncake never
    initializes glog, and glog then writes every line, INFO included, to stderr (what followed
    pytest's summary: a test module that imported ``mooncake.store`` itself first, and the
    reconnect attempts of its stores to pools the tests had stopped, as the process exited).

    Raises:
        ImportError: the pool client is not installed, or its native libraries are missing.
    """
    early = "mooncake.store" in sys.modules and not _configured
    configure_env()
    import mooncake.store

    _quiet_stderr()
    if early:
        log.warning("mooncake.store was imported before kvstrata configured Mooncake's log: "
                    "Mooncake logs every line to stderr in this process")
    return mooncake.store


def configure_env() -> None:
    """Set ``MC_LOG_LEVEL`` and ``MC_LOG_DIR`` (unless the user did), before any store's setup."""
    global _configured
    with _lock:
        if _configured:
            return
        _configured = True
        os.environ.setdefault("MC_LOG_LEVEL", LEVEL)
        if not os.environ.get("MC_LOG_DIR"):
            directory = default_log_dir()
            try:
                directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                os.chmod(directory, 0o700)  # object names and addresses: the owner's only
            except OSError as error:  # Mooncake logs to stderr then, as without kvstrata
                log.warning("Mooncake's log directory %s cannot be made (%s): its log goes to stderr", directory, error)
                return
            os.environ["MC_LOG_DIR"] = str(directory)
        _prune(log_dir())


def _quiet_stderr() -> None:
    """glog's stderrthreshold to FATAL in every glog this process loaded (Mooncake bundles its
    own, e.g. ``mooncake_transfer_engine_non_cuda.libs/libglog-<hash>.so.0.0.0``)."""
    for path in _loaded("libglog"):
        try:
            ctypes.c_int32.in_dll(ctypes.CDLL(path), "_ZN3fLI21FLAGS_stderrthresholdE").value = FATAL
        except (OSError, ValueError) as error:  # another glog build: its ERROR lines still show
            log.debug("glog %s: stderrthreshold not set (%s)", path, error)


def _loaded(name: str) -> list[str]:
    """Paths of the shared libraries mapped into this process whose file name starts with ``name``."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    paths = {line.split(None, 5)[5] for line in maps.splitlines() if line.count(" ") >= 5 and "/" in line}
    return sorted(p for p in paths if Path(p).name.startswith(name) and ".so" in p)


def _prune(directory: Path) -> None:
    """Drop glog files older than KEEP_S, and all but the newest KEEP_FILES."""
    try:
        files = [(p.stat().st_mtime, p) for p in directory.glob("*.log.*") if not p.is_symlink()]
    except OSError:
        return
    files.sort(reverse=True)
    now = time.time()
    for i, (mtime, path) in enumerate(files):
        if i >= KEEP_FILES or now - mtime > KEEP_S:
            path.unlink(missing_ok=True)


def errors() -> list[str]:
    """Mooncake's ERROR and FATAL lines this process logged since the last call (``file:line]
    message``), benign ones included."""
    pid = os.getpid()
    found: list[str] = []
    with _lock:
        try:
            paths = sorted(log_dir().glob(f"*.log.ERROR.*.{pid}"))
        except OSError:
            return []
        for path in paths:
            start = _read.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(start)
                    chunk = f.read()
            except OSError:
                continue
            whole = chunk[: chunk.rfind(b"\n") + 1]  # a line glog is still writing waits
            _read[path] = start + len(whole)
            for line in whole.decode(errors="replace").splitlines():
                match = _GLOG_LINE.match(line)
                if match:
                    found.append(f"{match.group(2)}] {match.group(3)}")
    return found


def benign(line: str) -> bool:
    return any(text in line for text in BENIGN)


def forward(level: int = logging.ERROR) -> list[str]:
    """Log Mooncake's new ERROR lines to ``kvstrata.pool`` (at ``level``, the last
    FORWARD_LINES of them; benign ones at DEBUG); returns the ones that are not benign."""
    real = []
    for line in errors():
        if benign(line):
            log.debug("mooncake: %s", line)
        else:
            real.append(line)
    if len(real) > FORWARD_LINES:
        log.log(level, "mooncake: %d more error lines, in %s", len(real) - FORWARD_LINES, log_dir())
    for line in real[-FORWARD_LINES:]:
        log.log(level, "mooncake: %s", line)
    return real


def pool_process_env() -> dict[str, str]:
    """The environment of a pool process kvstrata launches: its log goes to its own stdout
    (a log file of the embedded pool), so not to the files of ``MC_LOG_DIR`` that kvstrata
    set for this process; WARNING and up."""
    env = dict(os.environ)
    if env.get("MC_LOG_DIR") == str(default_log_dir()):
        del env["MC_LOG_DIR"]
    env.setdefault("MC_LOG_LEVEL", LEVEL)
    return env
