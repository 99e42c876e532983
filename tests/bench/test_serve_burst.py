"""bench serve's concurrency part: its prompts and its figures (pure: no server)."""

from __future__ import annotations

import math

import pytest

from kvstrata.bench.serve_burst import BurstPhase, BurstRun, concurrency, plan_bursts
from kvstrata.calibrate.serving.servers import Instance
from kvstrata.calibrate.serving.counters import Counters
from kvstrata.calibrate.serving.workload import ServeWorkload, hit_blocks
from kvstrata.bench.serve_report import PhaseRun
from kvstrata.calibrate.serving.measured import RequestRecord
from kvstrata.media import Medium

VOCAB = 4096


@pytest.mark.parametrize("workload,kv_tokens", [(ServeWorkload(), 1024), (ServeWorkload(block_tokens=16), 256),
                                                 (ServeWorkload(max_model_len=2048, turns=2), 4096)])
def test_every_burst_request_shares_the_prefix_and_hits_it_whole(workload, kv_tokens):
    plans = plan_bursts(workload, VOCAB, 3, kv_tokens)
    bt = workload.block_tokens
    for plan in plans:
        prefix = plan.seed[: plan.prefix_tokens]
        assert plan.prefix_tokens % bt == 0 and 0 < plan.prefix_tokens <= max(bt, kv_tokens // 2)
        prompts = (plan.seed, *plan.from_kvstrata, *plan.from_vllm)
        assert len(plan.from_kvstrata) == len(plan.from_vllm) == 16 and len(set(prompts)) == len(prompts)
        for prompt in prompts:  # the hit is the prefix, no more: the suffix ends before a full block
            assert prompt[: plan.prefix_tokens] == prefix
            assert hit_blocks(len(prompt), bt) * bt == plan.prefix_tokens
            assert len(prompt) + workload.max_tokens <= workload.max_model_len
        # the fillers hold more than vLLM's KV, and none starts with the prefix
        assert sum(len(f) for f in plan.fillers) > kv_tokens
        assert all(f[:bt] != prefix[:bt] for f in plan.fillers)
    assert [p.kvstrata_first for p in plans] == [True, False, True]
    # kvstrata's burst always comes after the fillers evicted the prefix from vLLM
    for plan in plans:
        assert plan.order.index(BurstPhase.FILL) < plan.order.index(BurstPhase.FROM_KVSTRATA)
        assert plan.prompts(BurstPhase.FROM_VLLM) == plan.from_vllm and len(set(plan.order)) == 3
    assert len({p.seed for p in plans}) == 3  # no round finds another's prefix


def _phase(ttfts: list[float], loaded: int = 0, loads: int = 0) -> PhaseRun:
    records = tuple(RequestRecord(i, 0, Instance.OURS, 270, (1, 2), t, 0.01, t + 0.01, 0.0, identical=True)
                    for i, t in enumerate(ttfts))
    counters = Counters({Medium.HOST: loaded} if loaded else {}, None, True, loads)
    return PhaseRun(records, {Instance.OURS: counters})


def test_the_figures_pair_each_rounds_bursts_and_count_the_loads():
    plans = plan_bursts(ServeWorkload(), VOCAB, 2, 1024)
    blocks = plans[0].prefix_tokens // 32
    runs = [BurstRun(plans[0], _phase([0.1] * 14 + [0.3] * 2, blocks, 1), _phase([0.1] * 14 + [0.2] * 2), (_phase([0.5]),)),
            BurstRun(plans[1], _phase([0.2] * 16, blocks, 1), _phase([0.1] * 16), (_phase([0.5]),))]
    c = concurrency(runs, Instance.OURS, 32)
    assert c.requests == 16 and c.prefix_blocks == blocks
    assert c.loaded_blocks == 2 * blocks and c.load_requests == 2 and c.loaded_once
    # per round: p90 of 14 x 0.1 and two 0.3 is 0.1 + 0.5 x 0.2 = 0.2, against 0.15; then 0.2 against 0.1
    assert c.ttft_p90.min == pytest.approx(0.2 / 0.15) and c.ttft_p90.max == pytest.approx(2.0)
    assert c.ttft_p50.median == pytest.approx(1.5)
    assert len(c.from_kvstrata.requests) == 32 and len(c.setup.requests) == 2 and c.setup.identical
    again = concurrency([BurstRun(plans[0], _phase([0.1] * 16, 3 * blocks, 3), _phase([0.1] * 16), ())],
                        Instance.OURS, 32)
    assert not again.loaded_once  # three loads of one prefix
    assert not math.isnan(again.ttft_p90.median)
