"""The simulator sized from KV groups: what a batch holds, what restores move, what HBM admits."""

from __future__ import annotations

import random

import pytest
from hybrid_support import dense_twin, gemma3_27b, gpt_oss_120b, qwen3_next_80b

from kvstrata.hardware.profile import load_profile
from kvstrata.kv.presets import load_geometry
from kvstrata.media import Medium
from kvstrata.plan.footprint import request_bytes, restore_bytes
from kvstrata.sim.batchkv import BatchKV
from kvstrata.sim.config import SimConfig
from kvstrata.sim.engine import Simulation
from kvstrata.sim.model import TimeModel
from kvstrata.sim.synthetic import Mix, SyntheticConfig, generate
from kvstrata.sim.tiers import parse_arch
from kvstrata.sim.trace import BLOCK_TOKENS, Request

H200 = load_profile("h200-cx7-gen5")


def brute_held(geometry, lengths):
    return tuple(
        sum(g.tokens_kept(n) for n in lengths) if g.kind.per_token else len(lengths) for g in geometry.groups
    )


@pytest.mark.parametrize("geometry", [gemma3_27b(), gpt_oss_120b(), qwen3_next_80b(), load_geometry("llama-3-8b")],
                         ids=lambda g: g.name)
def test_batch_kv_matches_summing_every_request(geometry):
    """Joins, steps and leaves in random order: the incremental sums equal a per-request recount."""
    rng = random.Random(7)
    batch, lengths = BatchKV(geometry), {}
    for _ in range(3000):
        op = rng.random()
        if op < 0.2:
            n = rng.choice([1, 5, 127, 128, 129, 1000, 1023, 1024, 3000])
            lengths[batch.join(n)] = n
        elif op < 0.3 and lengths:
            rid = rng.choice(sorted(lengths))
            batch.leave(rid, lengths.pop(rid))
        else:
            batch.step()
            lengths = {rid: n + 1 for rid, n in lengths.items()}
        assert batch.held() == brute_held(geometry, lengths.values())
        assert batch.tokens == sum(lengths.values()) and batch.requests == len(lengths)
    assert batch.bytes(2) == sum(request_bytes(geometry, n, 2) for n in lengths.values())


def test_prefill_of_a_dense_model_is_the_stated_formula():
    g = load_geometry("llama-3-8b")
    model = TimeModel.build(g, H200, ["gpu0"])
    width = g.num_layers * g.num_attention_heads * g.head_dim
    for new, cached in ((1000, 0), (333, 4096), (8192, 123)):
        flops = 2 * g.active_params * new + 4 * width * new * (cached + new / 2)
        assert model.prefill_s(new, cached) == flops / model.flops_per_s


def test_windowed_attention_costs_less_prefill_and_decode_than_its_dense_twin():
    g = gemma3_27b()
    sliding, twin = TimeModel.build(g, H200, ["gpu0"]), TimeModel.build(dense_twin(g), H200, ["gpu0"])
    assert sliding.prefill_s(512) == twin.prefill_s(512)  # inside the window they are the same model
    n, linear = 32_768, 2 * g.active_params * 32_768 / sliding.flops_per_s
    ratio = (sliding.prefill_s(n) - linear) / (twin.prefill_s(n) - linear)
    # ten full layers attend to n / 2 on average, 52 sliding ones to at most the window
    assert ratio == pytest.approx((10 * n / 2 + 52 * (1024 - 1024 / 2 / n * 1024)) / (62 * n / 2))
    assert ratio < 0.22
    held = BatchKV(g)
    held.join(32_768)
    twin_held = BatchKV(dense_twin(g))
    twin_held.join(32_768)
    assert sliding.decode_step_bytes_per_gpu(held.held()) == sliding.weight_bytes_per_gpu + g.kv_bytes(32_768)
    assert sliding.decode_step_s(1, held.held()) < twin.decode_step_s(1, twin_held.held())


def repeated(prompt_tokens, copies=4, gap_ms=20_000):
    ids = tuple(range(prompt_tokens // BLOCK_TOKENS))
    return [Request(i * gap_ms, prompt_tokens, 4, ids) for i in range(copies)]


@pytest.mark.parametrize("geometry", [gemma3_27b(), qwen3_next_80b()], ids=lambda g: g.name)
def test_a_dram_hit_moves_the_groups_restore_bytes(geometry):
    """Later copies of one prompt hit DRAM (HBM keeps nothing): each moves the window, not the
    prefix, of sliding layers and one state snapshot of the recurrent ones."""
    cfg = SimConfig(geometry, H200, instances=1, tier_tokens=((Medium.DEVICE, 0),))
    out = Simulation(repeated(16 * BLOCK_TOKENS), cfg, parse_arch("local-dram")).run()
    hits = [r.hit_tokens[Medium.HOST] for r in out.records]
    assert hits == [0] + [16 * BLOCK_TOKENS] * 3
    tp = cfg.gpus_per_instance
    expected = 3 * restore_bytes(geometry, 16 * BLOCK_TOKENS, tp).size_bytes
    assert expected < 3 * 16 * BLOCK_TOKENS * dense_twin(geometry).bytes_per_token_per_gpu(tp)
    assert out.link_bytes["mem:gpu0"] == pytest.approx(expected, rel=1e-9)


def test_hbm_admits_more_long_requests_of_a_windowed_model_than_of_its_dense_twin():
    """Twelve 32K-token prompts at once. The dense twin's HBM holds four such requests, so the fifth
    waits for the first to finish; the sliding model's holds them all, so every one is prefilled
    (prefill first) before any finishes."""
    burst = [Request(0, 32_768, 400, ()) for _ in range(12)]

    def run(geometry):
        cfg = SimConfig(geometry, H200, 1, 1)
        return sorted(Simulation(burst, cfg, parse_arch("hbm")).run().records, key=lambda r: r.first_token_s)

    g = gemma3_27b()
    free = int(H200.topology.node("gpu0").capacity_bytes * 0.9 - g.weight_bytes())
    assert free // request_bytes(dense_twin(g), 32_768 + 400) == 4
    assert free // request_bytes(g, 32_768 + 400) >= 12
    dense, sliding = run(dense_twin(g)), run(g)
    first_done = min(r.finish_s for r in dense)
    assert [r.first_token_s < first_done for r in dense] == [True] * 4 + [False] * 8
    assert max(r.first_token_s for r in sliding) < min(r.finish_s for r in sliding)


def test_streaming_moves_each_steps_kept_kv_over_pcie():
    g = gemma3_27b()
    trace = generate(SyntheticConfig(requests=20, rate=1.0, seed=2, mix=Mix(chat=0, system=0, agent=1)))
    outs = [Simulation(trace, SimConfig(x, H200, 1, 1), parse_arch("dram-streaming")).run() for x in (g, dense_twin(g))]
    assert outs[0].link_bytes["mem:gpu0"] < 0.5 * outs[1].link_bytes["mem:gpu0"]
