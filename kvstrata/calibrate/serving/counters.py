"""A ``vllm serve`` process's counters, read from what it exports (pure: parsing and arithmetic;
the bench fetches the texts).

Two sources. vLLM's Prometheus ``/metrics``: its own prefix cache's ``vllm:prefix_cache_queries``
and ``vllm:prefix_cache_hits`` (tokens). The connector's stats file (``stats_path`` in its
extra config, :mod:`kvstrata.integrations.vllm.stats`): the blocks it loaded into vLLM per
route, by the tier each came from, its loads and their seconds. When the server's ``/metrics``
exports the connector's ``kvstrata_connector_lookup_hit_blocks_total`` per tier, the hits per
tier are taken from there instead, and :attr:`Counters.hits_source` says which was read. The
connector's own CPU time comes from ``/metrics`` alone: ``kvstrata_connector_cpu_seconds_total``
by ``side`` (``scheduler``: its hooks in vLLM's engine-core process; ``worker``: its hooks and
threads in the worker process(es)); a server whose connector does not export it has none. So do
the bytes that CPU moved: ``kvstrata_connector_loaded_bytes_total`` (copied into vLLM's KV),
``kvstrata_connector_saved_bytes_total`` (copied out of it) and
``kvstrata_connector_moved_bytes_total`` (between its tiers; those to or from a disk or the pool
are checksummed too). At this host's copy and checksum rates (:class:`ByteRates`) that is what
the bytes themselves cost; the rest of the CPU is the connector's own
(:meth:`ConnectorCpu.beyond_bytes_s`).

Every counter is cumulative over the process's life: a phase's figures are the difference of a
snapshot after it and one before (:meth:`Counters.minus`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvstrata.media import Medium, parse_route

PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
CONNECTOR_HITS = "kvstrata_connector_lookup_hit_blocks_total"
CONNECTOR_CPU = "kvstrata_connector_cpu_seconds_total"
LOADED_BYTES = "kvstrata_connector_loaded_bytes_total"
SAVED_BYTES = "kvstrata_connector_saved_bytes_total"
MOVED_BYTES = "kvstrata_connector_moved_bytes_total"
INTER_TOKEN = "vllm:inter_token_latency_seconds"  # vLLM's histogram of the gaps between a request's tokens, engine-stamped
_CHECKSUMMED = frozenset({Medium.DISK.label, Medium.REMOTE.label})  # a move to or from these hashes its bytes
TIER_LABELS = ("tier", "medium", "source")  # the label of CONNECTOR_HITS that names the tier

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class HitsSource(enum.Enum):
    METRICS = "metrics"  # kvstrata_connector_lookup_hit_blocks_total on /metrics
    STATS_FILE = "stats file"  # the connector's stats_path JSON (blocks loaded, by source tier)
    NONE = "none"  # no connector


class ConnectorSide(enum.Enum):
    """Where the connector's CPU time was spent (its value: ``CONNECTOR_CPU``'s ``side`` label)."""

    SCHEDULER = "scheduler"  # vLLM's engine-core process: the scheduler-side hooks
    WORKER = "worker"  # the worker process(es): the worker-side hooks and the connector's threads


@dataclass(frozen=True)
class ByteRates:
    """This host's rates for what the connector does to bytes, measured by the run (one thread):
    a memory copy, and an xxh3 checksum."""

    copy_gbps: float
    checksum_gbps: float


@dataclass(frozen=True)
class ConnectorCpu:
    """The connector's CPU seconds per side, and the bytes that CPU moved: cumulative in a
    snapshot, over a phase after :meth:`minus`, a request's share after :meth:`per_request`.

    Attributes:
        copied_bytes: bytes copied into and out of vLLM's KV and between kvstrata's tiers.
        checksummed_bytes: of those, bytes written to or read from a disk or the pool (hashed).
    """

    scheduler_s: float = 0.0
    worker_s: float = 0.0
    copied_bytes: float = 0.0
    checksummed_bytes: float = 0.0

    @property
    def total_s(self) -> float:
        return self.scheduler_s + self.worker_s

    def bytes_s(self, rates: ByteRates) -> float:
        """What the bytes alone take at ``rates``: one copy each, and a checksum where hashed."""
        return self.copied_bytes / (rates.copy_gbps * 1e9) + self.checksummed_bytes / (rates.checksum_gbps * 1e9)

    def beyond_bytes_s(self, rates: ByteRates) -> float:
        """The CPU beyond what its bytes take at ``rates``: the connector's own cost."""
        return self.total_s - self.bytes_s(rates)

    def minus(self, earlier: ConnectorCpu) -> ConnectorCpu:
        return ConnectorCpu(self.scheduler_s - earlier.scheduler_s, self.worker_s - earlier.worker_s,
                            self.copied_bytes - earlier.copied_bytes, self.checksummed_bytes - earlier.checksummed_bytes)

    def plus(self, other: ConnectorCpu) -> ConnectorCpu:
        return ConnectorCpu(self.scheduler_s + other.scheduler_s, self.worker_s + other.worker_s,
                            self.copied_bytes + other.copied_bytes, self.checksummed_bytes + other.checksummed_bytes)

    def per_request(self, requests: int) -> ConnectorCpu:
        """Each figure over ``requests`` (>= 1)."""
        return ConnectorCpu(self.scheduler_s / requests, self.worker_s / requests, self.copied_bytes / requests,
                            self.checksummed_bytes / requests)


