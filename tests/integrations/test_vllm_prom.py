"""The connector's stats as vLLM carries them: the payload's merge, reduce and round trip through
vLLM's own classes, the Prometheus series a payload lands in, what a worker reports from a real
cache, and the scheduler's lookup counts."""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorLogging,
    KVConnectorProm,
    KVConnectorStats,
)

from kvstrata.cache import CacheConfig, TieredCache  # noqa: E402
from kvstrata.cache.grouped import GroupedMatch, GroupMatch  # noqa: E402
from kvstrata.index.prefix import Match  # noqa: E402
from kvstrata.integrations.vllm import KVStrataConnector  # noqa: E402
from kvstrata.integrations.vllm.prom import (  # noqa: E402
    CPU_SECONDS,
    EVICTED_BLOCKS,
    LOAD_FAILED_BLOCKS,
    LOADED_BYTES,
    LOOKUP_HIT_BLOCKS,
    LOOKUP_MISS_BLOCKS,
    METRICS,
    MOVED_BYTES,
    SAVED_BYTES,
    STORED_BLOCKS,
    TIER_CAPACITY_BYTES,
    TIER_USED_BYTES,
    KVStrataPromMetrics,
    KVStrataStats,
    LookupCounts,
    WorkerReporter,
    exported_names,
)
from kvstrata.integrations.vllm.scheduler import _Lookup  # noqa: E402
from kvstrata.integrations.vllm.stats import GroupStats, WorkerStats  # noqa: E402
from kvstrata.integrations.vllm.groups import hit_tiers  # noqa: E402
from kvstrata.media import Medium  # noqa: E402
from tests.cache_support import LAYOUT, kv_for, tokens  # noqa: E402

D, H, K, R = Medium.DEVICE, Medium.HOST, Medium.DISK, Medium.REMOTE


def stats(hits: int, moved: int, used: dict[str, float]) -> KVStrataStats:
    s = KVStrataStats()
    s.add(LOOKUP_HIT_BLOCKS, hits, ("host",))
    s.add(MOVED_BYTES, moved, ("host", "device"))
    for rank, value in used.items():
        s.set(TIER_USED_BYTES, value, ("host",), rank)
    return s


def test_stats_merge_reduce_and_round_trip_as_vllms_connector_stats():
    a, b = stats(3, 100, {"0": 10.0}), stats(2, 50, {"0": 20.0, "1": 5.0})
    assert isinstance(a, KVConnectorStats) and not a.is_empty() and KVStrataStats().is_empty()
    merged = a.aggregate(b)
    assert merged is a
    assert merged.reduce() == {"lookup_hit_blocks[host]": 5, "moved_bytes[host|device]": 150,
                               "tier_used_bytes[host]": 25.0}  # rank 0's later value, plus rank 1's
    rebuilt = KVStrataConnector.build_kv_connector_stats(merged.to_dict())
    assert isinstance(rebuilt, KVStrataStats) and rebuilt.to_dict() == merged.to_dict()
    rebuilt.aggregate(stats(1, 1, {}))
    assert merged.reduce()["lookup_hit_blocks[host]"] == 5  # a copy: vLLM's log merges into the first it builds
    assert KVStrataConnector.build_kv_connector_stats(None).is_empty()
    assert KVStrataConnector.build_kv_connector_stats({}).is_empty()


def transfer_config() -> KVTransferConfig:
    return KVTransferConfig(kv_connector="KVStrataConnector", kv_role="kv_both",
                            kv_connector_module_path="kvstrata.integrations.vllm")


def test_vllms_transfer_log_builds_merges_and_prints_the_payloads():
    logging = KVConnectorLogging(transfer_config())
    first = stats(3, 100, {"0": 10.0}).to_dict()
    logging.observe(first)
    logging.observe(stats(2, 50, {}).to_dict())
    lines: list[str] = []
    logging.log(lambda fmt, *args: lines.append(fmt % args))
    assert lines == ["KV Transfer metrics: lookup_hit_blocks[host]=5, moved_bytes[host|device]=150, "
                     "tier_used_bytes[host]=10.0"]
    assert first["counters"][LOOKUP_HIT_BLOCKS.name] == {"host": 3}  # the payload vLLM also observes: untouched


