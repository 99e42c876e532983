"""The connector's counters on vLLM's own ``/metrics``: the series, what travels, where they land.

vLLM (0.32, ``kv_connector/v1/metrics.py``) carries a connector's telemetry in three hops:

1. every step, each worker's ``get_kv_connector_stats()`` hands a :class:`KVStrataStats` of what
   changed since its last call (:class:`WorkerReporter`); the TP ranks' are merged with
   ``aggregate``, and so is the scheduler side's (its lookups: :class:`LookupCounts`);
2. the engine core sends the merged stats' ``to_dict()`` to the API server with its scheduler
   stats, only when log stats are on (the server's default; ``--disable-log-stats`` drops them);
3. in the API server, ``build_prom_metrics`` made the series in vLLM's registry with vLLM's labels
   (``model_name``, ``engine``) and :class:`KVStrataPromMetrics` ``observe`` adds each payload.

What travels is small and self-describing: ``{"counters": {name: {labels: delta}}, "gauges":
{name: {labels: {tp_rank: value}}}}``, label values joined by ``|``, every key a string (it goes
through msgpack). Counters are sums of deltas; a gauge is kept per TP rank (a rank sends it only
when it changed) and the series is the sum over the ranks, so a merge over ranks and one over
steps are the same ``aggregate``.

Who counts what. Every TP rank caches the same token blocks, so blocks and requests, and the load
and store time, are rank 0's (the lookups are the scheduler's, counted when vLLM admits a request,
of the full prompt blocks beyond vLLM's own prefix hit); bytes, transfer seconds, failed and
recomputed blocks, evictions and the tiers' fill are every rank's, summed (head-sliced: each rank
moves its heads' share of a block). ``loaded_bytes{tier}`` is ``loaded_blocks{tier}`` times the
instance's bytes of a vLLM block.
"""

from __future__ import annotations

import copy
import enum
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvstrata.media import Medium
from kvstrata.policies.payoff import ProbeOutcome
from kvstrata.policies.saving import SAMPLE_EVERY

if TYPE_CHECKING:
    from kvstrata.cache import TieredCache
    from kvstrata.integrations.vllm.stats import WorkerStats

log = logging.getLogger("kvstrata.integrations.vllm")

_SEP = "|"  # joins a series' label values in the payload (Medium labels hold none)


class Kind(enum.Enum):
    COUNTER = "counter"  # the payload holds deltas; exported with ``_total``
    GAUGE = "gauge"  # the payload holds each rank's last value


@dataclass(frozen=True)
class Metric:
    """One series family: its name as registered, kind, labels beyond vLLM's, and help text."""

    name: str
    kind: Kind
    labels: tuple[str, ...]
    help: str

    @property
    def exported(self) -> str:
        """The name on ``/metrics`` (a counter's ends in ``_total``)."""
        return f"{self.name}_total" if self.kind is Kind.COUNTER else self.name


def _counter(name: str, labels: tuple[str, ...], text: str) -> Metric:
    return Metric(f"kvstrata_connector_{name}", Kind.COUNTER, labels, text)


LOOKUP_HIT_BLOCKS = _counter("lookup_hit_blocks", ("tier",), "Prompt blocks beyond vLLM's own prefix hit that "
                             "kvstrata held when vLLM admitted the request, by the fastest tier holding them")
LOOKUP_MISS_BLOCKS = _counter("lookup_miss_blocks", (), "Full prompt blocks beyond vLLM's own prefix hit "
                              "that no kvstrata tier held when vLLM admitted the request")
LOOKUPS = _counter("lookups", ("answered_by",), "Lookups of prompts vLLM asked for, by who answered: the "
                   "scheduler (a prompt whose first block this server never stored: a miss, no question to the "
                   "workers) or the worker (rank 0's caches, across processes)")
LOADED_BLOCKS = _counter("loaded_blocks", ("tier",), "vLLM blocks restored into vLLM's KV, by source tier")
LOADED_BYTES = _counter("loaded_bytes", ("tier",), "Bytes restored into vLLM's KV, by source tier")
SAVED_BYTES = _counter("saved_bytes", (), "Bytes copied out of vLLM's KV for saves (every block offered to "
                       "kvstrata's tiers, new or held already)")
