"""One simulated ``vllm serve`` process: what a client sees of its steps (TTFT and TPOT from the
fits), vLLM's prefix hits, its admission limits, preemption, kvstrata's hits and loads, and the
host's CPUs shared between servers; with the time model (``ServingTimes``) it steps on."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest

from kvstrata.media import Medium
from kvstrata.plan.calpaths import CalPath
from kvstrata.plan.host import RESTORE_FIXED, HostCalibration, PathFit, PrefillFit
from kvstrata.plan.steps import ConnectorFit, DecodeFit, Stalls
from kvstrata.calibrate.serving.sim import counters_of
from kvstrata.sim.serving.cpus import HostCpus
from kvstrata.sim.serving.engine import Clock, EngineLimits, ServerSim, SimRequest
from kvstrata.sim.serving.store import ServerStore, StoreHit, TierLRU
from kvstrata.sim.serving.timing import Chunk, ServingTimes

BT = 16  # tokens per block
BLOCK_BYTES = 1_000_000
PREFILL = PrefillFit(latency_s=0.050, tokens_per_s=8_000.0, attn_s=2e-8)
DECODE = DecodeFit(latency_s=0.010, per_request_s=0.002)
TIMES = ServingTimes(PREFILL, DECODE, None, BLOCK_BYTES)
MODEL = "tiny-llama"
# restores: a fixed cost per tier plus the bytes at the path's rate (HostCalibration.restore_s)
HOST_FIXED_S, HOST_GBPS = 0.003, 1.0
DISK_FIXED_S, DISK_GBPS = 0.005, 0.5
CALIBRATION = HostCalibration(
    "test-host", "cpu", 2,
    paths={CalPath.MEMCPY_ONE: PathFit(0.0, HOST_GBPS), RESTORE_FIXED[Medium.HOST]: PathFit(HOST_FIXED_S, math.inf),
           CalPath.DISK_BLOCKS_WARM: PathFit(0.0, DISK_GBPS),
           RESTORE_FIXED[Medium.DISK]: PathFit(DISK_FIXED_S, math.inf)},
    prefill={MODEL: PREFILL}, decode={MODEL: DECODE})


def _prompt(n: int, first: int) -> tuple[int, ...]:
    return tuple(range(first, first + n))


class _Client:
    """The bench's client (:mod:`kvstrata.calibrate.serving.sim`): a request reaches the engine
    ``request_in_s`` after it is sent; each token reaches the client ``response_out_s`` after
    it is sampled."""

    def __init__(self, clock: Clock, times: ServingTimes = TIMES) -> None:
        self.clock, self.times = clock, times
        self.done: list[SimRequest] = []
        self._answers = 0

    def send(self, server: ServerSim, prompt: tuple[int, ...], max_tokens: int, at_s: float) -> SimRequest:
        answer = tuple(-(self._answers + i + 1) for i in range(max_tokens))  # ids no prompt has
        self._answers += max_tokens
        request = SimRequest(prompt, answer, at_s, self.done.append)
        self.clock.at(at_s + self.times.request_in_s, lambda: server.submit(request))
        return request

    def ttft_s(self, r: SimRequest) -> float:
        return r.first_token_s + self.times.response_out_s - r.sent_s


def _server(clock: Clock, kv_blocks: int = 64, max_num_seqs: int = 8, times: ServingTimes = TIMES,
            **kwargs) -> ServerSim:
    return ServerSim(clock, EngineLimits(kv_blocks, BT, max_num_seqs, **kwargs.pop("limits", {})), times, **kwargs)


# --- the time model -------------------------------------------------------------------------------


def test_serving_adds_half_the_prefill_over_the_decode_latency_each_way():
    assert TIMES.request_in_s == pytest.approx((PREFILL.latency_s - DECODE.latency_s) / 2)
    assert TIMES.response_out_s == TIMES.request_in_s
    slower_decode = ServingTimes(PrefillFit(0.01, 8_000.0), DecodeFit(0.02, 0.0), None, BLOCK_BYTES)
    assert slower_decode.request_in_s == 0.0


def test_a_step_of_decodes_alone_is_the_decode_fit():
    times = ServingTimes(PREFILL, DecodeFit(0.01, 0.002, 1e-6), None, BLOCK_BYTES)
    assert times.step_s([], 3, 500) == pytest.approx(times.decode.step_s(3, 500))


def test_serving_times_of_names_what_the_profile_lacks():
    times = ServingTimes.of(CALIBRATION, MODEL, BLOCK_BYTES)
    assert (times.prefill, times.decode, times.calibration) == (PREFILL, DECODE, CALIBRATION)
    with pytest.raises(ValueError, match=r"no vLLM step fits for model 'other' \(have: tiny-llama\)"):
        ServingTimes.of(CALIBRATION, "other", BLOCK_BYTES)
    with pytest.raises(ValueError, match=r"load from remote \(calibrate with --pool\).*'pool get'"):
        ServingTimes.of(CALIBRATION, MODEL, BLOCK_BYTES, tiers=(Medium.HOST, Medium.REMOTE))
    no_disk = HostCalibration("h", "cpu", 2, {CalPath.MEMCPY_ONE: PathFit(0.0, 1.0)}, {MODEL: PREFILL},
                              decode={MODEL: DECODE})
    with pytest.raises(ValueError, match="load from disk"):
        ServingTimes.of(no_disk, MODEL, BLOCK_BYTES)
    with_pool = HostCalibration("h", "cpu", 2, {**CALIBRATION.paths, CalPath.POOL_GET: PathFit(0.0, 2.0)},
                                {MODEL: PREFILL}, decode={MODEL: DECODE})
    assert ServingTimes.of(with_pool, MODEL, BLOCK_BYTES, tiers=(Medium.HOST, Medium.REMOTE)).block_bytes == BLOCK_BYTES


def test_a_load_takes_each_tiers_restore_one_after_another():
    times = ServingTimes(PREFILL, DECODE, CALIBRATION, BLOCK_BYTES)
    hit = StoreHit((Medium.DISK, Medium.DISK, Medium.HOST))
    expected = DISK_FIXED_S + 2 * BLOCK_BYTES / (DISK_GBPS * 1e9) + HOST_FIXED_S + BLOCK_BYTES / (HOST_GBPS * 1e9)
    assert times.load_s(hit) == pytest.approx(expected)
    # the device tier's blocks are copied as the host's are
    assert times.load_s(StoreHit((Medium.DEVICE,) * 3)) == pytest.approx(times.load_s(StoreHit((Medium.HOST,) * 3)))
    assert times.load_s(StoreHit(())) == 0.0
    assert TIMES.load_s(hit) == 0.0  # no calibration: loads take no time


def test_a_load_from_the_pool_pays_what_loads_from_it_took_beyond_its_path_as_served():
    with_pool = HostCalibration("h", "cpu", 2, {**CALIBRATION.paths, CalPath.POOL_GET: PathFit(0.0, 2.0)},
                                {MODEL: PREFILL}, decode={MODEL: DECODE})
    path = ServingTimes(PREFILL, DECODE, with_pool, BLOCK_BYTES)
    served = dataclasses.replace(path, connector=ConnectorFit(0.0, 0.001, 0.012))
    pooled = StoreHit((Medium.HOST, Medium.REMOTE, Medium.REMOTE))
    assert served.load_s(pooled) == pytest.approx(path.load_s(pooled) + 0.001 + 0.012)
    assert served.load_s(StoreHit((Medium.HOST,))) == pytest.approx(path.load_s(StoreHit((Medium.HOST,))) + 0.001)


def test_a_store_lands_after_its_paths_time():
    times = ServingTimes(PREFILL, DECODE, CALIBRATION, BLOCK_BYTES)
    assert times.store_s(Medium.HOST, 3) == pytest.approx(3 * BLOCK_BYTES / (HOST_GBPS * 1e9))
    assert times.store_s(Medium.DEVICE, 3) == 0.0
    assert times.store_s(Medium.DISK, 3) == 0.0  # disk write not calibrated: at once
    assert TIMES.store_s(Medium.HOST, 3) == 0.0


# --- what a client sees ---------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_tokens", [1, 100, 700])
def test_a_lone_requests_ttft_is_the_prefill_fit(prompt_tokens):
    clock = Clock()
    client, server = _Client(clock), _server(clock)
    r = client.send(server, _prompt(prompt_tokens, 1), 4, 0.0)
    clock.run()
    assert client.ttft_s(r) == pytest.approx(PREFILL.seconds(prompt_tokens))


def test_a_lone_requests_tpot_is_the_decode_fit_at_batch_one():
    clock = Clock()
    client, server = _Client(clock), _server(clock)
    r = client.send(server, _prompt(100, 1), 16, 0.0)
    clock.run()
    assert r.tpot_s == pytest.approx(DECODE.step_s(1, 0))
    assert r.finish_s - r.first_token_s == pytest.approx(15 * DECODE.step_s(1, 0))


def test_tpot_grows_with_the_tokens_a_request_holds():
    decode = DecodeFit(0.010, 0.002, per_token_s=1e-5)
    times = ServingTimes(PREFILL, decode, None, BLOCK_BYTES)
    tpot = {}
    for n in (100, 300):
        clock = Clock()
        client = _Client(clock, times)
        r = client.send(_server(clock, times=times), _prompt(n, 1), 8, 0.0)
        clock.run()
        tpot[n] = r.tpot_s
    assert tpot[300] - tpot[100] == pytest.approx(200 * decode.per_token_s)


def test_a_prompt_over_the_token_budget_is_prefilled_in_chunks():
    clock = Clock()
    client = _Client(clock)
    server = _server(clock, limits={"max_batched_tokens": 64})
    r = client.send(server, _prompt(100, 1), 2, 0.0)
    clock.run()
    steps = TIMES.step_s([Chunk(64, 0)], 0, 0) + TIMES.step_s([Chunk(36, 64)], 0, 0)
    assert client.ttft_s(r) == pytest.approx(TIMES.request_in_s + steps + TIMES.response_out_s)
    assert client.ttft_s(r) > PREFILL.seconds(100)  # a chunk's step pays the decode latency again


@pytest.mark.parametrize(("prompt_tokens", "hit_tokens"), [(100, 96), (96, 80), (17, 16), (16, 0)])
def test_a_repeated_prompt_hits_vllms_prefix_cache_short_of_its_last_token(prompt_tokens, hit_tokens):
    clock = Clock()
    client, server = _Client(clock), _server(clock)
    prompt = _prompt(prompt_tokens, 1)
    client.send(server, prompt, 4, 0.0)
    again = client.send(server, prompt, 4, 5.0)
    clock.run()
    counters = counters_of(server)
    assert counters.prefix_queries_tokens == 2 * prompt_tokens
    assert counters.prefix_hits_tokens == hit_tokens
    step = TIMES.step_s([Chunk(prompt_tokens - hit_tokens, hit_tokens)], 0, 0)
    assert client.ttft_s(again) == pytest.approx(TIMES.request_in_s + step + TIMES.response_out_s)
    assert counters.hit_blocks == {} and not counters.connector  # vLLM alone


def test_a_prompt_admitted_next_hits_the_blocks_scheduled_before_it_in_the_same_step():
    # vLLM caches a block as soon as the tokens filling it are scheduled
    clock = Clock()
    client, server = _Client(clock), _server(clock, max_num_seqs=2, limits={"max_batched_tokens": 64})
    prompt = _prompt(100, 1)
    client.send(server, prompt, 2, 0.0)
    second = client.send(server, prompt, 2, 0.001)  # arrives while the first's first chunk computes
    clock.run()
    # the next step schedules the first's last 36 tokens (its 6 full blocks cached), then admits the second
    assert counters_of(server).prefix_hits_tokens == 96
    assert second.first_token_s == pytest.approx(TIMES.step_s([Chunk(64, 0)], 0, 0)
                                                 + TIMES.step_s([Chunk(36, 64), Chunk(4, 96)], 0, 0)
                                                 + TIMES.request_in_s)


def test_max_num_seqs_one_serialises_two_requests():
    clock = Clock()
    client, server = _Client(clock), _server(clock, max_num_seqs=1)
    first = client.send(server, _prompt(100, 1), 8, 0.0)
    second = client.send(server, _prompt(100, 1000), 8, 0.0)
    clock.run()
    assert second.first_token_s == pytest.approx(first.finish_s + TIMES.step_s([Chunk(100, 0)], 0, 0))


def test_max_num_seqs_two_admits_a_second_request_beside_the_first_ones_decode():
    clock = Clock()
    client, server = _Client(clock), _server(clock, max_num_seqs=2)
    first = client.send(server, _prompt(100, 1), 8, 0.0)
    second = client.send(server, _prompt(100, 1000), 8, 0.01)  # while the first's prefill runs
    clock.run()
    assert second.first_token_s == pytest.approx(first.first_token_s + TIMES.step_s([Chunk(100, 0)], 1, 100))
    assert second.first_token_s < first.finish_s
    assert first.tpot_s > DECODE.step_s(1, 0)  # a decode step beside a prefill takes longer


def test_kv_memory_too_small_preempts_and_every_request_completes_once_with_its_whole_answer():
    clock = Clock()
    client = _Client(clock)
    server = _server(clock, kv_blocks=11)  # 10 usable; each request grows to 5 (40 + 40 tokens)
    sent = [client.send(server, _prompt(40, 1000 * i + 1), 40, 0.0) for i in range(3)]
    clock.run()
    assert server.preemptions >= 1
    assert Counter(id(r) for r in client.done) == {id(r): 1 for r in sent}
    for r in sent:
        assert r.output == len(r.answer) == 40
        assert r.tokens == r.prompt + r.answer
        assert r.first_token_s <= r.finish_s
    assert server.blocks.free == server.blocks.usable == 10  # every block given back
    assert counters_of(server).prefix_queries_tokens == 3 * 40  # a re-admission is not queried again


def test_the_null_block_is_left_out_of_the_servers_kv_memory():
    clock = Clock()
    assert _server(clock, kv_blocks=11).blocks.usable == 10


# --- kvstrata's store behind the server -----------------------------------------------------------

DISK_WRITE_GBPS = 0.25  # slower than the host's copy: a synchronous save waits for the disk
SAVING = dataclasses.replace(CALIBRATION,
                             paths={**CALIBRATION.paths, CalPath.DISK_WRITE: PathFit(0.0, DISK_WRITE_GBPS)})


def _connected(clock: Clock, host_blocks: int = 32, disk_blocks: int = 64, sync_save: bool = False,
               calibration: HostCalibration = CALIBRATION) -> ServerSim:
    """A server of 8 usable blocks with kvstrata's device (7 blocks), host and disk tiers."""
    store = ServerStore({Medium.DEVICE: TierLRU(7), Medium.HOST: TierLRU(host_blocks),
                         Medium.DISK: TierLRU(disk_blocks)})
    times = ServingTimes(PREFILL, DECODE, calibration, BLOCK_BYTES)
    return _server(clock, kv_blocks=9, times=times, store=store, sync_save=sync_save)