@pytest.fixture(scope="module")
def vllm_config():
    return VllmConfig(kv_transfer_config=transfer_config())


def test_payloads_land_in_series_with_vllms_labels(vllm_config):
    reg = CollectorRegistry()

    class Prom(KVConnectorProm):  # vLLM's own, its metric classes registering in the test's registry
        _gauge_cls = functools.partial(Gauge, registry=reg)
        _counter_cls = functools.partial(Counter, registry=reg)
        _histogram_cls = functools.partial(Histogram, registry=reg)

    prom = Prom(vllm_config, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    assert isinstance(prom.prom_metrics, KVStrataPromMetrics)
    miss = {"model_name": "m", "engine": "1"}
    assert reg.get_sample_value("kvstrata_connector_lookup_miss_blocks_total", miss) == 0  # there from the start
    prom.observe(stats(3, 100, {"0": 10.0, "1": 4.0}).to_dict(), engine_idx=1)
    prom.observe(stats(2, 50, {"1": 6.0}).to_dict(), engine_idx=1)  # rank 0 unchanged: not sent again
    host = {**miss, "tier": "host"}
    assert reg.get_sample_value("kvstrata_connector_lookup_hit_blocks_total", host) == 5
    assert reg.get_sample_value("kvstrata_connector_moved_bytes_total", {**miss, "src": "host", "dst": "device"}) == 150
    assert reg.get_sample_value("kvstrata_connector_tier_used_bytes", host) == 16.0  # 10 (rank 0) + 6 (rank 1)
    assert reg.get_sample_value("kvstrata_connector_lookup_hit_blocks_total", {**host, "engine": "0"}) is None
    names = {s.name for family in reg.collect() for s in family.samples if not s.name.endswith("_created")}
    assert names <= exported_names() and len(exported_names()) == len(METRICS)


def test_a_second_registration_in_one_process_replaces_the_first(vllm_config):
    # vLLM makes its loggers again (and unregisters only its own "vllm:" series); the default
    # registry would refuse a second series of one name
    from prometheus_client import REGISTRY

    types = {Counter: Counter, Gauge: Gauge, Histogram: Histogram}
    for _ in range(2):
        prom = KVStrataConnector.build_prom_metrics(vllm_config, types, ["model_name", "engine"], {0: ["m", "0"]})
        prom.observe(stats(1, 1, {"0": 1.0}).to_dict())
    assert REGISTRY.get_sample_value("kvstrata_connector_lookup_hit_blocks_total",
                                     {"model_name": "m", "engine": "0", "tier": "host"}) == 1


@pytest.fixture
def cache():
    b = LAYOUT.block_bytes
    made = TieredCache(CacheConfig(LAYOUT, "prom", device_bytes=4 * b, host_bytes=8 * b + 100, device="cpu"))
    yield made
    made.close()


def counters(report: KVStrataStats | None) -> dict:
    assert report is not None
    return report.to_dict()["counters"]


def test_a_worker_reports_what_changed_since_its_last_report(cache):
    worker = WorkerStats(block_bytes=LAYOUT.block_bytes, groups=[GroupStats("", "full", None, 2, LAYOUT.block_bytes)])
    reporter = WorkerReporter(0)
    toks = tokens(1, 6)
    result = cache.store(toks, kv_for(cache, toks)).result(timeout=10)
    worker.stored([(0, result)], 0.5)
    first = reporter.report(worker, [cache])
    assert counters(first)[STORED_BLOCKS.name] == {"": 6}
    assert counters(first)[SAVED_BYTES.name] == {"": 6 * LAYOUT.block_bytes}  # copied out of vLLM's KV
    # 6 blocks through a 4-block device tier; every tier's series from the first report, at 0 if so
    assert counters(first)[EVICTED_BLOCKS.name] == {"device": 2, "host": 0}
    gauges = first.to_dict()["gauges"]
    assert gauges[TIER_CAPACITY_BYTES.name]["host"] == {"0": 8 * LAYOUT.block_bytes + 100}  # as configured
    assert gauges[TIER_USED_BYTES.name]["host"] == {"0": 6 * LAYOUT.block_bytes}  # written through
    assert reporter.report(worker, [cache]) is None  # nothing changed

    handle = cache.load(cache.lookup(toks[: 3 * LAYOUT.block_tokens]))  # blocks 0-1 from the host
    loaded = handle.wait(timeout=10)
    handle.release()
    worker.loaded(3 * LAYOUT.block_tokens, [(0, 3, loaded)])
    worker.failed(3, "test")
    second = counters(reporter.report(worker, [cache]))
    assert STORED_BLOCKS.name not in second  # only what changed
    assert second[LOADED_BYTES.name] == {"host": 2 * LAYOUT.block_bytes, "device": LAYOUT.block_bytes}
    assert second[LOAD_FAILED_BLOCKS.name] == {"": 3}
    moved = cache.metrics.paths()
    assert second[MOVED_BYTES.name]["host|device"] == moved[(H, D)].bytes - first.data["counters"][
        MOVED_BYTES.name].get("host|device", 0)

    other_rank = counters(WorkerReporter(1).report(worker, [cache]))
    assert STORED_BLOCKS.name not in other_rank and LOADED_BYTES.name in other_rank  # blocks are rank 0's
    assert SAVED_BYTES.name in other_rank  # bytes are each rank's


def test_a_hits_tiers_are_each_blocks_slowest_copy_over_the_groups():
    keys = tuple(bytes([i]) * 16 for i in range(4))
    full = GroupMatch(0, Match(keys, (D, H, H, K), 16, 4))
    window = GroupMatch(2, Match(keys[2:], (R, D), 16, 4))  # a sliding group needs blocks 2 and 3
    assert hit_tiers(GroupedMatch(64, 16, 4, {"0": full, "1": window})) == (D, H, R, K)
    assert hit_tiers(GroupedMatch(64, 16, 4, {"1": window})) == (R, R, R, D)  # before the window: the next
    assert hit_tiers(GroupedMatch(0, 16, 4, {})) == ()


def test_lookups_count_the_blocks_beyond_vllms_own_hit():
    lookup = _Lookup(tiers=(D, H, H, K), computed=32, usable=6 * 16)
    assert lookup.tokens_by_tier(16) == {H: 16, K: 16}  # blocks 0-1 vLLM holds itself
    counts = LookupCounts()
    assert counts.report() is None
    counts.admitted((H, K), 2)
    counts.admitted((), 0)
    report = counters(counts.report())
    assert report == {LOOKUP_HIT_BLOCKS.name: {"host": 1, "disk": 1}, LOOKUP_MISS_BLOCKS.name: {"": 2}}
    assert counts.report() is None


def test_the_schedulers_cpu_alone_is_reported_at_most_every_second_and_with_any_counts():
    """The scheduler's hooks use CPU every step; a report each step (nothing else in it) cost
    vLLM's step its handling of connector stats, so CPU alone waits, and rides with counts."""
    counts = LookupCounts()
    counts.used_cpu(0.002)
    assert counters(counts.report()) == {CPU_SECONDS.name: {"scheduler": 0.002}}  # the first: at once
    counts.used_cpu(0.001)
    assert counts.report() is None  # alone, within the second: kept
    counts.admitted((H,), 0)
    assert counters(counts.report()) == {LOOKUP_HIT_BLOCKS.name: {"host": 1}, CPU_SECONDS.name: {"scheduler": 0.001}}
    counts.used_cpu(0.004)
    counts.cpu_reported_at -= 1.0  # a second later
    assert counters(counts.report()) == {CPU_SECONDS.name: {"scheduler": 0.004}}
