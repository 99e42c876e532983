"""Loading model configs from files, directories and built-in presets."""

from __future__ import annotations

import json

import pytest

from kvstrata.kv import DType, GeometryError, list_presets, load_config, load_geometry
from kvstrata.kv.groups import GroupKind
from tests.config_support import TINY_LLAMA

PRESETS = {
    "deepseek-v2-lite",
    "deepseek-v3",
    "gemma-3-27b",
    "gpt-oss-120b",
    "jamba-1.5-mini",
    "qwen3-next-80b-a3b",
    "llama-3-8b",
    "llama-3-70b",
    "llama-3.1-405b",
    "llama-3.2-1b",
    "mixtral-8x7b",
    "qwen2.5-0.5b",
    "qwen2.5-1.5b",
    "qwen2.5-7b",
    "qwen3-0.6b",
    "tiny-llama",
}

TINY = {**TINY_LLAMA, "torch_dtype": "bfloat16"}


def test_list_presets_is_sorted_and_complete():
    names = list_presets()
    assert names == sorted(names)
    assert set(names) == PRESETS


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_a_hugging_face_config_that_sizes(name):
    loaded_name, config = load_config(name)
    assert loaded_name == name
    assert config["architectures"] and config["model_type"]
    assert load_geometry(name).name == name


def test_tiny_llama_preset_matches_the_tiny_model_spec():
    _, config = load_config("tiny-llama")
    assert {key: config[key] for key in TINY} == TINY


def test_config_file_directory_and_other_file_names(tmp_path):
    model_dir = tmp_path / "My-Model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "other.json").write_text(json.dumps(TINY))
    assert load_config(str(model_dir / "config.json")) == ("My-Model", TINY)
    assert load_config(str(model_dir)) == ("My-Model", TINY)
    assert load_config(str(tmp_path / "other.json")) == ("other", TINY)


