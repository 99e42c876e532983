"""vLLM's own prefill and decode steps on this host, measured through ``vllm serve`` and fitted:
what the serving simulator's profile is made of (``kvstrata calibrate --model-dir DIR --engine vllm``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


TOGETHER = ((1, 64), (8, 256))  # (batch, context): the smallest and the largest of a calibration's
CONNECTOR_PROMPTS = (128, 448)
STALL_REQUESTS = 12
QUIET_WAIT_S = 3.0  # a test waits this long at most for a quiet host (a calibration 20 s): it times nothing


@pytest.fixture(scope="module")
def steps(tiny_model_dir, tmp_path_factory) -> dict:
    """The three servers (plain and with the connector on one half of the CPUs, one with the
    connector on the other), as bench serve binds its servers; the cache's own restores and stores taken as
    free (their fits are tested apart)."""
    import dataclasses
    import os

    from kvstrata.calibrate.serving import host, steps
    from kvstrata.calibrate.serving.servers import cpu_halves
    from kvstrata.calibrate.serving.steps import measure_vllm_steps

    logs = tmp_path_factory.mktemp("steps")
    with pytest.MonkeyPatch.context() as patch:  # fewer points than a calibration: each section still runs
        patch.setattr(steps, "TOGETHER", TOGETHER)
        patch.setattr(steps, "CONNECTOR_PROMPTS", CONNECTOR_PROMPTS)
        patch.setattr(steps, "STALL_REQUESTS", STALL_REQUESTS)
        patch.setattr(host, "QUIET_WAIT_S", QUIET_WAIT_S)
        return dataclasses.asdict(measure_vllm_steps(tiny_model_dir, logs, lambda blocks: 0.0, lambda blocks: 0.0,
                                                     repeats=2, cpus=cpu_halves(sorted(os.sched_getaffinity(0)))))


def test_the_connector_s_server_runs_where_the_plain_one_does_and_the_other_server_apart(tmp_path):
    """The connector's cost is what its server took beyond the plain server's fits: on other CPUs
    it would count their difference in speed as the connector's."""
    from kvstrata.calibrate.serving.steps import BIND, server_specs

    plain, ours, other = server_specs("/models/m", tmp_path, 1 << 17, "float32", 32, ("0-3", "4-7"), None)
    assert (plain.env[BIND], ours.env[BIND], other.env[BIND]) == ("0-3", "0-3", "4-7")
    assert plain.connector is None and ours.connector is not None and other.connector is not None
    assert ours.connector["disk_dir"] != other.connector["disk_dir"]
    assert plain.prefix_caching and not ours.prefix_caching
    assert all(BIND not in spec.env for spec in server_specs("/models/m", tmp_path, 1 << 17, "float32", 32, None, None))
    _, ours, other = server_specs("/models/m", tmp_path, 1 << 17, "float32", 32, None, tmp_path / "pool.json")
    assert ours.connector["model_id"] == other.connector["model_id"]  # one's stores are the other's hits in the pool


def test_misfit_is_how_far_the_points_lie_from_their_fits():
    from kvstrata.calibrate.serving.steps import EngineSteps
    from kvstrata.plan.host import PrefillFit
    from kvstrata.plan.steps import ConnectorFit, DecodeFit

    prefill, decode = PrefillFit(0.02, 10_000.0), DecodeFit(0.005, 0.0, 1e-6)
    on_fit = [(n, 0, prefill.seconds(n)) for n in (32, 64, 128)]
    twice = [(b, b * 100, 2 * decode.step_s(b, b * 100)) for b in (1, 2, 4)]
    steps = EngineSteps(prefill, decode, ConnectorFit(0.0), tuple(on_fit), tuple(twice), (), (), ())
    assert steps.misfit["prefill"] < 1e-9
    assert abs(steps.misfit["decode"] - 0.5) < 1e-9  # every point twice its fit: the fit is half off


