"""Where the pool is: a Mooncake master (and, on this host, a pool daemon for shared memory).

Parsed at the edge: from a TOML file (``[pool]`` table), from ``$KVSTRATA_POOL`` (a path to
such a file or to an embedded pool's state file), or from the embedded pool's state. A config
read from a file remembers it (``config_file``): a client that loses the pool reads it again
before reconnecting, so a pool restarted at new addresses (``kvstrata pool start`` picks new
ports and rewrites ``pool.json``) is found again.
"""

from __future__ import annotations

import enum
import json
import math
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from kvstrata import trust
from kvstrata.pool.network import check_name
from kvstrata.report import OMIT
from kvstrata.trust import Untrusted

ENV = "KVSTRATA_POOL"

def check_budgets(owner: str, **seconds: float) -> None:
    """Each of ``seconds`` a finite number > 0, and a backoff maximum not below its base.
    ``owner`` starts the message ("cache", "pool client:").

    Raises:
        ValueError: one line naming the first bad value.
    """
    for name, value in seconds.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"{owner} {name} must be a number of seconds > 0, got {value!r}")
    names = sorted(name for name in seconds if "backoff" in name)  # [..backoff_max_s, ..backoff_s]
    if len(names) == 2 and seconds[names[0]] < seconds[names[1]]:
        raise ValueError(f"{owner} {names[0]} must be >= {names[1]}, got {seconds[names[0]]!r} < {seconds[names[1]]!r}")


@dataclass(frozen=True)
class PoolBudgets:
    """How long a client waits on the pool (kvstrata.pool.client); ``DEFAULT_BUDGETS`` holds the
    defaults of every place that takes these budgets (CacheConfig, the engines' settings, the
    remote tier, the pool client).

    Attributes:
        op_timeout_s: one call: a lookup's existence query, a load's batch get or a store's
            batch put (up to 64 MiB and 128 blocks: kvstrata.tiers.staging.CALL_BYTES, ~0.04 s
            at loopback TCP's 1.5 GB/s). A live pool on loopback or a LAN answers in
            milliseconds; a second is ample, and is what a caller waits, once, for a pool that
            has stopped answering (then calls fail at once).
        connect_timeout_s: connecting: socket checks, then Mooncake's setup (~0.2 s on
            loopback; opening RDMA devices takes longer). Only building a cache waits for it;
            reconnects run in the background.
        backoff_s: after a fault, the first background probe comes this long after (jittered
            down to half), each failed one doubling the wait, up to ``backoff_max_s``: a pool
            that comes back is used again within ``backoff_max_s``, and each client of a dead
            master probes it every 5 to 10 s at most.
        backoff_max_s: the longest wait between probes.
    """

    op_timeout_s: float = 1.0
    connect_timeout_s: float = 5.0
    backoff_s: float = 0.5
    backoff_max_s: float = 10.0

    def __post_init__(self) -> None:
        check_budgets("pool budgets:", **{f.name: getattr(self, f.name) for f in fields(self)})


class RemoteMode(enum.Enum):
    """How a process reaches the pool."""

    TCP = "tcp"  # a client of the master; objects move over the pool's protocol
    SHM = "shm"  # a client of the pool daemon on this host, through shared memory


DEFAULT_BUDGETS = PoolBudgets()


@dataclass(frozen=True)
class PoolConfig:
    """How a client reaches the pool.

    Attributes:
        master: ``host:port`` of the Mooncake master.
        daemon: ``host:port`` of a pool daemon (mooncake_client) on this host, for the
            shared-memory mode; None when there is none here.
        protocol: transfer protocol ("tcp" here; "rdma" on RDMA hosts).
        metadata_server: Mooncake metadata mode ("P2PHANDSHAKE": no separate server).
        local_hostname: this client's address as the pool sees it.
        rdma_devices: RDMA NICs to use ("" for TCP).
        secret_file: a file holding the deployment's secret (64 hex digits, readable by its
            owner only): pool values are sealed with it and object names keyed (see
            ``kvstrata.tiers.poolvalue``); None: values are not authenticated (a pool only
            trusted processes can reach). An embedded pool makes one.
        segments: the pool daemons' segment names (``host:port``, as each daemon's ``--host``)
            that puts are spread over in turn, so that a later batched get draws on every
            daemon's NIC port at once; empty: the master places each object (measured: 32
            objects 13/19 over two daemons). A preference only: the master places an object
            elsewhere when that segment is full or unknown. Read as a list from TOML or JSON.
        network: the network namespace the pool runs in (``kvstrata.pool.network``): a
            client's threads that talk to the pool enter it (root only); None: the pool is
            reached from this process's own network. An embedded pool started by root runs in
            one, so nothing of the pool's, nor of its clients', listens on the host's network.
        config_file: the file this was read from (a TOML or a ``pool.json``), read again when
            the pool is lost; None: built in code, never re-read. Not part of the pool's
            identity (equality, hashing) nor of its JSON.
    """

    master: str
    daemon: str | None = None
    protocol: str = "tcp"
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    rdma_devices: str = ""
    secret_file: str | None = None
    segments: tuple[str, ...] = ()
    network: str | None = None
    config_file: Path | None = field(default=None, compare=False, metadata=OMIT)

    def __post_init__(self) -> None:
        for name in ("master",) + (("daemon",) if self.daemon else ()):
            if not _host_port(getattr(self, name)):
                raise ValueError(f"pool {name} must be host:port, got {getattr(self, name)!r}")
        if not isinstance(self.segments, (list, tuple)):
            raise ValueError(f"pool segments must be a list of host:port, got {self.segments!r}")
        bad = [segment for segment in self.segments if not _host_port(segment)]
        if bad:
            raise ValueError(f"pool segments must each be host:port, got {bad[0]!r}")
        if len(set(self.segments)) != len(self.segments):
            raise ValueError(f"pool segments must name each segment once, got {list(self.segments)!r}")
        object.__setattr__(self, "segments", tuple(self.segments))  # a list from TOML or JSON; hashable
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"pool protocol must be tcp or rdma, got {self.protocol!r}")
        if self.network is not None:
            check_name(self.network)
        if self.config_file is not None and not isinstance(self.config_file, Path):
            raise ValueError(f"pool config_file must be a pathlib.Path, got {self.config_file!r}")

    def to_json(self) -> dict:
        """How to reach the pool (``config_file`` left out: it is where this copy came from)."""
        doc = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "config_file"}
        return doc | {"segments": list(self.segments)}