def _evicted_then_again(server: ServerSim, client: _Client) -> SimRequest:
    """Prompt A (6 full blocks, 7 held), then another of 8 blocks that takes every block A held
    in vLLM (and evicts A from the 7-block device tier), then A again: its request."""
    a = _prompt(100, 1)
    client.send(server, a, 2, 0.0)
    client.send(server, _prompt(120, 1000), 2, 1.0)
    return client.send(server, a, 2, 2.0)


@pytest.mark.parametrize(("host_blocks", "tiers"), [
    (32, {Medium.HOST: 6}),
    # 9 host blocks: the other prompt's 7 stored after A's 6 push A's first 4 down to disk alone
    (9, {Medium.DISK: 4, Medium.HOST: 2}),
])
def test_a_prompt_vllm_evicted_is_loaded_from_kvstrata_counted_by_tier_and_its_step_pays_the_load(host_blocks, tiers):
    clock = Clock()
    server = _connected(clock, host_blocks)
    client = _Client(clock, server.times)
    again = _evicted_then_again(server, client)
    clock.run()
    counters = counters_of(server)
    assert counters.prefix_hits_tokens == 0  # vLLM's copy is gone
    assert counters.hit_blocks == tiers
    assert counters.load_requests == 1
    load_s = sum((HOST_FIXED_S + n * BLOCK_BYTES / (HOST_GBPS * 1e9)) if t is Medium.HOST
                 else (DISK_FIXED_S + n * BLOCK_BYTES / (DISK_GBPS * 1e9)) for t, n in tiers.items())
    assert counters.load_seconds == pytest.approx(load_s)
    step = TIMES.step_s([Chunk(4, 96)], 0, 0)  # the last 4 tokens computed after 96 loaded
    assert client.ttft_s(again) == pytest.approx(TIMES.request_in_s + step + load_s + TIMES.response_out_s)


