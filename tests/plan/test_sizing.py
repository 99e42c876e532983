"""``size_instances``: the GPUs one instance of a model takes, and the refusal when none hold it."""

from __future__ import annotations

import pytest

from kvstrata.hardware.profile import load_profile
from kvstrata.kv.fields import GeometryError
from kvstrata.kv.geometry import Attention, DType, KVGeometry
from kvstrata.kv.presets import load_geometry
from kvstrata.plan.architectures import HBM_USABLE_FRACTION
from kvstrata.plan.planner import make_plan
from kvstrata.plan.sizing import KV_MARGIN_FRACTION, Basis, WeightsDoNotFit, check_tp, size_instances, tp_degrees
from kvstrata.sim.config import SimConfig

GB = 10**9
H200_HBM = 141 * GB  # the catalog's datasheet figure


def made_up(name: str, weight_gb: float, kv_heads: int, heads: int, attention=Attention.GQA) -> KVGeometry:
    """A model not in the repository: ``weight_gb`` of bf16 weights, the given head counts."""
    params = int(weight_gb * GB) // 2
    extra = {"kv_lora_rank": 512, "qk_rope_head_dim": 64} if attention is Attention.MLA else {}
    head_dim = 576 if attention is Attention.MLA else 128
    return KVGeometry(name, attention, 40, kv_heads, head_dim, DType.BF16, params, params, heads, **extra)


@pytest.mark.parametrize(
    ("model", "profile", "gpus", "basis"),
    [
        # 16.1 GB of llama-3-8b fits one GPU with room to spare everywhere.
        ("llama-3-8b", "h200-cx7-gen5", 1, Basis.KV_MARGIN),
        # 93.4 GB of mixtral: > 63.45 GB (half an H200's usable 126.9), so 2; 46.7 GB each fits.
        ("mixtral-8x7b", "h200-cx7-gen5", 2, Basis.KV_MARGIN),
        # 141.1 GB of llama-3-70b: 70.55 GB on 2 H200s is over 63.45, 35.3 on 4 is under.
        ("llama-3-70b", "h200-cx7-gen5", 4, Basis.KV_MARGIN),
        ("llama-3-70b", "gen5-cx8-socket-direct", 4, Basis.KV_MARGIN),
        # A B200's usable 162 GB halves to 81: 70.55 GB on 2 of them leaves the margin.
        ("llama-3-70b", "b200-cx8-gen6", 2, Basis.KV_MARGIN),
        # 811.7 GB of llama-3.1-405b: 101.5 GB on 8 H200s fits 126.9 but not the margin.
        ("llama-3.1-405b", "h200-cx7-gen5", 8, Basis.WEIGHTS_ONLY),
        # 671 GB of fp8 deepseek-v3 on 8 B200s: 83.9 GB each, over 81: the weights alone.
        ("deepseek-v3", "b200-cx8-gen6", 8, Basis.WEIGHTS_ONLY),
        # One 80 GB H100 (72 GB usable) never holds 141.1 GB.
        ("llama-3-70b", "workstation", 1, Basis.NONE_FIT),
    ],
)
def test_default_is_the_fewest_gpus_that_hold_the_weights_with_kv_room(model, profile, gpus, basis):
    g, p = load_geometry(model), load_profile(profile)
    s = size_instances(g, p)
    assert (s.gpus_per_instance, s.basis) == (gpus, basis)
    assert s.instances == len(p.gpus) // gpus
    hbm_usable = p.topology.node("gpu0").capacity_bytes * HBM_USABLE_FRACTION
    share = g.weight_bytes() / gpus
    assert s.weights_fit == (share < hbm_usable)
    if basis is Basis.KV_MARGIN:
        assert share <= hbm_usable * (1 - KV_MARGIN_FRACTION)
    # No smaller degree the model allows would have done as well.
    for smaller in (k for k in tp_degrees(g, len(p.gpus)) if k < gpus):
        assert g.weight_bytes() / smaller > hbm_usable * (1 - KV_MARGIN_FRACTION)
    # The simulator and the planner default to the same choice.
    assert make_plan(g, p, 4096).tp == gpus
    if s.weights_fit:
        assert SimConfig(g, p).gpus_per_instance == gpus


