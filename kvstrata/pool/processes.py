"""The embedded pool's processes: launching ``mooncake_master`` and ``mooncake_client`` (the pool
daemon) in sessions of their own, logging to private files; waiting (bounded) until each
serves; ending them, and the processes a killed start left (by the token they carry,
``kvstrata.pool.started``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvstrata import trust
from kvstrata.extras import pip_command
from kvstrata.pool import libs, native_log
from kvstrata.pool.sockets import accepts
from kvstrata.pool.started import TOKEN_ENV, ProcessStamp, carries, carrying

START_TIMEOUT_S = 30.0
# How long the master keeps a pool daemon (and every object in its segment) after its last
# heartbeat. Mooncake's default, 10 s, dropped every object of a daemon stopped for 5 s
# (a stall, a SIGSTOP, a debugger); a dead daemon is still noticed at once by clients, whose
# calls to it fail (kvstrata.pool.client probes its socket).
CLIENT_TTL_S = 60


class PoolError(RuntimeError):
    """The embedded pool did not start (or stop); ``log``: the log that says more, if any
    (in a temporary run directory it is gone once the run ends: the message says what counts)."""

    def __init__(self, message: str, log: Path | None = None) -> None:
        super().__init__(message)
        self.log = log


def _binary(name: str) -> str:
    here = Path(sys.executable).parent / name  # the venv's console script
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise PoolError(
            f"{name} not found: install the pool engine: {pip_command('mooncake')}"
        )
    return found


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still "exists": check its state where /proc tells.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return True


def launch_master(host: str, port: int, metrics_port: int, log: Path, prefix: Sequence[str] = (),
                  token: str | None = None) -> subprocess.Popen:
    """``mooncake_master`` on ``host:port`` in its own session, logging to ``log`` (0600);
    ``prefix``: a command that runs it elsewhere (``ip netns exec NS``, for the lab); ``token``:
    the start's, carried in its environment (``kvstrata.pool.started``)."""
    return _launch("mooncake_master", [
        f"--rpc_address={host}",
        f"--rpc_port={port}",
        f"--metrics_host={host}",
        f"--metrics_port={metrics_port}",
        "--enable_http_metadata_server=false",
        f"--client_ttl={CLIENT_TTL_S}",
    ], log, prefix, token)


def launch_daemon(host: str, port: int, master: str, segment_bytes: int, log: Path,
                  prefix: Sequence[str] = (), token: str | None = None) -> subprocess.Popen:
    """A pool daemon (``mooncake_client``) on ``host`` (its segment's name: ``ip:port`` there
    names it exactly) serving on ``port``, owning a segment of ``segment_bytes`` of the master
    at ``master``; as ``launch_master``."""
    return _launch("mooncake_client", [
        f"--host={host}",
        f"--port={port}",
        f"--global_segment_size={segment_bytes}",
        "--local_buffer_size=16MB",
        f"--master_server_address={master}",
        "--metadata_server=P2PHANDSHAKE",
        "--protocol=tcp",
    ], log, prefix, token)


def _launch(program: str, flags: list[str], log: Path, prefix: Sequence[str], token: str | None) -> subprocess.Popen:
    env = native_log.pool_process_env() | ({TOKEN_ENV: token} if token else {})
    with private_file(log, "wb") as out:
        return subprocess.Popen([*prefix, _binary(program), *flags], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)


def private_file(path: Path, mode: str):
    """``open(path, mode)`` for writing, the file readable by its owner only (0600), never
    through a symlink nor into another user's file (``trust.open_private``)."""
    return os.fdopen(trust.open_private(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), mode)


def stamp_of(proc: subprocess.Popen, log: Path) -> ProcessStamp:
    """The stamp of ``proc``, taken once it serves (a wrapper has exec'd its program by then).

    Raises:
        PoolError: it exited meanwhile.
    """
    try:
        return ProcessStamp.of(proc.pid)
    except ProcessLookupError:
        raise PoolError(f"{Path(proc.args[0]).name} exited as it started: {_last_line(log)}", log) from None


def wait_for(address: str, proc: subprocess.Popen, log: Path,
             accepting: Callable[[str, float], bool] = accepts) -> None:
    """Until ``proc`` accepts connections on ``address`` (``accepting``: how to ask; the lab
    asks from inside a namespace).

    Raises:
        PoolError: it exited, or did not listen in time; the message carries the last line of
            its log (a temporary run directory's log is gone by the time a caller reads it).
    """
    name = next((Path(a).name for a in proc.args if Path(a).name.startswith("mooncake")), Path(proc.args[0]).name)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PoolError(f"{name} exited with {proc.returncode}: {_last_line(log)}", log)
        if accepting(address, 0.2):
            return
        time.sleep(0.1)
    terminate(proc.pid)
    raise PoolError(f"{name} did not listen on {address} within {START_TIMEOUT_S:.0f} s; its log's last line: "
                    f"{_last_line(log)}", log)


def _last_line(log: Path) -> str:
    """The last line of ``log`` that says something, and for a library the loader did not
    find, the command that installs it."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError as error:
        return f"(its log {log} is unreadable: {error.strerror})"
    if not lines:
        return "(its log is empty)"
    missing = libs.loader_error(lines[-1])
    return lines[-1] + (f"; install: {libs.install_command((missing,))}" if missing else "")


def terminate(pid: int, grace_s: float = 5.0) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and process_alive(pid):
        time.sleep(0.05)
    if process_alive(pid):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def end_carriers(token: str) -> int:
    """End every process launched with ``token``: each leading its process group (as ``start``
    launches them) with its group, any other alone; each checked again just before it is
    signalled. Returns how many there were."""
    pids = carrying(token)
    for pid in sorted(pids, key=lambda pid: not _leads_group(pid)):  # leaders first: their groups go with them
        if not carries(pid, token):
            continue  # gone with its group already
        if _leads_group(pid):
            terminate(pid)
        else:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return len(pids)


def _leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return False