MOVED_BYTES = _counter("moved_bytes", ("src", "dst"), "Bytes moved between kvstrata's tiers")
TRANSFER_SECONDS = _counter("transfer_seconds", ("src", "dst"), "Seconds the transfers of moved_bytes took "
                            "(each transfer's own time, summed: bytes / seconds is the achieved GB/s)")
LOADS = _counter("loads", (), "Requests whose hit kvstrata loaded")
ASYNC_LOADS = _counter("async_loads", (), "Loads run off vLLM's step (vLLM's asynchronous loads: from a disk or "
                       "the pool while other requests run, and every load of a hybrid model): their requests "
                       "waited for them, no step did")
LOAD_SECONDS = _counter("load_seconds", (), "kvstrata's own load time (to its device tier), summed")
STORES = _counter("stores", (), "Saves done: a request's full prompt blocks of a step, stored in every KV cache group")
STORED_BLOCKS = _counter("stored_blocks", (), "New blocks stored (not held before), over every KV cache group")
STORE_SECONDS = _counter("store_seconds", (), "Store time (copy out of vLLM, store, write-down), summed")
LOAD_FAILED_BLOCKS = _counter("load_failed_blocks", (), "vLLM blocks whose load failed")
RECOMPUTED_BLOCKS = _counter("recomputed_blocks", (), "Failed blocks vLLM recomputed "
                             "(kv_load_failure_policy recompute)")
EVICTED_BLOCKS = _counter("evicted_blocks", ("tier",), "Blocks evicted from a tier to make room")
CPU_SECONDS = _counter("cpu_seconds", ("side",), "CPU seconds the connector used: its hooks on the engine's "
                       "threads and its own threads, in the scheduler (side=scheduler) and the workers (side=worker)")
DECLINED_BLOCKS = _counter("declined_blocks", ("tier",), "Blocks of hits not loaded because loading them was "
                           "predicted slower than recomputing them (the tier's measured loads against the prefill's)")
SAVE_DROPPED_BLOCKS = _counter("save_dropped_blocks", (), "Blocks of saves dropped, not waited for: the stores "
                               "still in flight held save_backlog_bytes already (a tier that cannot keep up), "
                               "or the request's load failed in the same step (its KV computed over it)")
SAVE_SKIPPED_BLOCKS = _counter("save_skipped_blocks", (), "Prompt blocks not stored because stores did not pay: "
                               "too few stored blocks came back as hits for what a store costs (one request in "
                               f"{SAMPLE_EVERY} is stored anyway, to see whether reuse returns)")
UNWRITTEN_BLOCKS = _counter("unwritten_blocks", ("tier",), "Blocks not written down to a tier whose loads "
                            "do not pay (a disk the scheduler declines to load from, until its next probe is due)")
FAILED_TRANSFERS = _counter("failed_transfers", ("tier", "failure"), "Block transfers that failed, by destination "
                            "tier (device: a read into vLLM's KV) and how: unavailable (the tier was down: a pool "
                            "that timed out is down until a probe passes), abandoned (timed out), missing, corrupt, "
                            "no-space, error. A failed write leaves the block out of that tier; a failed read is "
                            "recomputed")
PROBES = _counter("probes", ("tier", "outcome"), "Probe reads of one block from a tier whose loads failed, off the "
                  "step (no request waits on them), by outcome: pays (within a one-block load's budget: the tier "
                  "is loaded from again where its measured loads pay), slow (past that budget), failed (the read "
                  "did not arrive), empty (the tier held no block only it holds: it is written again)")
TIER_USED_BYTES = Metric("kvstrata_connector_tier_used_bytes", Kind.GAUGE, ("tier",),
                         "Bytes of a tier's slots in use, as this instance's caches track them")
TIER_CAPACITY_BYTES = Metric("kvstrata_connector_tier_capacity_bytes", Kind.GAUGE, ("tier",),
                             "A tier's configured capacity in this instance's caches")