@dataclass(frozen=True)
class Counters:
    """One server's cumulative counters at one moment (or, after :meth:`minus`, over a phase).

    Attributes:
        loaded_blocks: blocks the connector loaded into vLLM, by the tier each came from (its
            stats file; empty without a connector).
        exported_blocks: ``kvstrata_connector_lookup_hit_blocks_total`` per tier from
            ``/metrics``; None where the server does not export it so.
        connector: the server has the connector (a stats file was read).
        load_requests: the connector's loads (requests it served KV to).
        load_seconds: their time in kvstrata (to its device tier), summed.
        restored_bytes: bytes kvstrata brought to its device tier.
        prefix_queries_tokens: prompt tokens vLLM's own prefix cache was asked for.
        prefix_hits_tokens: of those, tokens it held.
        connector_cpu: the connector's CPU seconds per side from ``/metrics``; None where the
            server does not export them (no connector, or one from before the counter).
        server_cpu_s: CPU seconds of the server's processes (API server, engine core, workers),
            from ``/proc``; None where not read.
    """

    loaded_blocks: Mapping[Medium, int] = field(default_factory=dict)
    exported_blocks: Mapping[Medium, int] | None = None
    connector: bool = False
    load_requests: int = 0
    load_seconds: float = 0.0
    restored_bytes: int = 0
    prefix_queries_tokens: float = 0.0
    prefix_hits_tokens: float = 0.0
    connector_cpu: ConnectorCpu | None = None
    server_cpu_s: float | None = None

    @property
    def hit_blocks(self) -> dict[Medium, int]:
        """kvstrata's hits in blocks by tier: from ``/metrics`` where exported, else the stats file."""
        chosen = self.exported_blocks if self.exported_blocks is not None else self.loaded_blocks
        return {m: chosen[m] for m in sorted(chosen, key=lambda m: m.value) if chosen[m]}

    @property
    def hits_source(self) -> HitsSource:
        if self.exported_blocks is not None:
            return HitsSource.METRICS
        return HitsSource.STATS_FILE if self.connector else HitsSource.NONE

    @property
    def prefix_hit_rate(self) -> float | None:
        """vLLM's own prefix cache: hit tokens over queried tokens (None: nothing asked)."""
        return self.prefix_hits_tokens / self.prefix_queries_tokens if self.prefix_queries_tokens else None

    def minus(self, earlier: Counters) -> Counters:
        """What happened between ``earlier`` and this snapshot of the same process (a per-tier
        series that appeared in between counts from zero)."""
        exported = None
        if self.exported_blocks is not None:
            exported = _difference(self.exported_blocks, earlier.exported_blocks or {})
        return Counters(
            _difference(self.loaded_blocks, earlier.loaded_blocks), exported, self.connector,
            self.load_requests - earlier.load_requests,
            self.load_seconds - earlier.load_seconds,
            self.restored_bytes - earlier.restored_bytes,
            self.prefix_queries_tokens - earlier.prefix_queries_tokens,
            self.prefix_hits_tokens - earlier.prefix_hits_tokens,
            None if self.connector_cpu is None else self.connector_cpu.minus(earlier.connector_cpu or ConnectorCpu()),
            None if self.server_cpu_s is None or earlier.server_cpu_s is None
            else self.server_cpu_s - earlier.server_cpu_s,
        )

    def plus(self, other: Counters) -> Counters:
        """Two phases' (or servers') counters together."""
        cpu = None
        if self.connector_cpu is not None or other.connector_cpu is not None:
            cpu = (self.connector_cpu or ConnectorCpu()).plus(other.connector_cpu or ConnectorCpu())
        exported = None
        if self.exported_blocks is not None or other.exported_blocks is not None:
            exported = _sum(self.exported_blocks or {}, other.exported_blocks or {})
        return Counters(
            _sum(self.loaded_blocks, other.loaded_blocks), exported, self.connector or other.connector,
            self.load_requests + other.load_requests,
            self.load_seconds + other.load_seconds,
            self.restored_bytes + other.restored_bytes,
            self.prefix_queries_tokens + other.prefix_queries_tokens,
            self.prefix_hits_tokens + other.prefix_hits_tokens,
            cpu,
            None if self.server_cpu_s is None and other.server_cpu_s is None
            else (self.server_cpu_s or 0.0) + (other.server_cpu_s or 0.0),
        )