def test_a_prompt_vllm_still_holds_is_not_loaded_again():
    clock = Clock()
    server = _connected(clock)
    client = _Client(clock, server.times)
    a = _prompt(100, 1)
    client.send(server, a, 2, 0.0)
    client.send(server, a, 2, 1.0)
    clock.run()
    counters = counters_of(server)
    assert counters.prefix_hits_tokens == 96
    assert counters.hit_blocks == {} and counters.load_requests == 0


def _one_saved(sync_save: bool):
    """A server saving to the host and disk tiers (SAVING) after one 100-token prompt ran to its end:
    the server, its client, the request."""
    clock = Clock()
    server = _connected(clock, sync_save=sync_save, calibration=SAVING)
    client = _Client(clock, server.times)
    r = client.send(server, _prompt(100, 1), 2, 0.0)
    clock.run()
    return server, client, r


def test_a_synchronous_save_holds_the_step_for_the_slowest_tiers_write():
    server, client, r = _one_saved(sync_save=True)
    disk_write_s = 6 * BLOCK_BYTES / (DISK_WRITE_GBPS * 1e9)  # the 6 full blocks, slower than the host copy
    assert client.ttft_s(r) == pytest.approx(PREFILL.seconds(100) + disk_write_s)
    keys = r.keys[:6]
    assert server.store.lookup(keys, r.first_token_s) == StoreHit((Medium.DEVICE,) * 6)
    for tier in (Medium.HOST, Medium.DISK):  # every tier holds them once the step is done
        assert all(server.store.tiers[tier].ready(k, r.first_token_s) for k in keys)