METRICS = (LOOKUP_HIT_BLOCKS, LOOKUP_MISS_BLOCKS, LOOKUPS, LOADED_BLOCKS, LOADED_BYTES, SAVED_BYTES, MOVED_BYTES,
           TRANSFER_SECONDS, LOADS, ASYNC_LOADS, LOAD_SECONDS, STORES, STORED_BLOCKS, STORE_SECONDS, LOAD_FAILED_BLOCKS, RECOMPUTED_BLOCKS, EVICTED_BLOCKS,
           CPU_SECONDS, DECLINED_BLOCKS, SAVE_DROPPED_BLOCKS, SAVE_SKIPPED_BLOCKS, UNWRITTEN_BLOCKS, FAILED_TRANSFERS,
           PROBES, TIER_USED_BYTES, TIER_CAPACITY_BYTES)
_BY_NAME = {m.name: m for m in METRICS}


def exported_names() -> frozenset[str]:
    """Every name the connector puts on ``/metrics``."""
    return frozenset(m.exported for m in METRICS)


@dataclass
class KVStrataStats(KVConnectorStats):
    """What changed, in the payload's form (see the module text); vLLM's KVConnectorStats."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}}

    def add(self, metric: Metric, value: float, labels: tuple[str, ...] = ()) -> None:
        """Add ``value`` to a counter series."""
        series = self.data["counters"].setdefault(metric.name, {})
        key = _SEP.join(labels)
        series[key] = series.get(key, 0) + value

    def set(self, metric: Metric, value: float, labels: tuple[str, ...], rank: str) -> None:
        """Rank ``rank``'s value of a gauge series."""
        self.data["gauges"].setdefault(metric.name, {}).setdefault(_SEP.join(labels), {})[rank] = value

    def aggregate(self, other: KVConnectorStats) -> KVStrataStats:
        """Merge ``other`` in (counters add; a rank's gauge takes ``other``'s value); returns self."""
        assert isinstance(other, KVStrataStats), f"cannot merge {type(other).__name__} into KVStrataStats"
        for name, series in other.data["counters"].items():
            mine = self.data["counters"].setdefault(name, {})
            for key, value in series.items():
                mine[key] = mine.get(key, 0) + value
        for name, series in other.data["gauges"].items():
            mine = self.data["gauges"].setdefault(name, {})
            for key, ranks in series.items():
                mine.setdefault(key, {}).update(ranks)
        return self

    def reduce(self) -> dict[str, int | float]:
        """One value a series for vLLM's log line: ``moved_bytes[host|disk]``, gauges summed over ranks."""
        out: dict[str, int | float] = {}
        for name, series in self.data["counters"].items():
            for key, value in series.items():
                out[_short(name, key)] = value
        for name, series in self.data["gauges"].items():
            for key, ranks in series.items():
                out[_short(name, key)] = sum(ranks.values())
        return out

    def is_empty(self) -> bool:
        return not self.data["counters"] and not self.data["gauges"]


def _short(name: str, key: str) -> str:
    short = name.removeprefix("kvstrata_connector_")
    return f"{short}[{key}]" if key else short


def stats_of(data: dict[str, Any] | None) -> KVStrataStats:
    """The stats a payload (``to_dict()``) describes, as a copy (vLLM's log keeps merging into
    the first it builds, and the same payload goes to the Prometheus logger too)."""
    return KVStrataStats(data=copy.deepcopy(data) if data else {})