def test_engine_gaps_are_the_sum_and_count_of_vllm_s_inter_token_histogram():
    from kvstrata.calibrate.serving.counters import engine_gaps

    text = """# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 700.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 722.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 3.99661019002815
vllm:request_time_per_output_token_seconds_sum{engine="0",model_name="m"} 0.28
"""
    assert engine_gaps(text) == (3.99661019002815, 722)
    assert engine_gaps("") == (0.0, 0)  # a server that stamps none: the client's gaps are taken instead


def test_a_load_from_the_pool_as_served_costs_what_it_took_beyond_the_pool_s_path():
    from kvstrata.plan.steps import remote_load_fit

    path = lambda blocks: 0.001 + 0.0002 * blocks  # noqa: E731
    points = [(1, path(1) + 0.010), (3, path(3) + 0.013), (13, path(13) + 0.012), (7, path(7) + 0.030)]
    assert remote_load_fit(points, path) == pytest.approx(0.0125)  # the median: one slow load does not set it
    assert remote_load_fit([(4, 0.0001)], path) == 0.0  # faster than the path: no cost beyond it


def test_cache_loads_reads_the_connector_s_seconds_loads_and_blocks_from_the_pool():
    from kvstrata.calibrate.serving.counters import cache_loads

    text = """kvstrata_connector_loads_total{engine="0",model_name="m"} 25.0
kvstrata_connector_load_seconds_total{engine="0",model_name="m"} 0.3609
kvstrata_connector_loaded_blocks_total{engine="0",model_name="m",tier="remote"} 70.0
kvstrata_connector_loaded_blocks_total{engine="0",model_name="m",tier="host"} 56.0
"""
    assert cache_loads(text) == (0.3609, 25, 70)
    assert cache_loads("") == (0.0, 0, 0)


