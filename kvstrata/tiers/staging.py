"""The remote tier's registered buffers: per thread, the only memory of the tier the pool sees.

Mooncake's transfer engine hands the addresses of every registered buffer to anyone who
reaches its handshake port, so no memory KV is served from is ever registered: every transfer
goes through a thread's own *lane*, header pages and ``STAGE_BYTES`` of staging for blocks, two
halves of each (one call's blocks are copied while the next call's move).

A lane is made under one store generation of the pool client (``PoolClient.generation``:
memory registered with one store is not with the next, and SHM segments are the daemon's): a
thread whose client has reconnected since gets a new lane. A lane a stray call may still read
or write (a call abandoned when its caller's budget ran out) is *retired*: kept, never reused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstrata.pool.calls import PoolUnavailable
from kvstrata.pool.client import PoolClient
from kvstrata.index.keys import BlockKey
from kvstrata.tiers import poolvalue

# A lane's registered headers: two halves, one per call in flight or being checked; 128 a half, so
# a batch of 128 blocks (SGLang's storage batch) can go in one call.
HEADER_PAGES_BYTES = 2 * 128 * poolvalue.HEADER_BYTES
HEADERS_PER_CALL = HEADER_PAGES_BYTES // 2 // poolvalue.HEADER_BYTES  # value headers in one half
# Payload bytes per batched pool call at most (a half of a lane's registered staging; at least one
# block, however large): inside its time budget (1 s) at loopback TCP rates on a loaded host too
# (64 MiB: ~0.04 s at 1.5 GB/s; one call at a time moves them).
CALL_BYTES = 64 * 1024**2
# A checked batch (a MAC or a checksum over every byte) is cut into calls that grow threefold from
# 1/16 of the batch, so that the checks of all but one small call overlap a transfer: a put seals a
# call's values before it starts, so its calls grow (the first call's seals wait alone); a get
# checks a call's values once they land, so its calls shrink (the last call's checks wait alone).
# Fewer, larger calls also pay the master's round trips fewer times. Sealed puts of 128 blocks of
# 2 MiB on loopback, against a raw put in the same rounds: 64+64 0.80x, 16+48+64 0.83x, 8+24+96 0.88x.
FIRST_CALL_SHARE, CALL_GROWTH = 16, 3
# Buffers per call at most: Mooncake's TCP transport moves each as a slice of its own, ~20 us
# apiece on loopback (a value is two: its header and its staging row).
CALL_BUFFERS = 1024
# A lane's registered staging for blocks, two halves of CALL_BYTES: one call's blocks are copied
# out of (or into) one half while the next call's move through the other.
STAGE_BYTES = 2 * CALL_BYTES


@dataclass
class Lane:
    """A thread's registered buffers: header pages, and staging for blocks made on first need."""

    header: torch.Tensor  # uint8 [HEADER_PAGES_BYTES]
    generation: int  # the client's store generation they were registered under
    block_bytes: int
    stage: torch.Tensor | None = None  # uint8 [2, rows, block_bytes]: two halves

    def headers(self, half: int, count: int) -> torch.Tensor:
        """``count`` value headers in one half of the header pages (uint8 [count, 128]):
        consecutive calls alternate halves, so one call's headers are checked while the next
        call's land."""
        head = poolvalue.HEADER_BYTES
        at = half * HEADERS_PER_CALL * head
        return self.header[at : at + count * head].view(count, head)

    def rows(self, client: PoolClient, half: int, count: int) -> torch.Tensor:
        """``count`` staging rows in one half of the staging (uint8 [count, block_bytes]), the
        staging registered (made) on first need.

        Raises:
            PoolUnavailable: the pool is down (no staging is made for a store that is gone), or
                (SHM mode) the daemon would not map a segment.
        """
        if self.stage is None:
            if not client.up:
                raise PoolUnavailable(f"remote tier: the pool is down ({client.down_reason})")
            rows = stage_rows(self.block_bytes)
            self.stage = client.allocate(2 * rows * self.block_bytes).view(2, rows, self.block_bytes)
        return self.stage[half, :count]


# A batched pipeline through one lane (the gets' or the puts'): whole blocks of ``keys`` as their
# parts (CPU, flat uint8, in order); per block None or its error.
BatchMove = Callable[[PoolClient, Lane, list[BlockKey], list[list[torch.Tensor]]], list[BaseException | None]]


class Lanes:
    """The lanes of one tier's threads, and those retired."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self._local = threading.local()
        self._lock = threading.Lock()
        self._retired: list[Lane] = []  # lanes a stray call may still use: kept, never reused

    def get(self, client: PoolClient) -> Lane:
        """This thread's lane under the client's current store (made, and registered, if needed).

        Raises:
            PoolUnavailable: the pool is down, or would not register (map) the header pages.
        """
        lane = getattr(self._local, "lane", None)
        generation = client.generation
        if lane is None or lane.generation != generation:
            if lane is not None:
                self.retire(lane)  # made for another store (a stray call may use it still)
            header = client.allocate(HEADER_PAGES_BYTES)  # pages: what SHM maps anyway
            lane = self._local.lane = Lane(header, generation, self.block_bytes)
        return lane

    def current(self) -> Lane | None:
        """This thread's lane, if it has one."""
        return getattr(self._local, "lane", None)

    def retire(self, lane: Lane) -> None:
        """A stray call may still use ``lane``: keep it, make a new one for this thread next time."""
        with self._lock:
            self._retired.append(lane)
        if getattr(self._local, "lane", None) is lane:
            self._local.lane = None

    def calls(self, blocks: int, growing: bool) -> list[range]:
        """The pool calls a batch of ``blocks`` is cut into: at most a half of the staging (and
        of the headers) and ``CALL_BUFFERS`` each; every value's bytes are checked (a MAC or a
        checksum), so calls grow threefold from 1/16 of the batch (``growing``: puts), or
        shrink to it (gets)."""
        most = max(1, min(HEADERS_PER_CALL, stage_rows(self.block_bytes), CALL_BUFFERS // 2))
        sizes = []
        size, left = -(-blocks // FIRST_CALL_SHARE), blocks
        while left:
            sizes.append(min(left if left <= size * (1 + CALL_GROWTH) else size, most))
            left -= sizes[-1]
            size *= CALL_GROWTH
        sizes = sizes if growing else sizes[::-1]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [range(start, start + size) for start, size in zip(starts, sizes)]


def stage_rows(block_bytes: int) -> int:
    """Blocks in a half of a lane's staging (at least one, however large)."""
    return max(1, STAGE_BYTES // 2 // block_bytes)


def buffers(headers: torch.Tensor, rows: torch.Tensor, batch: range) -> tuple[list, list]:
    """The pointers and sizes of one batched call's objects: block ``i`` of ``batch`` as its
    header (``headers[j]``, j its place in the batch), then its staging row (``rows[j]``)."""
    ptrs = [[headers[j].data_ptr(), rows[j].data_ptr()] for j in range(len(batch))]
    sizes = [[poolvalue.HEADER_BYTES, rows[j].numel()] for j in range(len(batch))]
    return ptrs, sizes


def copy_into(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dsts[i][:] = srcs[i]``; the caller's tensors may be inference tensors (made under
    ``torch.inference_mode``, as an engine's KV is), which only that mode may update in place."""
    with torch.inference_mode():
        torch._foreach_copy_(dsts, srcs)