class KVStrataPromMetrics(KVConnectorPromMetrics):
    """The series in vLLM's registry (made with the metric classes vLLM hands over), and each
    payload added to them: counters by their deltas, gauges as the sum of each rank's last value."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_ours()
        self._families = {m.name: self._family(m) for m in METRICS}
        self._children: dict[tuple[int, str, str], Any] = {}  # (engine, name, labels) -> the labelled series
        self._ranks: dict[tuple[int, str, str], dict[str, float]] = {}  # a gauge's last value per rank
        for metric in METRICS:  # a counter without labels of ours is on /metrics at 0 from the start
            if metric.kind is Kind.COUNTER and not metric.labels:
                for engine in per_engine_labelvalues:
                    self._child(engine, metric.name, "")

    def _family(self, metric: Metric) -> Any:
        labelnames = list(self._labelnames) + list(metric.labels)
        if metric.kind is Kind.COUNTER:
            return self._counter_cls(name=metric.name, documentation=metric.help, labelnames=labelnames)
        return self._gauge_cls(name=metric.name, documentation=metric.help, labelnames=labelnames,
                               multiprocess_mode="mostrecent")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, series in transfer_stats_data.get("counters", {}).items():
            for key, value in series.items():
                child = self._child(engine_idx, name, key)
                if child is not None and value > 0:
                    child.inc(value)
        for name, series in transfer_stats_data.get("gauges", {}).items():
            for key, ranks in series.items():
                child = self._child(engine_idx, name, key)
                if child is not None:
                    last = self._ranks.setdefault((engine_idx, name, key), {})
                    last.update(ranks)
                    child.set(sum(last.values()))

    def _child(self, engine: int, name: str, key: str) -> Any:
        child = self._children.get((engine, name, key))
        if child is None:
            metric = _BY_NAME.get(name)
            labels = key.split(_SEP) if key else []
            if metric is None or len(labels) != len(metric.labels):
                log.warning("KVStrataConnector: a stats series %s{%s} this server does not export", name, key)
                return None
            values = [*self.per_engine_labelvalues[engine], *labels]
            child = self._children[(engine, name, key)] = self._families[name].labels(*values)
        return child


def _unregister_ours() -> None:
    """Drop series of an earlier KVStrataPromMetrics in this process: vLLM unregisters only
    ``vllm:`` names before it makes its loggers again, and a second registration would raise."""
    from prometheus_client import REGISTRY

    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", "").startswith("kvstrata_connector_"):
            REGISTRY.unregister(collector)


class WorkerReporter:
    """A worker's reports: what its counters and caches say changed since the last one.

    Called from the worker's step only (one thread); the counters it reads are each read under
    their owner's lock. Cheap: a few dozen numbers a step; an unchanged step reports None.

    Args:
        tp_rank: the worker's TP rank (rank 0 counts blocks, requests and their time).
    """

    def __init__(self, tp_rank: int) -> None:
        self._rank = str(tp_rank)
        self._reported: dict[tuple[Metric, tuple[str, ...]], float] = {}
        self._gauges: dict[tuple[Metric, tuple[str, ...]], float] = {}

    def report(self, stats: WorkerStats, caches: Iterable[TieredCache], cpu_s: float = 0.0) -> KVStrataStats | None:
        """The changes since the last report; ``cpu_s``: the connector's CPU seconds in this worker so far."""
        out = KVStrataStats()
        counters, gauges = self._totals(stats, tuple(caches))
        counters[(CPU_SECONDS, ("worker",))] = cpu_s
        for key, total in counters.items():
            delta = total - self._reported.get(key, 0)
            if delta > 0 or key not in self._reported:  # a series seen first is exported, at 0 if so
                out.add(key[0], max(0, delta), key[1])
                self._reported[key] = max(total, self._reported.get(key, 0))
        for key, value in gauges.items():
            if self._gauges.get(key) != value:
                out.set(key[0], value, key[1], self._rank)
                self._gauges[key] = value
        return None if out.is_empty() else out

    def _totals(self, stats: WorkerStats, caches: tuple[TieredCache, ...]) -> tuple[dict, dict]:
        counters: dict[tuple[Metric, tuple[str, ...]], float] = {}
        gauges: dict[tuple[Metric, tuple[str, ...]], float] = {}

        def add(into: dict, metric: Metric, value: float, *labels: str) -> None:
            into[(metric, labels)] = into.get((metric, labels), 0) + value

        totals = stats.totals()
        if self._rank == "0":
            add(counters, LOADS, totals.load_requests)
            add(counters, ASYNC_LOADS, totals.async_loads)
            add(counters, LOAD_SECONDS, totals.load_seconds)
            add(counters, STORES, totals.store_requests)
            add(counters, STORED_BLOCKS, totals.new_blocks)
            add(counters, STORE_SECONDS, totals.store_seconds)
            for medium, blocks in totals.loaded_blocks.items():
                add(counters, LOADED_BLOCKS, blocks, medium.label)
        for medium, n in totals.loaded_bytes.items():
            add(counters, LOADED_BYTES, n, medium.label)
        add(counters, SAVED_BYTES, totals.saved_bytes)
        add(counters, LOAD_FAILED_BLOCKS, totals.failed_blocks)
        add(counters, RECOMPUTED_BLOCKS, totals.recomputed_blocks)
        if self._rank == "0":
            add(counters, SAVE_DROPPED_BLOCKS, totals.dropped_blocks)
        for cache in caches:
            for (src, dst), path in cache.metrics.paths().items():
                add(counters, MOVED_BYTES, path.bytes, src.label, dst.label)
                add(counters, TRANSFER_SECONDS, path.seconds, src.label, dst.label)
            for medium, blocks in cache.manager.skipped_writes().items():
                add(counters, UNWRITTEN_BLOCKS, blocks, medium.label)
            for (medium, failure), legs in cache.metrics.failures().items():
                add(counters, FAILED_TRANSFERS, legs, medium.label, failure.value)
            for medium, counts in cache.manager.counts().items():
                tier = cache.tier(medium)
                add(counters, EVICTED_BLOCKS, counts.evicted_blocks, medium.label)
                add(gauges, TIER_USED_BYTES, counts.used_slots * tier.layout.block_bytes, medium.label)
                add(gauges, TIER_CAPACITY_BYTES, tier.capacity_bytes, medium.label)
        return counters, gauges


