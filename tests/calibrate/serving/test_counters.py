"""A vllm serve process's counters as bench serve reads them: vLLM's and the connector's
/metrics, the connector's stats file, and a phase as the difference of two snapshots."""

from __future__ import annotations

import pytest

from kvstrata.calibrate.serving.counters import ByteRates, ConnectorCpu, Counters, HitsSource, counters_of, parse_metrics
from kvstrata.media import Medium

METRICS = """# HELP vllm:prefix_cache_queries_total Prefix cache queries.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0
kvstrata_connector_lookup_hit_blocks_total{engine="0",model_name="m",tier="host"} 12.0
kvstrata_connector_lookup_hit_blocks_total{engine="0",model_name="m",tier="remote"} 3.0
"""
STATS = {"load_paths": {"host -> device": 10, "remote -> host -> device": 2, "device": 1}, "load_requests": 4,
         "load_seconds": 0.2, "restored_bytes": 1000}


def test_counters_prefer_the_connectors_metrics_and_fall_back_to_its_stats_file():
    both = counters_of(METRICS, STATS)
    assert both.hit_blocks == {Medium.HOST: 12, Medium.REMOTE: 3} and both.hits_source is HitsSource.METRICS
    assert both.prefix_hit_rate == 0.25
    plain = "\n".join(line for line in METRICS.splitlines() if not line.startswith("kvstrata_"))
    file_only = counters_of(plain, STATS)
    assert file_only.hit_blocks == {Medium.DEVICE: 1, Medium.HOST: 10, Medium.REMOTE: 2}  # by the tier found in
    assert file_only.hits_source is HitsSource.STATS_FILE
    assert counters_of(plain, None).hits_source is HitsSource.NONE
    assert parse_metrics('a{x="1,2",y="q\\"r"} 3\n')["a"] == [({"x": "1,2", "y": 'q\\"r'}, 3.0)]


def test_a_phase_is_the_difference_of_two_snapshots():
    before = counters_of(METRICS.replace(" 12.0", " 2.0").replace("1000.0", "400.0"), STATS)
    after = counters_of(METRICS, {**STATS, "load_requests": 9, "load_seconds": 0.5})
    phase = after.minus(before)
    assert phase.hit_blocks == {Medium.HOST: 10}
    assert (phase.load_requests, phase.prefix_queries_tokens) == (5, 600.0)
    assert phase.load_seconds == pytest.approx(0.3)
    appeared = after.minus(counters_of("", None))  # a per-tier series that appeared in between counts from zero
    assert appeared.hit_blocks == {Medium.HOST: 12, Medium.REMOTE: 3}
    assert Counters().plus(phase).hit_blocks == phase.hit_blocks


# as vLLM's /metrics carries the connector's counter (prometheus_client adds a _created series)
CPU = """# HELP kvstrata_connector_cpu_seconds_total CPU seconds the KVStrata connector used.
# TYPE kvstrata_connector_cpu_seconds_total counter
kvstrata_connector_cpu_seconds_total{engine="0",model_name="m",side="scheduler"} 0.125
kvstrata_connector_cpu_seconds_total{engine="0",model_name="m",side="worker"} 0.25
kvstrata_connector_cpu_seconds_created{engine="0",model_name="m",side="worker"} 1.7e+09
"""


def test_the_connectors_cpu_seconds_by_side_and_over_a_phase():
    cpu = counters_of(METRICS + CPU, None).connector_cpu
    assert cpu == ConnectorCpu(0.125, 0.25) and cpu.total_s == 0.375
    two_engines = CPU + 'kvstrata_connector_cpu_seconds_total{engine="1",model_name="m",side="worker"} 0.5\n' \
                        'kvstrata_connector_cpu_seconds_total{engine="1",model_name="m",side="gpu"} 9.0\n'
    assert counters_of(two_engines, None).connector_cpu == ConnectorCpu(0.125, 0.75)  # summed; an unknown side left out
    assert counters_of(CPU, None).connector  # the counter alone says the server has the connector
    later = counters_of(CPU.replace(" 0.125", " 0.5").replace(" 0.25", " 1.0"), None)
    phase = later.minus(counters_of(CPU, None))
    assert phase.connector_cpu == ConnectorCpu(0.375, 0.75)
    assert phase.connector_cpu.per_request(3) == pytest.approx(ConnectorCpu(0.125, 0.25))
    assert later.minus(counters_of("", None)).connector_cpu == ConnectorCpu(0.5, 1.0)  # appeared: counts from zero
    assert phase.plus(phase).connector_cpu == ConnectorCpu(0.75, 1.5)
    assert phase.plus(Counters()).connector_cpu == phase.connector_cpu