def test_load_geometry_from_a_path_with_dtype_override(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    geometry = load_geometry(str(path), dtype="fp8")
    assert geometry.dtype is DType.FP8
    assert geometry.bytes_per_token == 2 * 4 * 2 * 64 * 1


def test_invalid_json_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"hidden_size": 256,')
    with pytest.raises(GeometryError, match="broken.json is not valid JSON"):
        load_config(str(path))


def test_json_that_is_not_an_object_is_rejected(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(GeometryError, match="list.json must hold a JSON object"):
        load_config(str(path))


def test_missing_path_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_config(str(tmp_path / "nope.json"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_config(str(tmp_path))


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(GeometryError, match="unknown model 'llama-9'") as excinfo:
        load_config("llama-9")
    assert all(name in str(excinfo.value) for name in PRESETS)


def test_weight_dtype_follows_the_config_not_the_kv_dtype_override():
    # DeepSeek-V3 ships fp8 weights (quantization_config fp8): 1 byte per parameter.
    v3 = load_geometry("deepseek-v3")
    assert v3.effective_weight_dtype is DType.FP8
    assert v3.weight_bytes() == v3.total_params
    # Storing Llama's KV as fp8 halves KV bytes, never the bf16 weights.
    llama = load_geometry("llama-3-70b", "fp8")
    assert llama.bytes_per_token == 163_840
    assert llama.effective_weight_dtype is DType.BF16
    assert llama.weight_bytes() == 2 * llama.total_params


# --- the hybrid presets: KV per group, with the arithmetic from each config ---------------------


def _group(geometry, kind):
    (group,) = [group for group in geometry.groups if group.kind is kind]
    return group


def test_gemma_3_27b():
    # google/gemma-3-27b-it text_config: 62 layers, 16 KV heads x head_dim 128, sliding_window 1024;
    # no sliding_window_pattern, so Gemma3TextConfig's 6: layers 5, 11, ..., 59 full (10), 52 sliding.
    # No max_position_embeddings: the class's 131072. Per token per layer: 2 * 16 * 128 * 2 B = 8,192.
    g = load_geometry("gemma-3-27b")
    full, sliding = _group(g, GroupKind.FULL), _group(g, GroupKind.SLIDING)
    assert full.layers == tuple(range(5, 62, 6))
    assert (sliding.num_layers, sliding.span) == (52, 1024)
    assert g.bytes_per_token == 10 * 8_192 == 81_920  # past every window: the full layers only
    assert g.block_token_bytes() == 62 * 8_192  # a token inside the window: every layer
    assert g.state_bytes() == 0
    assert g.kv_bytes(500) == 500 * 62 * 8_192
    assert g.kv_bytes(131_072) == 131_072 * 81_920 + 1024 * 52 * 8_192 == 11_173_625_856
    assert g.max_context == 131_072
    # The text decoder's 27.0B (vocab_size: the class's 262208, tied); the vision tower is not counted.
    assert g.total_params == pytest.approx(27.0e9, rel=0.01)
    assert g.uncounted_params == ("vision_config",)


def test_gpt_oss_120b():
    # openai/gpt-oss-120b: 36 layers alternating sliding (128 tokens) and full, 8 KV heads x 64:
    # 2 * 8 * 64 * 2 B = 2,048 per token per layer.
    g = load_geometry("gpt-oss-120b")
    full, sliding = _group(g, GroupKind.FULL), _group(g, GroupKind.SLIDING)
    assert full.layers == tuple(range(1, 36, 2)) and sliding.layers == tuple(range(0, 36, 2))
    assert sliding.span == 128
    assert g.bytes_per_token == 18 * 2_048 == 36_864
    assert g.kv_bytes(100_000) == 100_000 * 36_864 + 128 * 18 * 2_048 == 3_691_118_592
    assert g.max_context == 131_072
    # OpenAI's 116.8B total (128 experts in each of 36 layers) and 5.13B active, which leaves out
    # the 0.58B token embedding (our active count keeps it).
    assert g.total_params == pytest.approx(116.8e9, rel=0.01)
    assert g.active_params == pytest.approx(5.13e9 + 201_088 * 2_880, rel=0.01)


def test_qwen3_next_80b_a3b():
    # Qwen/Qwen3-Next-80B-A3B-Instruct: full_attention_interval 4: layers 3, 7, ..., 47 full (12),
    # 2 KV heads x 256: 2 * 2 * 256 * 2 B = 2,048 per token per layer. The 36 gated-delta-net layers
    # keep a state: conv (2 * 16 * 128 + 32 * 128 = 8,192 channels) x kernel 4 in bf16 = 65,536 B,
    # recurrent 32 value heads x 128 x 128 in fp32 = 2,097,152 B: 2,162,688 B per layer.
    g = load_geometry("qwen3-next-80b-a3b")
    full, state = _group(g, GroupKind.FULL), _group(g, GroupKind.STATE)
    assert full.layers == tuple(range(3, 48, 4))
    assert (state.num_layers, state.state_bytes, state.state_heads) == (36, 2_162_688, 16)
    assert g.bytes_per_token == 12 * 2_048 == 24_576
    assert g.state_bytes() == 36 * 2_162_688 == 77_856_768
    assert g.kv_bytes(262_144) == 262_144 * 24_576 + 77_856_768
    assert g.kv_bytes(0) == 0
    assert g.max_context == 262_144
    assert g.total_params == pytest.approx(80e9, rel=0.01)
    assert g.active_params == pytest.approx(3.9e9, rel=0.02)  # "A3B": 3B besides the embeddings


def test_jamba_1_5_mini():
    # ai21labs/AI21-Jamba-1.5-Mini: attention where layer % 8 == 4 (4 of 32 layers), 8 KV heads x 128:
    # 2 * 8 * 128 * 2 B = 4,096 per token per layer. The 28 Mamba layers: intermediate 2 * 4096 = 8,192
    # channels, conv state 8,192 x 4 in bf16 = 65,536 B, SSM state 8,192 x 16 in fp32 = 524,288 B.
    g = load_geometry("jamba-1.5-mini")
    full, state = _group(g, GroupKind.FULL), _group(g, GroupKind.STATE)
    assert full.layers == (4, 12, 20, 28)
    assert (state.num_layers, state.state_bytes) == (28, 589_824)
    assert g.bytes_per_token == 4 * 4_096 == 16_384
    assert g.state_bytes() == 28 * 589_824 == 16_515_072
    assert g.kv_bytes(256_000) == 256_000 * 16_384 + 16_515_072
    assert g.max_context == 262_144
    assert (g.total_params, g.active_params) == (pytest.approx(52e9, rel=0.01), pytest.approx(12e9, rel=0.02))
    # TP 2 halves the KV heads and the Mamba channels alike.
    assert g.kv_bytes(1000, tp=2) * 2 == g.kv_bytes(1000)


@pytest.mark.parametrize("name", ["gemma-3-27b", "gpt-oss-120b", "jamba-1.5-mini", "qwen3-next-80b-a3b"])
def test_hybrid_preset_param_counts_match_the_model_transformers_builds(name):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    _, config = load_config(name)
    hf_config = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "quantization_config"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    decoder = sum(p.numel() for key, p in model.named_parameters()
                  if "vision" not in key and "multi_modal_projector" not in key)
    assert load_geometry(name).total_params == pytest.approx(decoder, rel=0.001)


def test_a_config_that_cannot_be_sized_names_the_file_and_the_field(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, "layer_types": ["full_attention", "foo", "full_attention", "full_attention"]}))
    with pytest.raises(GeometryError) as info:
        load_geometry(str(tmp_path))
    message = str(info.value)
    assert message.startswith(f"{path}: config field 'layer_types' declares ['foo']")
    assert "\n" not in message
