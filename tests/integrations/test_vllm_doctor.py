"""``kvstrata doctor`` on real runs: vLLM's OpenAI server with the connector on the tiny model,
four workloads, the doctor naming the cause of each from the server's own ``/metrics``.

1. no reuse: distinct prompts only;
2. fits vLLM's own cache: three short prompts asked five times each, 400 KV blocks;
3. slow disk: six prompts asked twice through 40 KV blocks (the repeats evicted from vLLM), held
   in a disk tier whose reads are capped at 2 MB/s (an emulated slow drive), no host tier: the
   first load from it runs past its budget and is computed, the rest the scheduler declines;
4. kvstrata helps: the same, served from the host tier.

Cases 1 and 2 share a server: the second is diagnosed on the window after the first's dump
(``--since``). The three servers start together. The hardware profile is this host's, calibrated at small sizes by the module.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from kvstrata.cli import main  # noqa: E402
from kvstrata.doctor.sources import Samples  # noqa: E402
from kvstrata.integrations.vllm.server import ServerSpec, VllmServer, start_together  # noqa: E402

PROMPT_TOKENS = 300  # 9 full blocks of 32
BLOCK_BYTES = 4 * 2 * 32 * 2 * 64 * 2  # the tiny model: 4 layers x K,V x 32 tokens x 2 KV heads x 64 dims x bf16
DEVICE_BYTES = 16 * BLOCK_BYTES  # kvstrata's device tier: under two prompts, so repeats come from below it
TIER_BYTES = 400 * BLOCK_BYTES
SLOW_DISK_GBPS = 0.002  # 64 KiB blocks in ~33 ms each: far slower than the tiny model computes them
ENV = {"VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}


def prompt(seed: int, tokens: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(tokens)]


def ask(server: VllmServer, prompts: list[list[int]]) -> None:
    """Each prompt in turn, streamed (temperature 0, two tokens), as a client would."""
    client = openai.OpenAI(base_url=server.base_url, api_key="none")
    model = client.models.list().data[0].id
    for p in prompts:
        for _ in client.completions.create(model=model, prompt=p, max_tokens=2, temperature=0, stream=True):
            pass


def dump(server: VllmServer, stats_path: Path, into: Path, timeout_s: float = 20.0) -> Path:
    """The server's /metrics into a file, once it shows the stats file's loads and stores (the
    API server records a step's stats after the step's output)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = server.metrics_text()
        samples = Samples.parse([text], server.url)
        stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
        seen = (samples.total("kvstrata_connector_loads_total"), samples.total("kvstrata_connector_stored_blocks_total"))
        if seen == (stats.get("load_requests", 0), stats.get("new_blocks", 0)) or time.monotonic() > deadline:
            into.write_text(text)
            return into
        time.sleep(0.2)


def doctor(source: Path | str, profile: Path, *args: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["doctor", str(source), "--profile", str(profile), "--json", *args]) == 0
    return json.loads(out.getvalue())


def spec(model_dir: Path, work: Path, kv_blocks: int, **tiers) -> tuple[ServerSpec, Path]:
    stats = work / "stats.json"
    connector = {"device_bytes": DEVICE_BYTES, "stats_path": str(stats), **tiers}
    return ServerSpec(str(model_dir), kv_blocks=kv_blocks, connector=connector, env=ENV), stats


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    """This host calibrated at small sizes (seconds): its disk's block reads and kvstrata's fixed costs."""
    work = tmp_path_factory.mktemp("calibrate")
    out = work / "host.toml"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["calibrate", "--sizes-mib", "1", "4", "--repeats", "2", "--dir", str(work), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory) -> dict[str, tuple[VllmServer, Path, Path]]:
    """Each case's server (its stats file, its work directory), the three started together (a
    start is mostly three processes importing, one CPU each), stopped at the module's end."""
    started = {}
    for name, kv_blocks in (("big", 400), ("slow-disk", 40), ("host", 40)):
        work = tmp_path_factory.mktemp(f"doctor-{name}")
        tiers = {"slow-disk": dict(host_bytes=0, disk_dir=str(work / "disk"), disk_bytes=TIER_BYTES,
                                   disk_read_gbps=SLOW_DISK_GBPS)}.get(name, dict(host_bytes=TIER_BYTES))
        server_spec, stats = spec(tiny_model_dir, work, kv_blocks, **tiers)
        started[name] = (VllmServer(server_spec, work / "server.log"), stats, work)
    start_together([server for server, _, _ in started.values()])
    try:
        yield started
    finally:
        for server, _, _ in started.values():
            server.stop()


