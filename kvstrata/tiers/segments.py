"""Where a remote tier's puts go among the pool's segments (pool daemons by segment name).

Each batched put goes as one call per segment, all in flight at once, its blocks dealt out to
them one by one, so that a later batched get of those blocks draws on every daemon's NIC port
at once (measured: blocks on two daemons behind two 1 Gbit/s links got at 2x one link). A
segment is a preference: the master places an object elsewhere when that segment is full or
unknown. Without segments the master places each object.
"""

from __future__ import annotations

import threading
from typing import Any

from kvstrata.index.keys import BlockKey
from kvstrata.pool import native_log


class Segments:
    """One tier's dealing of blocks to segments: the turn goes on over its puts, in any threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._replicas: dict[str, Any] = {}  # segment name -> the ReplicateConfig that puts objects there
        self._turn = 0  # the segment the next batched put's first run goes to (an index, mod their count)

    def spread(self, segments: tuple[str, ...], batch: range) -> list[tuple[range, tuple[Any, ...]]]:
        """The sub-calls that put one call's blocks: with ``segments`` (the pool's), ``batch`` dealt out
        block by block, one strided run per segment (``range(start, stop, count)``, none
        empty), each with the extra argument of its call (the ReplicateConfig that puts its
        objects on its segment); without, the whole batch and none (the master places them).

        Dealt, not cut: a later restore reads the blocks in calls of its own (and over several
        workers), and any run of consecutive blocks then has near-equal shares on every segment.
        Cut into contiguous runs, one get call held 16 blocks of one daemon and 8 of the other,
        and two 1 Gbit/s ports gave 1.33x one port instead of 2x (measured in the lab). The
        dealing turns by ``len(batch)`` from call to call, so it goes on round the segments
        over the tier's puts, in any threads."""
        if not segments:
            return [(batch, ())]
        count = len(segments)
        with self._lock:
            turn = self._turn
            self._turn = (turn + len(batch)) % count
        return [(range(batch.start + n, batch.stop, count), (self.replica(segments[(turn + n) % count]),))
                for n in range(min(count, len(batch)))]

    def placed(self, segments: tuple[str, ...], key: BlockKey) -> tuple[Any, ...]:
        """The extra argument of a put of ``key``'s object alone: the ReplicateConfig of the
        segment its key picks (keys are uniform hashes), or none without segments."""
        return (self.replica(segments[int.from_bytes(key, "little") % len(segments)]),) if segments else ()

    def replica(self, segment: str) -> Any:
        """A ``mooncake.store.ReplicateConfig`` that puts each object once, on ``segment``; one per
        segment, made on first use (Mooncake is imported only where a tier reached a pool)."""
        with self._lock:
            config = self._replicas.get(segment)
            if config is None:
                config = native_log.store_module().ReplicateConfig()
                config.replica_num, config.preferred_segment = 1, segment
                self._replicas[segment] = config
            return config
