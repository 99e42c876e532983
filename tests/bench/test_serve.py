"""``kvstrata bench serve`` end to end at its smallest: real ``vllm serve`` processes on the tiny
model, the real ``openai`` client, the shared pool; through the command line with ``--json`` and
``--plot``, the typed report kept to render the table too.

4 conversations x 2 turns, one round; vLLM's KV memory 9 blocks of 32 tokens (8 and its null
block: one request of 256 tokens), so by a conversation's second turn vLLM has evicted its first,
and kvstrata's device tier (as many blocks) has passed it on to the host tier. Six servers start
one after another, and one restarts (~20 s each on 2 cores): about three minutes.

Asserted: the report's shape (what ``kvstrata doctor`` reads: metrics_text by server, each
request's prompt_tokens and ttft_s), and behaviour that could fail: kvstrata's hits from its host
tier on the second turns, every completion equal to the cold server's, the second server's hits
from the pool, the restarted server's from its disk, the decode server's KV from the pool, and no
server left running.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from tests.process_support import children_running

pytest.importorskip("vllm")
pytest.importorskip("openai")

from kvstrata.cli import main  # noqa: E402

CONVERSATIONS, TURNS = 4, 2
ARGS = ["--conversations", str(CONVERSATIONS), "--turns", str(TURNS), "--rounds", "1", "--max-model-len", "256",
        "--kv-blocks", "9", "--max-tokens", "8", "--user-tokens", "32", "--rate", "4", "--host-mib", "16",
        "--disk-mib", "32", "--remote-mib", "32"]
SERVERS = {"baseline", "kvstrata", "second", "prefill", "decode", "reference"}


@pytest.fixture(scope="module")
def pool_file(request):
    """The session's pool as a file; None without the pool engine (the pool's parts are then skipped)."""
    try:
        return request.getfixturevalue("pool").config_file
    except pytest.skip.Exception:
        return None


@pytest.fixture(scope="module")
def run(tiny_model_dir, pool_file, tmp_path_factory):
    """(the --json document, the typed report, the plot's path)."""
    from kvstrata.bench import serve
    from kvstrata.calibrate.serving import host

    tmp = tmp_path_factory.mktemp("serve")
    reports = []
    real = serve.run_serve_bench

    def keep(*args, **kwargs):
        reports.append(real(*args, **kwargs))
        return reports[-1]

    pool = ["--pool", str(pool_file)] if pool_file is not None else ["--no-pool"]
    argv = ["bench", "serve", "--model-dir", str(tiny_model_dir), *ARGS, *pool, "--json", "--plot", str(tmp / "ttft.png")]
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setattr(serve, "run_serve_bench", keep)
        patch.setattr(host, "QUIET_WAIT_S", 3.0)  # a test waits this long at most for a quiet host: it times nothing
        code = main(argv)
    assert code == 0
    return json.loads(out.getvalue()), reports[0], tmp / "ttft.png"


def test_the_report_has_each_configurations_figures_per_request(run):
    doc, _, plot = run
    config = doc["config"]
    assert (config["kv_blocks"], config["workload"]["block_tokens"], config["block_bytes"]) == (9, 32, 4 * 2 * 32 * 2 * 64 * 4)  # float32: layers x K,V x tokens x heads x dim x 4 B
    assert config["host_bytes"] == 16 << 20 and config["disk_bytes"] == 32 << 20
    for name in ("baseline", "kvstrata"):
        m = doc[name]
        assert len(m["requests"]) == len(m["ttft_s"]) == CONVERSATIONS * TURNS
        assert all(r["prompt_tokens"] > 0 and r["ttft_s"] > 0 and len(r["output_ids"]) == 8 for r in m["requests"])
        assert 0 < m["ttft_p50_s"] <= m["ttft_p90_s"] <= m["ttft_p99_s"]
        assert m["tpot_p50_s"] > 0 and m["requests_per_s"] > 0 and m["output_tokens_per_s"] > 0
        assert 0 <= m["vllm_prefix_hit_rate"] <= 1
    assert doc["versus"]["ttft_p50"]["rounds"] == 1
    assert doc["baseline"]["hits"] == {}  # vLLM alone
    assert set(doc["metrics_text"]) == (SERVERS if doc["pool"] else {"baseline", "kvstrata", "reference"})
    assert all("vllm:prefix_cache_queries_total" in text for text in doc["metrics_text"].values())
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the connector's CPU, the bytes it moved (it stored every prompt, loaded later turns), and
    # what of the CPU is beyond those bytes at the host's rates, measured in the run
    cpu, rates = doc["kvstrata"]["connector_cpu_per_request"], doc["byte_rates"]
    assert cpu["copied_bytes"] >= config["block_bytes"] and 0 < cpu["checksummed_bytes"] <= cpu["copied_bytes"]
    assert rates["copy_gbps"] > 0 and rates["checksum_gbps"] > 0
    assert doc["connector_cpu_beyond_bytes_per_request_s"] == pytest.approx(
        cpu["scheduler_s"] + cpu["worker_s"] - cpu["copied_bytes"] / (rates["copy_gbps"] * 1e9)
        - cpu["checksummed_bytes"] / (rates["checksum_gbps"] * 1e9))
    # each server's processes' CPU per request: more than the connector's alone, and their ratio per round
    assert doc["kvstrata"]["server_cpu_per_request_s"] > cpu["scheduler_s"] + cpu["worker_s"]
    assert doc["baseline"]["server_cpu_per_request_s"] > 0 and doc["versus"]["server_cpu_per_request"]["median"] > 0


def test_kvstrata_serves_later_turns_from_its_host_tier_after_vllm_evicted_them(run):
    doc, _, _ = run
    hits = doc["kvstrata"]["hits"]
    assert hits["host"]["blocks"] > 0
    # kvstrata's hits are the blocks beyond vLLM's own prefix hit: the two never count a token twice
    assert doc["kvstrata"]["hit_rate"] + doc["kvstrata"]["vllm_prefix_hit_rate"] <= 1
    later = [r for r in doc["kvstrata"]["requests"] if r["turn"] > 0]
    assert len(later) == CONVERSATIONS


def test_every_completion_equals_the_cold_servers(run):
    doc, _, _ = run
    assert doc["identical"] is True
    assert doc["baseline"]["identical"] is True and doc["kvstrata"]["identical"] is True
    assert all(r["identical"] for r in doc["kvstrata"]["requests"])
    assert doc["reference_prompts"] >= CONVERSATIONS * TURNS


def test_two_servers_share_the_pool_and_a_restarted_server_reads_its_disk(run, pool_file):
    doc, _, _ = run
    restart = doc["restart"]
    if pool_file is None:
        assert doc["shared_pool"] == {"skipped": "--no-pool"}
        assert restart["server"] == "kvstrata" and restart["replay"]["hits"]["disk"]["blocks"] > 0
        return
    second = doc["shared_pool"]["servers"]["second"]
    assert second["hits"]["remote"]["blocks"] > 0  # its turns' history was put in the pool by the other server
    assert len(second["requests"]) + len(doc["shared_pool"]["servers"]["kvstrata"]["requests"]) == CONVERSATIONS * TURNS
    assert restart["server"] == "second" and restart["restart_s"] > 0
    assert restart["replay"]["hits"]["disk"]["blocks"] > 0
    assert [r["prompt_tokens"] for r in restart["replay"]["requests"]] == [r["prompt_tokens"] for r in second["requests"]]
    assert restart["replay"]["identical"] is True
    assert "vllm:prefix_cache_queries_total" in restart["metrics_text_before"]


def test_prefill_decode_hands_the_kv_over_in_the_pool(run, pool_file):
    if pool_file is None:
        pytest.skip("no pool engine")
    pd = run[0]["prefill_decode"]
    assert pd["decode"]["hits"]["remote"]["blocks"] > 0
    assert all(len(r["output_ids"]) == 1 for r in pd["prefill"]["requests"])
    assert len(pd["decode"]["requests"]) == len(pd["prefill"]["requests"]) == CONVERSATIONS * TURNS
    assert pd["restore_measured_s"] > 0 and pd["restore_predicted_s"] > 0
    assert pd["prediction"] == "a quick calibration of this host"
    assert pd["decode"]["identical"] is True and pd["prefill"]["identical"] is True


def test_no_server_is_left_running(run):
    assert not children_running("api_server")


def test_the_table_names_each_configuration(run):
    from kvstrata.bench.cli.serve import _print_serve

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _print_serve(run[1])
    text = out.getvalue()
    for words in ("vLLM alone", "vLLM + kvstrata", "kvstrata / vLLM", "restarted", "Completions: every one"):
        assert words in text
    if run[1].pool is not None:
        assert "2 servers: second" in text and "P/D handoff" in text and "predicted for this host" in text



def test_a_burst_sharing_a_prefix_only_kvstrata_holds_loads_each_block_once(run):
    burst = run[1].concurrency
    assert burst.requests == 16 and burst.ttft_p90.rounds == 1
    # kvstrata's burst: the prefix loaded once (the other 15 found it in vLLM's cache), every answer the cold one
    assert 0 < burst.loaded_blocks == burst.prefix_blocks and burst.load_requests == 1 and burst.loaded_once
    assert burst.from_kvstrata.identical and burst.from_vllm.identical and burst.setup.identical
    assert burst.from_vllm.hits == {} and burst.ttft_p90.median > 0