def _difference(later: Mapping[Medium, int], earlier: Mapping[Medium, int]) -> dict[Medium, int]:
    return {m: later[m] - earlier.get(m, 0) for m in later if later[m] - earlier.get(m, 0)}


def _sum(a: Mapping[Medium, int], b: Mapping[Medium, int]) -> dict[Medium, int]:
    media = sorted({*a, *b}, key=lambda m: m.value)
    return {m: a.get(m, 0) + b.get(m, 0) for m in media}


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition: per metric name, its samples as (labels, value)."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        labels = dict(_LABEL.findall(match["labels"] or ""))
        samples.setdefault(match["name"], []).append((labels, value))
    return samples


def counters_of(metrics_text: str, stats: Mapping[str, Any] | None, server_cpu_s: float | None = None) -> Counters:
    """A snapshot from a server's ``/metrics`` text and its connector's stats (None: no connector),
    with its processes' CPU seconds so far (None: not read)."""
    metrics = parse_metrics(metrics_text)
    stats = stats or {}
    loaded: dict[Medium, int] = {}
    for route, blocks in (stats.get("load_paths") or {}).items():
        source = parse_route(route)[0]  # the tier the block was found in
        loaded[source] = loaded.get(source, 0) + int(blocks)
    return Counters(
        loaded, _exported_hits(metrics), bool(stats) or CONNECTOR_HITS in metrics or CONNECTOR_CPU in metrics,
        int(stats.get("load_requests", 0)), float(stats.get("load_seconds", 0.0)), int(stats.get("restored_bytes", 0)),
        sum(v for _, v in metrics.get(PREFIX_QUERIES, [])), sum(v for _, v in metrics.get(PREFIX_HITS, [])),
        _connector_cpu(metrics), server_cpu_s,
    )


def _connector_cpu(metrics: Mapping[str, list[tuple[dict[str, str], float]]]) -> ConnectorCpu | None:
    """``CONNECTOR_CPU`` summed per side (over engines and workers), and the bytes moved; None
    where the CPU is not exported. A side this bench does not know is left out."""
    samples = metrics.get(CONNECTOR_CPU)
    if not samples:
        return None
    by_side = dict.fromkeys(ConnectorSide, 0.0)
    for labels, value in samples:
        side = next((s for s in ConnectorSide if s.value == labels.get("side")), None)
        if side is not None:
            by_side[side] += value
    copied = sum(v for name in (LOADED_BYTES, SAVED_BYTES, MOVED_BYTES) for _, v in metrics.get(name, []))
    hashed = sum(v for labels, v in metrics.get(MOVED_BYTES, [])
                 if labels.get("src") in _CHECKSUMMED or labels.get("dst") in _CHECKSUMMED)
    return ConnectorCpu(by_side[ConnectorSide.SCHEDULER], by_side[ConnectorSide.WORKER], copied, hashed)


def _exported_hits(metrics: Mapping[str, list[tuple[dict[str, str], float]]]) -> dict[Medium, int] | None:
    """The connector's hit blocks per tier from ``/metrics``; None where it does not export them
    per tier (under one of ``TIER_LABELS``, valued a tier's name)."""
    samples = metrics.get(CONNECTOR_HITS)
    if not samples:
        return None
    by_tier: dict[Medium, int] = {}
    for labels, value in samples:
        name = next((labels[k] for k in TIER_LABELS if k in labels), None)
        medium = Medium.__members__.get(name.upper()) if name else None
        if medium is None:
            return None  # a shape this bench does not know: the stats file says it instead
        by_tier[medium] = by_tier.get(medium, 0) + int(value)
    return by_tier


def cache_loads(metrics_text: str) -> tuple[float, int, int]:
    """The connector's loads so far on a server: the cache's seconds loading, how many loads, and
    how many blocks came from the pool."""
    metrics = parse_metrics(metrics_text)
    total = lambda name: sum(v for _, v in metrics.get(name, []))  # noqa: E731
    remote = sum(v for labels, v in metrics.get("kvstrata_connector_loaded_blocks_total", [])
                 if labels.get("tier") == "remote")
    return (total("kvstrata_connector_load_seconds_total"), int(total("kvstrata_connector_loads_total")), int(remote))


def engine_gaps(metrics_text: str) -> tuple[float, int]:
    """The seconds between tokens a server's engine has stamped so far, and how many gaps: the
    sum and the count of its ``vllm:inter_token_latency_seconds`` histogram."""
    metrics = parse_metrics(metrics_text)
    return (sum(v for _, v in metrics.get(f"{INTER_TOKEN}_sum", [])),
            int(sum(v for _, v in metrics.get(f"{INTER_TOKEN}_count", []))))
