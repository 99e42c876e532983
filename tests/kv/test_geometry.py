"""KV geometry and parameter counts from Hugging Face configs."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.kv import Attention, DType, GeometryError, KVGeometry, geometry_from_config, kv_shape_from_config
from kvstrata.kv.geometry import attention_for_heads
from kvstrata.kv.groups import GroupKind
from kvstrata.kv.presets import load_config, load_geometry


def llama_config(**overrides):
    """A small Llama-style config; ``None`` values delete the key."""
    config = {
        "model_type": "llama",
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_attention_heads": 8,
        "num_hidden_layers": 6,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    config.update(overrides)
    return {key: value for key, value in config.items() if value is not None}


# --- bytes per token ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "attention", "bytes_per_token"),
    [
        ("llama-3-8b", Attention.GQA, 131_072),  # 2 * 32 layers * 8 heads * 128 * 2 B
        ("llama-3-70b", Attention.GQA, 327_680),  # 2 * 80 * 8 * 128 * 2
        ("llama-3.1-405b", Attention.GQA, 516_096),  # 2 * 126 * 8 * 128 * 2
        ("qwen2.5-7b", Attention.GQA, 57_344),  # 2 * 28 * 4 * 128 * 2
        ("mixtral-8x7b", Attention.GQA, 131_072),  # 2 * 32 * 8 * 128 * 2
        ("deepseek-v3", Attention.MLA, 70_272),  # 61 * (512 + 64) * 2
        ("deepseek-v2-lite", Attention.MLA, 31_104),  # 27 * (512 + 64) * 2
        ("tiny-llama", Attention.GQA, 2_048),  # 2 * 4 * 2 * 64 * 2
    ],
)
def test_bytes_per_token_of_real_configs(preset, attention, bytes_per_token):
    geometry = load_geometry(preset)
    assert geometry.attention is attention
    assert geometry.dtype is DType.BF16
    assert geometry.bytes_per_token == bytes_per_token


def test_mla_geometry_is_one_latent_head():
    geometry = load_geometry("deepseek-v3")
    assert (geometry.num_kv_heads, geometry.head_dim) == (1, 576)
    assert (geometry.kv_lora_rank, geometry.qk_rope_head_dim) == (512, 64)
    assert geometry.num_attention_heads == 128


def test_attention_kind_follows_kv_head_count():
    assert geometry_from_config(llama_config(num_key_value_heads=None)).attention is Attention.MHA
    assert geometry_from_config(llama_config(num_key_value_heads=8)).attention is Attention.MHA
    assert geometry_from_config(llama_config(num_key_value_heads=1)).attention is Attention.MQA
    assert geometry_from_config(llama_config(num_key_value_heads=4)).attention is Attention.GQA


def test_head_dim_explicit_or_from_hidden_size():
    assert geometry_from_config(llama_config()).head_dim == 64
    assert geometry_from_config(llama_config(head_dim=128)).head_dim == 128
    assert geometry_from_config(llama_config(head_dim=None)).head_dim == 64


def test_dtype_scales_bytes_per_token():
    bf16 = load_geometry("llama-3-70b")
    assert bf16.with_dtype(DType.FP8).bytes_per_token == 163_840
    assert bf16.with_dtype(DType.FP32).bytes_per_token == 655_360
    assert load_geometry("deepseek-v3", dtype="fp8").bytes_per_token == 35_136


def test_dtype_argument_wins_over_config_then_config_then_bf16():
    assert geometry_from_config(llama_config(), dtype="fp32").dtype is DType.FP32
    assert geometry_from_config(llama_config(), dtype=DType.FP8).dtype is DType.FP8
    assert geometry_from_config(llama_config(torch_dtype="float16")).dtype is DType.FP16
    new_style = llama_config(torch_dtype=None, dtype="float32")
    assert geometry_from_config(new_style).dtype is DType.FP32
    assert geometry_from_config(llama_config(torch_dtype=None)).dtype is DType.BF16


def test_nested_text_config_is_followed():
    text = llama_config(torch_dtype=None)
    wrapper = {"model_type": "llava", "torch_dtype": "float16", "text_config": text}
    geometry = geometry_from_config(wrapper, name="vlm")
    assert geometry.num_layers == 6
    assert geometry.dtype is DType.FP16  # taken from the wrapper's top level
    assert geometry.bytes_per_token == geometry_from_config(text, dtype="fp16").bytes_per_token


def test_layer_count_aliases():
    config = llama_config(num_hidden_layers=None, n_layer=3)
    assert geometry_from_config(config).num_layers == 3


# --- tensor parallelism ---------------------------------------------------------------------------


def test_tp_splits_kv_heads():
    geometry = load_geometry("llama-3-70b")
    assert geometry.bytes_per_token_per_gpu() == 327_680
    assert geometry.bytes_per_token_per_gpu(2) == 163_840
    assert geometry.bytes_per_token_per_gpu(8) == 40_960


def test_tp_beyond_kv_heads_replicates_one_head_per_rank():
    geometry = load_geometry("llama-3-70b")
    assert geometry.bytes_per_token_per_gpu(16) == 40_960
    assert geometry.bytes_per_token_per_gpu(64) == 40_960


def test_mla_latent_is_replicated_on_every_rank():
    geometry = load_geometry("deepseek-v3")
    assert geometry.bytes_per_token_per_gpu(8) == 70_272
    assert geometry.bytes_per_token_per_gpu(16) == 70_272


@pytest.mark.parametrize("tp", [3, 12, 0, -1])
def test_tp_that_does_not_fit_the_kv_heads_is_rejected(tp):
    with pytest.raises(GeometryError, match="'tp'"):
        load_geometry("llama-3-70b").bytes_per_token_per_gpu(tp)


def test_block_and_context_bytes():
    geometry = load_geometry("llama-3-70b")
    assert geometry.bytes_per_block(256) == 256 * 327_680
    assert geometry.bytes_per_block(16, tp=8) == 16 * 40_960
    assert geometry.kv_bytes(0) == 0
    assert geometry.kv_bytes(1000, tp=8) == 40_960_000
    with pytest.raises(GeometryError, match="'block_tokens'"):
        geometry.bytes_per_block(0)
    with pytest.raises(GeometryError, match="'tokens'"):
        geometry.kv_bytes(-1)


# --- parameter counts -----------------------------------------------------------------------------


def test_tiny_llama_param_count_exactly():
    embeddings = 2 * 4096 * 256  # untied embedding + LM head
    attention = 256 * 256 * 2 + 256 * 128 * 2  # q, o: 4 heads * 64; k, v: 2 heads * 64
    mlp = 3 * 256 * 512
    norms = 2 * 256
    expected = embeddings + 4 * (attention + mlp + norms) + 256
    geometry = load_geometry("tiny-llama")
    assert geometry.total_params == geometry.active_params == expected


def test_tied_embeddings_count_once():
    untied = geometry_from_config(llama_config())
    tied = geometry_from_config(llama_config(tie_word_embeddings=True))
    assert untied.total_params - tied.total_params == 1000 * 512


@pytest.mark.parametrize(
    ("preset", "published_total", "published_active", "active_rel_tol"),
    [
        ("llama-3-8b", 8.03e9, 8.03e9, 0.01),
        ("llama-3-70b", 70.6e9, 70.6e9, 0.01),
        ("llama-3.1-405b", 405e9, 405e9, 0.01),
        ("qwen2.5-7b", 7.61e9, 7.61e9, 0.01),
        ("mixtral-8x7b", 46.7e9, 12.9e9, 0.01),
        # DeepSeek's 671B is the main model without the 14B multi-token-prediction module
        # (685B with it), as is our count, so 1% holds for the total. "37B activated" is a
        # rounded figure that does not say whether the embedding counts: 5%.
        ("deepseek-v3", 671e9, 37e9, 0.05),
        # "2.4B activated" seems to leave out the token embedding (0.21B) that our active count
        # keeps (2.66B), so only the total is compared.
        ("deepseek-v2-lite", 15.7e9, None, None),
    ],
)
def test_param_counts_match_published_figures(
    preset, published_total, published_active, active_rel_tol
):
    geometry = load_geometry(preset)
    assert geometry.total_params == pytest.approx(published_total, rel=0.01)
    if published_active is not None:
        assert geometry.active_params == pytest.approx(published_active, rel=active_rel_tol)


def test_moe_active_counts_shared_and_top_k_experts():
    _, config = load_config("deepseek-v3")
    base = geometry_from_config(config)
    one_more = geometry_from_config({**config, "num_experts_per_tok": 9})
    expert = 3 * 7168 * 2048
    moe_layers = 61 - 3
    assert one_more.active_params - base.active_params == moe_layers * expert
    assert one_more.total_params == base.total_params


def test_deepseek_moe_layer_placement():
    _, config = load_config("deepseek-v3")
    every_layer = geometry_from_config(config)
    every_other = geometry_from_config({**config, "moe_layer_freq": 2})
    # Layers 3..60 route when moe_layer_freq is 1; with 2 only the even ones (29) do and the
    # odd ones (29) become dense MLPs of width intermediate_size.
    moe_block = 7168 * 256 + (256 + 1) * 3 * 7168 * 2048
    dense_mlp = 3 * 7168 * 18432
    assert every_layer.total_params - every_other.total_params == 29 * (moe_block - dense_mlp)


def test_weight_bytes():
    geometry = load_geometry("llama-3-8b")
    assert geometry.weight_bytes() == 2 * geometry.total_params
    assert geometry.weight_bytes(DType.FP8) == geometry.total_params
    unset = dataclasses.replace(geometry, weight_dtype=None, dtype=DType.FP32)
    assert unset.effective_weight_dtype is DType.FP32  # no weight dtype: weights as the KV
    assert unset.weight_bytes() == 4 * geometry.total_params


# --- rejected configs -----------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["num_hidden_layers", "num_attention_heads", "hidden_size"])
def test_missing_required_field_is_named(field):
    with pytest.raises(GeometryError, match=f"'{field}' is missing"):
        geometry_from_config(llama_config(**{field: None}))


@pytest.mark.parametrize("field", ["vocab_size", "intermediate_size"])
def test_a_missing_weight_field_is_named_not_fatal(field):
    # KV never depends on the weight fields: the count leaves that part out and says so.
    full = geometry_from_config(llama_config())
    partial = geometry_from_config(llama_config(**{field: None}))
    assert partial.uncounted_params == (field,)
    assert partial.bytes_per_token == full.bytes_per_token
    assert 0 < partial.total_params < full.total_params
    assert full.uncounted_params == ()


@pytest.mark.parametrize("field", ["qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"])
def test_missing_mla_field_is_named(field):
    _, config = load_config("deepseek-v3")
    del config[field]
    with pytest.raises(GeometryError, match=f"'{field}' is missing"):
        geometry_from_config(config)


@pytest.mark.parametrize("value", [-3, 0, True, 2.5, "32"])
def test_non_positive_or_non_integer_field_is_named(value):
    with pytest.raises(GeometryError, match="'num_hidden_layers' must be a positive integer"):
        geometry_from_config(llama_config(num_hidden_layers=value))


def test_hidden_size_not_divisible_by_heads():
    with pytest.raises(GeometryError, match="'hidden_size'.*not divisible"):
        geometry_from_config(llama_config(hidden_size=500))


def test_kv_heads_that_do_not_group_the_query_heads():
    with pytest.raises(GeometryError, match="'num_key_value_heads'"):
        geometry_from_config(llama_config(num_key_value_heads=3))
    with pytest.raises(GeometryError, match="'num_key_value_heads'"):
        geometry_from_config(llama_config(num_key_value_heads=16))


def test_unknown_dtype_names_value_and_allowed_ones():
    with pytest.raises(GeometryError, match="'int4'.*allowed: .*bf16"):
        geometry_from_config(llama_config(), dtype="int4")
    with pytest.raises(GeometryError, match="'torch_dtype'.*'int4'"):
        geometry_from_config(llama_config(torch_dtype="int4"))


def test_a_pure_recurrent_model_is_refused():
    config = {"model_type": "mamba", "hidden_size": 768, "num_hidden_layers": 24, "vocab_size": 50280}
    with pytest.raises(GeometryError, match="'model_type' is 'mamba', a recurrent architecture without attention"):
        geometry_from_config(config)


def test_a_hybrid_model_is_sized_by_its_groups():
    # JambaConfig's defaults fill the Mamba fields: attention where layer % 8 == 4 (layer 4 of 6),
    # Mamba on the other five, each a conv state of (2 * 512) x 4 bf16 and an SSM state of
    # (2 * 512) x 16 fp32: 8,192 + 65,536 = 73,728 bytes.
    geometry = geometry_from_config(llama_config(model_type="jamba"))
    state, full = geometry.groups
    assert (state.kind, state.layers, state.state_bytes) == (GroupKind.STATE, (0, 1, 2, 3, 5), 73_728)
    assert (full.kind, full.layers) == (GroupKind.FULL, (4,))
    assert geometry.bytes_per_token == 2 * 1 * 2 * 64 * 2
    assert geometry.state_bytes() == 5 * 73_728
    assert geometry.kv_bytes(1000) == 1000 * 512 + 5 * 73_728


@pytest.mark.parametrize(
    ("overrides", "full_layers", "windowed", "span"),
    [
        # Every layer sliding (transformers' cache: a sliding_window and no layer_types).
        ({"sliding_window": 4096}, 0, (GroupKind.SLIDING, 6), 4096),
        ({"layer_types": ["sliding_attention", "full_attention"] * 3, "sliding_window": 1024}, 3,
         (GroupKind.SLIDING, 3), 1024),
        # GPT-Neo's attention_types; its window_size defaults to 256.
        ({"attention_types": [[["global", "local"], 3]]}, 3, (GroupKind.SLIDING, 3), 256),
        ({"attention_chunk_size": 8192}, 0, (GroupKind.CHUNKED, 6), 8192),
    ],
)
def test_windowed_attention_is_sized(overrides, full_layers, windowed, span):
    geometry = geometry_from_config(llama_config(**overrides))
    layer = 2 * 2 * 64 * 2  # K and V of 2 heads x 64, bf16: 512 bytes per token per layer
    kind, layers = windowed
    (group,) = [group for group in geometry.groups if group.kind is kind]
    assert (group.num_layers, group.span) == (layers, span)
    assert geometry.bytes_per_token == full_layers * layer
    tokens = 10_000
    assert geometry.kv_bytes(tokens) == tokens * full_layers * layer + span * layers * layer
    assert geometry.kv_bytes(100) == 100 * 6 * layer  # inside every window: every layer keeps every token


def test_switched_off_window_and_all_full_layers_are_accepted():
    config = llama_config(
        sliding_window=131072, use_sliding_window=False, layer_types=["full_attention"] * 6
    )
    assert geometry_from_config(config).bytes_per_token == 2 * 6 * 2 * 64 * 2


def test_qwen_style_moe_is_counted():
    # num_experts (Qwen2/3-MoE): every layer routes among experts of moe_intermediate_size
    # (else intermediate_size); the KV is the dense model's.
    dense = geometry_from_config(llama_config())
    moe = geometry_from_config(llama_config(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=256))
    expert = 3 * 512 * 256
    dense_mlp = 3 * 512 * 1024
    assert moe.bytes_per_token == dense.bytes_per_token
    assert moe.total_params - dense.total_params == 6 * (512 * 60 + 60 * expert - dense_mlp)
    assert moe.total_params - moe.active_params == 6 * 56 * expert


def test_more_experts_per_token_than_experts_is_rejected():
    _, config = load_config("mixtral-8x7b")
    with pytest.raises(GeometryError, match="'num_experts_per_tok'"):
        geometry_from_config({**config, "num_experts_per_tok": 9})


# --- the shape alone -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset", ["llama-3-8b", "qwen2.5-7b", "mixtral-8x7b", "deepseek-v3", "deepseek-v2-lite", "tiny-llama"]
)
def test_the_shape_is_the_geometrys(preset):
    _, config = load_config(preset)
    shape, geometry = kv_shape_from_config(config), geometry_from_config(config)
    assert (shape.attention, shape.num_layers, shape.num_kv_heads, shape.head_dim) == (
        geometry.attention, geometry.num_layers, geometry.num_kv_heads, geometry.head_dim
    )
    assert (shape.kv_lora_rank, shape.qk_rope_head_dim) == (geometry.kv_lora_rank, geometry.qk_rope_head_dim)


@pytest.mark.parametrize(
    "overrides",
    [
        {"sliding_window": 4096},
        {"layer_types": ["sliding_attention", "full_attention"] * 3},
        {"attention_types": [[["global", "local"], 3]]},
        {"attention_chunk_size": 8192},
        {"num_experts": 60, "num_experts_per_tok": 4},
    ],
)
def test_the_shape_is_read_where_layers_keep_fewer_tokens(overrides):
    shape = kv_shape_from_config(llama_config(**overrides))
    assert (shape.attention, shape.num_layers, shape.num_kv_heads, shape.head_dim) == (Attention.GQA, 6, 2, 64)


def test_the_shape_of_a_recurrent_model_or_a_bad_field_is_refused():
    with pytest.raises(GeometryError, match="'model_type'"):
        kv_shape_from_config(llama_config(model_type="jamba"))
    with pytest.raises(GeometryError, match="'layer_types'.*linear_attention"):
        kv_shape_from_config(llama_config(layer_types=["linear_attention", "full_attention"] * 3))
    with pytest.raises(GeometryError, match="'num_key_value_heads'"):
        kv_shape_from_config(llama_config(num_key_value_heads=3))
    with pytest.raises(GeometryError, match="JSON object"):
        kv_shape_from_config(["not", "a", "config"])


def test_geometry_validates_its_own_fields():
    geometry = load_geometry("llama-3-8b")
    with pytest.raises(GeometryError, match="'num_layers' must be a positive integer, got -3"):
        dataclasses.replace(geometry, num_layers=-3)
    with pytest.raises(GeometryError, match="'attention'"):
        dataclasses.replace(geometry, attention=Attention.MHA)
    with pytest.raises(GeometryError, match="'active_params'"):
        dataclasses.replace(geometry, active_params=geometry.total_params + 1)
    with pytest.raises(GeometryError, match="'kv_lora_rank'"):
        dataclasses.replace(geometry, kv_lora_rank=512)
    mla = load_geometry("deepseek-v3")
    with pytest.raises(GeometryError, match="'head_dim'"):
        dataclasses.replace(mla, head_dim=512)


@pytest.mark.parametrize(
    ("text", "dtype"),
    [
        ("bf16", DType.BF16),
        ("bfloat16", DType.BF16),
        ("torch.bfloat16", DType.BF16),
        ("fp16", DType.FP16),
        ("float16", DType.FP16),
        ("half", DType.FP16),
        ("FP32", DType.FP32),
        ("float32", DType.FP32),
        ("float", DType.FP32),
        ("fp8", DType.FP8),
        ("float8_e4m3fn", DType.FP8),
        ("float8_e5m2", DType.FP8),
    ],
)
def test_dtype_parse(text, dtype):
    assert DType.parse(text) is dtype


def test_dtype_sizes():
    assert [d.size_bytes for d in (DType.FP32, DType.BF16, DType.FP16, DType.FP8)] == [4, 2, 2, 1]


# --- properties -----------------------------------------------------------------------------------


def make_geometry(layers, kv_heads, head_dim, dtype, group=1):
    heads = kv_heads * group
    return KVGeometry(
        name="prop",
        attention=attention_for_heads(heads, kv_heads, "kv"),
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        total_params=1,
        active_params=1,
        num_attention_heads=heads,
    )


shapes = st.tuples(
    st.integers(1, 200),  # layers
    st.integers(1, 64),  # kv heads
    st.integers(1, 512),  # head dim
    st.sampled_from(list(DType)),
    st.integers(1, 8),  # query heads per KV head
)


@given(shapes, st.integers(1, 8))
def test_bytes_per_token_is_linear_in_layers_and_kv_heads(shape, factor):
    layers, kv_heads, head_dim, dtype, group = shape
    base = make_geometry(layers, kv_heads, head_dim, dtype, group).bytes_per_token
    more_layers = make_geometry(layers * factor, kv_heads, head_dim, dtype, group)
    more_heads = make_geometry(layers, kv_heads * factor, head_dim, dtype, group)
    assert more_layers.bytes_per_token == factor * base
    assert more_heads.bytes_per_token == factor * base


@given(shapes, st.integers(0, 10**6), st.integers(0, 10**6))
def test_kv_bytes_is_tokens_times_bytes_per_token_and_monotone(shape, tokens_a, tokens_b):
    geometry = make_geometry(*shape)
    assert geometry.kv_bytes(tokens_a) == tokens_a * geometry.bytes_per_token
    low, high = sorted((tokens_a, tokens_b))
    assert geometry.kv_bytes(low) <= geometry.kv_bytes(high)


@given(shapes, st.integers(0, 6))
def test_tp_shards_sum_to_the_whole_when_tp_divides_kv_heads(shape, log2_tp):
    layers, _, head_dim, dtype, group = shape
    tp = 2**log2_tp
    geometry = make_geometry(layers, tp * 2, head_dim, dtype, group)
    assert tp * geometry.bytes_per_token_per_gpu(tp) == geometry.bytes_per_token
