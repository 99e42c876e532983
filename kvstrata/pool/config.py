"""Where the pool is: a Mooncake master (and, on this host, a pool daemon for shared memory).

Parsed at the edge: from a TOML file (``[pool]`` table), from ``$KVSTRATA_POOL`` (a path to
such a file or to an embedded pool's state file), or from the embedded pool's state.
"""

from __future__ import annotations

import enum
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ENV = "KVSTRATA_POOL"


class RemoteMode(enum.Enum):
    """How a process reaches the pool."""

    TCP = "tcp"  # a client of the master; objects move over the pool's protocol
    SHM = "shm"  # a client of the pool daemon on this host, through shared memory


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
    """

    master: str
    daemon: str | None = None
    protocol: str = "tcp"
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    rdma_devices: str = ""
    secret_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("master",) + (("daemon",) if self.daemon else ()):
            host, _, port = getattr(self, name).rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"pool {name} must be host:port, got {getattr(self, name)!r}")
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"pool protocol must be tcp or rdma, got {self.protocol!r}")

    def to_json(self) -> dict:
        return asdict(self)


def load_pool_config(path: str | Path) -> PoolConfig:
    """A ``[pool]`` TOML table, or an embedded pool's ``pool.json`` state file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"pool config {str(path)!r} does not exist")
    if path.suffix == ".json":
        state = json.loads(path.read_text())
        return PoolConfig(**state["config"])
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: invalid TOML: {exc}") from None
    table = data.get("pool", data)
    known = set(PoolConfig.__dataclass_fields__)
    unknown = set(table) - known
    if unknown:
        raise ValueError(f"{path}: unknown pool setting(s) {sorted(unknown)}; known: {sorted(known)}")
    if "master" not in table:
        raise ValueError(f"{path}: pool.master (host:port of the Mooncake master) is missing")
    return PoolConfig(**table)


SECRET_BYTES = 32


def make_secret(path: Path) -> None:
    """Write a new random deployment secret to ``path`` (0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)
        out.write(os.urandom(SECRET_BYTES).hex() + "\n")


def read_secret(config: PoolConfig) -> bytes | None:
    """The deployment secret of ``config.secret_file`` (None without one).

    Raises:
        ValueError: the file is missing, readable by others, or not 64 hex digits.
    """
    if config.secret_file is None:
        return None
    path = Path(config.secret_file)
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
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