def test_a_save_behind_the_engine_costs_the_step_nothing_and_lands_after_each_tiers_write():
    server, client, r = _one_saved(sync_save=False)
    assert client.ttft_s(r) == pytest.approx(PREFILL.seconds(100))
    keys, done = r.keys[:6], r.first_token_s
    for tier, rate in ((Medium.HOST, HOST_GBPS), (Medium.DISK, DISK_WRITE_GBPS)):
        landed = done + 6 * BLOCK_BYTES / (rate * 1e9)
        assert not server.store.tiers[tier].ready(keys[0], landed - 1e-6)
        assert all(server.store.tiers[tier].ready(k, landed) for k in keys)


def test_a_synchronous_save_does_not_charge_the_blocks_its_step_loaded():
    clock = Clock()
    server = _connected(clock, sync_save=True, calibration=SAVING)
    client = _Client(clock, server.times)
    again = _evicted_then_again(server, client)
    clock.run()
    assert counters_of(server).hit_blocks == {Medium.HOST: 6}
    load_s = HOST_FIXED_S + 6 * BLOCK_BYTES / (HOST_GBPS * 1e9)
    step = TIMES.step_s([Chunk(4, 96)], 0, 0)
    assert client.ttft_s(again) == pytest.approx(TIMES.request_in_s + step + load_s + TIMES.response_out_s)