CPU_REPORT_EVERY_S = 1.0  # the scheduler side's CPU, when nothing else is reported with it


@dataclass
class LookupCounts:
    """The scheduler side's lookups, counted as vLLM admits requests, until the next report
    (one thread: the engine core's scheduler)."""

    stats: KVStrataStats | None = None
    cpu_s: float = 0.0  # the hooks' CPU since the last report (added to its counts once, at the report)
    cpu_reported_at: float = 0.0  # when the CPU was last reported (time.monotonic)

    def _open(self) -> KVStrataStats:
        """The counts since the last report (begun if none)."""
        if self.stats is None:
            self.stats = KVStrataStats()
        return self.stats

    def admitted(self, tiers: tuple[Medium, ...], missed: int, declined: dict[Medium, int] | None = None) -> None:
        """A request's lookup: the tier of each block kvstrata grants, the blocks it lacked, and
        those it held but declined to load (slower than recomputing them)."""
        stats = self._open()
        for medium in Medium:
            n = tiers.count(medium)
            if n:
                stats.add(LOOKUP_HIT_BLOCKS, n, (medium.label,))
        if missed:
            stats.add(LOOKUP_MISS_BLOCKS, missed)
        for medium, n in (declined or {}).items():
            stats.add(DECLINED_BLOCKS, n, (medium.label,))
        self.stats = None if stats.is_empty() else stats

    def answered(self, by_scheduler: bool) -> None:
        """A lookup, answered by the scheduler (a miss it knew of) or the workers."""
        self._open().add(LOOKUPS, 1, ("scheduler" if by_scheduler else "worker",))

    def probed(self, medium: Medium, outcome: ProbeOutcome) -> None:
        """A probe read of ``medium`` ended, with ``outcome``."""
        self._open().add(PROBES, 1, (medium.label, outcome.value))

    def skipped(self, blocks: int) -> None:
        """A request's ``blocks`` new prompt blocks were not stored: stores did not pay."""
        if blocks > 0:
            self._open().add(SAVE_SKIPPED_BLOCKS, blocks)

    def used_cpu(self, seconds: float) -> None:
        """The scheduler side's hooks used ``seconds`` of CPU (several hooks a step: summed here)."""
        if seconds > 0:
            self.cpu_s += seconds

    def report(self) -> KVStrataStats | None:
        """The counts since the last report (None: nothing to say). The hooks' CPU changes every
        step; alone it is reported at most every ``CPU_REPORT_EVERY_S``, else with the next
        counts: a report every decode step cost vLLM's step its handling of connector stats
        (on the tiny model, 0.1-0.2 ms of a 3.4 ms step)."""
        now = time.monotonic()
        if self.cpu_s > 0 and (self.stats is not None or now - self.cpu_reported_at >= CPU_REPORT_EVERY_S):
            self._open().add(CPU_SECONDS, self.cpu_s, ("scheduler",))
            self.cpu_s, self.cpu_reported_at = 0.0, now
        stats, self.stats = self.stats, None
        return stats
