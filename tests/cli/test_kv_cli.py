"""``kvstrata kv-size`` through the real command-line entry point."""

from __future__ import annotations

import json

import pytest

from kvstrata.cli import main

TINY = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
}

REQUIRED_KEYS = {
    "model", "attention", "dtype", "tp", "bytes_per_token", "bytes_per_token_per_gpu",
    "block_tokens", "bytes_per_block", "num_layers", "num_kv_heads", "head_dim",
    "total_params", "active_params", "weight_bytes",
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
    (model_dir / "config.json").write_text(json.dumps(TINY))
    report = run_json(capsys, "--model", str(model_dir / "config.json"))
    assert report["model"] == "tiny"
    assert report["bytes_per_token"] == 2 * 4 * 2 * 64 * 2


def test_table_output(capsys):
    assert main(["kv-size", "--model", "llama-3-70b", "--tp", "8", "--context", "32768"]) == 0
    out = capsys.readouterr().out
    assert "llama-3-70b" in out
    assert "327,680" in out
    assert "40,960" in out
    assert "10.74 GB" in out  # 32768 * 327680 bytes, decimal GB
    assert "GiB" not in out  # one unit: decimal, as the README says


def test_bad_config_exits_2_naming_the_field(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({key: v for key, v in TINY.items() if key != "num_attention_heads"}))
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