def test_a_synchronous_save_charges_blocks_two_requests_of_a_step_share_once():
    clock = Clock()
    store = ServerStore({Medium.DEVICE: TierLRU(64), Medium.HOST: TierLRU(64), Medium.DISK: TierLRU(64)})
    times = ServingTimes(PREFILL, DECODE, SAVING, BLOCK_BYTES)
    server = _server(clock, times=times, store=store, sync_save=True, max_num_seqs=2,
                     limits={"max_batched_tokens": 64})
    client = _Client(clock, times)
    prompt = _prompt(100, 1)
    client.send(server, prompt, 2, 0.0)
    second = client.send(server, prompt, 2, 0.001)  # hits the first's 6 blocks as its last chunk is scheduled
    clock.run()
    write_s = BLOCK_BYTES / (DISK_WRITE_GBPS * 1e9)  # one block's disk write
    first_step = TIMES.step_s([Chunk(64, 0)], 0, 0) + 4 * write_s  # blocks 0-3
    second_step = TIMES.step_s([Chunk(36, 64), Chunk(4, 96)], 0, 0) + 2 * write_s  # blocks 4-5, once
    assert second.first_token_s == pytest.approx(TIMES.request_in_s + first_step + second_step)


def test_a_producer_saves_without_loading_and_a_consumer_loads_without_saving():
    pool = TierLRU(64)
    clock = Clock()
    client = _Client(clock)
    producer = _server(clock, store=ServerStore({Medium.HOST: TierLRU(64), Medium.REMOTE: pool}), loads=False)
    consumer = _server(clock, store=ServerStore({Medium.HOST: TierLRU(64), Medium.REMOTE: pool}), saves=False)
    a = _prompt(100, 1)
    client.send(producer, a, 1, 0.0)
    client.send(producer, a, 1, 1.0)
    client.send(consumer, a, 2, 2.0)
    client.send(consumer, _prompt(100, 500), 2, 3.0)
    clock.run()
    assert counters_of(producer).hit_blocks == {}  # vLLM's own hit served the repeat; no lookups
    assert len(pool) == 6  # A's full blocks only: the consumer stored nothing
    assert counters_of(consumer).hit_blocks == {Medium.REMOTE: 6}


