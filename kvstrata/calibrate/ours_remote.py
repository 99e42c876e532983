"""Blocks stored in and restored from the pool at the tier: ``RemoteTier`` driven by the transfer
worker (how ``kvstrata lab``'s workers fill the pool; kvstrata's side of ``bench remote``).

This is the first hop of every pool transfer the cache makes: the worker's byte movers (two by
default, as in the cache) run the cache's own handlers between the pool and a host tier (built as
the cache builds its own: never registered with the pool), so each block is copied once, through
the tier's own registered staging: stores call ``RemoteTier.write_many`` (one object per block: the 128-byte value header
and the block; batched puts, pipelined with sealing), restores ``RemoteTier.read_many_into``
(batched gets, pipelined with checking every value), the whole batch on one mover. The tier is driven with no block table: it names objects by key and
ignores slots (the cache's block manager keeps the table, outside this first hop). The host tier
holds the stored blocks in its first half of slots and the restored ones in its second.

Verification: before each restore the destination is zeroed (untimed); afterwards every block
is compared byte for byte with the block stored, so a restore that moved nothing or the wrong
bytes fails the run instead of looking fast.
"""

from __future__ import annotations

import time
import torch

from kvstrata.index.keys import BlockKey
from kvstrata.kv.layout import KVLayout
from kvstrata.manager.plans import Leg, Slot
from kvstrata.media import Medium
from kvstrata.pool.config import PoolConfig, RemoteMode
from kvstrata.tiers import poolvalue
from kvstrata.tiers.memory import HostTier
from kvstrata.tiers.remote import RemoteTier
from kvstrata.timing import VerificationError
from kvstrata.transfer.worker import Moved, TransferWorker

OP_TIMEOUT_S = 60.0  # a benchmark may move large blocks over a slow link: bound calls loosely


class OursRemote:
    """The blocks as objects of a RemoteTier, stored and restored through the worker.

    Args:
        layout: the block layout.
        pool: where the pool is.
        mode: TCP or SHM.
        keys: one key per block.
        blocks: the blocks, uint8 ``[blocks, layers, layer_bytes]`` (CPU).
        namespace_tag: the objects' name prefix (the cache's namespace tag, so a cache of
            that namespace finds them: see ``kvstrata.calibrate.poolcache``).
        workers: the worker's byte movers.
        secret, encrypt: seal (and encrypt) the values, as a cache with the pool's secret does.

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
        secret: bytes | None = None,
        encrypt: bool = False,
    ) -> None:
        self.layout = layout
        self.keys = keys
        self.size_bytes = len(keys) * layout.block_bytes
        self.tier = RemoteTier(layout, self.size_bytes, pool, mode, namespace_tag=namespace_tag, op_timeout_s=OP_TIMEOUT_S,
                               secret=secret, encrypt=encrypt)
        self._worker: TransferWorker | None = None
        self.host: HostTier | None = None
        try:
            self.host = HostTier(layout, 2 * self.size_bytes)
            self.host.buffer[: len(keys)].copy_(blocks)  # [blocks, layers, layer_bytes]: slots 0..n-1
            self._worker = TransferWorker({Medium.HOST: self.host, Medium.REMOTE: self.tier}, workers)
        except BaseException:
            self.close()
            raise
        self.verified_bytes = 0

    @property
    def names(self) -> list[str]:
        return [self.tier.object_name(k) for k in self.keys]

    def values(self) -> torch.Tensor:
        """Each object's whole value as the tier writes it, uint8 ``[blocks, 128 + block_bytes]``:
        the bytes a raw client must move to match ours."""
        digest = poolvalue.layout_digest(self.layout.describe())
        out = torch.empty((len(self.keys), poolvalue.HEADER_BYTES + self.layout.block_bytes), dtype=torch.uint8)
        for i, key in enumerate(self.keys):
            header = poolvalue.encode_header(key, digest, self.layout.block_bytes, None)
            out[i, : poolvalue.HEADER_BYTES] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
            out[i, poolvalue.HEADER_BYTES :] = self.host.view(i).view(-1)
        return out

    # --- steps: each returns the seconds its timed part took -----------------------------------

    def store_s(self) -> float:
        """Every block, host -> pool, as new objects (removed first, untimed: a put of a name
        that exists is a no-op and would time nothing)."""
        self.remove()
        # The remote tier names the object by the key: slot 0, no table.
        legs = [Leg(key, Slot(Medium.HOST, i), Slot(Medium.REMOTE, 0)) for i, key in enumerate(self.keys)]
        start = time.perf_counter()
        return _settled_s(self._live().move(legs), start)

    def restore_s(self, count: int | None = None) -> float:
        """The first ``count`` blocks (all by default), pool -> host; then verified."""
        keys = self.keys[: len(self.keys) if count is None else count]
        n = len(self.keys)
        dst = self.host.buffer[n : n + len(keys)]  # [blocks, layers, layer_bytes]
        dst.zero_()  # a restore that moved nothing must not verify
        legs = [Leg(key, Slot(Medium.REMOTE, 0), Slot(Medium.HOST, n + i)) for i, key in enumerate(keys)]
        start = time.perf_counter()
        seconds = _settled_s(self._live().move(legs), start)
        for i in range(len(keys)):
            if not torch.equal(dst[i], self.host.view(i)):
                raise VerificationError(f"remote tier: restored block {i} differs from the block stored")
        self.verified_bytes += dst.numel()
        return seconds

    def remove(self) -> None:
        """Delete the objects from the pool (untimed housekeeping)."""
        self.tier.remove_from_pool(self.keys, force=True)

    def close(self) -> None:
        """Remove the objects, stop the worker, leave the pool. Idempotent."""
        try:
            if self.tier.up:
                self.remove()
        finally:
            if self._worker is not None:
                self._worker.close()
                self._worker = None
            if self.host is not None:
                self.host.close()
            self.tier.close()

    def _live(self) -> TransferWorker:
        if self._worker is None:
            raise RuntimeError("closed")
        return self._worker


def _settled_s(moved: Moved, start: float) -> float:
    """Seconds from ``start`` to now (every leg has settled); then the first failure, if any, raises."""
    seconds = time.perf_counter() - start
    error = next((e for e in moved.errors if e is not None), None)
    if error is not None:
        raise error
    return seconds
