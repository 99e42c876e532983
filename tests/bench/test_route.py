"""``kvstrata bench route`` end to end at its smallest: two real ``vllm serve`` with the connector
on the tiny model and one pool, ``kvstrata route``'s front, the real ``openai`` client; through the
command line with ``--json`` and ``--plot``.

3 conversations x 2 turns, one round, every policy (3: not a multiple of the servers, so round
robin, taking requests in arrival order, sends each second turn to the other server); vLLM's KV memory 9 blocks of 32 tokens, so a
conversation's second turn finds its history only where its first turn went (that server's
vLLM cache or kvstrata tiers) or in the pool. Two servers start together, then the cold reference.

Asserted: the report's shape per policy (requests, TTFT, TPOT, goodput, requests per server
adding up, ratios to round robin over one round), every completion equal to the cold server's
(float32: exact), the round robin's second turns served from kvstrata's tiers on the other server
(its history from the pool), and no server left running.
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

pytestmark = pytest.mark.server  # the router's front serves beside the test

CONVERSATIONS, TURNS = 3, 2
ARGS = ["--conversations", str(CONVERSATIONS), "--turns", str(TURNS), "--rounds", "1", "--max-model-len", "256",
        "--kv-blocks", "9", "--max-tokens", "8", "--user-tokens", "32", "--rate", "4", "--host-mib", "16",
        "--disk-mib", "32", "--remote-mib", "32"]
POLICIES = ["round-robin", "predicted-ttft", "dynamo", "llm-d"]  # round robin first, then --policies' default order


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory, request):
    """(the --json document, the plot's path)."""
    from kvstrata.calibrate.serving import host

    try:
        pool = ["--pool", str(request.getfixturevalue("pool").config_file)]
    except pytest.skip.Exception:
        pool = ["--no-pool"]
    tmp = tmp_path_factory.mktemp("route")
    argv = ["bench", "route", "--model-dir", str(tiny_model_dir), *ARGS, *pool, "--json", "--plot", str(tmp / "ttft.png")]
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setattr(host, "QUIET_WAIT_S", 3.0)  # a test waits this long at most for a quiet host: it times nothing
        code = main(argv)
    assert code == 0
    return json.loads(out.getvalue()), tmp / "ttft.png"


def test_each_policy_has_its_figures_and_ratios_to_round_robin(run):
    doc, plot = run
    assert [r["policy"] for r in doc["results"]] == POLICIES
    assert doc["servers"] == ["server-1", "server-2"] and len(doc["orders"]) == 1
    for r in doc["results"]:
        m = r["measured"]
        assert len(m["requests"]) == CONVERSATIONS * TURNS
        assert 0 < m["ttft_p50_s"] <= m["ttft_p90_s"] and m["tpot_p50_s"] > 0
        assert sum(r["requests_per_server"].values()) == CONVERSATIONS * TURNS
        assert 0 <= r["goodput"]["share"] <= 1 and r["goodput"]["requests"] == CONVERSATIONS * TURNS
        assert r["versus_round_robin"]["ttft_p50"]["rounds"] == 1
    assert doc["results"][0]["versus_round_robin"]["ttft_p50"]["median"] == 1.0
    assert doc["results"][0]["requests_per_server"] == {"server-1": 3, "server-2": 3}  # in turn
    assert "skipped" in doc["sglang"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_completion_equals_the_cold_servers(run):
    doc, _ = run
    assert doc["identical"] is True
    assert all(r["measured"]["identical"] is True for r in doc["results"])
    assert doc["reference_prompts"] == len(POLICIES) * CONVERSATIONS * TURNS  # every pass's prompts its own


def test_round_robin_sends_a_second_turn_to_the_server_that_does_not_hold_its_history(run):
    """Round robin alternates 6 requests over 2 servers: each conversation's second turn goes to
    the other server (3 conversations, requests in arrival order), which holds none of its history
    in vLLM or its own tiers: with the pool, kvstrata finds it there."""
    doc, _ = run
    rr = doc["results"][0]["measured"]
    if doc["pool"] is not None:
        assert rr["hits"]["remote"]["blocks"] > 0


def test_no_server_is_left_running(run):
    assert not children_running("vllm.entrypoints.openai.api_server")