# --- the host's CPUs ------------------------------------------------------------------------------


def test_work_runs_slower_while_another_worker_steps_and_less_while_it_only_spins_on_other_cpus():
    cpus = HostCpus(2.5, spin_s=1.0, beside_spin=1.5)
    cpus.stepping(1, True, 0.0)
    assert cpus.stretch(1, 0.0) == 1.0  # its own step in flight is no other server's
    assert cpus.stretch(2, 0.0) == 2.5
    cpus.stepping(2, True, 0.1)
    assert cpus.stretch(1, 0.1) == 2.5
    cpus.stepping(1, False, 0.2)
    assert cpus.stretch(2, 0.3) == 1.5  # 1's worker spins until 1.2
    assert cpus.stretch(1, 0.3) == 2.5  # 2 still steps
    cpus.stepping(2, False, 0.5)
    assert cpus.stretch(1, 1.0) == 1.5  # 2's worker spins until 1.5
    assert cpus.stretch(2, 1.1) == 1.5  # 1's until 1.2
    assert cpus.stretch(2, 1.3) == 1.0
    assert cpus.stretch(1, 1.5) == cpus.stretch(2, 1.5) == 1.0
    cpus.stepping(3, False, 1.5)  # one spinning, one stepping: the stepping one counts
    cpus.stepping(4, True, 1.5)
    assert cpus.stretch(1, 1.6) == 2.5


def test_servers_bound_to_the_same_cpus_leave_the_rest_free():
    cpus = HostCpus(2.0, spin_s=1.0)
    cpus.bind(1, "0")
    cpus.bind(2, "0")
    cpus.bind(3, "1")
    cpus.stepping(1, True, 0.0)
    assert cpus.stretch(2, 0.0) == 1.0
    assert cpus.stretch(3, 0.0) == 2.0


def test_a_stopped_server_holds_no_cpu():
    cpus = HostCpus(2.0, spin_s=1.0)
    cpus.stepping(1, True, 0.0)
    cpus.stepping(1, False, 0.1)
    cpus.leave(1)
    assert cpus.stretch(2, 0.2) == 1.0


def test_a_host_measured_as_not_slowing_never_stretches():
    cpus = HostCpus(spin_s=5.0)
    for server in range(8):
        cpus.stepping(server, True, 0.0)
    assert cpus.stretch(99, 1.0) == 1.0


