"""A fleet of mixed TP sizes on one shared pool: TP-matched vs head-sliced blocks."""

from __future__ import annotations

import pytest

from kvstrata.hardware.profile import load_profile
from kvstrata.kv.presets import load_geometry
from kvstrata.media import Medium
from kvstrata.plan.footprint import stored_bytes
from kvstrata.plan.sharing import KVSharing, pool_bytes
from kvstrata.sim.config import Routing, SimConfig
from kvstrata.sim.engine import Simulation
from kvstrata.sim.instance import pack_servers
from kvstrata.sim.pool import SharedPool
from kvstrata.sim.synthetic import Mix, SyntheticConfig, generate
from kvstrata.sim.tiers import parse_arch
from kvstrata.sim.trace import BLOCK_TOKENS, Request

H200 = load_profile("h200-cx7-gen5")


@pytest.fixture(scope="module")
def llama8b():
    return load_geometry("llama-3-8b")


def shared_prefixes(requests=120, prefixes=5, prefix_blocks=4):
    """Requests over a few shared prefixes, each with one block of its own; one every 0.5 s.
    Five prefixes round robin over four instances: every instance sees every prefix."""
    out, own = [], 10_000
    for i in range(requests):
        p = i % prefixes
        ids = [p * 100 + b for b in range(prefix_blocks)] + [own + i]
        out.append(Request(i * 500, (prefix_blocks + 1) * BLOCK_TOKENS, 2, tuple(ids)))
    return out


def run(geometry, requests, sharing, fleet=(), pool_blocks=None, routing=Routing.ROUND_ROBIN, arch="remote-gdr", **kw):
    tiers = [(Medium.DEVICE, 0)] + ([(Medium.REMOTE, pool_blocks * BLOCK_TOKENS)] if pool_blocks is not None else [])
    cfg = SimConfig(geometry, H200, fleet_tp=tuple(fleet), tier_tokens=tuple(tiers), sharing=sharing,
                    routing=routing, **kw)
    return Simulation(requests, cfg, parse_arch(arch)).run()


def test_one_tp_size_gives_the_same_run_in_both_modes(llama8b):
    trace = generate(SyntheticConfig(requests=120, rate=2.0, seed=4))
    outs = [run(llama8b, trace, m, fleet=(2, 2, 2), pool_blocks=40) for m in KVSharing]
    a, b = (o.pool for o in outs)
    assert a == b
    assert [r.hit_tokens for r in outs[0].records] == [r.hit_tokens for r in outs[1].records]
    assert [r.first_token_s for r in outs[0].records] == [r.first_token_s for r in outs[1].records]


def test_four_tp_sizes_keep_four_copies_matched_one_sliced(llama8b):
    trace = shared_prefixes()
    matched, sliced = (run(llama8b, trace, m, fleet=(8, 4, 2, 1)).pool for m in (KVSharing.MATCHED, KVSharing.SLICED))
    # Every TP size saw every prefix block: 4 copies of each.
    assert matched.copies_max == 4 and sliced.copies_max == 1
    prefix, own = 5 * 4, 120
    assert matched.distinct_blocks == sliced.distinct_blocks == prefix + own
    assert matched.copies_mean == pytest.approx((4 * prefix + own) / (prefix + own))
    assert matched.used_bytes == (4 * prefix + own) * matched.block_bytes
    assert sliced.used_bytes == (prefix + own) * sliced.block_bytes
    assert sliced.block_hit_ratio > matched.block_hit_ratio


def test_under_a_tight_pool_head_sliced_hits_more_and_restores_sooner(llama8b):
    trace = shared_prefixes()
    # 30 blocks: the 20 prefix blocks once fit with room for recent own blocks; four copies do not.
    outs = {m: run(llama8b, trace, m, fleet=(8, 4, 2, 1), pool_blocks=30) for m in KVSharing}
    matched, sliced = outs[KVSharing.MATCHED].pool, outs[KVSharing.SLICED].pool
    assert matched.used_bytes <= matched.capacity_bytes == sliced.capacity_bytes
    assert sliced.token_hit_ratio > matched.token_hit_ratio
    assert sliced.block_hit_ratio == pytest.approx(4 * 115 / (5 * 120), abs=0.02)  # all but each prefix's first
    served = {m: sum(r.hit_tokens[Medium.REMOTE] for r in o.records) for m, o in outs.items()}
    assert served[KVSharing.SLICED] > served[KVSharing.MATCHED]
    mean_ttft = {m: sum(r.ttft_s for r in o.records) / len(o.records) for m, o in outs.items()}
    assert mean_ttft[KVSharing.SLICED] < mean_ttft[KVSharing.MATCHED]


