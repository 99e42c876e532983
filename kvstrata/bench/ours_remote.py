"""Our side of the remote benchmark, at the tier: ``RemoteTier`` driven by the transfer engine.

This is the first hop of every pool transfer the cache makes: the engine's workers (two by
default, as in the cache) call ``RemoteTier.write`` and ``RemoteTier.read_into`` once per block,
between the pool and host memory from ``RemoteTier.allocate`` (a host tier built on it, as the
cache builds its own), so the blocks move zero-copy; each call puts or gets one object (the
64-byte value header and the block) and verifies the header it reads. The tier is driven
directly, with no block table: its ``write`` and ``read_into`` name the object by the key and
ignore the slot (the cache's block manager keeps the table, outside this first hop).

Verification: before each restore the destination is zeroed (untimed); afterwards every block
is compared byte for byte with the block stored, so a restore that moved nothing or the wrong
bytes fails the run instead of looking fast.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from kvstrata.index.keys import BlockKey
from kvstrata.kv.layout import KVLayout
from kvstrata.pool.config import PoolConfig, RemoteMode
from kvstrata.tiers import poolvalue
from kvstrata.tiers.memory import HostTier
from kvstrata.tiers.remote import RemoteTier
from kvstrata.timing import VerificationError
from kvstrata.transfer.engine import TransferEngine, TransferResult

OP_TIMEOUT_S = 60.0  # a benchmark may move large blocks over a slow link: bound calls loosely


class OursRemote:
    """The benchmark's blocks as objects of a RemoteTier, stored and restored through the engine.

    Args:
        layout: the block layout.
        pool: where the pool is.
        mode: TCP or SHM.
        keys: one key per block.
        blocks: the blocks, uint8 ``[blocks, layers, layer_bytes]`` (CPU).
        namespace_tag: the objects' name prefix (the cache's namespace tag, so a cache of
            that namespace finds them: see ``kvstrata.bench.poolcache``).
        workers: transfer engine threads.

    Raises:
        PoolUnavailable: the pool could not be reached.
    """

    def __init__(
        self,
        layout: KVLayout,
        pool: PoolConfig,
        mode: RemoteMode,
        keys: list[BlockKey],
        blocks: torch.Tensor,
        namespace_tag: str,
        workers: int,
    ) -> None:
        self.layout = layout
        self.keys = keys
        self.size_bytes = len(keys) * layout.block_bytes
        self.tier = RemoteTier(layout, self.size_bytes, pool, mode, namespace_tag=namespace_tag, op_timeout_s=OP_TIMEOUT_S)
        self._engine: TransferEngine | None = None
        try:
            self.src = HostTier(layout, self.size_bytes, buffer=self.tier.allocate(self.size_bytes))
            self.src.buffer.copy_(blocks)
            self.dst = HostTier(layout, self.size_bytes, buffer=self.tier.allocate(self.size_bytes))
            self._engine = TransferEngine(workers)
        except BaseException:
            self.close()
            raise
        self.verified_bytes = 0

    @property
    def names(self) -> list[str]:
        return [self.tier.object_name(k) for k in self.keys]

    def values(self) -> torch.Tensor:
        """Each object's whole value as the tier writes it, uint8 ``[blocks, 64 + block_bytes]``:
        the bytes a raw client must move to match ours."""
        digest = poolvalue.layout_digest(self.layout.describe())
        out = torch.empty((len(self.keys), poolvalue.HEADER_BYTES + self.layout.block_bytes), dtype=torch.uint8)
        for i, key in enumerate(self.keys):
            header = poolvalue.encode_header(key, digest, self.layout.block_bytes, None)
            out[i, : poolvalue.HEADER_BYTES] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
            out[i, poolvalue.HEADER_BYTES :] = self.src.view(i).view(-1)
        return out

    # --- steps: each returns the seconds its timed part took -----------------------------------

    def store_s(self) -> float:
        """Every block, host -> pool, as new objects (removed first, untimed: a put of a name
        that exists is a no-op and would time nothing)."""
        self.remove()
        start = time.perf_counter()
        # The remote tier names the object by the key: slot 0, no table.
        futures = [self._live().submit(self.src, i, self.tier, 0, key) for i, key in enumerate(self.keys)]
        return _settled_s(futures, start)

    def restore_s(self, count: int | None = None) -> float:
        """The first ``count`` blocks (all by default), pool -> host; then verified."""
        keys = self.keys[: len(self.keys) if count is None else count]
        dst = self.dst.buffer[: len(keys)]  # [blocks, layers, layer_bytes]
        dst.zero_()  # a restore that moved nothing must not verify
        start = time.perf_counter()
        futures = [self._live().submit(self.tier, 0, self.dst, i, key) for i, key in enumerate(keys)]
        seconds = _settled_s(futures, start)
        for i in range(len(keys)):
            if not torch.equal(dst[i], self.src.view(i)):
                raise VerificationError(f"remote tier: restored block {i} differs from the block stored")
        self.verified_bytes += dst.numel()
        return seconds

    def remove(self) -> None:
        """Delete the objects from the pool (untimed housekeeping)."""
        self.tier.remove_from_pool(self.keys, force=True)

    def close(self) -> None:
        """Remove the objects, stop the engine, leave the pool. Idempotent."""
        try:
            if self.tier.up:
                self.remove()
        finally:
            if self._engine is not None:
                self._engine.close()
                self._engine = None
            self.tier.close()

    def _live(self) -> TransferEngine:
        if self._engine is None:
            raise RuntimeError("closed")
        return self._engine


def _settled_s(futures: list[Future[TransferResult]], start: float) -> float:
    """Seconds from ``start`` until every transfer has finished; then the first failure, if any, raises."""
    errors = [f.exception() for f in futures]  # a list, not any(): wait for every one
    seconds = time.perf_counter() - start
    for error in errors:
        if error is not None:
            raise error
    return seconds