def test_stretches_below_one_and_a_negative_spin_are_refused():
    with pytest.raises(ValueError, match="together"):
        HostCpus(0.5)
    with pytest.raises(ValueError, match="spin_s"):
        HostCpus(2.0, spin_s=-1.0)
    with pytest.raises(ValueError, match="beside_spin"):
        HostCpus(2.0, beside_spin=0.9)


def test_a_request_after_the_other_server_stepped_runs_slower_while_its_worker_spins():
    """Two servers taking turns, never stepping at once: the second's request, sent while the
    first's worker still spins, runs slower than one sent after the spin is over."""
    def second_after(gap_s: float) -> SimRequest:
        clock = Clock()
        cpus = HostCpus(3.0, spin_s=0.5, beside_spin=2.0)
        client = _Client(clock)
        a, b = _server(clock, cpus=cpus), _server(clock, cpus=cpus)
        first = client.send(a, _prompt(100, 1), 4, 0.0)
        clock.run()
        second = client.send(b, _prompt(100, 500), 16, first.finish_s + gap_s)
        clock.run()
        return second

    spun, quiet = second_after(0.05), second_after(0.6)
    assert spun.tpot_s > 1.5 * quiet.tpot_s
    assert spun.ttft_s > quiet.ttft_s


def test_a_request_stalls_by_the_beside_share_while_another_worker_holds_cpus_and_the_alone_share_else():
    cpus = HostCpus(2.0, spin_s=1.0, stalls=Stalls(0.0, (), 1.0, (0.25,)))
    assert cpus.stall_s(1, 0.0) == 0.0  # alone: never measured late
    cpus.stepping(2, True, 0.0)
    assert cpus.stall_s(1, 0.1) == 0.25
    assert cpus.stall_s(2, 0.1) == 0.0  # its own worker is no other server's
    cpus.stepping(2, False, 0.2)
    assert cpus.stall_s(1, 1.1) == 0.25  # spinning still holds the CPUs
    assert cpus.stall_s(1, 1.3) == 0.0


@pytest.mark.parametrize("share", [0.04, 0.135, 0.2, 0.5])
def test_every_run_of_requests_stalls_at_the_measured_share_with_sizes_spread_over_those_measured(share):
    sizes = (0.05, 0.06, 0.07, 0.12, 0.24, 0.38)
    cpus = HostCpus(stalls=Stalls(share, sizes, 0.0, ()))
    stalls = [cpus.stall_s(1, float(t)) for t in range(400)]
    for n in (24, 48, 400):
        assert abs(sum(1 for x in stalls[:n] if x) - n * share) <= 1, n  # every phase: its share, within one
    late = [x for x in stalls if x]
    assert late[:4] == [0.12, 0.06, 0.24, 0.05]  # the median first, then the quartiles, ...
    assert abs(sum(late) / len(late) - sum(sizes) / len(sizes)) < 0.03  # over many, their mean
    again = HostCpus(stalls=Stalls(share, sizes, 0.0, ()))
    assert [again.stall_s(1, float(t)) for t in range(400)] == stalls


def _two_servers_at_once(cpus: HostCpus | None) -> list[SimRequest]:
    clock = Clock()
    client = _Client(clock)
    sent = [client.send(_server(clock, cpus=cpus), _prompt(100, 1), 16, 0.0) for _ in range(2)]
    clock.run()
    return sent


def test_two_servers_stepping_at_once_on_too_few_cpus_run_slower_than_alone():
    clock = Clock()
    client = _Client(clock)
    alone = client.send(_server(clock, cpus=HostCpus(2.0)), _prompt(100, 1), 16, 0.0)
    clock.run()
    together = _two_servers_at_once(HostCpus(2.0))
    assert max(r.tpot_s for r in together) > 1.5 * alone.tpot_s
    for r in together:
        assert r.finish_s - r.sent_s > alone.finish_s - alone.sent_s
    # on a host where a step is no slower for another's, each runs as it does alone
    for r in _two_servers_at_once(HostCpus()):
        assert r.tpot_s == pytest.approx(alone.tpot_s)
        assert r.finish_s == pytest.approx(alone.finish_s)
