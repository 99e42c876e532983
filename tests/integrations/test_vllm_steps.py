"""vLLM's own prefill and decode steps on this host, measured through ``vllm serve`` and fitted:
what the serving simulator's profile is made of (``kvstrata calibrate --model-dir DIR --engine vllm``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def steps(tiny_model_dir, tmp_path_factory) -> dict:
    import dataclasses

    from kvstrata.integrations.vllm.steps import measure_vllm_steps

    log = tmp_path_factory.mktemp("steps") / "vllm-serve.log"
    return dataclasses.asdict(measure_vllm_steps(tiny_model_dir, log, repeats=2))


def test_prefill_grows_with_new_tokens_and_the_fit_follows_the_points(steps):
    from kvstrata.plan.host import PrefillFit

    fit = PrefillFit(**steps["prefill"])
    fresh = {n: t for n, c, t in steps["prefill_points"] if c == 0}
    assert fresh[512] > 2 * fresh[32]  # the tiny model still does more work for more tokens
    _follows(fit.seconds, steps["prefill_points"])


def test_a_decode_step_grows_with_the_batch_and_the_fit_follows_the_points(steps):
    from kvstrata.plan.steps import DecodeFit

    fit = DecodeFit(**steps["decode"])
    by = {(b, s): t for b, s, t in steps["decode_points"]}
    one, eight = min(by.items())[1], max(by.items())[1]
    assert eight > one  # eight requests' step costs more than one's
    assert fit.step_s(8, 8 * 264) > fit.step_s(1, 264)
    _follows(fit.step_s, steps["decode_points"])


def _follows(fit, points) -> None:
    """Most points within 15% of the fit, none beyond 50% (one point is the median of two timed
    calls on a shared 2-core machine)."""
    errors = sorted(abs(fit(a, b) - t) / t for a, b, t in points)
    assert errors[len(errors) // 2] < 0.15 and errors[-1] < 0.5, errors
