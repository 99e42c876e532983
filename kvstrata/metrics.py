"""Cache metrics: hits and misses per tier, bytes moved per (source, destination), achieved
GB/s per transfer; exposed in Prometheus text format from a registry of the cache's own when
the 'metrics' extra (prometheus_client) is installed, else kept as the plain counts alone."""

from __future__ import annotations

import collections
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstrata.extras import require
from kvstrata.manager.plans import Failure
from kvstrata.media import Medium

if TYPE_CHECKING:
    from kvstrata.transfer.worker import TransferResult

GBPS_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500)


class _Unexposed:
    """A Prometheus registry's, counter's or histogram's stand-in without prometheus_client: the
    cache's own counts (``CacheMetrics.hit_blocks``, ...) are kept either way; only the exposition
    is missing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def labels(self, *values: str) -> _Unexposed:
        return self

    def inc(self, amount: float = 1) -> None:
        pass

    def observe(self, value: float) -> None:
        pass


@dataclass(frozen=True)
class PathTotals:
    """What moved along one (source, destination) path so far: bytes, and the seconds the
    transfers took (each handler call's own time, summed: bytes / seconds is the achieved
    rate of a transfer, not of the path's wall clock where transfers overlap)."""

    bytes: int
    seconds: float


class CacheMetrics:
    def __init__(self, keep_last: int = 1024) -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Histogram
        except ModuleNotFoundError:  # no 'metrics' extra: plain counts, and exposition() says what to install
            CollectorRegistry = Counter = Histogram = _Unexposed
        self.registry = CollectorRegistry()
        self._hits = Counter(
            "kvstrata_lookup_blocks", "Blocks found by lookups, by the fastest tier holding them", ["tier"],
            registry=self.registry,
        )
        self._hit_children: dict[Medium, Any] = {}  # labels() of _hits per tier: a lookup skips its lock and parse
        self._misses = Counter("kvstrata_lookup_miss_blocks", "Full blocks lookups did not find", registry=self.registry)
        self._pool_dropped = Counter(
            "kvstrata_pool_dropped_blocks",
            "Blocks this cache's view of the shared pool listed that a lookup found gone from it (evicted, removed)",
            registry=self.registry,
        )
        self._bytes = Counter(
            "kvstrata_moved_bytes", "Bytes moved between tiers", ["src", "dst"], registry=self.registry
        )
        self._failures = Counter(
            "kvstrata_failed_legs", "Block transfers that failed, by destination tier and kind", ["dst", "failure"],
            registry=self.registry,
        )
        self._gbps = Histogram(
            "kvstrata_transfer_gbps", "Achieved GB/s per transfer", ["src", "dst"], buckets=GBPS_BUCKETS,
            registry=self.registry,
        )
        self._lock = threading.Lock()
        self._recent: deque[TransferResult] = deque(maxlen=keep_last)
        self.hit_blocks = {m: 0 for m in Medium}
        self.miss_blocks = 0
        self.pool_dropped_blocks = 0
        self.moved_bytes: dict[tuple[Medium, Medium], int] = {}
        self.transfer_seconds: dict[tuple[Medium, Medium], float] = {}
        self.failed_legs: collections.Counter[tuple[Medium, Failure]] = collections.Counter()

    def lookup(self, found: Mapping[Medium, int], missed: int) -> None:
        """A lookup found ``found`` blocks per fastest tier (``Match.counts``) and missed ``missed``."""
        with self._lock:
            for m, blocks in found.items():
                self.hit_blocks[m] += blocks
            self.miss_blocks += missed
        for m, blocks in found.items():
            hits = self._hit_children.get(m)
            if hits is None:  # a tier's series appears at its first hit, as labels() makes it
                hits = self._hit_children.setdefault(m, self._hits.labels(m.label))
            hits.inc(blocks)
        if missed:
            self._misses.inc(missed)

    def pool_dropped(self, blocks: int) -> None:
        """A lookup found ``blocks`` of this cache's view of the pool gone from it (so they were
        not promised: the lookup missed them instead of a load)."""
        if blocks:
            with self._lock:
                self.pool_dropped_blocks += blocks
            self._pool_dropped.inc(blocks)

    def transfer(self, record: TransferResult) -> None:
        with self._lock:
            self._recent.append(record)
            key = (record.src, record.dst)
            self.moved_bytes[key] = self.moved_bytes.get(key, 0) + record.bytes
            self.transfer_seconds[key] = self.transfer_seconds.get(key, 0.0) + record.seconds
        self._bytes.labels(record.src.label, record.dst.label).inc(record.bytes)
        if record.seconds > 0:
            self._gbps.labels(record.src.label, record.dst.label).observe(record.gbps)

    def failed(self, dst: Medium, failure: Failure) -> None:
        """A block transfer into ``dst`` failed as ``failure``."""
        with self._lock:
            self.failed_legs[(dst, failure)] += 1
        self._failures.labels(dst.label, failure.value).inc()

    def failures(self) -> dict[tuple[Medium, Failure], int]:
        """Failed block transfers so far, by destination tier and kind."""
        with self._lock:
            return dict(self.failed_legs)

    def paths(self) -> dict[tuple[Medium, Medium], PathTotals]:
        """Bytes and seconds per (source, destination) so far, read together."""
        with self._lock:
            return {k: PathTotals(n, self.transfer_seconds[k]) for k, n in self.moved_bytes.items()}

    def recent(self) -> list[TransferResult]:
        with self._lock:
            return list(self._recent)

    def exposition(self) -> bytes:
        """Prometheus text exposition of this cache's metrics (the 'metrics' extra)."""
        return require("prometheus_client", "the cache's Prometheus exposition").generate_latest(self.registry)
