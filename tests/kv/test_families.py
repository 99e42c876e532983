"""The per-family rules against transformers 5.19's own config classes and caches.

For each family a transformers config is built with various values; its layer kinds are what
transformers' cache makes of it (``cache_utils.get_layer_types_and_kwargs``, legacy names
remapped), and the KV groups kvstrata reads from the same config, as a plain dict, must put
every layer in the group of that kind, with the window or chunk transformers passes. State
sizes are compared to the tensors a tiny model's cache holds after a forward pass, parameter
counts to the model transformers builds (on the meta device).
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from transformers.cache_utils import get_layer_types_and_kwargs  # noqa: E402
from transformers.configuration_utils import remap_legacy_layer_types  # noqa: E402

from kvstrata.kv import DType, GeometryError, geometry_from_config, load_config  # noqa: E402
from kvstrata.kv.groups import GroupKind  # noqa: E402

C = transformers
SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128, intermediate_size=128)

# transformers' layer kind -> the KV groups a layer of that kind is in.
GROUPS_OF_KIND = {
    "full_attention": {GroupKind.FULL},
    "sliding_attention": {GroupKind.SLIDING},
    "chunked_attention": {GroupKind.CHUNKED},
    "linear_attention": {GroupKind.STATE},
    "conv": {GroupKind.STATE},
    "hybrid": {GroupKind.FULL, GroupKind.STATE},
    "moe": set(),
    "mlp": set(),
}


def configs():
    """(id, transformers config) pairs: each family with defaults left to its class and with values set."""
    mamba2 = dict(mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2)
    return [
        ("gemma2", C.Gemma2Config(num_hidden_layers=5, head_dim=16, sliding_window=32, **SMALL)),
        ("gemma2-explicit", C.Gemma2Config(num_hidden_layers=4, head_dim=16, sliding_window=32,
                                           layer_types=["full_attention"] * 3 + ["sliding_attention"], **SMALL)),
        ("gemma3-pattern-4", C.Gemma3TextConfig(num_hidden_layers=13, head_dim=16, sliding_window=32,
                                                sliding_window_pattern=4, **SMALL)),
        ("gemma3-defaults", C.Gemma3TextConfig(num_hidden_layers=13, head_dim=16, **SMALL)),
        ("gemma3-bidirectional", C.Gemma3TextConfig(num_hidden_layers=7, head_dim=16, sliding_window=64,
                                                    use_bidirectional_attention=True, **SMALL)),
        ("gemma3-multimodal", C.Gemma3Config(text_config=dict(num_hidden_layers=8, head_dim=16, sliding_window=48,
                                                              **SMALL))),
        ("gpt_oss", C.GptOssConfig(num_hidden_layers=5, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                   sliding_window=16, **SMALL)),
        ("cohere2", C.Cohere2Config(num_hidden_layers=9, sliding_window=64, **SMALL)),
        ("cohere2-pattern-3", C.Cohere2Config(num_hidden_layers=7, sliding_window=64, sliding_window_pattern=3,
                                              **SMALL)),
        ("llama4-text", C.Llama4TextConfig(num_hidden_layers=9, head_dim=16, attention_chunk_size=64,
                                           num_local_experts=4, interleave_moe_layer_step=2,
                                           intermediate_size_mlp=96, **SMALL)),
        ("llama4-no-rope-interval-3", C.Llama4TextConfig(num_hidden_layers=7, head_dim=16, no_rope_layer_interval=3,
                                                         num_local_experts=2, **SMALL)),
        ("llama4-no-rope-list", C.Llama4TextConfig(num_hidden_layers=4, head_dim=16, no_rope_layers=[0, 1, 1, 0],
                                                   num_local_experts=2, **SMALL)),
        ("qwen3_next", C.Qwen3NextConfig(num_hidden_layers=8, head_dim=16, linear_key_head_dim=8,
                                         linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4,
                                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=32, **SMALL)),
        ("qwen3_next-interval-3", C.Qwen3NextConfig(num_hidden_layers=6, head_dim=16, full_attention_interval=3,
                                                    linear_key_head_dim=8, linear_value_head_dim=8,
                                                    linear_num_key_heads=2, linear_num_value_heads=2,
                                                    num_experts=2, num_experts_per_tok=1, **SMALL)),
        ("jamba", C.JambaConfig(num_hidden_layers=8, attn_layer_period=4, attn_layer_offset=2, num_experts=4,
                                mamba_d_state=8, **SMALL)),
        ("jamba-defaults", C.JambaConfig(num_hidden_layers=16, num_experts=2, mamba_d_state=8, **SMALL)),
        ("nemotron_h-pattern", C.NemotronHConfig(hybrid_override_pattern="M*-MEM*E", mamba_num_heads=8,
                                                 mamba_head_dim=16, n_groups=2, ssm_state_size=16, head_dim=16,
                                                 n_routed_experts=4, moe_intermediate_size=32,
                                                 moe_shared_expert_intermediate_size=48, **SMALL)),
        ("nemotron_h-list", C.NemotronHConfig(layers_block_type=["mamba", "attention", "mlp", "mamba"],
                                              mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
                                              head_dim=16, **SMALL)),
        ("falcon_h1", C.FalconH1Config(num_hidden_layers=3, mamba_d_ssm=128, **mamba2, **SMALL)),
        ("granitemoehybrid", C.GraniteMoeHybridConfig(num_hidden_layers=4,
                                                      layer_types=["mamba", "attention", "mamba", "mamba"],
                                                      num_local_experts=4, shared_intermediate_size=64,
                                                      **mamba2, **SMALL)),
        ("granitemoehybrid-dense", C.GraniteMoeHybridConfig(num_hidden_layers=3,
                                                            layer_types=["attention", "mamba", "attention"],
                                                            num_local_experts=0, shared_intermediate_size=64,
                                                            **mamba2, **SMALL)),
        ("bamba", C.BambaConfig(num_hidden_layers=5, attn_layer_indices=[1, 3], **mamba2, **SMALL)),
        ("mistral", C.MistralConfig(num_hidden_layers=3, sliding_window=64, **SMALL)),
        ("mistral-no-window", C.MistralConfig(num_hidden_layers=3, sliding_window=None, **SMALL)),
        ("mixtral", C.MixtralConfig(num_hidden_layers=2, num_local_experts=4, **SMALL)),
        ("qwen2-window", C.Qwen2Config(num_hidden_layers=6, use_sliding_window=True, sliding_window=64,
                                       max_window_layers=2, **SMALL)),
        ("qwen2-window-off", C.Qwen2Config(num_hidden_layers=6, sliding_window=64, **SMALL)),
        ("qwen3-window", C.Qwen3Config(num_hidden_layers=4, head_dim=16, use_sliding_window=True, sliding_window=32,
                                       max_window_layers=3, **SMALL)),
        ("qwen2_moe-window", C.Qwen2MoeConfig(num_hidden_layers=6, use_sliding_window=True, sliding_window=64,
                                              max_window_layers=4, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32, shared_expert_intermediate_size=48, **SMALL)),
        ("qwen3_moe", C.Qwen3MoeConfig(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[0], **SMALL)),
        ("qwen3_moe-window", C.Qwen3MoeConfig(num_hidden_layers=3, use_sliding_window=True, sliding_window=64,
                                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              **SMALL)),
        ("lfm2", C.Lfm2Config(num_hidden_layers=4, full_attn_idxs=[1, 3], **SMALL)),
        ("llama", C.LlamaConfig(num_hidden_layers=3, **SMALL)),
    ]


CONFIGS = configs()


def transformers_layers(config):
    """What transformers' cache makes of ``config``: each layer's kind and the window it passes."""
    text = config.get_text_config(decoder=True)
    kinds, kwargs = get_layer_types_and_kwargs(text)
    return remap_legacy_layer_types(list(kinds)), [kw.get("sliding_window") for kw in kwargs]


def our_layers(geometry):
    kinds = [set() for _ in range(geometry.num_layers)]
    spans = [None] * geometry.num_layers
    for group in geometry.groups:
        for layer in group.layers:
            kinds[layer].add(group.kind)
            if group.span is not None:
                spans[layer] = group.span
    return kinds, spans


@pytest.mark.parametrize("as_saved", [False, True], ids=["to_dict", "config.json"])
@pytest.mark.parametrize(("family", "config"), CONFIGS, ids=[name for name, _ in CONFIGS])
def test_layer_kinds_and_windows_agree_with_transformers(family, config, as_saved):
    # config.json holds what save_pretrained writes: the fields that differ from the defaults.
    data = config.to_diff_dict() if as_saved else config.to_dict()
    geometry = geometry_from_config(data)
    kinds, windows = transformers_layers(config)
    ours, spans = our_layers(geometry)
    assert len(ours) == len(kinds)
    assert ours == [GROUPS_OF_KIND[kind] for kind in kinds]
    for layer, kind in enumerate(kinds):
        if kind in ("sliding_attention", "chunked_attention"):
            assert spans[layer] == windows[layer], f"layer {layer}"


@pytest.mark.parametrize(("family", "config"), CONFIGS, ids=[name for name, _ in CONFIGS])
def test_param_counts_agree_with_the_model_transformers_builds(family, config):
    # Left out on purpose (kvstrata.kv.params): linear biases, attention sinks, q/k norms. At these
    # tiny widths they are up to 1.3% of the model (gpt-oss' expert biases); at real widths < 0.1%.
    geometry = geometry_from_config(config.to_dict())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    hf = sum(p.numel() for name, p in model.named_parameters()
             if not any(part in name for part in ("vision", "multi_modal_projector")))
    assert geometry.total_params == pytest.approx(hf, rel=0.015)
    assert geometry.uncounted_params == (("vision_config",) if family == "gemma3-multimodal" else ())


# --- state sizes, against a tiny model's cache -----------------------------------------------------


STATE_MODELS = {
    "jamba": C.JambaConfig(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, num_experts=2,
                           mamba_d_state=8, mamba_d_conv=3, mamba_expand=2, **SMALL),
    "bamba": C.BambaConfig(num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=8, mamba_n_groups=2,
                           mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, **SMALL),
    "nemotron_h": C.NemotronHConfig(hybrid_override_pattern="M*-M", mamba_num_heads=8, mamba_head_dim=16,
                                    n_groups=2, ssm_state_size=16, conv_kernel=4, expand=2, head_dim=16, **SMALL),
    "falcon_h1": C.FalconH1Config(num_hidden_layers=2, mamba_d_ssm=96, mamba_n_heads=8, mamba_n_groups=2,
                                  mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, **SMALL),
    "granitemoehybrid": C.GraniteMoeHybridConfig(num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
                                                 mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
                                                 mamba_expand=2, num_local_experts=2, shared_intermediate_size=64,
                                                 **SMALL),
    "qwen3_next": C.Qwen3NextConfig(num_hidden_layers=4, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                                    linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4,
                                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=32, **SMALL),
    "lfm2": C.Lfm2Config(num_hidden_layers=3, full_attn_idxs=[1], conv_L_cache=3, **SMALL),
}


def cache_after_forward(config, dtype, tokens=7):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        return model(torch.randint(0, 100, (1, tokens)), use_cache=True).past_key_values


def cached_bytes(layer):
    """(K and V bytes per token, state bytes) one cache layer holds for one sequence."""
    per_token = state = 0
    keys = getattr(layer, "keys", None)
    if isinstance(keys, torch.Tensor) and keys.numel():
        per_token = 2 * keys[0, :, 0].numel() * keys.element_size()
    for name in ("conv_states", "recurrent_states"):
        for tensor in (getattr(layer, name, None) or {}).values():
            if tensor is not None:
                state += tensor[0].numel() * tensor.element_size()
    return per_token, state


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("family", sorted(STATE_MODELS))
def test_state_and_kv_bytes_are_what_the_cache_holds(family, dtype):
    config = STATE_MODELS[family]
    data = config.to_dict()
    data["dtype"] = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    geometry = geometry_from_config(data)
    cache = cache_after_forward(config, dtype)
    expected = [[0, 0] for _ in range(geometry.num_layers)]
    for group in geometry.groups:
        for layer in group.layers:
            expected[layer][0] += group.token_bytes() // group.num_layers
            expected[layer][1] += group.state_bytes_per_gpu() // group.num_layers
    assert [list(cached_bytes(layer)) for layer in cache.layers] == expected


def test_a_state_keeps_its_dtypes_under_a_kv_dtype_override():
    config = {**STATE_MODELS["qwen3_next"].to_dict(), "dtype": "bfloat16"}
    bf16, fp8 = geometry_from_config(config), geometry_from_config(config, dtype="fp8")
    assert fp8.state_bytes() == bf16.state_bytes()
    assert fp8.bytes_per_token == bf16.bytes_per_token // 2
    (state,) = [group for group in fp8.groups if group.kind is GroupKind.STATE]
    assert state.dtype is DType.FP32  # the delta-rule state; its conv state is in the model's bf16


# --- what is refused, in one line naming the field --------------------------------------------------


def llama(**overrides):
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 4, "vocab_size": 128, "intermediate_size": 128}
    config.update(overrides)
    return {key: value for key, value in config.items() if value is not None}


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (llama(layer_types=["full_attention", "foo", "full_attention", "bar"]),
         r"config field 'layer_types' declares \['bar', 'foo'\], which is not modelled"),
        # DeepSeek-V3.2's config.json: V3's fields, its model type and the indexer's (no layer_types).
        ({**load_config("deepseek-v3")[1], "model_type": "deepseek_v32", "index_topk": 2048, "index_head_dim": 128,
          "index_n_heads": 64},
         r"config field 'model_type' \('deepseek_v32'\) gives its layers the kind \['indexed_attention'\]"),
        (C.DeepseekV32Config(num_hidden_layers=2).to_diff_dict(), r"'layer_types' declares \['indexed_attention'\]"),
        (llama(layer_types=["deepseek_sparse_attention"] * 4), r"'layer_types' declares \['indexed_attention'\]"),
        (llama(layer_types=["full_attention"] * 3), r"'layer_types' lists 3 layers, but the model has 4"),
        (llama(layer_types=["sliding_attention"] * 4), r"config field 'sliding_window' .* must be a positive integer"),
        (llama(layer_types=["chunked_attention"] * 4), r"config field 'attention_chunk_size'"),
        (llama(model_type="nemotron_h", hybrid_override_pattern="M*X-"), r"'hybrid_override_pattern' holds \['X'\]"),
        (llama(model_type="granitemoehybrid", mamba_n_heads=8), r"'model_type' gives the model no attention layer"),
        (llama(layer_types=["linear_attention"] * 2 + ["full_attention"] * 2),
         r"config field 'model_type' \('llama'\) has 'linear_attention' layers whose state is not modelled"),
        ({"model_type": "mamba", "hidden_size": 768, "num_hidden_layers": 24, "vocab_size": 50280},
         r"config field 'model_type' is 'mamba', a recurrent architecture without attention layers"),
        (llama(model_type="zamba2"), r"config field 'model_type' is 'zamba2', a hybrid"),
        (llama(model_type="qwen3_next", linear_num_value_heads=3, linear_num_key_heads=2),
         r"'linear_num_value_heads' \(3\) must be a multiple of 'linear_num_key_heads' \(2\)"),
    ],
    ids=["unknown-kind", "deepseek-v32", "deepseek-v32-saved", "legacy-sparse", "length", "no-window", "no-chunk", "pattern",
         "no-attention", "unknown-state", "pure-mamba", "zamba2", "gdn-heads"],
)
def test_what_is_not_modelled_is_refused_in_one_line_naming_the_field(config, says):
    with pytest.raises(GeometryError, match=says) as info:
        geometry_from_config(config)
    assert "\n" not in str(info.value)


def test_a_missing_state_field_is_named():
    config = STATE_MODELS["bamba"].to_dict()
    config["mamba_n_heads"] = None  # explicitly null: the class default does not apply
    with pytest.raises(GeometryError, match="config field 'mamba_n_heads' must be a positive integer, got None"):
        geometry_from_config(config)
