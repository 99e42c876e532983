"""``bench serve`` simulated: every configuration the bench reports, with the requests each phase
sends, the tiers its hits come from, and the same figures on every run."""

from __future__ import annotations

import dataclasses

import pytest

from kvstrata.calibrate.serving.servers import Instance
from kvstrata.calibrate.serving.counters import HitsSource
from kvstrata.calibrate.serving.workload import ServeWorkload, generated_trace
from kvstrata.calibrate.serving.validate import simulated_figures
from kvstrata.media import Medium
from kvstrata.plan.host import PrefillFit
from kvstrata.plan.steps import DecodeFit, Stalls
from kvstrata.calibrate.serving.sim import ServeSetup, SimulatedServe, simulate_serve
from kvstrata.sim.serving.engine import EngineLimits
from kvstrata.sim.serving.timing import ServingTimes

MiB = 2**20
WORKLOAD = ServeWorkload()
ROUNDS = 2
BLOCK_BYTES = 131072
# no calibration: loads and stores take no time, steps the fits'
TIMES = ServingTimes(PrefillFit(0.020, 20_000.0, 1e-8), DecodeFit(0.010, 0.001), None, BLOCK_BYTES)
POOL_CONFIGURATIONS = {"baseline", "kvstrata", "shared_pool", "shared_pool.kvstrata", "shared_pool.second",
                       "restart", "prefill_decode.decode", "prefill_decode.prefill"}


def _setup(pool: bool = True) -> ServeSetup:
    """The bench's defaults on a small model: 32 KV blocks of 128 KiB, 8 sequences at once."""
    return ServeSetup(WORKLOAD, tuple(generated_trace(WORKLOAD)), 4096, ROUNDS,
                      EngineLimits(32, WORKLOAD.block_tokens, 8), BLOCK_BYTES, 32 * BLOCK_BYTES,
                      64 * MiB, 256 * MiB, 128 * MiB, pool, TIMES)


@pytest.fixture(scope="module")
def sim() -> SimulatedServe:
    return simulate_serve(_setup())


@pytest.fixture(scope="module")
def sim_no_pool() -> SimulatedServe:
    return simulate_serve(_setup(pool=False))


def test_every_configuration_with_the_requests_its_phase_sends(sim):
    c = sim.configurations
    assert set(c) == POOL_CONFIGURATIONS
    w = WORKLOAD
    assert len(c["baseline"].requests) == len(c["kvstrata"].requests) == w.conversations * w.turns * ROUNDS
    assert len(c["shared_pool"].requests) == w.conversations * w.turns
    first, second = c["shared_pool.kvstrata"].requests, c["shared_pool.second"].requests
    assert len(first) + len(second) == w.conversations * w.turns
    assert {r.server for r in first} == {Instance.OURS} and {r.server for r in second} == {Instance.SECOND}
    assert len(c["prefill_decode.decode"].requests) == len(c["prefill_decode.prefill"].requests) == w.requests


def test_every_answer_has_max_tokens_and_a_p_d_prefill_one(sim):
    for name, m in sim.configurations.items():
        tokens = 1 if name == "prefill_decode.prefill" else WORKLOAD.max_tokens
        assert {len(r.output_ids) for r in m.requests} == {tokens}, name
        assert all(r.ttft_s > 0 for r in m.requests), name


def test_the_restart_replays_the_turns_the_second_server_served(sim):
    c = sim.configurations
    replayed = sorted(r.prompt for r in c["restart"].requests)
    assert replayed == sorted(r.prompt for r in c["shared_pool.second"].requests)
    assert {r.server for r in c["restart"].requests} == {Instance.SECOND}


def test_p_d_decodes_the_prompts_its_producer_prefilled(sim):
    c = sim.configurations
    assert (sorted(r.prompt for r in c["prefill_decode.decode"].requests)
            == sorted(r.prompt for r in c["prefill_decode.prefill"].requests))


def test_vllm_alone_has_no_kvstrata_hits_and_kvstrata_has_some(sim):
    c = sim.configurations
    assert c["baseline"].hits == {} and c["baseline"].hits_source is HitsSource.NONE
    assert c["kvstrata"].hits and c["kvstrata"].hit_rate > 0
    assert set(c["kvstrata"].hits) <= {Medium.DEVICE, Medium.HOST}  # no pool in the rounds; disk behind host
    assert c["baseline"].vllm_prefix_hit_rate > 0  # later turns extend earlier ones


def test_free_loads_make_kvstrata_no_slower_than_vllm_alone(sim):
    c = sim.configurations
    assert c["kvstrata"].ttft_p50_s <= c["baseline"].ttft_p50_s
    assert c["kvstrata"].ttft_p90_s <= c["baseline"].ttft_p90_s


def test_the_restarted_servers_hits_are_mostly_from_its_disk(sim):
    hits = sim.configurations["restart"].hits
    disk = hits[Medium.DISK].blocks
    assert all(disk > h.blocks for tier, h in hits.items() if tier is not Medium.DISK)


def test_p_d_decode_hits_come_from_the_pool_and_host_none_from_disk(sim):
    hits = sim.configurations["prefill_decode.decode"].hits
    assert Medium.DISK not in hits
    assert hits[Medium.REMOTE].blocks > 0 and hits[Medium.HOST].blocks > 0
    assert sim.configurations["prefill_decode.prefill"].hits == {}  # a producer does not load


def test_the_same_setup_gives_the_same_figures(sim):
    again = simulate_serve(_setup())
    assert simulated_figures(again) == simulated_figures(sim)
    for name, m in sim.configurations.items():
        assert again.configurations[name].requests == m.requests, name
    assert again.preemptions == sim.preemptions


def test_without_a_pool_the_restart_is_the_kvstrata_server_replaying_its_last_round(sim_no_pool):
    c = sim_no_pool.configurations
    assert set(c) == {"baseline", "kvstrata", "restart"}
    assert {r.server for r in c["restart"].requests} == {Instance.OURS}
    last_round = c["kvstrata"].requests[-WORKLOAD.requests:]
    assert sorted(r.prompt for r in c["restart"].requests) == sorted(r.prompt for r in last_round)
    hits = c["restart"].hits
    assert Medium.REMOTE not in hits
    assert hits[Medium.DISK].blocks > sum(h.blocks for h in hits.values()) / 2
    assert set(sim_no_pool.preemptions) == {Instance.BASELINE, Instance.OURS}


def test_stalls_measured_beside_another_server_delay_the_pooled_phases_first_tokens_only():
    """Every request sent while another server's worker holds the other CPUs stalls 0.5 s: the two
    servers' and P/D's first tokens come that much later, the rounds' (one server at a time) not."""
    spinning = dataclasses.replace(TIMES, decode=dataclasses.replace(TIMES.decode, spin_s=1.0))
    stalled = dataclasses.replace(spinning, stalls=Stalls(beside=1.0, beside_s=(0.5,)))
    calm, late = (simulated_figures(simulate_serve(dataclasses.replace(_setup(), times=times)))
                  for times in (spinning, stalled))
    for name in ("shared_pool", "prefill_decode.decode"):
        assert late[name].value("ttft_p50") > calm[name].value("ttft_p50") + 0.4, name
    for name in ("baseline", "kvstrata", "restart"):
        assert late[name].value("ttft_p50") == pytest.approx(calm[name].value("ttft_p50"), rel=0.05), name
