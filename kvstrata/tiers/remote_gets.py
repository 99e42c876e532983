"""The remote tier's gets (``kvstrata.tiers.remote``): each value lands in this thread's
registered staging (``kvstrata.tiers.staging``), is copied out into the caller's memory (one
copy), and that copy is verified against a copy of its header (the MAC, or the payload
checksum): bytes changed in staging during or after the transfer are a miss, never served.

A read that did not end cleanly (timed out, or a transport error) raises PoolUnavailable: the
caller's memory was never handed to the pool; the thread's staging buffers, which a stray call
may still write, are retired (kept, never reused).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvstrata.errors import BlockMissing, CorruptBlock
from kvstrata.index.keys import BlockKey
from kvstrata.pool import ops
from kvstrata.pool.client import CallTimedOut, PendingCall, PoolClient, PoolUnavailable
from kvstrata.pool.codes import MISSING, Code
from kvstrata.tiers import poolvalue
from kvstrata.tiers.base import Pieces, split_like
from kvstrata.tiers.staging import Lane, buffers, copy_into

NAMES_KEPT = 1 << 14  # object names, and the newest write time read at each, remembered per tier (a few MB at most)


class GetPath:
    """The get half of ``RemoteTier`` (a mixin: its state is the tier's)."""

    def read_into(self, slot: int, key: BlockKey, dst: torch.Tensor, layers: slice = slice(None)) -> None:
        """Read layers ``layers`` of ``key`` into ``dst`` (uint8 ``[n_layers, layer_bytes]``).

        The whole object always moves (header, then payload) into this thread's staging, and
        is copied out before it is verified: into ``dst`` itself for a whole block in CPU
        memory, else into a private copy whose requested layers go to ``dst`` once verified.

        Raises:
            BlockMissing: the object is not in the pool (a CorruptBlock: a miss).
            CorruptBlock: wrong size, header of another key or layout, bad checksum; ``dst``
                may hold some of its bytes and must be discarded.
            PoolUnavailable: the pool is down or did not answer; ``dst`` was not touched.
        """
        client = self._live()
        start, stop = self._layer_range(layers)
        layer_bytes = self.layout.layer_bytes
        shape = (stop - start, layer_bytes)
        if dst.dtype != torch.uint8 or tuple(dst.shape) != shape:
            raise ValueError(f"remote tier: dst must be uint8 {list(shape)}, got {dst.dtype} {list(dst.shape)}")
        name = self.object_name(key)
        lane = self._lanes.get(client)
        row = lane.rows(client, 0, 1)[0]
        lane.header[: poolvalue.HEADER_BYTES].zero_()  # never a stale header of an earlier read
        ptrs = [lane.header.data_ptr(), row.data_ptr()]
        sizes = [poolvalue.HEADER_BYTES, row.numel()]
        try:
            (got,) = client.call(f"get of {name}", ops.BATCH_GET_MULTI, [name], [ptrs], [sizes],
                                 generation=lane.generation)
        except CallTimedOut as error:
            raise self._abandon(lane, str(error)) from None
        if got < 0:
            self._get_failed(client, lane, name, got)
        if got != sum(sizes):
            raise CorruptBlock(f"remote tier: {name} read {got} bytes, expected {sum(sizes)}: a value of the wrong size")
        head = lane.header[: poolvalue.HEADER_BYTES].numpy().tobytes()
        whole = dst.device.type == "cpu" and dst.is_contiguous() and (start, stop) == (0, self.layout.num_layers)
        private = dst.view(-1) if whole else torch.empty_like(row)
        copy_into([private], [row])  # out of staging first: what is verified is what is served
        self._opened(name, key, head, [private.numpy()])
        if not whole:
            copy_into([dst], [private.view(self.layout.num_layers, layer_bytes)[start:stop]])

    def read_many_into(
        self, slots: list[int], keys: list[BlockKey], dsts: list[torch.Tensor], layers: slice = slice(None)
    ) -> list[BaseException | None]:
        """Whole blocks of several keys in few pool calls (each value still verified on its
        own): per key None (in ``dst``, verified) or the exception ``read_into`` would have
        raised for it. Whole blocks into contiguous CPU destinations are read as
        ``read_pieces`` reads them, one piece each; partial reads, other destinations, and
        batches that name a key twice go one by one."""
        shape = (self.layout.num_layers, self.layout.layer_bytes)
        whole = self._layer_range(layers) == (0, self.layout.num_layers)
        if not whole or len(set(keys)) != len(keys) or not all(
                d.dtype == torch.uint8 and tuple(d.shape) == shape and d.is_contiguous() and d.device.type == "cpu"
                for d in dsts):
            return super().read_many_into(slots, keys, dsts, layers)
        return self.read_pieces(slots, keys, [[dst.view(-1)] for dst in dsts])

    def read_pieces(self, slots: list[int], keys: list[BlockKey], blocks: Sequence[Pieces]) -> list[BaseException | None]:
        """Read whole blocks into their pieces as they lie: each object into this thread's
        staging in batched, pipelined gets, copied out into its pieces, then verified there
        (no key twice; else as the default does: ``read_many_into``, then scattered).

        The gets are pipelined: the get of the next call's blocks runs while this thread copies
        out and checks the blocks of the last (the MAC reads every byte). A call that times out
        fails its blocks and the later ones (PoolUnavailable); their pieces were never handed to
        the pool, and the staging a stray call may still write is retired."""
        self._check_pieces(blocks)
        if len(set(keys)) != len(keys):
            return super().read_pieces(slots, keys, blocks)
        return self._staged_batch(keys, blocks, self._get_blocks)

    def _get_blocks(self, client: PoolClient, lane: Lane, keys: list[BlockKey],
                    blocks: list[list[torch.Tensor]]) -> list[BaseException | None]:
        """Batched, pipelined gets of whole blocks (as their parts: CPU, flat uint8, in order):
        the object of ``keys[i]`` into the staging buffers ``[header, row]``, then copied out
        into ``blocks[i]`` and verified there."""
        names = [self.object_name(k) for k in keys]
        out: list[BaseException | None] = [None] * len(keys)
        calls = self._lanes.calls(len(keys), growing=False)
        try:
            pending: PendingCall | None = self._start_get(client, lane, calls[0], 0, names)
        except PoolUnavailable as error:  # DOWN: nothing was handed to the pool
            return [error] * len(keys)
        try:
            for k, batch in enumerate(calls):
                current, pending = pending, None
                try:
                    got = current.result()
                except CallTimedOut as error:
                    abandoned = self._abandon(lane, str(error))
                    out[batch.start :] = [abandoned] * (len(keys) - batch.start)
                    return out
                unstarted = None
                if k + 1 < len(calls):
                    try:
                        pending = self._start_get(client, lane, calls[k + 1], (k + 1) % 2, names)
                        pending.handed_over()  # before the checks below hold the interpreter's lock
                    except PoolUnavailable as error:  # DOWN since: the later blocks stay untouched
                        unstarted = error
                self._check_got(client, lane, keys, names, blocks, batch, got, k % 2, out)
                if unstarted is not None:
                    out[batch.stop :] = [unstarted] * (len(keys) - batch.stop)
                    return out
        finally:
            if pending is not None:  # an error escaped with a call in flight: let it land first
                try:
                    pending.result()
                except Exception:  # noqa: BLE001 - the error that escaped is the one to report
                    pass
        return out

    def _start_get(self, client: PoolClient, lane: Lane, batch: range, half: int, names: list[str]) -> PendingCall:
        headers = lane.headers(half, len(batch))
        headers.zero_()  # a header a get did not write (a duplicate name, say) must not pass for one
        ptrs, sizes = buffers(headers, lane.rows(client, half, len(batch)), batch)
        return client.start(f"batch get of {len(batch)} blocks", ops.BATCH_GET_MULTI,
                            names[batch.start : batch.stop], ptrs, sizes, generation=lane.generation)

    def _check_got(self, client: PoolClient, lane: Lane, keys: list[BlockKey], names: list[str],
                   blocks: list[list[torch.Tensor]], batch: range, got: list[int], half: int,
                   out: list[BaseException | None]) -> None:
        """Copy out and verify the blocks of one finished get (``got``: bytes or a code per
        block; in staging ``half``) into ``out``: the headers and payloads are copied out of
        staging first, and the copies are what is checked and served."""
        heads = lane.headers(half, len(batch)).numpy().tobytes()
        rows = lane.rows(client, half, len(batch))
        size = poolvalue.HEADER_BYTES + self.layout.block_bytes
        for j, i in enumerate(batch):
            try:
                if got[j] < 0:
                    self._get_failed(client, lane, names[i], got[j])
                if got[j] != size:
                    raise CorruptBlock(f"remote tier: {names[i]} read {got[j]} bytes: a value of the wrong size")
                copy_into(blocks[i], split_like(rows[j], blocks[i]))  # checked next, still in cache
                head = heads[j * poolvalue.HEADER_BYTES : (j + 1) * poolvalue.HEADER_BYTES]
                self._opened(names[i], keys[i], head, [part.numpy() for part in blocks[i]])
            except (CorruptBlock, PoolUnavailable) as error:
                out[i] = error

    def _opened(self, name: str, key: BlockKey, head: bytes, parts: list[np.ndarray]) -> None:
        """Check a value read from object ``name`` (``ValueSeal.open``): none older than the
        newest this tier has read there is served. Why reads, not puts, set that bar: a put of a
        name the pool holds already succeeds (code 0) and leaves the old value in place, so a
        put does not tell which value the pool holds; the first read after it does.

        Raises:
            CorruptBlock: as ``ValueSeal.open``; a replay among them.
        """
        with self._lock:
            newest = self._seen.get(name, 0)
        written_ns = self._seal.open(key, head, parts, newest).written_ns
        with self._lock:
            self._seen[name] = max(written_ns, self._seen.get(name, 0))
            self._seen.move_to_end(name)
            if len(self._seen) > NAMES_KEPT:
                self._seen.popitem(last=False)

    def _abandon(self, lane: Lane, why: str) -> PoolUnavailable:
        """The error for a get that did not end cleanly: the stray call may still write this
        thread's staging (retired, never the caller's memory)."""
        self._lanes.retire(lane)
        return PoolUnavailable(f"remote tier: {why}")

    def _get_failed(self, client: PoolClient, lane: Lane, name: str, code: int) -> None:
        """Raise the error a failed get (Mooncake code ``code``) means."""
        if code in MISSING:
            raise BlockMissing(f"remote tier: {name} is not in the pool (Mooncake code {code})")
        expected = poolvalue.HEADER_BYTES + self.layout.block_bytes
        if code == Code.BUFFERS_TOO_SMALL:
            raise CorruptBlock(f"remote tier: {name} is larger than {expected} bytes: a value of the wrong size: rejected")
        if code == Code.TRANSFER_FAIL:
            # Either the object is smaller than our buffers (refused before any transfer) or
            # the transport failed: the object's size tells which.
            try:
                size = client.call(f"size of {name}", ops.GET_SIZE, name)
            except CallTimedOut as error:  # the get itself has returned: nothing more lands
                raise self._abandon(lane, str(error)) from None
            except PoolUnavailable:
                size = None
            if size == Code.OBJECT_NOT_FOUND:
                raise BlockMissing(f"remote tier: {name} is not in the pool")
            if size is not None and size >= 0 and size != expected:
                raise CorruptBlock(f"remote tier: {name} is {size} bytes, not {expected}: a value of the wrong size: rejected")
        client.mark_down(f"get failed with Mooncake code {code}", lane.generation)
        raise self._abandon(lane, f"get of {name} failed (Mooncake code {code})")
