"""Observations from metrics text (a real vLLM 0.32 server's, saved), summed over engines; from
a ``bench serve --json`` report by its shape; and sources that are not either, in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.doctor.sources import SourceError, Samples, from_bench, metrics_url, observation, read
from kvstrata.media import Medium

DATA = Path(__file__).parent / "data"
# vLLM's /metrics after 12 prompts (6 distinct of ~300 tokens, each twice) with a KV connector
# that served the repeats but puts no series of its own there (scraped from a real server).
VLLM_DUMP = DATA / "vllm_0.32_connector_without_series.txt"

CONNECTOR_TEXT = """\
# TYPE kvstrata_connector_lookup_hit_blocks_total counter
kvstrata_connector_lookup_hit_blocks_total{engine="0",model_name="m",tier="host"} 40.0
kvstrata_connector_lookup_hit_blocks_total{engine="0",model_name="m",tier="disk"} 14.0
# TYPE kvstrata_connector_lookup_miss_blocks_total counter
kvstrata_connector_lookup_miss_blocks_total{engine="0",model_name="m"} 54.0
# TYPE kvstrata_connector_loaded_blocks_total counter
kvstrata_connector_loaded_blocks_total{engine="0",model_name="m",tier="host"} 40.0
kvstrata_connector_loaded_blocks_total{engine="0",model_name="m",tier="disk"} 14.0
# TYPE kvstrata_connector_loaded_bytes_total counter
kvstrata_connector_loaded_bytes_total{engine="0",model_name="m",tier="host"} 2621440.0
kvstrata_connector_loaded_bytes_total{engine="0",model_name="m",tier="disk"} 917504.0
# TYPE kvstrata_connector_moved_bytes_total counter
kvstrata_connector_moved_bytes_total{dst="device",engine="0",model_name="m",src="host"} 2621440.0
kvstrata_connector_moved_bytes_total{dst="host",engine="0",model_name="m",src="disk"} 917504.0
# TYPE kvstrata_connector_transfer_seconds_total counter
kvstrata_connector_transfer_seconds_total{dst="device",engine="0",model_name="m",src="host"} 0.002
kvstrata_connector_transfer_seconds_total{dst="host",engine="0",model_name="m",src="disk"} 0.4
# TYPE kvstrata_connector_loads_total counter
kvstrata_connector_loads_total{engine="0",model_name="m"} 6.0
# TYPE kvstrata_connector_load_seconds_total counter
kvstrata_connector_load_seconds_total{engine="0",model_name="m"} 0.5
# TYPE kvstrata_connector_stored_blocks_total counter
kvstrata_connector_stored_blocks_total{engine="0",model_name="m"} 54.0
# TYPE kvstrata_connector_load_failed_blocks_total counter
kvstrata_connector_load_failed_blocks_total{engine="0",model_name="m"} 2.0
# TYPE kvstrata_connector_tier_used_bytes gauge
kvstrata_connector_tier_used_bytes{engine="0",model_name="m",tier="host"} 3.0e6
kvstrata_connector_tier_used_bytes{engine="0",model_name="m",tier="disk"} 3.5e6
# TYPE kvstrata_connector_tier_capacity_bytes gauge
kvstrata_connector_tier_capacity_bytes{engine="0",model_name="m",tier="host"} 3.1e6
kvstrata_connector_tier_capacity_bytes{engine="0",model_name="m",tier="disk"} 2.0e8
"""


def test_vllms_own_series_from_a_real_server():
    obs = read(str(VLLM_DUMP))[0]
    v = obs.vllm
    assert obs.connector is None and obs.model == "/tmp/dscratch/tiny"
    assert (v.requests, v.prompt_tokens) == (12, 3612)
    assert (v.prefix_queries_tokens, v.prefix_hits_tokens) == (3612, 0)
    assert (v.external_queries_tokens, v.external_hits_tokens) == (3612, 1728)
    assert (v.block_tokens, v.kv_cache_tokens) == (32, 1280)  # from cache_config_info's labels
    assert v.prompt_tokens_hist.count == 12 and v.computed_tokens_hist.total == 1884
    assert v.ttft_hist.quantile(0.5) == pytest.approx(0.04)
    assert v.prefill_seconds_hist.count == 12 and v.prefill_seconds_hist.total > 0


def test_series_are_summed_over_engines():
    text = VLLM_DUMP.read_text()
    two = Samples.parse([text, text.replace('engine="0"', 'engine="1"')], "two engines")
    v = observation(two, "two engines").vllm
    assert (v.prompt_tokens, v.external_hits_tokens, v.requests) == (2 * 3612, 2 * 1728, 24)
    assert v.ttft_hist.count == 24 and v.kv_cache_tokens == 1280  # each engine's own KV memory


def test_the_connectors_series_by_tier_and_leg():
    c = observation(Samples.parse([CONNECTOR_TEXT], "t"), "t").connector
    assert [t.medium for t in c.tiers] == [Medium.HOST, Medium.DISK]
    host, disk = c.tiers
    assert (host.hit_blocks, host.loaded_blocks, host.loaded_bytes) == (40, 40, 2621440)
    assert (disk.used_bytes, disk.capacity_bytes) == (3.5e6, 2.0e8)
    assert host.evicted_blocks is None  # not reported: unknown, not zero
    assert {(leg.src, leg.dst): leg.seconds for leg in c.legs} == {(Medium.HOST, Medium.DEVICE): 0.002,
                                                                  (Medium.DISK, Medium.HOST): 0.4}
    assert (c.miss_blocks, c.loads, c.load_seconds, c.stored_blocks, c.load_failed_blocks) == (54, 6, 0.5, 54, 2)
    assert c.recomputed_blocks == 0  # absent counts nothing


def test_a_bench_report_is_read_by_its_shape():
    # bench serve's report: each server's final /metrics by its name, its requests under the same name
    report = {"config": {"rounds": 1}, "metrics_text": {"baseline": VLLM_DUMP.read_text(),
                                                        "kvstrata": VLLM_DUMP.read_text() + CONNECTOR_TEXT},
              "baseline": {"requests": [{"prompt_tokens": 300, "ttft_s": 0.05}, {"prompt_tokens": 310, "ttft_s": 0.03}],
                           "ttft_p50_s": 0.04},
              "kvstrata": {"requests": [{"prompt_tokens": 300, "ttft_s": 0.02}]}}
    baseline, ours = from_bench(report, "bench.json")
    assert baseline.source == "bench.json [baseline]" and baseline.connector is None and baseline.baseline
    assert not ours.baseline
    assert [(r.prompt_tokens, r.ttft_s) for r in baseline.requests] == [(300, 0.05), (310, 0.03)]
    assert ours.source == "bench.json [kvstrata]" and ours.connector is not None and len(ours.requests) == 1
    # a list of configurations, each with its own text and requests
    configs = {"configs": [{"name": "a", "metrics_text": VLLM_DUMP.read_text(),
                            "rows": [{"prompt_tokens": 30, "ttft_s": 0.01}]}]}
    (a,) = from_bench(configs, "b.json")
    assert a.source == "b.json [a]" and a.requests[0].prompt_tokens == 30


@pytest.mark.parametrize(("text", "named"), [
    ("<html><body>Not found</body></html>", "not Prometheus metrics text"),
    ("node_cpu_seconds_total 12.0\n", "metrics, but not a vLLM server's"),
    ('{"rows": [1, 2]}', "not a `kvstrata bench serve --json` report"),
    ('{"rows": [1, 2', "looks like JSON but is not"),
])
def test_a_file_that_is_not_metrics_is_one_line(tmp_path, text, named):
    path = tmp_path / "dump.txt"
    path.write_text(text)
    with pytest.raises(SourceError, match=named) as info:
        read(str(path))
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_a_url_that_does_not_answer_is_one_line():
    with pytest.raises(SourceError, match=r"http://127\.0\.0\.1:9/metrics: no answer") as info:
        read("http://127.0.0.1:9", timeout_s=2)
    assert "\n" not in str(info.value)
    with pytest.raises(SourceError, match="no such file"):
        read("/no/such/dump")


def test_a_server_url_gets_its_metrics_path():
    assert metrics_url("http://h:8000") == "http://h:8000/metrics"
    assert metrics_url("http://h:8000/") == "http://h:8000/metrics"
    assert metrics_url("http://h:8000/custom/metrics") == "http://h:8000/custom/metrics"


def test_a_window_between_two_dumps(tmp_path):
    earlier, later = tmp_path / "earlier.txt", tmp_path / "later.txt"
    earlier.write_text(VLLM_DUMP.read_text() + CONNECTOR_TEXT)
    grown = CONNECTOR_TEXT.replace('tier="host"} 40.0', 'tier="host"} 100.0').replace(
        'kvstrata_connector_loads_total{engine="0",model_name="m"} 6.0', 'kvstrata_connector_loads_total{engine="0",model_name="m"} 9.0')
    later.write_text(VLLM_DUMP.read_text() + grown)
    (obs,) = read(str(later), since=str(earlier))
    c, v = obs.connector, obs.vllm
    assert c.tier(Medium.HOST).hit_blocks == 60 and c.loads == 3 and c.miss_blocks == 0
    assert c.tier(Medium.DISK).used_bytes == 3.5e6  # a gauge: its value now
    assert v.prompt_tokens == 0 and v.ttft_hist.count == 0 and v.block_tokens == 32
    with pytest.raises(SourceError, match="went down since the earlier dump"):
        read(str(earlier), since=str(later))
