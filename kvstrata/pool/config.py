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
    """

    master: str
    daemon: str | None = None
    protocol: str = "tcp"
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    rdma_devices: str = ""

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


def pool_from_env() -> PoolConfig | None:
    value = os.environ.get(ENV)
    return load_pool_config(value) if value else None
