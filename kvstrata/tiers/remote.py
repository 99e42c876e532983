"""The remote tier: blocks in a shared DRAM pool (Mooncake Store) that many processes use.

Where blocks live. Block ``key`` is a pool object in the format of ``kvstrata.tiers.poolvalue``
(a 128-byte header, then the payload), sealed with the deployment's secret: every value read
back is authenticated before it is served. Its name is ``kvstrata/<namespace_tag>/<key hex>``
without a secret; with one, both parts are keyed with it (``ValueSeal.object_name``), so that a
listing of the pool says nothing of whose blocks they are. Keys are chained from the namespace
digest already; the name's middle part keeps the objects of different models or tenants apart. Objects live in the pool daemons, never in this process
(it joins with a segment of 0 bytes), so they outlive it and every instance sees them.

The block manager's table for this tier is this process's view of the pool: keys it wrote, and
keys other instances wrote that ``find`` (``exists``) saw. ``discard`` does not remove the
object, since other instances share it, and the pool evicts by itself when full. A key READY in
the view may therefore be gone from the pool: the cache's lookup asks the pool about the blocks
only it holds (``find``, one bounded call) and forgets those gone, counted; one gone between the
lookup and the read raises BlockMissing (a CorruptBlock), a miss, never wrong data.
``remove_from_pool`` deletes objects explicitly.

Private memory. No memory that KV is served from (a host or device tier, an engine's pages) is
ever registered with the store: Mooncake's transfer engine hands the addresses of every
registered buffer to anyone who reaches its handshake port, and any such client may then read
and write them. Every transfer goes through this thread's own registered staging buffers (a
header page and ``STAGE_BYTES`` of blocks, two halves: one call's blocks are copied while the
next call's move). A put copies the caller's bytes into staging and seals them from the
caller's (private) memory, never from staging; a get copies the value out of staging into the caller's memory (one copy), then
verifies that copy (the MAC, or the payload checksum) against a copy of its header: bytes
changed in staging during or after the transfer are a miss, never served.

Placement. With the pool's ``segments`` (pool daemons by segment name), each batched put goes
as one call per segment, all in flight at once, its blocks dealt out to them one by one, so
that a later batched get of those blocks draws on every daemon's NIC port at once (measured:
blocks on two daemons behind two 1 Gbit/s links got at 2x one link). The runs go round the
segments block by block over the tier's puts (no segment takes more than one block more than
another); ``write`` picks its object's segment by the key. Without segments the master places
each object (measured: 32 objects 13/19 over two daemons). A segment is a preference: the master
places an object elsewhere when that segment is full or unknown.

Faults. Every store call is bounded (``op_timeout_s``) on a private worker thread; a timeout or
a transport error puts the tier DOWN: calls raise PoolUnavailable at once while a background
thread probes the pool with backoff, reconnecting (to new addresses, if the pool's config file
says so) when it can (see ``kvstrata.pool.client``). A tier built with ``required=False`` starts
DOWN when the pool cannot be reached, and keeps trying. ``on_reconnect`` tells the owner of the
tier's table (the block manager's view) that the pool is back, perhaps another pool: its view
may name objects the pool no longer has. The contract for the caller's memory:

* A read that did not end cleanly (timed out, or a transport error) raises PoolUnavailable:
  the caller's memory was never handed to the pool; the thread's staging buffers, which a
  stray call may still write, are retired (kept, never reused).
* A ``write`` that times out raises PoolUnavailable; should the put complete later anyway, the
  object is removed then, since the source memory may have changed meanwhile (an instance that
  reads it in between finds that its bytes fail the value's MAC, or without a secret its
  payload checksum: a miss).
"""

from __future__ import annotations

import functools
import re
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvstrata.errors import BlockMissing, CorruptBlock
from kvstrata.index.keys import BlockKey
from kvstrata.kv.layout import KVLayout
from kvstrata.media import Medium
from kvstrata.pool.client import CallTimedOut, PendingCall, PoolClient, PoolUnavailable, Reconnected
from kvstrata.pool import native_log, ops
from kvstrata.pool.codes import MISSING, PUT_DONE, PUT_REFUSED, Code
from kvstrata.pool.config import DEFAULT_BUDGETS, PoolConfig, RemoteMode
from kvstrata.tiers import poolvalue
from kvstrata.tiers.base import Pieces, Tier, split_like
from kvstrata.tiers.staging import Lane, Lanes, buffers