def test_session_routing_keeps_a_prefix_on_one_instance_so_the_modes_agree_on_hits(llama8b):
    trace = shared_prefixes()
    matched, sliced = (run(llama8b, trace, m, fleet=(8, 4, 2, 1), routing=Routing.SESSION).pool for m in KVSharing)
    assert matched.hit_blocks == sliced.hit_blocks
    assert matched.copies_max == 1


@pytest.mark.parametrize("pool_blocks", [0, 3, 17, 200])
def test_head_sliced_never_hits_less_at_the_same_capacity(llama8b, pool_blocks):
    trace = generate(SyntheticConfig(requests=150, rate=2.0, seed=7, mix=Mix(chat=1, system=2, agent=1)))
    matched, sliced = (run(llama8b, trace, m, fleet=(4, 2, 1, 1), pool_blocks=pool_blocks).pool
                       for m in (KVSharing.MATCHED, KVSharing.SLICED))
    assert sliced.hit_tokens >= matched.hit_tokens


def test_replicated_heads_cost_their_copies_in_the_pool():
    tiny = load_geometry("tiny-llama")  # 2 KV heads: at TP 8 each is on 4 ranks
    block = stored_bytes(tiny, BLOCK_TOKENS)
    assert pool_bytes(tiny, BLOCK_TOKENS, 8, KVSharing.MATCHED) == 4 * block
    assert pool_bytes(tiny, BLOCK_TOKENS, 2, KVSharing.MATCHED) == block
    assert pool_bytes(tiny, BLOCK_TOKENS, 8, KVSharing.SLICED) == block
    out = run(tiny, shared_prefixes(requests=12), KVSharing.MATCHED, fleet=(8,))
    assert out.pool.copies_max == 4 and out.pool.copies_mean == 4


def test_mla_latent_is_stored_tp_times_matched_once_sliced():
    ds = load_geometry("deepseek-v2-lite")
    block = stored_bytes(ds, BLOCK_TOKENS)
    for tp in (1, 2, 4, 8):
        assert pool_bytes(ds, BLOCK_TOKENS, tp, KVSharing.MATCHED) == tp * block
        assert pool_bytes(ds, BLOCK_TOKENS, tp, KVSharing.SLICED) == block


@pytest.mark.parametrize("model", ["llama-3-8b", "tiny-llama", "deepseek-v2-lite", "qwen3-next-80b-a3b", "gemma-3-27b"])
def test_matched_bytes_are_every_ranks_share(model):
    # The head-slicing rule's copies agree with summing what each rank holds.
    g = load_geometry(model)
    for tp in (1, 2, 4, 8):
        assert pool_bytes(g, 3 * BLOCK_TOKENS, tp, KVSharing.MATCHED) == tp * stored_bytes(g, 3 * BLOCK_TOKENS, tp=tp)


def test_instances_pack_onto_servers_in_order():
    assert pack_servers((8, 4, 2, 1), 8) == [(0, 0), (1, 0), (1, 4), (1, 6)]
    assert pack_servers((2, 2, 2, 2), 8) == [(0, 0), (0, 2), (0, 4), (0, 6)]
    assert pack_servers((1, 8), 8) == [(0, 0), (1, 0)]


def test_instances_on_other_servers_share_only_the_pool_links(llama8b):
    out = run(llama8b, shared_prefixes(), KVSharing.SLICED, fleet=(8, 8))
    keys = [k for k, b in out.link_bytes.items() if b]
    assert any(k.startswith("s1/") for k in keys) and any(not k.startswith("s1/") and "gpu" in k for k in keys)
    assert not any(k.startswith("s1/") and "pool." in k for k in keys)
    assert out.gpus == 16


def test_a_fleet_refuses_instances_and_gpus_per_instance(llama8b):
    with pytest.raises(ValueError, match="fleet"):
        SimConfig(llama8b, H200, gpus_per_instance=2, fleet_tp=(2, 1))


def test_the_pool_evicts_by_bytes_and_counts_copies():
    pool = SharedPool(capacity_bytes=10, block_bytes=2)
    four, one = pool.view(4, 4), pool.view(1, 2)
    four.touch([1, 2])
    one.touch([1])
    assert pool.used_bytes == 10 and pool.stats().copies_max == 3.0  # block 1: 4 + 2 bytes
    assert one.touch([3]) == [] and not four.leading_run([1, 2])  # (4, 1) went: 4 bytes for 2
    assert one.leading_run([1, 3]) == 2 and four.leading_run([2]) == 1
    assert pool.view(9, 12).touch([5]) == [] and 5 not in pool.view(9, 12)  # bigger than the pool
