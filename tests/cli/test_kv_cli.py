"""``kvstrata kv-size`` through the real command-line entry point."""

from __future__ import annotations

import json

import pytest

from kvstrata.cli import main
from tests.config_support import TINY_LLAMA

REQUIRED_KEYS = {
    "model", "attention", "dtype", "tp", "bytes_per_token", "bytes_per_token_per_gpu",
    "block_tokens", "bytes_per_block", "num_layers", "num_kv_heads", "head_dim",
    "total_params", "active_params", "weight_bytes",
    "state_bytes", "state_bytes_per_gpu", "max_context", "hybrid", "uncounted_params", "groups",
}
GROUP_KEYS = {
    "kind", "label", "layers", "num_layers", "kv_heads", "head_dim", "span", "dtype", "bytes_per_token",
    "state_bytes",
}


def run_json(capsys, *argv):
    assert main(["kv-size", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_for_a_preset(capsys):
    report = run_json(capsys, "--model", "llama-3-70b")
    assert REQUIRED_KEYS <= report.keys()
    assert "context_tokens" not in report
    assert report["model"] == "llama-3-70b"
    assert report["attention"] == "gqa"
    assert report["dtype"] == "bf16"
    assert report["bytes_per_token"] == 327_680
    assert report["bytes_per_token_per_gpu"] == 327_680
    assert report["bytes_per_block"] == 256 * 327_680
    assert report["weight_bytes"] == 2 * report["total_params"]
    assert report["state_bytes"] == 0 and report["hybrid"] is False
    assert report["max_context"] == 8192
    (group,) = report["groups"]
    assert GROUP_KEYS <= group.keys() and "context_bytes" not in group
    assert (group["kind"], group["layers"], group["bytes_per_token"]) == ("full", list(range(80)), 327_680)


def test_json_with_tp_dtype_block_and_context(capsys):
    report = run_json(
        capsys, "--model", "llama-3-70b", "--tp", "8", "--dtype", "fp8",
        "--block-tokens", "16", "--context", "1000",
    )
    assert report["tp"] == 8
    assert report["dtype"] == "fp8"
    assert report["bytes_per_token"] == 163_840
    assert report["bytes_per_token_per_gpu"] == 20_480
    assert report["bytes_per_block"] == 16 * 20_480
    assert report["context_tokens"] == 1000
    assert report["context_bytes"] == 1000 * 163_840
    assert report["context_bytes_per_gpu"] == 1000 * 20_480


def test_mla_per_gpu_bytes_do_not_shrink_with_tp(capsys):
    report = run_json(capsys, "--model", "deepseek-v3", "--tp", "8")
    assert report["attention"] == "mla"
    assert report["bytes_per_token"] == report["bytes_per_token_per_gpu"] == 70_272


def test_config_path_in_a_model_directory(tmp_path, capsys):
    model_dir = tmp_path / "tiny"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    report = run_json(capsys, "--model", str(model_dir / "config.json"))
    assert report["model"] == "tiny"
    assert report["bytes_per_token"] == 2 * 4 * 2 * 64 * 2


def test_table_output(capsys):
    assert main(["kv-size", "--model", "llama-3-70b", "--tp", "8", "--context", "8192"]) == 0
    out = capsys.readouterr().out
    assert "llama-3-70b" in out
    assert "327,680" in out
    assert "40,960" in out
    assert "2.68 GB" in out  # 8192 * 327680 bytes (its whole context), decimal GB
    assert "KV groups" not in out  # one group: the table above says it all
    assert "GiB" not in out  # one unit: decimal, as the README says


def test_bad_config_exits_2_naming_the_field(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({key: v for key, v in TINY_LLAMA.items() if key != "num_attention_heads"}))
    assert main(["kv-size", "--model", str(path)]) == 2
    captured = capsys.readouterr()
    assert "num_attention_heads" in captured.err
    assert captured.out == ""


def test_tp_that_does_not_divide_kv_heads_exits_2_naming_the_flag_and_what_works(capsys):
    assert main(["kv-size", "--model", "llama-3-70b", "--tp", "3"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--tp 3: llama-3-70b's 8 KV heads do not split over 3 GPUs" in err
    assert "it runs on 1, 2, 4, 8 or a multiple of 8 GPUs" in err
    assert "'tp'" not in err
    assert run_json(capsys, "--model", "llama-3-70b", "--tp", "16")["bytes_per_token_per_gpu"] == 327_680 // 8


@pytest.mark.parametrize(
    ("argv", "says"),
    [(["--tp", "0"], "--tp 0: an instance needs at least 1 GPU"),
     (["--block-tokens", "0"], "--block-tokens must be at least 1, got 0"),
     (["--context", "-1"], "--context must be a non-negative number of tokens, got -1")],
)
def test_bad_sizes_exit_2_naming_the_flag(capsys, argv, says):
    assert main(["kv-size", "--model", "llama-3-70b", *argv]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert says in err
    assert not any(name in err for name in ("'tp'", "'block_tokens'", "'tokens'"))


def test_unknown_model_exits_2_listing_presets(capsys):
    assert main(["kv-size", "--model", "llama-9"]) == 2
    assert "tiny-llama" in capsys.readouterr().err


def test_list_prints_the_presets(capsys):
    assert main(["kv-size", "--list"]) == 0
    names = capsys.readouterr().out.split()
    assert "llama-3-70b" in names and "deepseek-v3" in names and "tiny-llama" in names
    assert run_json(capsys, "--list") == names


def test_model_or_list_is_required(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["kv-size"])
    assert excinfo.value.code == 2
    assert "--model" in capsys.readouterr().err


def test_json_for_a_hybrid_model_breaks_the_bytes_down_by_group(capsys):
    # Qwen3-Next: 12 full layers of 2 x 2 x 256 x 2 B and 36 gated-delta-net layers of a
    # 2,162,688-byte state (see tests/kv/test_presets.py for the arithmetic).
    report = run_json(capsys, "--model", "qwen3-next-80b-a3b", "--context", "100000")
    assert report["hybrid"] is True
    assert report["bytes_per_token"] == 24_576
    assert report["state_bytes"] == 77_856_768
    assert report["context_bytes"] == 100_000 * 24_576 + 77_856_768
    state, full = report["groups"]
    assert all(GROUP_KEYS | {"context_bytes"} <= group.keys() for group in report["groups"])
    assert (state["kind"], state["label"], state["num_layers"], state["dtype"]) == (
        "state", "linear_attention", 36, "fp32")
    assert (state["state_bytes"], state["bytes_per_token"], state["context_bytes"]) == (77_856_768, 0, 77_856_768)
    assert (full["kind"], full["layers"], full["kv_heads"], full["head_dim"]) == ("full", list(range(3, 48, 4)), 2, 256)
    assert full["context_bytes"] == 100_000 * 24_576
    assert sum(group["context_bytes"] for group in report["groups"]) == report["context_bytes"]


def test_json_for_a_sliding_window_model(capsys):
    # gpt-oss-120b: 18 full and 18 sliding (128-token) layers, 2 x 8 x 64 x 2 B each per token.
    report = run_json(capsys, "--model", "gpt-oss-120b", "--context", "4096", "--tp", "8")
    sliding, full = report["groups"]
    assert (sliding["kind"], sliding["span"], sliding["bytes_per_token"]) == ("sliding", 128, 36_864)
    assert sliding["context_bytes"] == 128 * 36_864
    assert full["context_bytes"] == 4096 * 36_864
    assert report["bytes_per_token"] == 36_864  # past the window: the full layers only
    assert report["context_bytes"] == (4096 + 128) * 36_864
    assert report["context_bytes_per_gpu"] == report["context_bytes"] // 8
    assert report["bytes_per_block"] == 256 * 2 * 36_864 // 8  # a block inside the window: every layer


def test_the_table_has_a_row_per_group_and_names_what_is_not_counted(capsys):
    assert main(["kv-size", "--model", "gemma-3-27b", "--context", "32768"]) == 0
    out = capsys.readouterr().out
    assert "KV groups" in out
    assert "sliding_attention" in out and "full_attention" in out
    assert "425,984" in out and "81,920" in out  # 52 sliding and 10 full layers' bytes per token
    assert "vision_config" in out and "at least" in out


def test_context_beyond_the_model_exits_2_naming_both_numbers(capsys):
    assert main(["kv-size", "--model", "llama-3-70b", "--context", "200000"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.count("\n") == 0
    assert "--context 200,000 exceeds llama-3-70b's 8,192-token context (config field 'max_position_embeddings')" in err
    assert captured.out == ""
    assert run_json(capsys, "--model", "llama-3-70b", "--context", "8192")["context_tokens"] == 8192


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({**TINY_LLAMA, "layer_types": ["full_attention", "foo", "full_attention", "full_attention"]},
         "config field 'layer_types' declares ['foo'], which is not modelled"),
        ({**TINY_LLAMA, "num_key_value_heads": 3}, "config field 'num_key_value_heads' (3) must divide the 4"),
        ({**TINY_LLAMA, "model_type": "deepseek_v32", "kv_lora_rank": 32, "qk_rope_head_dim": 16},
         "config field 'model_type' ('deepseek_v32') gives its layers the kind ['indexed_attention']"),
    ],
    ids=["unknown-kind", "heads", "indexer"],
)
def test_a_config_that_cannot_be_sized_exits_2_in_one_line_naming_the_file_and_field(tmp_path, capsys, config, says):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["kv-size", "--model", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    err = captured.err.rstrip("\n")
    assert "\n" not in err
    assert err.startswith(f"error: {path}: ")
    assert says in err
    assert captured.out == ""


def test_missing_weight_fields_are_named_not_fatal(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({key: value for key, value in TINY_LLAMA.items() if key != "vocab_size"}))
    report = run_json(capsys, "--model", str(path))
    assert report["uncounted_params"] == ["vocab_size"]
    assert report["bytes_per_token"] == 2 * 4 * 2 * 64 * 2
    assert main(["kv-size", "--model", str(path)]) == 0
    assert "vocab_size" in capsys.readouterr().out


def test_tp_that_a_state_cannot_split_over_exits_2_naming_the_state(capsys):
    # Qwen3-Next's gated delta net splits by its 16 key heads; its 2 KV heads replicate past TP 2.
    assert main(["kv-size", "--model", "qwen3-next-80b-a3b", "--tp", "32"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--tp 32: qwen3-next-80b-a3b's linear_attention layers keep a state of 16 heads" in err
    report = run_json(capsys, "--model", "qwen3-next-80b-a3b", "--tp", "16")
    assert report["state_bytes_per_gpu"] * 16 == report["state_bytes"]
    assert report["bytes_per_token_per_gpu"] == report["bytes_per_token"] // 2
