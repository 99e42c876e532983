"""A pool user outside kvstrata, as a tamperer (or any other tenant) is: the raw store calls
(Mooncake's, through a bounded client, with no secret) into and out of one registered buffer."""

from __future__ import annotations

import torch

from kvstrata.pool import ops
from kvstrata.pool.client import PoolClient
from kvstrata.pool.config import PoolConfig


class RawPool:
    """A raw client of ``pool`` and a registered buffer of ``capacity`` bytes (the largest value
    it gets or puts); ``close`` it."""

    def __init__(self, pool: PoolConfig, capacity: int) -> None:
        self.client = PoolClient(pool)
        self.buffer = self.client.allocate(capacity)

    def get(self, name: str) -> bytes | None:
        """The object ``name``'s bytes (the buffer's capacity at most); None: the pool has none."""
        (got,) = self.client.call("raw get", ops.BATCH_GET, [name], [self.buffer.data_ptr()], [self.buffer.numel()])
        return None if got < 0 else self.buffer[:got].numpy().tobytes()

    def put(self, name: str, value: bytes) -> None:
        """Make ``value`` the object ``name``, over any object of that name (removed first)."""
        self.client.call("raw remove", ops.REMOVE, name, True)
        self.buffer[: len(value)] = torch.frombuffer(bytearray(value), dtype=torch.uint8)
        assert self.client.call("raw put", ops.BATCH_PUT, [name], [self.buffer.data_ptr()], [len(value)]) == [0]

    def close(self) -> None:
        self.client.close()