def test_a_model_not_in_the_catalog_with_six_kv_heads_takes_three_gpus():
    # 150 GB over 6 KV heads and 48 query heads on H200s: 2 GPUs hold 75 GB (> 63.45), 3 hold
    # 50 GB, and 3 divides both head counts.
    g = made_up("six-heads-150b", 150, kv_heads=6, heads=48)
    s = size_instances(g, load_profile("h200-cx7-gen5"))
    assert s.gpus_per_instance == 3 and s.instances == 2  # 8 GPUs make two groups of 3
    assert s.basis is Basis.KV_MARGIN


def test_the_default_splits_query_heads_evenly_too():
    # An MLA model's latent allows any degree; 320 GB needs 6 H200s by weight (53 GB each), but
    # 6 does not divide 128 query heads, so engines run 8.
    g = made_up("mla-320b", 320, kv_heads=1, heads=128, attention=Attention.MLA)
    assert 6 in tp_degrees(g, 8) and 6 not in tp_degrees(g, 8, engine_heads=True)
    assert size_instances(g, load_profile("h200-cx7-gen5")).gpus_per_instance == 8
    # Asked for, 6 is the KV rule's to judge, as elsewhere.
    assert size_instances(g, load_profile("h200-cx7-gen5"), 6).basis is Basis.REQUESTED


def test_instances_asked_for_bound_the_gpus_each_gets():
    g, p = load_geometry("llama-3-70b"), load_profile("h200-cx7-gen5")
    assert size_instances(g, p, instances=2).gpus_per_instance == 4
    tight = size_instances(g, p, instances=4)  # 2 GPUs each: the weights fit, the margin does not
    assert (tight.gpus_per_instance, tight.basis) == (2, Basis.WEIGHTS_ONLY)
    none = size_instances(g, p, instances=8)
    assert not none.weights_fit
    with pytest.raises(ValueError, match="3 instances of 4 GPUs need 12 GPUs"):
        size_instances(g, p, 4, 3)
    with pytest.raises(ValueError, match="at least 1"):
        size_instances(g, p, instances=0)


def test_weights_that_do_not_fit_are_refused_in_one_line_naming_model_bytes_and_gpus():
    g, p = load_geometry("llama-3.1-405b"), load_profile("h200-cx7-gen5")
    s = size_instances(g, p, 1)
    with pytest.raises(WeightsDoNotFit) as info:
        s.check_fits()
    msg = str(info.value)
    assert "\n" not in msg
    assert f"llama-3.1-405b's {g.weight_bytes() / GB:,.1f} GB of bf16 weights" in msg
    assert f"1 x H200-SXM ({H200_HBM / GB:,.1f} GB HBM each" in msg
    assert "8 GPUs per instance would hold them" in msg
    with pytest.raises(WeightsDoNotFit, match="no tensor-parallel group of the node's 1 GPU"):
        size_instances(g, load_profile("workstation")).check_fits()


def test_the_simulator_refuses_a_model_its_gpus_cannot_hold():
    # 141.1 GB of llama-3-70b on one H200 (126.9 GB usable): refused, not simulated; on 2, run.
    with pytest.raises(WeightsDoNotFit, match="llama-3-70b"):
        SimConfig(load_geometry("llama-3-70b"), load_profile("h200-cx7-gen5"), 1)
    assert SimConfig(load_geometry("llama-3-70b"), load_profile("h200-cx7-gen5"), 2).instances == 4


def test_a_degree_the_kv_heads_refuse_names_the_ones_that_work():
    g, p = load_geometry("llama-3-70b"), load_profile("h200-cx7-gen5")
    with pytest.raises(GeometryError, match=r"8 KV heads do not split over 3 GPUs.*runs on 1, 2, 4, 8$") as info:
        size_instances(g, p, 3)
    assert "'tp'" not in str(info.value)
    with pytest.raises(ValueError, match="9 GPUs per instance, but the node has only 8 GPUs"):
        size_instances(g, p, 9)


def test_a_tp_degree_the_state_refuses_names_the_state_not_the_heads():
    geometry = load_geometry("qwen3-next-80b-a3b")  # 2 KV heads (replicated past 2), 16 key heads of state
    check_tp(geometry, 8)
    with pytest.raises(GeometryError, match=r"recurrent state \(16 heads\) does not split over 32 GPUs.*1, 2, 4, 8, 16$"):
        check_tp(geometry, 32)
    with pytest.raises(GeometryError, match="2 KV heads do not split over 3 GPUs"):
        check_tp(geometry, 3)