def test_the_connector_s_cost_per_request_is_its_stream_beyond_the_plain_server_s_at_one_pace():
    """A stream of 128-token prompts (4 blocks) to the connector's server took 20 ms more (median)
    than the plain server's; the store of 4 blocks is 2 ms: the connector costs 18 ms a request,
    whatever a lone request after a pause costs (the pairs' misses here 30-60 ms beyond their prefill)."""
    from kvstrata.plan.steps import connector_fit
    from kvstrata.plan.host import PrefillFit

    prefill = PrefillFit(0.02, 10_000.0)
    store = lambda blocks: 0.0005 * blocks  # noqa: E731
    restore = lambda blocks: 0.0002 * blocks  # noqa: E731
    points = []
    for n, lone, load in ((64, 0.03, 0.004), (128, 0.06, 0.002), (256, 0.04, 0.003), (448, 0.05, 0.009)):
        cached = (n - 1) // 32 * 32
        miss = prefill.seconds(n, 0) + store(n // 32) + lone
        points.append((n, miss, prefill.seconds(n - cached, cached) + restore(cached // 32) + lone + load))
    fit = connector_fit([0.05, 0.06, 0.09], [0.07, 0.08, 0.2], points, prefill, restore, store, 32, 128)
    assert abs(fit.request_s - 0.018) < 1e-9
    assert abs(fit.load_s - 0.0035) < 1e-9  # the median of the repeats' 2-9 ms beyond their own misses


def test_the_connector_s_cost_is_never_below_zero_and_needs_its_streams():
    from kvstrata.plan.steps import connector_fit
    from kvstrata.plan.host import PrefillFit

    prefill = PrefillFit(0.02, 10_000.0)
    points = [(64, 0.05, 0.01)]  # a repeat faster than its prefill could be
    fit = connector_fit([0.08], [0.05], points, prefill, lambda b: 0.0, lambda b: 0.0, 32, 128)
    assert fit.request_s == 0.0 and fit.load_s == 0.0
    with pytest.raises(ValueError, match="stream to each server"):
        connector_fit([], [0.05], points, prefill, lambda b: 0.0, lambda b: 0.0, 32, 128)


def test_prefill_grows_with_new_tokens_and_the_fit_follows_the_points(steps):
    from kvstrata.plan.host import PrefillFit

    fit = PrefillFit(**steps["prefill"])
    fresh = {n: t for n, c, t in steps["prefill_points"] if c == 0}
    assert fresh[512] > 1.25 * fresh[32]  # more work for more tokens, on top of serving's ~20 ms of its own
    _follows(fit.seconds, steps["prefill_points"])


def test_every_decode_point_is_measured_and_the_fit_follows_them(steps):
    from kvstrata.calibrate.serving.steps import DECODE_BATCHES, DECODE_CONTEXTS
    from kvstrata.plan.steps import DecodeFit

    fit = DecodeFit(**steps["decode"])
    assert sorted(b for b, _, _ in steps["decode_points"]) == sorted(DECODE_BATCHES * len(DECODE_CONTEXTS))
    assert all(0 < t < 1 for _, _, t in steps["decode_points"])  # a streamed token of the tiny model: ms, not s
    _follows(fit.step_s, steps["decode_points"])


def test_a_step_beside_the_other_server_decoding_is_timed_against_one_alone(steps):
    assert [(b, s // b - 16) for b, s, _, _, _ in steps["together_points"]] == list(TOGETHER)
    assert all(alone > 0 and stepping > 0 and spinning > 0 for _, _, alone, stepping, spinning in steps["together_points"])
    from kvstrata.calibrate.serving.steps import _stretch
    from kvstrata.plan.steps import DecodeFit

    fit = DecodeFit(**steps["decode"])  # each factor from its own column of points, against the fit
    assert fit.together == _stretch(fit, [(b, held, t) for b, held, _, t, _ in steps["together_points"]])
    assert fit.beside_spin == _stretch(fit, [(b, held, t) for b, held, _, _, t in steps["together_points"]])


def test_a_vllm_worker_is_seen_spinning_after_its_last_step(steps):
    """vLLM's worker busy-polls its queue about a second after a step (its shared-memory reader):
    the server's processes keep a CPU busy after the last token is out, and stop within the watch."""
    from kvstrata.calibrate.serving.steps import SPIN_WATCH_S

    assert len(steps["spin_points"]) == 2
    assert 0 < steps["decode"]["spin_s"] < SPIN_WATCH_S - 0.5


def test_a_prompt_sent_again_is_served_by_kvstrata_faster_than_it_was_computed(steps):
    """vLLM's own prefix cache is off on the connector's server: the repeat's blocks come from
    kvstrata's tiers. A 448-token prompt loads 13 blocks and computes 32 tokens."""
    points = steps["connector_points"]
    longest = [(miss, hit) for n, miss, hit in points if n == max(n for n, *_ in points)]
    assert len(longest) == 2  # the repeats, the warm-up left out
    assert sorted(hit for _, hit in longest)[0] < sorted(miss for miss, _ in longest)[-1]
    assert steps["connector"]["request_s"] >= 0 and steps["connector"]["load_s"] >= 0


def test_the_stalls_are_fitted_from_streams_to_each_server_alone_and_one_taking_turns_between_two(steps):
    from kvstrata.plan.steps import Stalls, fit_stalls

    alone, paced, beside = steps["stall_alone"], steps["connector_alone"], steps["stall_beside"]
    assert len(alone) == len(paced) == STALL_REQUESTS
    assert [len(t) for t in beside] == [STALL_REQUESTS // 2] * 2  # no pool: no handoffs
    assert all(0 < t < 5 for t in [*alone, *paced, *beside[0], *beside[1]])
    assert Stalls(**steps["stalls"]) == Stalls(*fit_stalls([alone, paced]), *fit_stalls(beside))


def _follows(fit, points) -> None:
    """The fit runs through the points: between the fastest and the slowest at every point, and
    within half of most (each point is the median of two streamed requests on a shared 2-core
    machine, a few milliseconds of a server's time: how close is for bench serve and validate to
    say, not a test)."""
    times = [t for _, _, t in points]
    predicted = [fit(a, b) for a, b, _ in points]
    assert all(min(times) / 2 <= p <= 2 * max(times) for p in predicted), (predicted, times)
    errors = sorted(abs(p - t) / t for p, t in zip(predicted, times))
    assert errors[len(errors) // 2] < 0.5, errors
