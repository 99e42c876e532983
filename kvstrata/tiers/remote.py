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
changed in staging during or after the transfer are a miss, never served. (The buffers:
``kvstrata.tiers.staging``; the puts: ``remote_puts``; the gets: ``remote_gets``.)

Placement. With the pool's ``segments`` (pool daemons by segment name), each batched put goes
as one call per segment, all in flight at once, its blocks dealt out to them one by one, so
that a later batched get of those blocks draws on every daemon's NIC port at once (measured:
blocks on two daemons behind two 1 Gbit/s links got at 2x one link). The runs go round the
segments block by block over the tier's puts (no segment takes more than one block more than
another); ``write`` picks its object's segment by the key. Without segments the master places
each object (measured: 32 objects 13/19 over two daemons). A segment is a preference: the master
places an object elsewhere when that segment is full or unknown (``kvstrata.tiers.segments``).

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

from kvstrata.errors import BlockMissing
from kvstrata.index.keys import BlockKey
from kvstrata.kv.layout import KVLayout
from kvstrata.media import Medium
from kvstrata.pool import ops
from kvstrata.pool.client import PoolClient, PoolUnavailable, Reconnected
from kvstrata.pool.codes import Code
from kvstrata.pool.config import DEFAULT_BUDGETS, PoolConfig, RemoteMode
from kvstrata.tiers import poolvalue
from kvstrata.tiers.base import Pieces, Tier, TierCapabilities
from kvstrata.tiers.remote_gets import NAMES_KEPT, GetPath
from kvstrata.tiers.remote_puts import PoolRefused, PutPath
from kvstrata.tiers.segments import Segments
from kvstrata.tiers.staging import BatchMove, Lanes

__all__ = ["BlockMissing", "PoolRefused", "PoolUnavailable", "Reconnected", "RemoteMode", "RemoteTier"]

_TAG = re.compile(r"[A-Za-z0-9._-]{0,128}")
EXISTS_PER_CALL = 1024  # names per existence query


class RemoteTier(PutPath, GetPath, Tier):
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
    capabilities = TierCapabilities(batched_reads=True, pipelined=True)

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
        self._segments = Segments()  # where batched puts go among the pool's segments
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

    def _staged_batch(self, keys: list[BlockKey], blocks: Sequence[Pieces], move: BatchMove) -> list[BaseException | None]:
        """Run ``move`` (the gets' or the puts' pipeline) over whole blocks, given as their non-empty
        pieces, through this thread's lane, its staging made before the first call. Making it
        can find the pool DOWN (and this thread's buffers to be made again): then every block
        fails with that PoolUnavailable, and ``move`` does not run."""
        client = self._live()
        parts = [[p for p in pieces if p.numel()] for pieces in blocks]
        try:
            lane = self._lanes.get(client)
            lane.rows(client, 0, 0)
        except PoolUnavailable as error:
            return [error] * len(keys)
        return move(client, lane, keys, parts)

    def _now_ns(self) -> int:
        """A written_ns for a value about to be sealed: the wall clock, strictly increasing."""
        with self._lock:
            self._clock_ns = max(time.time_ns(), self._clock_ns + 1)
            return self._clock_ns

def fresh_tag() -> str:
    """A namespace tag no other tier uses (tests, benchmarks)."""
    return uuid.uuid4().hex
