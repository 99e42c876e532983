"""``make_plan`` and ``kvstrata plan`` on windowed and hybrid models: sized from the KV groups."""

from __future__ import annotations

import json

import pytest
from hybrid_support import dense_twin, gemma3_27b, gpt_oss_120b, qwen3_next_80b
from rich.console import Console

from kvstrata.cli import main
from kvstrata.cli.plan import render
from kvstrata.kv.groups import GroupKind
from kvstrata.plan.footprint import request_bytes, restore_bytes, stored_bytes
from kvstrata.plan.planner import make_plan

GEMMA, OSS, QWEN = gemma3_27b(), gpt_oss_120b(), qwen3_next_80b()


def arch(plan, key):
    return next(a for a in plan.architectures if a.arch.value == key)


@pytest.mark.parametrize("context", [8192, 131_072])
def test_hbm_holds_more_long_requests_of_a_sliding_model_than_of_its_dense_twin(h200, context):
    sliding, dense = make_plan(GEMMA, h200, context, gpus=1), make_plan(dense_twin(GEMMA), h200, context, gpus=1)
    free = int(h200.topology.node("gpu0").capacity_bytes * 0.9 - GEMMA.weight_bytes())
    assert arch(sliding, "hbm").concurrent_requests == free // GEMMA.kv_bytes(context)
    assert arch(dense, "hbm").concurrent_requests == free // (context * dense_twin(GEMMA).bytes_per_token)
    assert arch(sliding, "hbm").concurrent_requests > 3 * arch(dense, "hbm").concurrent_requests
    assert sliding.capacity.hbm_tokens == free * context // GEMMA.kv_bytes(context)


def test_sliding_restore_grows_only_by_the_full_layers_past_the_window(h200):
    small, large = (make_plan(GEMMA, h200, n, gpus=1) for n in (16_384, 131_072))
    assert small.restore_bytes == GEMMA.kv_bytes(16_384)
    assert large.restore_bytes - small.restore_bytes == (131_072 - 16_384) * GEMMA.bytes_per_token
    sliding = next(s for s in large.restore_groups.shares if s.group.kind is GroupKind.SLIDING)
    assert sliding.tokens == 1024


def test_a_hybrid_restores_one_state_snapshot_and_streams_it_every_step(h200):
    plan = make_plan(QWEN, h200, 65_536, cached_tokens=32_768)
    tp = plan.tp
    state = next(s for s in plan.restore_groups.shares if s.group.kind is GroupKind.STATE)
    assert state.size_bytes == QWEN.state_bytes(tp) and state.tokens == 0
    assert plan.restore_bytes == tp * (32_768 * QWEN.bytes_per_token_per_gpu(tp) + QWEN.state_bytes(tp))
    stream = arch(plan, "dram-streaming")
    assert stream.per_step_external_bytes == request_bytes(QWEN, 65_536, tp)
    # off-GPU stores keep each request's tokens and one snapshot
    dram = 2 * 1024 * 10**9 * 8 // 10
    assert plan.capacity.dram_tokens == dram * 65_536 // stored_bytes(QWEN, 65_536)


def test_streaming_waits_for_the_first_layer_only(h200):
    plan = make_plan(GEMMA, h200, 65_536, gpus=1)
    stream = arch(plan, "dram-streaming")
    # layer 0 is sliding: it holds a 1024-token window of the 65,536-token context
    share = 1024 * 2 * 16 * 128 * 2 / GEMMA.kv_bytes(65_536)
    assert stream.first_wait_s == pytest.approx(stream.per_step_external_s * share)


def test_plan_json_gives_each_groups_restore_bytes(h200):
    doc = make_plan(OSS, h200, 32_768, cached_tokens=20_000, gpus=2).to_json()
    groups = {g["kind"]: g for g in doc["groups"]}
    assert set(groups) == {"sliding", "full"}
    assert groups["sliding"]["restore_tokens"] == 128 and groups["sliding"]["span"] == 128
    assert groups["full"]["restore_tokens"] == 20_000 and groups["full"]["layers"] == 18
    assert sum(g["restore_bytes"] for g in doc["groups"]) == doc["restore_bytes"]
    assert groups["sliding"]["restore_bytes_per_gpu"] == restore_bytes(OSS, 20_000, 2).shares[0].size_bytes
    assert doc["context_bytes"] == OSS.kv_bytes(32_768)


def test_a_dense_plans_json_has_one_group_and_its_usual_restore(capsys):
    assert main(["plan", "--model", "llama-3-70b", "--context", "4096", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    tp = len(doc["gpus"])
    assert doc["restore_bytes"] == 4096 * doc["bytes_per_token_per_gpu"] * tp
    assert [(g["kind"], g["layers"], g["restore_tokens"]) for g in doc["groups"]] == [("full", 80, 4096)]
    assert doc["groups"][0]["restore_bytes"] == doc["restore_bytes"]
    assert doc["context_bytes"] == 4096 * doc["bytes_per_token"]


def text(plan):
    console = Console(width=200, record=True)
    render(console, plan)
    return console.export_text()


def test_the_restore_table_lists_each_group_of_a_hybrid_only(h200, llama70b):
    out = text(make_plan(QWEN, h200, 32_768))
    assert "The restore by KV group" in out
    assert "1 state" in out and "32,768" in out  # a snapshot, and every token of the full layers
    lines = [line for line in out.splitlines() if line.lstrip("│ ").startswith(("state", "full"))]
    assert len(lines) == 2
    assert "GB held at this context" in out
    dense = text(make_plan(llama70b, h200, 32_768))
    assert "by KV group" not in dense and "held at this context" not in dense
