"""The Grafana dashboard (deploy/grafana/kvstrata-vllm.json): dashboard JSON Grafana imports, on a
``${DS_PROMETHEUS}`` data source, querying only series the connector exports (the names come
from :mod:`kvstrata.integrations.vllm.prom`). test_vllm_metrics.py checks every series it
queries against a real server's ``/metrics``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvstrata-vllm.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{")  # every series is selected with {model_name=~...}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(dash: dict) -> list[str]:
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def queried_series(dash: dict) -> set[str]:
    """Every series name the dashboard's PromQL selects."""
    return {name for expr in queries(dash) for name in _SELECTOR.findall(expr)}


def test_it_is_a_dashboard_on_a_prometheus_data_source_variable():
    dash = dashboard()
    assert dash["title"] and re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dash["uid"])
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    graphs = [p for p in dash["panels"] if p["type"] != "row"]
    assert graphs and all(p["type"] == "timeseries" for p in graphs)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in graphs:
        assert panel["title"] and panel["targets"] and panel["datasource"] == DATASOURCE
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"} and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs))
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE and target["expr"].count("(") == target["expr"].count(")")


def test_it_queries_only_what_the_connector_exports_and_vllms_ttft_and_prefix_cache():
    pytest.importorskip("vllm")
    from kvstrata.integrations.vllm.prom import exported_names

    series = queried_series(dashboard())
    ours = {s for s in series if s.startswith("kvstrata_")}
    assert ours <= exported_names(), sorted(ours - exported_names())
    # the panels the operator looks for: hits by tier, restores, paths, time, failures, occupancy
    assert {"kvstrata_connector_lookup_hit_blocks_total", "kvstrata_connector_lookup_miss_blocks_total",
            "kvstrata_connector_loaded_bytes_total", "kvstrata_connector_moved_bytes_total",
            "kvstrata_connector_transfer_seconds_total", "kvstrata_connector_load_seconds_total",
            "kvstrata_connector_store_seconds_total", "kvstrata_connector_load_failed_blocks_total",
            "kvstrata_connector_recomputed_blocks_total", "kvstrata_connector_tier_used_bytes",
            "kvstrata_connector_tier_capacity_bytes"} <= ours
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:prefix_cache_hits_total",
            "vllm:prefix_cache_queries_total"} <= series
