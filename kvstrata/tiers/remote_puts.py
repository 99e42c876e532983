"""The remote tier's puts (``kvstrata.tiers.remote``): each value sealed from the caller's own
(private) memory, copied into this thread's registered staging (``kvstrata.tiers.staging``),
and put from there; batches in pipelined calls, dealt out to the pool's segments
(``kvstrata.tiers.segments``).

A ``write`` that times out raises PoolUnavailable; should the put complete later anyway, the
object is removed then, since the source memory may have changed meanwhile (an instance that
reads it in between finds that its bytes fail the value's MAC, or without a secret its payload
checksum: a miss).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvstrata.index.keys import BlockKey
from kvstrata.pool import ops
from kvstrata.pool.client import CallTimedOut, PendingCall, PoolClient, PoolUnavailable
from kvstrata.pool.codes import PUT_DONE, PUT_REFUSED
from kvstrata.tiers import poolvalue
from kvstrata.tiers.base import Pieces, split_like
from kvstrata.tiers.staging import Lane, buffers, copy_into


class PoolRefused(RuntimeError):
    """The pool refused to store one object (full, say); the pool itself is fine."""


class PutPath:
    """The put half of ``RemoteTier`` (a mixin: its state is the tier's)."""

    def write(self, slot: int, key: BlockKey, src: torch.Tensor) -> None:
        """Put ``src`` (uint8 ``[layers, layer_bytes]``, any device) as the object of ``key``.

        ``slot`` is not used. A key already in the pool is left as it is (keys name content).
        The value is sealed from ``src`` (a private copy of it, off the CPU), then copied into
        this thread's staging, which the pool reads.

        Raises:
            PoolUnavailable: the pool is down or did not answer in time.
            PoolRefused: the pool would not take this object now (e.g. full).
        """
        client = self._live()
        shape = (self.layout.num_layers, self.layout.layer_bytes)
        if src.dtype != torch.uint8 or tuple(src.shape) != shape:
            raise ValueError(f"remote tier: src must be uint8 {list(shape)}, got {src.dtype} {list(src.shape)}")
        name = self.object_name(key)
        lane = self._lanes.get(client)
        row = lane.rows(client, 0, 1)[0].view(shape)
        private = src.to("cpu").contiguous()  # sealed here, never in staging: staging is not ours alone
        if self._seal.encrypt:  # the ciphertext streamed into the row through private scratch (poolvalue._stream)
            header, _ = self._seal.seal(key, [private.numpy()], self._now_ns(), into=row.numpy())
        else:
            header, _ = self._seal.seal(key, [private.numpy()], self._now_ns())
            row.copy_(private)
        lane.header[: poolvalue.HEADER_BYTES].numpy()[:] = np.frombuffer(header, dtype=np.uint8)
        ptrs = [lane.header.data_ptr(), row.data_ptr()]
        sizes = [poolvalue.HEADER_BYTES, row.numel()]
        try:
            (rc,) = client.call(
                f"put of {name}", ops.BATCH_PUT_MULTI, [name], [ptrs], [sizes], *self._segments.placed(self.pool.segments, key),
                on_late=lambda store, codes: _undo_late_put(store, name, codes), generation=lane.generation,
            )
        except CallTimedOut:
            self._lanes.retire(lane)  # the stray put still reads the header and staging
            raise
        if rc in PUT_DONE:
            return
        if rc in PUT_REFUSED:
            raise PoolRefused(f"remote tier: the pool refused {name} (Mooncake code {rc})")
        client.mark_down(f"put failed with Mooncake code {rc}", lane.generation)
        raise PoolUnavailable(f"remote tier: put of {name} failed (Mooncake code {rc})")

    def write_many(self, slots: list[int], keys: list[BlockKey], srcs: list[torch.Tensor]) -> list[BaseException | None]:
        """Put several blocks in few pool calls; per block None or the error ``write`` would
        have raised for it. CPU sources (not encrypted, no key twice) go as ``write_pieces``
        puts them, one piece each; any other batch goes block by block."""
        shape = (self.layout.num_layers, self.layout.layer_bytes)
        blocks = [[src.view(-1)] for src in srcs if src.dtype == torch.uint8 and tuple(src.shape) == shape
                  and src.is_contiguous() and src.device.type == "cpu"]
        if len(blocks) != len(srcs) or self._seal.encrypt or len(set(keys)) != len(keys):
            return super().write_many(slots, keys, srcs)
        return self.write_pieces(slots, keys, blocks)

    def write_pieces(self, slots: list[int], keys: list[BlockKey], blocks: Sequence[Pieces]) -> list[BaseException | None]:
        """Put several blocks, each from its pieces as they lie, through this thread's staging:
        one object per block (not encrypted, no key twice); else as the default does
        (gathered, then ``write_many``).

        The puts are batched and pipelined: this thread seals the next call's blocks (the MAC
        reads every byte) and copies them into staging while the pool takes the last call's. A
        put that times out leaves its blocks and the later ones failed (PoolUnavailable); its
        objects are removed should it complete later, as ``write`` does."""
        self._check_pieces(blocks)
        if self._seal.encrypt or len(set(keys)) != len(keys):
            return super().write_pieces(slots, keys, blocks)
        return self._staged_batch(keys, blocks, self._put_blocks)

    def _put_blocks(self, client: PoolClient, lane: Lane, keys: list[BlockKey],
                    blocks: list[list[torch.Tensor]]) -> list[BaseException | None]:
        """Batched, pipelined puts of blocks given as their parts (CPU, flat uint8, in order):
        each sealed from its parts, copied into a staging row, and the object of ``keys[i]``
        put from the buffers ``[header, row]``. Each call goes as the sub-calls ``Segments.spread`` cuts
        it into (one per segment), together."""
        names = [self.object_name(k) for k in keys]
        out: list[BaseException | None] = [None] * len(keys)
        pending: list[tuple[range, PendingCall]] = []  # the sub-calls in flight, in block order
        try:
            for k, batch in enumerate(self._lanes.calls(len(keys), growing=True)):
                headers = lane.headers(k % 2, len(batch))
                rows = lane.rows(client, k % 2, len(batch))
                for j, i in enumerate(batch):  # overlaps the puts of the previous call
                    # Copied, then sealed from the caller's bytes (still in cache), never from staging.
                    copy_into(split_like(rows[j], blocks[i]), blocks[i])
                    header, _ = self._seal.seal(keys[i], [part.numpy() for part in blocks[i]], self._now_ns())
                    headers[j].numpy()[:] = np.frombuffer(header, dtype=np.uint8)
                if not self._settle_puts(client, lane, names, pending, out):
                    return out
                ptrs, sizes = buffers(headers, rows, batch)
                for run, placed in self._segments.spread(self.pool.segments, batch):
                    at = slice(run.start - batch.start, run.stop - batch.start, run.step)
                    run_names = names[run.start : run.stop : run.step]
                    try:
                        call = client.start(f"batch put of {len(run)} blocks", ops.BATCH_PUT_MULTI,
                                            run_names, ptrs[at], sizes[at], *placed, generation=lane.generation,
                                            on_late=lambda store, codes, n=run_names: _undo_late_puts(store, n, codes))
                    except PoolUnavailable as error:  # DOWN: this call's blocks (some perhaps put) and the later ones fail
                        out[batch.start :] = [error] * (len(keys) - batch.start)
                        return out
                    pending.append((run, call))
                for _, call in pending:  # before the next call's seals hold the interpreter's lock
                    call.handed_over()
            self._settle_puts(client, lane, names, pending, out)
        finally:
            for _, call in pending:  # an error escaped with puts in flight: let them finish reading
                try:
                    call.result()
                except Exception:  # noqa: BLE001 - the error that escaped is the one to report
                    pass
        return out

    def _settle_puts(self, client: PoolClient, lane: Lane, names: list[str], pending: list[tuple[range, PendingCall]],
                     out: list[BaseException | None]) -> bool:
        """Settle the sub-calls in ``pending`` in order (``_settle_put``), taking each off it; False
        once one finds the pool DOWN (those left are still in flight: the caller waits for them)."""
        while pending:
            run, call = pending.pop(0)
            if not self._settle_put(client, lane, names, run, call, out):
                for later, _ in pending:  # dealt among this call's blocks: failed with them
                    for i in later:
                        out[i] = out[i] or PoolUnavailable(f"remote tier: the pool is down ({client.down_reason})")
                return False
        return True

    def _settle_put(self, client: PoolClient, lane: Lane, names: list[str], blocks: range, call: PendingCall,
                    out: list[BaseException | None]) -> bool:
        """The outcome of one batched put (of ``blocks``, a run that may be strided) into ``out``;
        False when the pool is DOWN now (the blocks after the run's last are failed too: nothing
        more is put)."""
        after = blocks[-1] + 1
        try:
            codes = call.result()
        except CallTimedOut as error:
            self._lanes.retire(lane)  # the stray put still reads the headers
            for i in blocks:
                out[i] = error
            out[after:] = [error] * (len(out) - after)
            return False
        for j, i in enumerate(blocks):
            rc = codes[j]
            if rc in PUT_REFUSED:
                out[i] = PoolRefused(f"remote tier: the pool refused {names[i]} (Mooncake code {rc})")
            elif rc not in PUT_DONE:
                client.mark_down(f"put failed with Mooncake code {rc}", lane.generation)
                out[i] = PoolUnavailable(f"remote tier: put of {names[i]} failed (Mooncake code {rc})")
        if client.up:
            return True
        down = PoolUnavailable(f"remote tier: the pool is down ({client.down_reason}); the put was not made")
        out[after:] = [down] * (len(out) - after)
        return False


def _undo_late_put(store, name: str, codes: list[int]) -> None:
    # A put that completed after its caller gave up: its source may have changed meanwhile.
    if codes and codes[0] == 0:
        ops.REMOVE.run(store, name, True)


def _undo_late_puts(store, names: list[str], codes: list[int]) -> None:
    # As _undo_late_put, for each object of a batched put.
    stored = [name for name, rc in zip(names, codes) if rc == 0]
    if stored:
        ops.BATCH_REMOVE.run(store, stored, True)
