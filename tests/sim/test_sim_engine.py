"""Behaviour of the trace-driven simulator on small synthetic traces."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvstrata.hardware.flows import GB
from kvstrata.hardware.pcie import PcieLink
from kvstrata.hardware.profile import load_profile
from kvstrata.hardware.whatif import apply_upgrades, with_nics
from kvstrata.kv.presets import load_geometry
from kvstrata.media import Medium
from kvstrata.policies.write import WritePolicy
from kvstrata.sim.config import SimConfig
from kvstrata.sim.engine import Simulation
from kvstrata.sim.lru import BlockLRU
from kvstrata.sim.results import percentile, summarise
from kvstrata.sim.run import offered_load, simulate, trace_span_s
from kvstrata.sim.synthetic import Mix, SyntheticConfig, generate
from kvstrata.sim.tiers import parse_arch
from kvstrata.sim.trace import BLOCK_TOKENS

SEVEN = ["hbm", "local-dram", "remote-gdr", "remote-staged", "pd-handoff", "dram-streaming", "nvme"]


@pytest.fixture(scope="module")
def geometry():
    return load_geometry("llama-3-8b")


@pytest.fixture(scope="module")
def trace():
    return generate(SyntheticConfig(requests=150, rate=2.0, seed=3))


def restore_heavy():
    # Agents over long prefixes at a low rate: many big hits, little queueing.
    return generate(SyntheticConfig(requests=60, rate=0.5, seed=5, mix=Mix(chat=0, system=0, agent=1)))


def small_hbm(profile, geometry, gpus=1, instances=1, **kw):
    # A tiny HBM prefix cache forces hits down to the slower tier.
    return SimConfig(geometry, profile, gpus, instances, tier_tokens=((Medium.DEVICE, 0),), **kw)


@pytest.mark.parametrize("arch", SEVEN + ["hbm+pool+nvme"])
def test_every_request_completes_once_in_time_order(arch, geometry, trace):
    cfg = SimConfig(geometry, load_profile("h200-cx7-gen5"), 1, 2, tier_tokens=((Medium.DEVICE, 4096),), record_events=True)
    out = Simulation(trace, cfg, parse_arch(arch)).run()
    assert len(out.records) == len(trace)
    assert all(r.completions == 1 for r in out.records)
    assert all(r.arrival_s <= r.first_token_s <= r.finish_s for r in out.records)
    assert out.event_times == sorted(out.event_times)


@pytest.mark.parametrize("arch", ["local-dram", "remote-gdr", "remote-staged", "pd-handoff", "nvme", "dram-streaming"])
def test_bytes_conserved_per_link(arch, geometry, trace):
    out = Simulation(trace, small_hbm(load_profile("h200-cx7-gen5"), geometry, 1, 2), parse_arch(arch)).run()
    assert out.link_bytes, "a restore-heavy run moves bytes"
    assert set(out.link_bytes) == set(out.link_sent_bytes)
    for key, sent in out.link_sent_bytes.items():
        assert out.link_bytes[key] == pytest.approx(sent, rel=1e-9), key


def test_gdr_bytes_into_gpu_equal_pool_hits(geometry, trace):
    cfg = small_hbm(load_profile("h200-cx7-gen5"), geometry, 1, 1)
    out = Simulation(trace, cfg, parse_arch("remote-gdr")).run()
    hit = sum(r.hit_tokens[Medium.REMOTE] for r in out.records) * geometry.bytes_per_token_per_gpu(1)
    assert hit > 0
    assert out.link_bytes["mem:gpu0"] == pytest.approx(hit, rel=1e-9)


def test_faster_links_never_raise_mean_ttft(geometry):
    reqs = restore_heavy()
    base = load_profile("h200-cx7-gen5")
    ttft = []
    for eff in (0.4, 0.7, 1.0):
        profile = dataclasses.replace(base, efficiency=(("nic port", eff),))
        out = Simulation(reqs, small_hbm(profile, geometry), parse_arch("remote-gdr")).run()
        ttft.append(summarise(out).mean_ttft_s)
    assert ttft[0] >= ttft[1] >= ttft[2]
    assert ttft[0] > ttft[2]


def test_larger_cache_never_lowers_hit_rate(geometry, trace):
    profile = load_profile("h200-cx7-gen5")
    rates = []
    for tokens in (0, 8192, 65536, 1 << 20):
        cfg = SimConfig(geometry, profile, 1, 2, tier_tokens=((Medium.DEVICE, tokens),))
        rates.append(summarise(Simulation(trace, cfg, parse_arch("hbm")).run()).hit_rate[Medium.DEVICE])
    assert rates == sorted(rates)
    assert rates[-1] > rates[0] == 0.0


def _restore_gain(fast, slow, geometry, gpus):
    reqs = restore_heavy()
    times = []
    for profile in (slow, fast):
        out = Simulation(reqs, small_hbm(profile, geometry, gpus), parse_arch("remote-gdr")).run()
        times.append(summarise(out).mean_restore_s)
    return times[0] / times[1]


def test_cx8_helps_network_bound_restore(geometry):
    b200 = load_profile("b200-cx8-gen6")
    assert _restore_gain(b200, with_nics(b200, "CX-7"), geometry, 1) > 1.8


def test_cx8_capped_by_one_gen5_gpu_link(geometry):
    h200 = load_profile("h200-cx7-gen5")
    gain = _restore_gain(apply_upgrades(h200, "+cx8"), h200, geometry, 1)
    assert 1.0 <= gain <= 1.26


def test_streaming_tpot_bound_by_pcie(geometry):
    reqs = generate(SyntheticConfig(requests=40, rate=1.0, seed=2))
    cfg = SimConfig(geometry, load_profile("h200-cx7-gen5"), 1, 1)
    sim = Simulation(reqs, cfg, parse_arch("dram-streaming"))
    out = sim.run()
    pcie_bytes_per_s = sim.instances[0].stream_bytes_per_s
    assert pcie_bytes_per_s <= PcieLink(5, 16).after_encoding_gbps * GB * (1 + 1e-9)  # H200: Gen5 x16, one way
    per_token = geometry.bytes_per_token_per_gpu(1)
    for r in out.records:
        if r.tpot_s is not None:
            # every step reads at least this request's own KV over PCIe
            assert r.tpot_s >= r.request.input_length * per_token / pcie_bytes_per_s * (1 - 1e-9)
    hbm = summarise(Simulation(reqs, cfg, parse_arch("hbm")).run())
    assert summarise(out).tpot_s["p50"] > hbm.tpot_s["p50"]


def test_block_lru_evicts_least_recent():
    lru = BlockLRU(2)
    lru.touch([1, 2])
    lru.touch([1])
    lru.touch([3])
    assert lru.leading_run([1]) == 1 and lru.leading_run([2]) == 0 and len(lru) == 2


def test_block_lru_of_no_blocks_holds_and_evicts_nothing():
    lru = BlockLRU(0)
    assert lru.touch([1, 2]) == [] and len(lru) == 0 and lru.leading_run([1]) == 0


def test_parse_arch():
    assert parse_arch("hbm+pool+nvme").tiers == (Medium.DEVICE, Medium.REMOTE, Medium.DISK)
    assert parse_arch("pd-handoff").pd_handoff
    with pytest.raises(ValueError):
        parse_arch("tape")


def test_percentile():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert math.isnan(percentile([], 50))


@pytest.mark.parametrize("slots", [1, 3])
def test_restores_queue_for_their_slots(slots, geometry):
    reqs = restore_heavy()
    reqs = [dataclasses.replace(r, timestamp_ms=0) for r in reqs]  # all at once: a queue forms
    cfg = small_hbm(load_profile("h200-cx7-gen5"), geometry, restore_slots=slots)
    out = Simulation(reqs, cfg, parse_arch("nvme")).run()
    spans = [(r.restore_started_s, r.arrival_s + r.restore_s) for r in out.records if r.restore_started_s is not None]
    assert len(spans) > slots
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    running = peak = 0
    for _, d in events:
        running += d
        peak = max(peak, running)
    assert peak == slots
    if slots == 1:  # one slot: restores run in arrival order
        assert sorted(spans) == spans


def test_restore_slots_must_be_positive(geometry):
    with pytest.raises(ValueError, match="restore_slots"):
        SimConfig(geometry, load_profile("h200-cx7-gen5"), restore_slots=0)


def test_write_back_demotes_only_what_hbm_evicts(geometry, trace):
    profile = load_profile("h200-cx7-gen5")
    roomy = SimConfig(geometry, profile, 1, 1, tier_tokens=((Medium.DEVICE, 10**9),))
    out = Simulation(trace, roomy, parse_arch("hbm+dram+nvme", "back")).run()
    assert out.tier_writes[Medium.HOST] == out.tier_writes[Medium.DISK] == 0  # nothing ever evicted
    tight = SimConfig(geometry, profile, 1, 1, tier_tokens=((Medium.DEVICE, 8 * BLOCK_TOKENS), (Medium.HOST, 32 * BLOCK_TOKENS)))
    back = Simulation(trace, tight, parse_arch("hbm+dram+nvme", "back")).run()
    through = Simulation(trace, tight, parse_arch("hbm+dram+nvme")).run()
    assert 0 < back.tier_writes[Medium.HOST] < through.tier_writes[Medium.HOST]
    assert 0 < back.tier_writes[Medium.DISK] <= through.tier_writes[Medium.DISK]
    assert all(r.completions == 1 for r in back.records)
    # What HBM misses, the cascade still serves from below.
    assert sum(r.hit_tokens[Medium.HOST] + r.hit_tokens[Medium.DISK] for r in back.records) > 0


def test_unknown_write_policy_is_named():
    with pytest.raises(ValueError, match="write policy 'around'"):
        parse_arch("nvme", "around")


def test_selective_write_is_refused_in_one_line():
    assert parse_arch("nvme", WritePolicy.WRITE_BACK).label == "nvme (write-back)"
    with pytest.raises(ValueError, match="^the simulator models write-through and write-back, not selective$"):
        parse_arch("nvme", WritePolicy.SELECTIVE)


def test_pd_counts_its_prefill_gpus(geometry, trace):
    cfg = SimConfig(geometry, load_profile("h200-cx7-gen5"), 1, 2)
    assert Simulation(trace, cfg, parse_arch("pd-handoff")).run().gpus == 4
    assert Simulation(trace, cfg, parse_arch("hbm")).run().gpus == 2


def test_offered_load_scales_with_time(geometry, trace):
    from kvstrata.sim.run import offered_load, scale_time

    cfg = SimConfig(geometry, load_profile("h200-cx7-gen5"), 1, 2)
    load = offered_load(trace, cfg)
    assert load > 0
    assert offered_load(scale_time(trace, 2.0), cfg) == pytest.approx(load / 2, rel=1e-3)
    with pytest.raises(ValueError, match="positive"):
        scale_time(trace, 0)


def test_no_requests_or_no_arrival_rate_are_refused_by_the_core(geometry):
    cfg = SimConfig(geometry, load_profile("h200-cx7-gen5"))
    with pytest.raises(ValueError, match="no requests"):
        simulate([], cfg, ["hbm"])
    at_once = [dataclasses.replace(r, timestamp_ms=3) for r in generate(SyntheticConfig(requests=4, seed=1))]
    assert trace_span_s(at_once) == 0 and trace_span_s([]) == 0
    with pytest.raises(ValueError, match="arrival rate"):
        offered_load(at_once, cfg)
    spread = generate(SyntheticConfig(requests=4, seed=1, rate=1.0))
    assert trace_span_s(spread) == (max(r.timestamp_ms for r in spread) - min(r.timestamp_ms for r in spread)) / 1000
    assert offered_load(spread, cfg) > 0
