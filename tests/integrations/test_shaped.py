"""A model of a real model's shape with random weights: the config's shape kept, every id decodes,
a directory reused or refused, and a bad name one line (builds small configs: a few seconds)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvstrata.integrations.shaped import ShapedSpec, make_shaped
from kvstrata.kv import load_geometry
from kvstrata.kv.geometry import GeometryError

pytestmark = pytest.mark.slow  # trains a tokenizer and writes weights (several seconds each)

# Qwen3's published fields (qk-norm, head_dim apart from hidden / heads), at a size a test builds fast
SMALL_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": 6000, "max_position_embeddings": 4096, "rope_theta": 1000000, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 5999, "eos_token_id": 5998,
}
SHAPE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "head_dim", "vocab_size", "tie_word_embeddings", "rope_theta")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    config = tmp_path_factory.mktemp("cfg") / "config.json"
    config.write_text(json.dumps(SMALL_QWEN3))
    out = tmp_path_factory.mktemp("small-qwen3")
    return config, make_shaped(out, ShapedSpec(str(config))), out


def test_the_model_has_the_configs_shape_and_the_tokenizer_its_vocabulary(small):
    config, built, out = small
    written = json.loads((out / "config.json").read_text())
    assert {k: written[k] for k in SHAPE} == {k: SMALL_QWEN3[k] for k in SHAPE}
    assert written["architectures"] == ["Qwen3ForCausalLM"]
    assert built.kv_bytes_per_token == load_geometry(str(config), "bfloat16").bytes_per_token == 2 * 2 * 2 * 64 * 2
    hidden, inter, vocab = 128, 256, 6000
    layer = 4 * 64 * hidden + 2 * 2 * 64 * hidden + 4 * 64 * hidden + 3 * hidden * inter + 2 * hidden + 2 * 64
    assert built.parameters == vocab * hidden + 2 * layer + hidden  # tied head: one embedding matrix

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok.get_vocab()) == vocab
    text = tok.decode(list(range(vocab)))  # every id the model can emit decodes
    assert "<t5999>" in text and "<t4500>" in text
    assert written["eos_token_id"] == tok.eos_token_id  # the published ids name fillers here: the tokenizer's own


def test_the_model_loads_in_transformers_and_the_same_spec_is_reused(small):
    import torch
    from transformers import AutoModelForCausalLM

    _, _, out = small
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    written = (out / "model.safetensors").stat().st_mtime_ns
    again = make_shaped(out, ShapedSpec(str(small[0])))  # the same spec: reused, not rewritten
    assert (out / "model.safetensors").stat().st_mtime_ns == written and again.parameters == small[1].parameters
    assert model(torch.tensor([[3, 4, 5]])).logits.shape == (1, 3, 6000)


def test_a_directory_of_another_model_is_refused_and_a_bad_name_is_one_line(small, tmp_path):
    config, _, out = small
    with pytest.raises(FileExistsError, match="another spec"):
        make_shaped(out, ShapedSpec(str(config), seed=1))
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        make_shaped(tmp_path / "x", ShapedSpec(str(config)))
    with pytest.raises(GeometryError, match="unknown model 'nope'"):
        make_shaped(tmp_path / "y", ShapedSpec("nope"))
    with pytest.raises(ValueError, match="dtype"):
        ShapedSpec("qwen2.5-0.5b", dtype="int8")
    run = subprocess.run([sys.executable, "-m", "kvstrata", "model", "make", str(tmp_path / "z"), "--like", "nope"],
                         capture_output=True, text=True)
    assert run.returncode != 0
    assert [line for line in run.stderr.splitlines() if line.startswith("error:")] == [
        line for line in run.stderr.splitlines() if "unknown model 'nope'" in line]
