"""The connector's counters on a real ``vllm serve``'s ``/metrics``, beside its JSON stats file.

One server (vLLM's OpenAI server, the tiny model, 40 KV blocks of 32 tokens) with kvstrata's
device, host and disk tiers; a ~600-token prompt is asked, asked again (vLLM's own prefix hit),
pushed out of vLLM's KV and kvstrata's device tier by four others, and asked once more: kvstrata
restores it from its host tier. The scrape is the API server's, so the series being there at
all says vLLM's stat logger ran the connector's ``observe`` in that process.
"""

from __future__ import annotations

import json
import random
import time

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvstrata.integrations.vllm.server import ServerSpec, VllmServer  # noqa: E402

PROMPT_TOKENS = 600  # 18 full blocks of 32 (a hit stops before the last token)
BLOCK_BYTES = 4 * 2 * 32 * 2 * 64 * 2  # the tiny model: 4 layers x K,V x 32 tokens x 2 KV heads x 64 dims x bf16
DEVICE_BYTES = 24 * BLOCK_BYTES  # one prompt's blocks, not two: the others push the first out
HOST_BYTES = 200 * BLOCK_BYTES + 12345  # every block the test stores, and not a whole number of blocks
DISK_BYTES = 400 * BLOCK_BYTES


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(PROMPT_TOKENS)]


def scrape(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of kvstrata's and vLLM's series: (name, labels less vLLM's) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))
            out[(s.name, labels)] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def tier_sum(samples: dict, name: str) -> dict[str, float]:
    return {dict(k[1])["tier"]: v for k, v in samples.items() if k[0] == name}


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """The server after the requests: its /metrics, its JSON stats, and the stats' block bytes."""
    work = tmp_path_factory.mktemp("vllm-metrics")
    stats_path = work / "stats.json"
    connector = {"device_bytes": DEVICE_BYTES, "host_bytes": HOST_BYTES, "disk_dir": str(work / "disk"),
                 "disk_bytes": DISK_BYTES, "stats_path": str(stats_path)}
    spec = ServerSpec(str(tiny_model_dir), kv_blocks=40, connector=connector,
                      env={"VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"})
    with VllmServer(spec, work / "server.log") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none")
        model = client.models.list().data[0].id
        for seed in (0, 0, 1, 2, 3, 4, 0):  # the last: out of vLLM's KV and kvstrata's device tier
            client.completions.create(model=model, prompt=prompt(seed), max_tokens=2, temperature=0)
        yield _settled(server, stats_path), json.loads(stats_path.read_text())


def _settled(server: VllmServer, stats_path, timeout_s: float = 20.0) -> dict:
    """The scrape once it shows the stats file's loads and stores (the API server records a
    step's stats after the step's output)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(server.metrics_text())
        stats = json.loads(stats_path.read_text())
        seen = (value(samples, "kvstrata_connector_loads_total"), value(samples, "kvstrata_connector_stored_blocks_total"))
        if seen == (stats["load_requests"], stats["new_blocks"]) or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def test_a_host_hit_is_counted_loaded_and_moved(served):
    samples, stats = served
    assert stats["block_bytes"] == BLOCK_BYTES
    hits = tier_sum(samples, "kvstrata_connector_lookup_hit_blocks_total")
    loaded = tier_sum(samples, "kvstrata_connector_loaded_blocks_total")
    assert hits.get("host", 0) > 0 and loaded.get("host", 0) > 0
    assert value(samples, "kvstrata_connector_lookup_miss_blocks_total") == 5 * 18  # each prompt's first ask
    for tier, blocks in loaded.items():
        assert value(samples, "kvstrata_connector_loaded_bytes_total", tier=tier) == blocks * BLOCK_BYTES
    # host hits are copied into vLLM's blocks out of the host tier's slots: nothing moves to kvstrata's device tier
    assert value(samples, "kvstrata_connector_moved_bytes_total", src="host", dst="device") == 0
    assert value(samples, "kvstrata_connector_moved_bytes_total", src="device", dst="host") > 0  # the saves' puts
    assert value(samples, "kvstrata_connector_transfer_seconds_total", src="device", dst="host") > 0
    assert value(samples, "kvstrata_connector_saved_bytes_total") >= stats["stored_bytes"] > 0  # offered >= new
    assert value(samples, "kvstrata_connector_stored_blocks_total") == 5 * 18
    assert value(samples, "kvstrata_connector_load_failed_blocks_total") == 0  # there, at 0
    # vLLM's own per-source count of the hit's tokens, from the connector's tiers
    assert value(samples, "vllm:prompt_tokens_cached_by_source_total", source="host") == hits["host"] * 32


def test_a_prompt_whose_first_block_was_never_stored_is_a_miss_the_scheduler_answers(served):
    """Seeds 0, 0, 1, 2, 3, 4, 0: the first 0 is asked of the worker (no report yet says its
    caches started empty), the second is vLLM's own hit (nothing asked), 1 to 4 were never
    stored (the scheduler's misses, no round trip), the last 0 was: the worker answers it."""
    samples, _ = served
    lookups = {dict(k[1])["answered_by"]: v for k, v in samples.items() if k[0] == "kvstrata_connector_lookups_total"}
    assert lookups == {"scheduler": 4, "worker": 2}
    assert value(samples, "kvstrata_connector_lookup_miss_blocks_total") == 5 * 18  # counted as before


def test_the_tier_gauges_are_the_configured_capacities_and_what_is_stored(served):
    samples, stats = served
    capacity = tier_sum(samples, "kvstrata_connector_tier_capacity_bytes")
    used = tier_sum(samples, "kvstrata_connector_tier_used_bytes")
    assert capacity == {"device": DEVICE_BYTES, "host": HOST_BYTES, "disk": DISK_BYTES}
    stored = stats["new_blocks"] * BLOCK_BYTES
    # written back: in the host, which is not full, and nothing on disk until it evicts (or the server stops)
    assert (used["host"], used["disk"]) == (stored, 0)
    assert used["device"] == 0  # host hits are served in place, saves go straight to the host tier
    # every tier's eviction series is exported, at 0 where none was needed
    assert set(tier_sum(samples, "kvstrata_connector_evicted_blocks_total")) == {"device", "host", "disk"}


def test_the_counters_agree_with_the_stats_file(served):
    samples, stats = served
    by_source: dict[str, float] = {}
    for route, blocks in stats["load_paths"].items():
        source = route.split(" -> ")[0]
        by_source[source] = by_source.get(source, 0) + blocks
    assert tier_sum(samples, "kvstrata_connector_loaded_blocks_total") == by_source
    assert value(samples, "kvstrata_connector_loads_total") == stats["load_requests"] > 0
    assert value(samples, "kvstrata_connector_stored_blocks_total") == stats["new_blocks"]
    assert value(samples, "kvstrata_connector_stores_total") == stats["store_requests"] > 0
    assert value(samples, "kvstrata_connector_load_seconds_total") == pytest.approx(stats["load_seconds"])
    assert value(samples, "kvstrata_connector_store_seconds_total") == pytest.approx(stats["store_seconds"])
    assert value(samples, "kvstrata_connector_load_failed_blocks_total") == stats["failed_blocks"]
    assert value(samples, "kvstrata_connector_recomputed_blocks_total") == stats["recomputed_blocks"]


def test_every_series_the_dashboard_queries_is_on_the_servers_metrics(served):
    from tests.integrations.test_vllm_dashboard import dashboard, queried_series

    samples, _ = served
    on_metrics = {name for name, _ in samples}
    assert queried_series(dashboard()) - on_metrics == set()
