"""The seed's seven architectures as ``make_plan`` judges them: capacity, first wait, per step.

Capacities are recomputed here from the stated assumptions (90% of HBM usable, 80% of DRAM
for KV) and llama-3-70b's parameter count worked out from its config by hand.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from kvstrata.hardware.profile import load_profile
from kvstrata.kv.presets import load_geometry
from kvstrata.plan.architectures import Architecture
from kvstrata.plan.planner import make_plan
from kvstrata.plan.restore import RestorePath, RestorePlanner

GB = 1e9
KEYS = ["hbm", "local-dram", "remote-gdr", "remote-staged", "pd-handoff", "dram-streaming", "nvme"]

# llama-3-70b from its config.json: vocab 128256, hidden 8192, 80 layers, 64 query heads,
# 8 KV heads of 128, MLP 28672, untied embeddings; bf16 = 2 bytes per parameter.
V, H, L, I, KV_WIDTH = 128256, 8192, 80, 28672, 8 * 128
PER_LAYER = 2 * H * H + 2 * H * KV_WIDTH + 3 * H * I + 2 * H  # q, o; k, v; gate/up/down; 2 norms
PARAMS_70B = 2 * V * H + L * PER_LAYER + H  # embeddings + lm_head, layers, final norm
WEIGHTS_70B = 2 * PARAMS_70B
BPT_70B = 2 * 80 * 8 * 128 * 2
H200_HBM = 141 * 10**9
B200_HBM = 180 * 10**9


def arch(plan, key):
    return next(a for a in plan.architectures if a.arch.value == key)


def test_all_seven_in_the_seeds_order(llama70b, h200):
    plan = make_plan(llama70b, h200, 32768)
    assert [a.arch.value for a in plan.architectures] == KEYS
    assert [a.value for a in Architecture] == KEYS
    assert len({a.title for a in Architecture}) == 7
    assert all(a.why and a.cost for a in Architecture)


def test_hbm_resident_waits_for_nothing_and_moves_nothing_per_step(llama70b, h200):
    hbm = arch(make_plan(llama70b, h200, 32768), "hbm")
    assert hbm.first_wait_s == 0
    assert hbm.per_step_external_bytes == 0
    assert hbm.bound_by == "HBM"


@pytest.mark.parametrize(
    ("profile", "hbm_bytes", "gpus"),
    [("h200-cx7-gen5", H200_HBM, 4), ("h200-cx7-gen5", H200_HBM, 8), ("b200-cx8-gen6", B200_HBM, 1),
     ("b200-cx8-gen6", B200_HBM, 2), ("b200-cx8-gen6", B200_HBM, 8)],
)
def test_hbm_capacity_is_usable_hbm_after_weights_over_per_gpu_kv(llama70b, profile, hbm_bytes, gpus):
    plan = make_plan(llama70b, load_profile(profile), 32768, gpus=gpus)
    assert llama70b.weight_bytes() == WEIGHTS_70B
    per_gpu_bpt = BPT_70B // gpus  # 8 KV heads split over <= 8 GPUs
    free = Fraction(9, 10) * hbm_bytes - Fraction(WEIGHTS_70B, gpus)
    expected = int(free // per_gpu_bpt)
    assert plan.capacity.hbm_tokens == expected
    assert plan.capacity.weights_fit
    assert arch(plan, "hbm").capacity_tokens == expected
    assert arch(plan, "pd-handoff").capacity_tokens == expected  # the decode side keeps KV in HBM


def test_off_gpu_capacities_from_the_profile(llama70b, h200):
    plan = make_plan(llama70b, h200, 32768)
    # Two sockets x 1024 GB of DDR5, 80% for KV; a 4096 GB pool; two 7.68 TB Gen4 drives.
    assert plan.capacity.dram_tokens == int(2 * 1024 * 10**9 * 8 // 10 // BPT_70B)
    assert plan.capacity.pool_tokens == int(4096 * 10**9 * 8 // 10 // BPT_70B)
    assert plan.capacity.nvme_tokens == int(2 * 7_680 * 10**9 // BPT_70B)
    assert plan.capacity.dram_tokens > plan.capacity.hbm_tokens


@pytest.mark.parametrize("context", [4096, 32768, 100_000])
def test_concurrent_requests_are_whole_contexts_that_fit(llama70b, h200, context):
    plan = make_plan(llama70b, h200, context)
    for a in plan.architectures:
        assert a.capacity_tokens is not None
        assert a.concurrent_requests == a.capacity_tokens // context


def test_decode_step_reads_weights_share_and_kv_shard_at_hbm_speed(llama70b, h200):
    context = 32768
    plan = make_plan(llama70b, h200, context, gpus=4)
    expected = (WEIGHTS_70B // 4 + context * BPT_70B // 4) / (4.8e12)  # H200: 4.8 TB/s
    for a in plan.architectures:
        assert a.per_step_hbm_s == pytest.approx(expected, rel=1e-9)
        if a.arch is not Architecture.DRAM_STREAMING:
            assert a.per_step_s == pytest.approx(expected, rel=1e-9)


def test_an_fp8_kv_cache_does_not_shrink_the_weights_read_per_step(h200):
    fp8_kv = load_geometry("llama-3-70b", "fp8")  # weights stay bf16, as the config says
    assert fp8_kv.weight_bytes() == WEIGHTS_70B
    context = 32768
    plan = make_plan(fp8_kv, h200, context, gpus=4)
    kv_shard = context * (BPT_70B // 2) // 4  # 1-byte KV elements
    expected = (WEIGHTS_70B // 4 + kv_shard) / 4.8e12
    assert arch(plan, "hbm").per_step_hbm_s == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("profile", ["h200-cx7-gen5", "b200-cx8-gen6"])
def test_dram_streaming_moves_the_whole_shard_across_pcie_every_step(llama70b, profile):
    context = 32768
    p = load_profile(profile)
    plan = make_plan(llama70b, p, context, cached_tokens=1024)
    stream, hbm = arch(plan, "dram-streaming"), arch(plan, "hbm")
    assert stream.per_step_external_bytes == context * BPT_70B // plan.tp
    assert stream.per_step_s > hbm.per_step_s
    assert stream.bound_by.startswith("PCIe")
    # Each step costs what restoring the full context from local DRAM costs, whatever is cached.
    full = RestorePlanner(p, list(plan.gpus)).restore(RestorePath.LOCAL_DRAM, [context * BPT_70B // plan.tp] * plan.tp)
    assert stream.per_step_s == pytest.approx(full.seconds, rel=1e-12)
    # Decode starts before the whole context is in.
    assert 0 < stream.first_wait_s < full.seconds


@pytest.mark.parametrize("cached", [0, 1024, 16384])
def test_prefix_hit_cuts_first_wait_never_the_per_step_reads(llama70b, h200, cached):
    context = 32768
    whole = make_plan(llama70b, h200, context)
    part = make_plan(llama70b, h200, context, cached_tokens=cached)
    for key in ("local-dram", "remote-gdr", "remote-staged", "nvme"):
        assert arch(part, key).first_wait_s < arch(whole, key).first_wait_s, key
    for a, b in zip(whole.architectures, part.architectures):
        assert b.per_step_s == a.per_step_s, a.arch
        assert b.per_step_external_bytes == a.per_step_external_bytes, a.arch


def test_pd_handoff_moves_the_full_context_not_only_the_cached_part(llama70b, h200):
    context = 32768
    plan = make_plan(llama70b, h200, context, cached_tokens=1024)
    pd = arch(plan, "pd-handoff")
    assert pd.first_wait_path is RestorePath.PD_HANDOFF
    assert pd.first_wait_s == arch(make_plan(llama70b, h200, context), "pd-handoff").first_wait_s
    # 4 GPUs, each fed by its own CX-7: a quarter of the context per GPU at one port's rate.
    port = 400 / 8 * 4096 / (4096 + 26)
    assert pd.first_wait_s == pytest.approx(context * BPT_70B / 4 / (port * GB), rel=1e-3)
    assert pd.first_wait_s > arch(plan, "remote-gdr").first_wait_s * 10


def test_weights_that_do_not_fit_leave_every_architecture_no_capacity(llama70b, ws):
    # 141 GB of bf16 weights on one 80 GB H100.
    assert WEIGHTS_70B > 80 * 10**9
    plan = make_plan(llama70b, ws, 8192, gpus=1)
    assert not plan.capacity.weights_fit
    assert not plan.sizing.weights_fit
    assert plan.capacity.hbm_tokens == 0
    assert len(plan.architectures) == 7
    for a in plan.architectures:
        assert a.capacity_tokens == 0 and a.concurrent_requests == 0, a.arch
        # The plan says it once (its sizing); a row names only what its own path lacks.
        assert a.unavailable is None or "weights" not in a.unavailable, a.arch


def test_the_same_model_fits_once_spread_over_enough_gpus(llama70b, h200):
    one = make_plan(llama70b, h200, 8192, gpus=1)  # 141.1 GB > 90% of 141 GB
    two = make_plan(llama70b, h200, 8192, gpus=2)
    assert not one.capacity.weights_fit
    assert two.capacity.weights_fit
    assert all(a.unavailable is None for a in two.architectures)


def test_remote_architectures_unavailable_without_a_pool(ws):
    small = load_geometry("llama-3-8b")  # 16 GB of weights fit on the workstation's H100
    plan = make_plan(small, ws, 8192)
    assert plan.capacity.weights_fit
    for key in ("remote-gdr", "remote-staged", "pd-handoff"):
        a = arch(plan, key)
        assert a.unavailable and "NIC" in a.unavailable, key
        assert a.first_wait_s is None and a.capacity_tokens is None
    for key in ("hbm", "local-dram", "dram-streaming", "nvme"):
        assert arch(plan, key).unavailable is None, key
    assert plan.capacity.pool_tokens is None
