"""Loading model configs from files, directories and built-in presets."""

from __future__ import annotations

import json

import pytest

from kvstrata.kv import DType, GeometryError, list_presets, load_config, load_geometry

PRESETS = {
    "deepseek-v2-lite",
    "deepseek-v3",
    "llama-3-8b",
    "llama-3-70b",
    "llama-3.1-405b",
    "mixtral-8x7b",
    "qwen2.5-7b",
    "tiny-llama",
}

TINY = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
    "torch_dtype": "bfloat16",
}


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