def _host_port(value: object) -> bool:
    """Whether ``value`` is a ``host:port`` string."""
    host, _, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    return bool(host) and port.isdigit()


def json_error(exc: Exception) -> str:
    """Why a JSON document could not be read, in words (for a message that names the file)."""
    if isinstance(exc, json.JSONDecodeError):
        return f"invalid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
    if isinstance(exc, KeyError):
        return f"no {exc.args[0]!r} entry"
    return str(exc)


def load_pool_config(path: str | Path) -> PoolConfig:
    """A ``[pool]`` TOML table, or an embedded pool's ``pool.json`` state file; the config
    remembers the file (absolute), to read it again on reconnect.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not a pool config (bad TOML or JSON, unknown or bad settings).
    """
    path = Path(path).absolute()
    if not path.is_file():
        raise FileNotFoundError(f"pool config {str(path)!r} does not exist")
    if path.suffix == ".json":
        try:
            state = json.loads(path.read_text())
            return PoolConfig(**state["config"], config_file=path)
        except (ValueError, KeyError, TypeError) as exc:  # half-written, or not a pool's state
            raise ValueError(f"{path}: not a pool state file: {json_error(exc)}") from None
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: invalid TOML: {exc}") from None
    table = data.get("pool", data)
    known = set(PoolConfig.__dataclass_fields__) - {"config_file"}
    unknown = set(table) - known
    if unknown:
        raise ValueError(f"{path}: unknown pool setting(s) {sorted(unknown)}; known: {sorted(known)}")
    if "master" not in table:
        raise ValueError(f"{path}: pool.master (host:port of the Mooncake master) is missing")
    return PoolConfig(**table, config_file=path)


SECRET_BYTES = 32


def make_secret(path: Path) -> None:
    """Write a new random deployment secret to ``path`` (0600), unless it holds a valid one.

    A pool restarted in the same place keeps its secret: the clients that read it still seal
    and name values as every new client will.

    Raises:
        Untrusted: ``path`` is a symlink or another user's file: neither kept (a secret someone
            else knows) nor written through.
    """
    try:
        secret_at(path)
        return
    except Untrusted:
        raise
    except ValueError:
        pass  # none, or a weak one of this user's own: replaced
    with os.fdopen(trust.open_private(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as out:
        out.write(os.urandom(SECRET_BYTES).hex() + "\n")


def read_secret(config: PoolConfig) -> bytes | None:
    """The deployment secret of ``config.secret_file`` (None without one); see ``secret_at``."""
    return None if config.secret_file is None else secret_at(Path(config.secret_file))


def secret_at(path: Path) -> bytes:
    """The deployment secret in ``path``: a regular file of this user's (not a symlink),
    readable by them only.

    Raises:
        Untrusted: a symlink, another user's file, or not a regular file (a secret another
            user could have planted or can read is no secret).
        ValueError: the file is missing, readable by others, or not 64 hex digits.
    """
    try:
        with os.fdopen(trust.open_own(path, "pool secret_file"), "r") as file:
            mode = os.fstat(file.fileno()).st_mode
            text = file.read().strip()
    except OSError as error:
        raise ValueError(f"pool secret_file {path}: {error.strerror or error}") from None
    if mode & 0o077:
        raise ValueError(f"pool secret_file {path} is readable by others (mode {mode & 0o777:o}): chmod 600 it")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) < SECRET_BYTES:
        raise ValueError(f"pool secret_file {path} must hold {2 * SECRET_BYTES} hex digits")
    return secret


def pool_from_env() -> PoolConfig | None:
    value = os.environ.get(ENV)
    return load_pool_config(value) if value else None
