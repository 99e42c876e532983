"""Load, recompute or split the cached prefix: every plan gives the cold run's tokens."""

from __future__ import annotations

import random
import uuid

import pytest

transformers = pytest.importorskip("transformers")

from kvstrata.cache import CacheConfig, TieredCache  # noqa: E402
from kvstrata.integrations.hf import KVStrataLM, model_layout  # noqa: E402
from kvstrata.integrations.recompute import measure_prefill  # noqa: E402
from kvstrata.media import Medium  # noqa: E402
from kvstrata.plan.calpaths import CalPath  # noqa: E402
from kvstrata.plan.host import HostCalibration, PathFit, PrefillFit  # noqa: E402
from kvstrata.plan.recompute import PlanKind  # noqa: E402

BLOCK = 32
NEW_TOKENS = 8
PREFILL = PrefillFit(latency_s=0.001, tokens_per_s=20_000.0, attn_s=1e-8)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def ids(tiny_model_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    rng = random.Random(1)
    vocab = "the cache block restore path prefix hit layer token memory device host disk pool".split()
    return tokenizer(" ".join(rng.choice(vocab) for _ in range(300))).input_ids


@pytest.fixture
def warm(model, ids, tmp_path):
    """A cache holding the prompt's blocks on disk only, and the cold run's generation."""
    layout = model_layout(model.config, BLOCK, model.dtype)
    b = layout.block_bytes
    config = CacheConfig(layout, f"tiny-{uuid.uuid4().hex[:8]}", device_bytes=64 * b, host_bytes=64 * b,
                         disk_bytes=64 * b, disk_dir=tmp_path / "disk", device="cpu")
    with TieredCache(config) as cache:
        cold = KVStrataLM(model, cache).generate(ids, NEW_TOKENS, reuse=False)
        yield cache, cold


def disk_only(cache):
    for medium in (Medium.DEVICE, Medium.HOST):
        cache.evict(medium, 10_000)


def calibration(gbps: float, cpu_gbps: float = 1e3) -> HostCalibration:
    """Storage at ``gbps``; reads costing the cores ``cpu_gbps`` (the contention on a CPU host)."""
    return HostCalibration("test", "cpu", 2, {CalPath.DISK_READ_COLD: PathFit(0.0, gbps),
                                              CalPath.DISK_READ_WARM: PathFit(0.0, cpu_gbps)})


def test_each_strategy_gives_the_cold_tokens(model, ids, warm):
    cache, cold = warm
    hit = (len(ids) - 1) // BLOCK * BLOCK
    lm = KVStrataLM(model, cache)
    for strategy, kind, loaded in (("load", PlanKind.LOAD, hit), ("recompute", PlanKind.RECOMPUTE, 0)):
        disk_only(cache)
        got = lm.generate(ids, NEW_TOKENS, store=False, strategy=strategy)
        assert got.tokens == cold.tokens, strategy
        assert (got.plan, got.hit_tokens) == (kind, loaded)
    assert lm.generate(ids, NEW_TOKENS, store=False).plan is PlanKind.LOAD  # the default


@pytest.mark.parametrize("blocks", [0, 1, 3, 5, -1])
def test_split_at_each_k_gives_the_cold_tokens(blocks, model, ids, warm):
    cache, cold = warm
    hit = (len(ids) - 1) // BLOCK * BLOCK
    k = hit if blocks == -1 else blocks * BLOCK
    disk_only(cache)
    got = KVStrataLM(model, cache).generate(ids, NEW_TOKENS, store=False, strategy="split", split_tokens=k)
    assert got.tokens == cold.tokens
    assert got.compute_tokens == k
    assert got.plan is (PlanKind.LOAD if k == 0 else PlanKind.RECOMPUTE if k == hit else PlanKind.SPLIT)
    if got.plan is not PlanKind.RECOMPUTE:
        assert got.hit_tokens == hit - k
        assert got.load.paths == {(Medium.DISK, Medium.DEVICE): (hit - k) // BLOCK}  # only [k, hit) was read


@pytest.mark.parametrize(("gbps", "kind"), [(1e3, PlanKind.LOAD), (1e-5, PlanKind.RECOMPUTE), (0.04, PlanKind.SPLIT)])
def test_auto_follows_the_calibration_and_keeps_the_tokens(gbps, kind, model, ids, warm):
    cache, cold = warm
    disk_only(cache)
    lm = KVStrataLM(model, cache, calibration=calibration(gbps), prefill=PREFILL)
    got = lm.generate(ids, NEW_TOKENS, store=False, strategy="auto")
    assert got.tokens == cold.tokens
    assert got.plan is kind and got.decision.kind is kind
    assert got.compute_tokens == got.decision.compute_tokens
    assert got.decision.predicted_s <= min(got.decision.load_only_s, got.decision.recompute_s)


def test_on_the_cpu_a_load_that_takes_the_cores_rules_out_the_split(model, ids, warm):
    cache, cold = warm
    disk_only(cache)
    lm = KVStrataLM(model, cache, calibration=calibration(0.01, cpu_gbps=0.01), prefill=PREFILL)
    got = lm.generate(ids, NEW_TOKENS, store=False, strategy="auto")
    assert got.tokens == cold.tokens and got.plan is not PlanKind.SPLIT


def test_auto_reads_the_cache_calibration_and_its_prefill(model, ids, warm):
    cache, cold = warm
    cal = HostCalibration("test", "cpu", 2, {CalPath.DISK_READ_COLD: PathFit(0.0, 1e3)},
                          {cache.config.model_id: PREFILL})
    object.__setattr__(cache.config, "calibration", cal)  # as if configured so
    disk_only(cache)
    got = KVStrataLM(model, cache).generate(ids, NEW_TOKENS, store=False, strategy="auto")
    assert got.tokens == cold.tokens and got.plan is PlanKind.LOAD


def test_bad_input_is_named(model, ids, warm):
    cache, _ = warm
    lm = KVStrataLM(model, cache)
    hit = (len(ids) - 1) // BLOCK * BLOCK
    with pytest.raises(ValueError, match="unknown strategy 'fastest'"):
        lm.generate(ids, 1, strategy="fastest")
    with pytest.raises(ValueError, match="not a multiple of the block size"):
        lm.generate(ids, 1, strategy="split", split_tokens=BLOCK + 1)
    with pytest.raises(ValueError, match="beyond the cached prefix"):
        lm.generate(ids, 1, strategy="split", split_tokens=hit + BLOCK)
    with pytest.raises(ValueError, match="split_tokens goes with strategy 'split'"):
        lm.generate(ids, 1, strategy="split")
    with pytest.raises(ValueError, match="split_tokens goes with strategy 'split'"):
        lm.generate(ids, 1, strategy="load", split_tokens=0)
    with pytest.raises(ValueError, match="needs a HostCalibration"):
        lm.generate(ids, 1, strategy="auto")
    with pytest.raises(ValueError, match="prefill fit"):
        KVStrataLM(model, cache, calibration=calibration(1.0)).generate(ids, 1, strategy="auto")
    with pytest.raises(ValueError, match="streaming supports"):
        lm.generate(ids, 1, strategy="split", split_tokens=0, streaming=True)


def test_measure_prefill_fits_this_host(model):
    fit = measure_prefill(model, sizes=(32, 128, 256), cached=(256,), repeats=2)
    assert fit.tokens_per_s > 0 and fit.latency_s >= 0 and fit.attn_s >= 0
    assert fit.seconds(256) > fit.seconds(32)
    with pytest.raises(ValueError, match="exceeds the model's"):
        measure_prefill(model, sizes=(32, 100_000))
