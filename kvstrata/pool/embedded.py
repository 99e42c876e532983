"""An embedded pool on loopback: one Mooncake master and one pool daemon, as real processes.

``start`` picks free ports, launches ``mooncake_master`` and ``mooncake_client`` (the pool
daemon that owns the DRAM segment) in their own sessions, waits (bounded) until both accept
connections, and writes ``pool.json`` in the run directory (whole, by a rename: clients that
lost the pool read it again); ``stop`` ends them; ``status`` checks them (alive and answering).
Inference processes join with segment size 0, so objects live in the daemon and survive any
inference process exiting. Launching and ending the processes: ``kvstrata.pool.processes``;
asking them at the socket level: ``kvstrata.pool.sockets``.

Security: the master and the daemon listen on 127.0.0.1, but every Mooncake process (the daemon
and each client) also opens its transfer engine's handshake and data ports on the wildcard
address, which no option moves. So a pool started by root runs in a network namespace of its
own (``kvstrata.pool.network``): every listener of the pool's and of its clients' is inside it,
where only root reaches, and nothing listens on the host's network. Without root (or with
``network=PoolNetwork.HOST``) the pool is on the host's loopback and those ports are open on
every interface: run such pools only on trusted hosts and networks. The run directory, which holds
the deployment secret (``pool.key``) and names the processes ``stop`` signals, is trusted only
if it is this user's (``kvstrata.trust``): one another user made, or a symlink, is refused in one
line, and its state, key and logs are never followed through a symlink. A recorded pid is
signalled only while it is still the process that was started (``kvstrata.pool.started``).

A start killed midway (SIGKILL, at any point) leaves the processes it had launched running,
named in no ``pool.json``. So ``start`` writes ``starting.json`` first, with a fresh token its
processes then carry in their environment (``kvstrata.pool.started``), and removes it once
``pool.json`` names them; ``stop`` (which the next ``start`` runs first) ends every process
carrying the token of a ``starting.json`` it finds: those of that start, and no other. Starts
in one run directory take turns (a lock held while starting), so one never ends another's.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvstrata import trust
from kvstrata.pool import libs
from kvstrata.pool import network as netns
from kvstrata.pool.network import PoolNetwork
from kvstrata.pool.config import PoolConfig, json_error, make_secret, secret_at
from kvstrata.pool.processes import (CLIENT_TTL_S, START_TIMEOUT_S, PoolError, end_carriers, launch_daemon,
                                     launch_master, private_file, process_alive, stamp_of, terminate, wait_for)
from kvstrata.pool.sockets import accepts, accepts_in, answers, answers_in, free_port
from kvstrata.pool.started import ProcessStamp, new_token

_log = logging.getLogger("kvstrata.pool")

# The pool's processes (kvstrata.pool.processes) and socket checks (kvstrata.pool.sockets) are
# reached through this module too.
__all__ = ["CLIENT_TTL_S", "SECRET", "START_TIMEOUT_S", "STARTING", "STATE", "PoolError", "PoolState", "Stopped",
           "accepts", "accepts_in", "answers", "answers_in", "default_run_dir", "free_port", "launch_daemon",
           "launch_master", "master_metrics", "network_for", "process_alive", "read_start_token", "read_state",
           "start", "status", "stop", "terminate", "wait_for"]

STATE = "pool.json"
SECRET = "pool.key"
STARTING = "starting.json"  # a start under way (or killed): the token its processes carry
START_LOCK = ".start.lock"  # held while a start runs: starts in one run directory take turns
RUN_DIR = "pool run directory"  # how messages name it
# A pool daemon's start is tried again (on a new port) once: on a busy host (CI, beside SGLang's
# and vLLM's own Mooncake clients) one was seen stuck in Mooncake's own retries of its client's
# port ("Failed to create client on port 13788, retry 6/20") past START_TIMEOUT_S, and a fresh
# one starts.
DAEMON_ATTEMPTS = 2
# And a start whose daemon did not serve twice starts again with a fresh master, once: in CI a
# daemon's setup failed every retry for a minute against one master ("Failed to create client on
# port ..., retry 6/20" on both ports), seen once in 2,500 tests.
START_ATTEMPTS = 2


def default_run_dir() -> Path:
    return Path(os.environ.get("KVSTRATA_POOL_DIR", Path.home() / ".cache" / "kvstrata" / "pool"))


@dataclass(frozen=True)
class PoolState:
    """An embedded pool as ``pool.json`` records it.

    Attributes:
        master_stamp, daemon_stamp: which processes ``master_pid`` and ``daemon_pid`` were when
            started (None: recorded by a kvstrata that kept no stamp; such a pid is never
            signalled, as nothing tells the pool's process from another that holds it now).
    """

    config: PoolConfig
    master_pid: int
    daemon_pid: int
    metrics_port: int
    segment_bytes: int
    run_dir: str
    master_stamp: ProcessStamp | None = None
    daemon_stamp: ProcessStamp | None = None

    def processes(self) -> tuple[tuple[str, int, ProcessStamp | None], ...]:
        """``(name, pid, stamp)`` of each process, in the order ``stop`` ends them."""
        return ("daemon", self.daemon_pid, self.daemon_stamp), ("master", self.master_pid, self.master_stamp)

    def to_json(self) -> dict:
        stamps = {f"{name}_stamp": stamp.to_json() if stamp else None for name, _, stamp in self.processes()}
        return {
            "config": self.config.to_json(),
            "master_pid": self.master_pid,
            "daemon_pid": self.daemon_pid,
            "metrics_port": self.metrics_port,
            "segment_bytes": self.segment_bytes,
            "run_dir": self.run_dir,
        } | stamps

    @classmethod
    def from_json(cls, doc: dict) -> "PoolState":
        # No stamps (a pool.json older than them): None, a pid never signalled.
        stamps = {k: ProcessStamp.from_json(doc[k]) for k in ("master_stamp", "daemon_stamp") if doc.get(k) is not None}
        rest = {k: doc[k] for k in doc if k != "config" and k not in stamps}
        return cls(PoolConfig(**doc["config"]), **rest, **stamps)


def read_state(run_dir: Path | None = None) -> PoolState | None:
    """The pool recorded in ``run_dir`` (default: ``default_run_dir()``); None if none is.

    Raises:
        Untrusted: the run directory or its ``pool.json`` is not this user's, or a symlink.
        ValueError: ``pool.json`` is not a pool's state.
    """
    run_dir = Path(run_dir or default_run_dir()).absolute()
    path = run_dir / STATE
    text = _read_own(run_dir, STATE, "pool state file")
    if text is None:
        return None
    try:
        state = PoolState.from_json(json.loads(text))
    except (ValueError, KeyError, TypeError) as exc:  # edited by hand, or not a pool's state
        raise ValueError(f"{path}: not a pool state file: {json_error(exc)}") from None
    return replace(state, config=replace(state.config, config_file=path))


def _read_own(run_dir: Path, name: str, what: str) -> str | None:
    """The text of ``run_dir / name``, a file of this user's in a run directory of this user's;
    None if either is missing.

    Raises:
        Untrusted: the run directory or the file is not this user's, or a symlink.
    """
    if not os.path.lexists(run_dir):
        return None
    trust.check_private_dir(run_dir, RUN_DIR)
    try:
        with os.fdopen(trust.open_own(run_dir / name, what), "r") as file:
            return file.read()
    except FileNotFoundError:
        return None


def _ours(pid: int, stamp: ProcessStamp | None) -> bool:
    """Whether ``pid`` is still the process started under ``stamp`` (never, without one)."""
    return stamp is not None and stamp.holds(pid)


def status(run_dir: Path | None = None) -> dict:
    """What runs: the recorded processes still the ones started, their ports answering (a
    stopped process is not up)."""
    state = read_state(run_dir)
    if state is None:
        return {"running": False, "reason": "no embedded pool started in " + str(run_dir or default_run_dir())}
    master_up = _ours(state.master_pid, state.master_stamp) and answers_in(state.config.network, state.config.master)
    daemon_up = _ours(state.daemon_pid, state.daemon_stamp) and answers_in(state.config.network, state.config.daemon)
    return {
        "running": master_up and daemon_up,
        "network": state.config.network or "host",
        "master": {"address": state.config.master, "pid": state.master_pid, "up": master_up},
        "daemon": {"address": state.config.daemon, "pid": state.daemon_pid, "up": daemon_up},
        "segment_bytes": state.segment_bytes,
        "state_file": str(Path(state.run_dir) / STATE),
    }


def master_metrics(run_dir: Path | None = None, timeout_s: float = 2.0) -> str:
    """The master's Prometheus text (``/metrics`` on its metrics port), fetched from inside the
    pool's network, where a scraper on the host cannot reach.

    Raises:
        PoolError: no pool recorded in ``run_dir``, or the master did not answer (one line).
    """
    import urllib.request

    state = read_state(run_dir)
    if state is None:
        raise PoolError(f"no embedded pool started in {run_dir or default_run_dir()}")
    url = f"http://127.0.0.1:{state.metrics_port}/metrics"

    def fetch() -> str:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:
            return answer.read().decode(errors="replace")

    try:
        return netns.run_in(state.config.network, fetch)
    except (OSError, netns.NetworkError) as error:
        where = f" in network {state.config.network}" if state.config.network else ""
        raise PoolError(f"the pool master's metrics at {url}{where} did not answer: {error}") from None


def start(segment_bytes: int = 2 * 1024**3, run_dir: Path | None = None, secret_file: Path | None = None,
          network: PoolNetwork = PoolNetwork.AUTO) -> PoolState:
    """Start a master and a pool daemon on loopback (or return the running one). The state's
    config names ``pool.json`` as its file, so clients built on it follow a restarted pool.

    Args:
        secret_file: the deployment secret the state names for clients (``pool.config.secret_at``
            checks it); None: the run directory's ``pool.key``, made (0600) unless it holds one.
        network: where the pool listens: PRIVATE, a network namespace of its own (root
            only); HOST, the host's loopback; AUTO, PRIVATE where this process can make one.

    Raises:
        Untrusted: ``run_dir`` (made 0700 if missing) is another user's or a symlink, or a
            file in it that ``start`` reads or writes is, or ``secret_file`` is.
        ValueError: ``secret_file`` is no secret (missing, readable by others, too short), or
            a pool runs in ``run_dir`` with another secret.
        PoolError: a process did not start, or (PRIVATE) its network could not be made.
    """
    # Its logs, state and secret: the owner's only; and who else could plant a pool.json
    # naming processes to kill, or a pool.key they know?
    run_dir = trust.private_dir(Path(run_dir or default_run_dir()).absolute(), RUN_DIR)
    if secret_file is not None:
        secret_file = Path(secret_file).absolute()
        secret_at(secret_file)  # before anything starts: one line saying what is wrong with it
    lock = trust.open_private(run_dir / START_LOCK, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed, or when this process dies
        return _start(segment_bytes, run_dir, secret_file, network)
    finally:
        os.close(lock)


def _start(segment_bytes: int, run_dir: Path, secret_file: Path | None, network: PoolNetwork) -> PoolState:
    """``start`` in ``run_dir``, its lock held."""
    current = status(run_dir)
    if current["running"]:
        running = read_state(run_dir)
        if secret_file is not None and running.config.secret_file != str(secret_file):
            raise ValueError(f"a pool runs in {run_dir} with secret_file {running.config.secret_file}: "
                             f"stop it to start one with {secret_file}")
        return running
    stopped = stop(run_dir)  # clear a half-dead previous pool, or what a killed start left
    if stopped.unknown_pids:
        _log.warning("%s", stopped.describe())
    missing = libs.missing_libraries()
    if missing:  # the programs would exit 127 naming only the first
        raise PoolError(libs.describe(missing))
    token = new_token()
    _write_json(run_dir / STARTING, {"token": token})  # before any process: a kill at any point leaves it
    try:
        ns = network_for(network)
        prefix, accepting = netns.exec_prefix(ns) if ns else (), accepts_in(ns)
        def port() -> int:  # free where the pool listens
            return netns.run_in(ns, free_port)

        for attempt in range(START_ATTEMPTS):
            try:
                master, metrics_port, daemon = _launch_pool(run_dir, segment_bytes, port, prefix, accepting, token)
                break
            except PoolError as error:
                if attempt + 1 == START_ATTEMPTS:
                    raise
                _log.warning("pool start: %s; starting a fresh master and daemon", error)
        secret = secret_file
        if secret is None:
            secret = run_dir / SECRET
            make_secret(secret)  # kept across restarts: values sealed with it, names keyed (tiers/poolvalue.py)
        config = PoolConfig(master=f"127.0.0.1:{master.port}", daemon=f"127.0.0.1:{daemon.port}",
                            secret_file=str(secret), network=ns, config_file=run_dir / STATE)
        state = PoolState(config, master.proc.pid, daemon.proc.pid, metrics_port, segment_bytes, str(run_dir),
                          master.stamp, daemon.stamp)
        _write_json(run_dir / STATE, state.to_json())
    except BaseException:  # a process that did not start, or an interrupt: end all this start launched
        end_carriers(token)
        (run_dir / STARTING).unlink(missing_ok=True)
        raise
    (run_dir / STARTING).unlink()  # pool.json names them now (a kill before this: stop ends them anyway)
    return state


@dataclass(frozen=True)
class _Serving:
    """A pool process that serves: its process, its stamp, the port it serves on."""

    proc: subprocess.Popen
    stamp: ProcessStamp
    port: int


def _launch_pool(run_dir: Path, segment_bytes: int, port: Callable[[], int], prefix: Sequence[str],
            accepting: Callable[[str, float], bool], token: str) -> tuple[_Serving, int, _Serving]:
    """A master, then a pool daemon of it (tried again once on another port), each serving:
    (master, its metrics port, daemon).

    Raises:
        PoolError: either did not serve in time (what it launched is ended first).
    """
    master_port, metrics_port = port(), port()
    master = f"127.0.0.1:{master_port}"
    master_proc = launch_master("127.0.0.1", master_port, metrics_port, run_dir / "master.log", prefix, token)
    try:
        wait_for(master, master_proc, run_dir / "master.log", accepting)
        serving = _Serving(master_proc, stamp_of(master_proc, run_dir / "master.log"), master_port)
        for attempt in range(DAEMON_ATTEMPTS):
            daemon_port = port()
            daemon_proc = launch_daemon("127.0.0.1", daemon_port, master, segment_bytes, run_dir / "daemon.log",
                                        prefix, token)
            try:
                wait_for(f"127.0.0.1:{daemon_port}", daemon_proc, run_dir / "daemon.log", accepting)
                return serving, metrics_port, _Serving(daemon_proc, stamp_of(daemon_proc, run_dir / "daemon.log"),
                                                       daemon_port)
            except PoolError:
                if attempt + 1 == DAEMON_ATTEMPTS:
                    raise
        raise AssertionError("unreachable: the last attempt raises")
    except BaseException:
        terminate(master_proc.pid)
        raise


def network_for(network: PoolNetwork) -> str | None:
    """The namespace the pool runs in (made if missing); None: the host's network.

    Raises:
        PoolError: PRIVATE, and it cannot be made (one line saying why).
    """
    why = netns.unavailable()
    if network is PoolNetwork.HOST or (network is PoolNetwork.AUTO and why is not None):
        if network is PoolNetwork.AUTO:
            _log.info("pool network: the host's loopback (%s); Mooncake's transfer ports listen on every "
                      "interface: run this pool on a trusted host", why)
        return None
    name = netns.name_for_user()  # kept when the pool stops: its clients' Mooncake threads stay in it
    try:
        netns.create(name)
    except netns.NetworkError as error:
        raise PoolError(f"the pool's private network could not be made: {error}") from None
    return name


def _write_json(path: Path, doc: dict) -> None:
    """``doc`` as ``path`` (0600), whole: readers see the old file or the new one, never part."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    with private_file(partial, "w") as out:
        out.write(json.dumps(doc, indent=2))
    os.replace(partial, path)


@dataclass(frozen=True)
class Stopped:
    """What ``stop`` did.

    Attributes:
        recorded: a pool was recorded in the run directory (its ``pool.json`` is gone now).
        unknown_pids: recorded pids left alone although a process holds them: recorded without
            a stamp (by an older kvstrata), so nothing tells the pool's process from another.
        interrupted: processes a start killed midway had left running (its ``starting.json``
            names their token), ended.
    """

    recorded: bool
    unknown_pids: tuple[int, ...] = ()
    interrupted: int = 0

    def describe(self) -> str:
        """One line on the pids left alone (empty when none was)."""
        if not self.unknown_pids:
            return ""
        pids = ", ".join(map(str, self.unknown_pids))
        return (f"not signalled: pid(s) {pids}, recorded by an older kvstrata without their start time, so "
                "they may be unrelated processes that now hold those pids; stop them yourself if they are the pool's")


def stop(run_dir: Path | None = None) -> Stopped:
    """Stop the embedded pool: signal each recorded process group whose leader is still the
    process started (``PoolState.processes``), and forget the pool; then end what a start
    killed midway left running (the processes carrying its token), and forget that start.

    Raises:
        Untrusted, ValueError: as ``read_state`` (and ``read_start_token``).
    """
    run_dir = Path(run_dir or default_run_dir()).absolute()
    state = read_state(run_dir)
    token = read_start_token(run_dir)
    unknown = []
    for _, pid, stamp in state.processes() if state else ():
        if _ours(pid, stamp):
            terminate(pid)
        elif stamp is None and process_alive(pid):
            unknown.append(pid)
    (run_dir / STATE).unlink(missing_ok=True)
    interrupted = 0
    if token is not None:
        interrupted = end_carriers(token)  # after the recorded ones: those pool.json named are gone already
        (run_dir / STARTING).unlink(missing_ok=True)
    return Stopped(state is not None, tuple(unknown), interrupted)


def read_start_token(run_dir: Path) -> str | None:
    """The token of the start recorded under way in ``run_dir`` (``starting.json``); None if none is.

    Raises:
        Untrusted: the run directory or the file is not this user's, or a symlink.
        ValueError: the file is not a start's record.
    """
    path = run_dir / STARTING
    text = _read_own(run_dir, STARTING, "pool start record")
    if text is None:
        return None
    try:
        token = json.loads(text)["token"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a pool start record: {json_error(exc)}") from None
    if not (isinstance(token, str) and re.fullmatch(r"[0-9a-f]{32}", token)):
        raise ValueError(f"{path}: not a pool start record: its token is not 32 hex digits")
    return token