__all__ = ["BlockMissing", "PoolRefused", "PoolUnavailable", "Reconnected", "RemoteMode", "RemoteTier"]

_TAG = re.compile(r"[A-Za-z0-9._-]{0,128}")
EXISTS_PER_CALL = 1024  # names per existence query
NAMES_KEPT = 1 << 14  # object names, and the newest write time read at each, remembered per tier (a few MB at most)


class PoolRefused(RuntimeError):
    """The pool refused to store one object (full, say); the pool itself is fine."""


class RemoteTier(Tier):
    """Blocks as objects in a shared Mooncake pool.

    Args:
        layout: what every block holds; values written under another layout are never served.
        capacity_bytes: how much of the pool this process's view tracks.
        pool: where the pool is.
        mode: TCP (via the master) or SHM (via the pool daemon on this host).
        namespace_tag: the object name's middle part (e.g. ``Namespace.tag``).
        op_timeout_s: the longest one store call is waited for.
        connect_timeout_s: the longest connecting may take.
        backoff_s, backoff_max_s: after a fault, the first wait before a background probe, and
            the longest (it doubles per failed probe).
        required: raise if the pool cannot be reached now; False: start DOWN, keep trying.
        secret: the deployment secret (``kvstrata.pool.config.read_secret``): values are sealed
            and object names keyed with it, and a value without this deployment's seal is a
            miss; None: neither (a pool only trusted processes reach), and each value carries
            an xxh3_64 of its payload instead, checked on every read.
        encrypt: encrypt payloads too (AES-GCM; needs ``secret``).

    Raises:
        PoolUnavailable: the pool client is not installed, or (``required``) the pool could
            not be reached within ``connect_timeout_s``.
    """

    medium = Medium.REMOTE
    shared = True
    batched_reads = True
    pipelined = True

    def __init__(
        self,
        layout: KVLayout,
        capacity_bytes: int,
        pool: PoolConfig,
        mode: RemoteMode = RemoteMode.TCP,
        namespace_tag: str = "",
        op_timeout_s: float = DEFAULT_BUDGETS.op_timeout_s,
        connect_timeout_s: float = DEFAULT_BUDGETS.connect_timeout_s,
        backoff_s: float = DEFAULT_BUDGETS.backoff_s,
        backoff_max_s: float = DEFAULT_BUDGETS.backoff_max_s,
        required: bool = True,
        secret: bytes | None = None,
        encrypt: bool = False,
    ) -> None:
        super().__init__(layout, capacity_bytes)
        if not isinstance(namespace_tag, str) or not _TAG.fullmatch(namespace_tag):
            raise ValueError(f"remote tier: namespace_tag must match {_TAG.pattern}, got {namespace_tag!r}")
        self.namespace_tag = namespace_tag
        self._seal = poolvalue.ValueSeal(layout.describe(), layout.block_bytes, namespace_tag, secret, encrypt)
        # Keyed names cost an HMAC each, on every lookup that asks the pool: remember recent ones.
        self._names = functools.lru_cache(maxsize=NAMES_KEPT)(self._seal.object_name)
        # object name -> the newest written_ns of a value this tier read there, the NAMES_KEPT most
        # recent: a read of an older value there is a replay (tiers/poolvalue.py), refused.
        self._seen: OrderedDict[str, int] = OrderedDict()
        self._clock_ns = 0  # the last written_ns given out: they strictly increase
        self._lanes = Lanes(layout.block_bytes)  # each thread's registered buffers
        self._lock = threading.Lock()
        self._replicas: dict[str, Any] = {}  # segment name -> the ReplicateConfig that puts objects there
        self._turn = 0  # the segment the next batched put's first run goes to (an index, mod their count)
        self._listener: Callable[[RemoteTier, Reconnected], None] | None = None
        self._pool = pool
        reconnected = weakref.WeakMethod(self._reconnected)  # the client must not keep the tier alive

        def on_up(event: Reconnected) -> None:
            method = reconnected()
            if method is not None:
                method(event)

        self._client: PoolClient | None = PoolClient(pool, mode, op_timeout_s, connect_timeout_s, backoff_s,
                                                     backoff_max_s, required, on_up)

    # --- names and memory ---------------------------------------------------------------------

    def object_name(self, key: BlockKey) -> str:
        """The pool object of ``key`` (keyed with the secret, when there is one)."""
        return self._names(key)

    @property
    def mode(self) -> RemoteMode:
        return self._live().mode

    @property
    def pool(self) -> PoolConfig:
        """Where the pool is (now: a reconnect may have found it elsewhere)."""
        client = self._client
        return self._pool if client is None else client.pool

    @property
    def up(self) -> bool:
        """False while the pool is down (calls fail fast, a background probe runs) or once closed."""
        return self._client is not None and self._client.up

    @property
    def unavailable(self) -> str | None:
        """Why the tier cannot serve now (the pool down, unreachable, the tier closed); None: it can."""
        client = self._client
        return "remote tier is closed" if client is None else client.down_reason

    def on_reconnect(self, listener: Callable[[RemoteTier, Reconnected], None] | None) -> None:
        """Call ``listener(tier, event)`` (on the probing thread) each time the pool is reached
        again: after a fault, or for the first time."""
        self._listener = listener

    def _reconnected(self, event: Reconnected) -> None:
        listener = self._listener
        if listener is not None:
            listener(self, event)

    # --- the Tier interface -------------------------------------------------------------------

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
                f"put of {name}", ops.BATCH_PUT_MULTI, [name], [ptrs], [sizes], *self._placed(key),
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
        client = self._live()
        parts = [[p for p in pieces if p.numel()] for pieces in blocks]
        try:
            lane = self._lanes.get(client)
            lane.rows(client, 0, 0)  # the staging, made before the first put
        except PoolUnavailable as error:  # DOWN, and this thread's buffers must be made again
            return [error] * len(keys)
        return self._put_blocks(client, lane, keys, parts)

    def _put_blocks(self, client: PoolClient, lane: Lane, keys: list[BlockKey],
                    blocks: list[list[torch.Tensor]]) -> list[BaseException | None]:
        """Batched, pipelined puts of blocks given as their parts (CPU, flat uint8, in order):
        each sealed from its parts, copied into a staging row, and the object of ``keys[i]``
        put from the buffers ``[header, row]``. Each call goes as the sub-calls ``_spread`` cuts
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
                    _copy(split_like(rows[j], blocks[i]), blocks[i])
                    header, _ = self._seal.seal(keys[i], [part.numpy() for part in blocks[i]], self._now_ns())
                    headers[j].numpy()[:] = np.frombuffer(header, dtype=np.uint8)
                if not self._settle_puts(client, lane, names, pending, out):
                    return out
                ptrs, sizes = buffers(headers, rows, batch)
                for run, placed in self._spread(batch):
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

    def _spread(self, batch: range) -> list[tuple[range, tuple[Any, ...]]]:
        """The sub-calls that put one call's blocks: with the pool's segments, ``batch`` dealt out
        block by block, one strided run per segment (``range(start, stop, count)``, none
        empty), each with the extra argument of its call (the ReplicateConfig that puts its
        objects on its segment); without, the whole batch and none (the master places them).

        Dealt, not cut: a later restore reads the blocks in calls of its own (and over several
        workers), and any run of consecutive blocks then has near-equal shares on every segment.
        Cut into contiguous runs, one get call held 16 blocks of one daemon and 8 of the other,
        and two 1 Gbit/s ports gave 1.33x one port instead of 2x (measured in the lab). The
        dealing turns by ``len(batch)`` from call to call, so it goes on round the segments
        over the tier's puts, in any threads."""
        segments = self.pool.segments
        if not segments:
            return [(batch, ())]
        count = len(segments)
        with self._lock:
            turn = self._turn
            self._turn = (turn + len(batch)) % count
        return [(range(batch.start + n, batch.stop, count), (self._replica(segments[(turn + n) % count]),))
                for n in range(min(count, len(batch)))]

    def _placed(self, key: BlockKey) -> tuple[Any, ...]:
        """The extra argument of a put of ``key``'s object alone: the ReplicateConfig of the
        segment its key picks (keys are uniform hashes), or none without segments."""
        segments = self.pool.segments
        return (self._replica(segments[int.from_bytes(key, "little") % len(segments)]),) if segments else ()

    def _replica(self, segment: str) -> Any:
        """A ``mooncake.store.ReplicateConfig`` that puts each object once, on ``segment``; one per
        segment, made on first use (Mooncake is imported only where a tier reached a pool)."""
        with self._lock:
            config = self._replicas.get(segment)
            if config is None:
                config = native_log.store_module().ReplicateConfig()
                config.replica_num, config.preferred_segment = 1, segment
                self._replicas[segment] = config
            return config

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
        _copy([private], [row])  # out of staging first: what is verified is what is served
        self._opened(name, key, head, [private.numpy()])
        if not whole:
            _copy([dst], [private.view(self.layout.num_layers, layer_bytes)[start:stop]])

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
        client = self._live()
        parts = [[p for p in pieces if p.numel()] for pieces in blocks]
        try:
            lane = self._lanes.get(client)
            lane.rows(client, 0, 0)  # the staging, made before the first get
        except PoolUnavailable as error:  # DOWN, and this thread's buffers must be made again
            return [error] * len(keys)
        return self._get_blocks(client, lane, keys, parts)

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
                _copy(blocks[i], split_like(rows[j], blocks[i]))  # checked next, still in cache
                head = heads[j * poolvalue.HEADER_BYTES : (j + 1) * poolvalue.HEADER_BYTES]
                self._opened(names[i], keys[i], head, [part.numpy() for part in blocks[i]])
            except (CorruptBlock, PoolUnavailable) as error:
                out[i] = error

    def close(self) -> None:
        """Leave the pool (the objects stay). Idempotent; afterwards calls raise RuntimeError.
        Memory from ``allocate`` stays valid for whoever still holds it."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # --- shared visibility --------------------------------------------------------------------

    def find(self, keys: list[BlockKey]) -> list[bool]:
        return self.exists(keys)

    def exists(self, keys: list[BlockKey]) -> list[bool]:
        """Which of ``keys`` are in the pool now (written by any instance). False where the
        pool could not say (down, error)."""
        if not keys:
            return []
        client = self._live()
        out: list[bool] = []
        for first in range(0, len(keys), EXISTS_PER_CALL):
            names = [self.object_name(k) for k in keys[first : first + EXISTS_PER_CALL]]
            try:
                answers = client.call(f"exists of {len(names)} objects", ops.BATCH_IS_EXIST, names)
            except PoolUnavailable:
                return out + [False] * (len(keys) - len(out))
            if any(a < 0 for a in answers):
                client.mark_down(f"exists answered {min(answers)}")
            out += [a == 1 for a in answers]
        return out

    def remove_from_pool(self, keys: list[BlockKey], force: bool = False) -> list[bool]:
        """Delete objects from the pool for every instance (the table is the caller's).

        Args:
            force: remove even objects under a read lease (a reader then gets a miss).

        Returns:
            Per key, whether it is gone from the pool now (False: under a lease, or an error).

        Raises:
            PoolUnavailable: the pool is down or did not answer in time.
        """
        if not keys:
            return []
        client = self._live()
        codes = client.call(f"remove of {len(keys)} objects", ops.BATCH_REMOVE, [self.object_name(k) for k in keys], force)
        return [rc in (0, Code.OBJECT_NOT_FOUND) for rc in codes]

    # --- helpers ------------------------------------------------------------------------------

    def _live(self) -> PoolClient:
        client = self._client
        if client is None:
            raise RuntimeError("remote tier is closed")
        return client

    def _now_ns(self) -> int:
        """A written_ns for a value about to be sealed: the wall clock, strictly increasing."""
        with self._lock:
            self._clock_ns = max(time.time_ns(), self._clock_ns + 1)
            return self._clock_ns

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


def _copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dsts[i][:] = srcs[i]``; the caller's tensors may be inference tensors (made under
    ``torch.inference_mode``, as an engine's KV is), which only that mode may update in place."""
    with torch.inference_mode():
        torch._foreach_copy_(dsts, srcs)


def _undo_late_put(store, name: str, codes: list[int]) -> None:
    # A put that completed after its caller gave up: its source may have changed meanwhile.
    if codes and codes[0] == 0:
        ops.REMOVE.run(store, name, True)


def _undo_late_puts(store, names: list[str], codes: list[int]) -> None:
    # As _undo_late_put, for each object of a batched put.
    stored = [name for name, rc in zip(names, codes) if rc == 0]
    if stored:
        ops.BATCH_REMOVE.run(store, stored, True)



def fresh_tag() -> str:
    """A namespace tag no other tier uses (tests, benchmarks)."""
    return uuid.uuid4().hex