def test_a_connector_without_the_cpu_counter_has_none():
    older = counters_of(METRICS, STATS)
    assert older.connector and older.connector_cpu is None
    assert older.minus(older).connector_cpu is None and older.plus(Counters()).connector_cpu is None


# the bytes that CPU moved: into vLLM (by tier), out of vLLM, between tiers (by src and dst)
BYTES = """kvstrata_connector_loaded_bytes_total{engine="0",model_name="m",tier="host"} 3e6
kvstrata_connector_loaded_bytes_total{engine="0",model_name="m",tier="disk"} 1e6
kvstrata_connector_saved_bytes_total{engine="0",model_name="m"} 2e6
kvstrata_connector_moved_bytes_total{dst="host",engine="0",model_name="m",src="device"} 2e6
kvstrata_connector_moved_bytes_total{dst="disk",engine="0",model_name="m",src="host"} 2e6
kvstrata_connector_moved_bytes_total{dst="device",engine="0",model_name="m",src="disk"} 1e6
kvstrata_connector_moved_bytes_total{dst="device",engine="0",model_name="m",src="remote"} 5e5
"""


def test_the_bytes_the_connectors_cpu_moved_and_its_cpu_beyond_them():
    cpu = counters_of(CPU + BYTES, None).connector_cpu
    assert cpu.copied_bytes == 11.5e6  # every copy: into vLLM, out of it, between tiers
    assert cpu.checksummed_bytes == 3.5e6  # the moves to or from a disk or the pool
    rates = ByteRates(copy_gbps=10.0, checksum_gbps=5.0)
    assert cpu.bytes_s(rates) == pytest.approx(11.5e6 / 10e9 + 3.5e6 / 5e9)
    assert cpu.beyond_bytes_s(rates) == pytest.approx(0.375 - cpu.bytes_s(rates))
    phase = counters_of((CPU + BYTES).replace("2e6", "5e6"), None).minus(counters_of(CPU + BYTES, None)).connector_cpu
    assert (phase.copied_bytes, phase.checksummed_bytes) == (9e6, 3e6)  # saved 3e6, device->host 3e6, host->disk 3e6
    assert phase.per_request(3).copied_bytes == 3e6
    assert counters_of(CPU, None).connector_cpu.copied_bytes == 0  # a connector exporting no bytes: none counted


def test_the_servers_cpu_seconds_over_a_phase_and_per_request():
    from kvstrata.calibrate.serving.measured import RequestRecord, measure
    from kvstrata.calibrate.serving.servers import Instance

    before, after = counters_of(METRICS, STATS, server_cpu_s=10.0), counters_of(METRICS, STATS, server_cpu_s=16.0)
    phase = after.minus(before)
    assert phase.server_cpu_s == pytest.approx(6.0)
    assert phase.plus(phase).server_cpu_s == pytest.approx(12.0) and phase.plus(Counters()).server_cpu_s == 6.0
    assert after.minus(counters_of(METRICS, STATS)).server_cpu_s is None  # a snapshot without it: no difference
    records = [RequestRecord(i, 0, Instance.OURS, 128, (1, 2), 0.02, 0.004, 0.03, 0.25 * i) for i in range(3)]
    assert measure(records, phase, 16).server_cpu_per_request_s == pytest.approx(2.0)
    assert measure(records, counters_of(METRICS, STATS), 16).server_cpu_per_request_s is None