@pytest.fixture(scope="module")
def big_vllm(servers, profile) -> tuple[Path, Path, dict]:
    """Cases 1 and 2 on one server with 400 KV blocks and a host tier: dumps after the distinct
    prompts and after the short repeated ones, and the doctor's answer from the live URL after
    the first."""
    server, stats, work = servers["big"]
    ask(server, [prompt(100 + i) for i in range(12)])
    distinct = dump(server, stats, work / "distinct.txt")
    live = doctor(server.url, profile)
    short = [prompt(200 + i, 100) for i in range(3)]
    ask(server, short * 5)
    repeated = dump(server, stats, work / "repeated.txt")
    return distinct, repeated, live


def served_twice(server: VllmServer, stats: Path, work: Path) -> Path:
    """Six prompts asked twice through 40 KV blocks: the repeats are gone from vLLM's cache."""
    ask(server, [prompt(i) for i in range(6)] * 2)
    return dump(server, stats, work / "metrics.txt")


def causes(doc: dict) -> dict[str, dict]:
    return {f["cause"]: f for f in doc["findings"]}


def test_no_reuse_is_reuse_limited_not_a_capacity_problem(big_vllm, profile):
    distinct, _, live = big_vllm
    doc = doctor(distinct, profile)
    found = causes(doc)
    assert (live["verdict"], set(causes(live))) == (doc["verdict"], set(found))  # the URL answers as its dump
    assert doc["verdict"] == "no_gain"
    assert found["reuse_limited"]["severity"] == "problem"
    assert found["reuse_limited"]["change"]["kind"] == "disable_connector"
    assert "capacity_limited" not in found and "helps" not in found
    assert all(f["change"]["kind"] != "bigger_tier" for f in doc["findings"])
    assert doc["summary"]["kvstrata_hit_rate"] == 0


def test_a_workload_that_fits_vllms_cache_is_served_by_vllm(big_vllm, profile):
    distinct, repeated, _ = big_vllm
    doc = doctor(repeated, profile, "--since", str(distinct))
    found = causes(doc)
    assert "vllm_cache_serves" in found and doc["verdict"] == "no_gain"
    assert doc["summary"]["vllm_hit_rate"] > 0.5
    assert found["vllm_cache_serves"]["evidence"]["connector_hit_tokens"]["value"] == 0


def test_a_slow_disk_is_declined_by_the_scheduler_and_asks_for_no_change(servers, profile):
    metrics = served_twice(*servers["slow-disk"])
    doc = doctor(metrics, profile)
    found = causes(doc)
    # the first load from the disk ran past its budget (twice the prefill of its tokens) and was
    # computed instead; the scheduler then declined the disk's hits: kvstrata never waited on it
    assert doc["verdict"] != "hurts" and "helps" not in found and "slower_than_recompute" not in found
    declined = found["declined"]
    assert declined["tier"] == "disk" and declined["change"]["kind"] == "none"
    assert found["load_failures"]["severity"] in ("warn", "problem")
    disk = next(t for t in doc["tiers"] if t["tier"] == "disk")
    assert disk["hit_rate"] > 0


def test_host_restores_help_and_the_hit_rate_per_tier_is_reported(servers, profile):
    metrics = served_twice(*servers["host"])
    doc = doctor(metrics, profile)
    found = causes(doc)
    assert doc["verdict"] == "helps"
    assert "slower_than_recompute" not in found
    assert found.get("below_prediction", {}).get("severity", "info") == "info"  # if slower than calibrated: cheap anyway
    evidence = found["helps"]["evidence"]
    assert evidence["host_hit_rate"]["value"] > 0.3 and evidence["saved_s"]["value"] > 0
    host = next(t for t in doc["tiers"] if t["tier"] == "host")
    assert host["hit_rate"] > 0.3 and host["seconds_per_block"] < host["recompute_s_per_block"]
