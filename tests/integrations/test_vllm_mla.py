"""vLLM (CPU) with the KVStrata connector on an MLA model: a tiny random-weight DeepSeek-V2-Lite
shape (``make_tiny_mla``), run by vLLM's CPU MLA backend.

vLLM caches MLA's compressed latent (``kv_lora_rank + rope_dim`` = 576 per token and layer, the
same on every TP rank) in one KV cache group of an ``MLAAttentionSpec``; head-sliced blocks
(the connector's default) keep it as one slice per block, stored once whatever the TP size. Its
CPU backend forces 16-token blocks and turns vLLM's prefix caching off. Engine A computes the
prompts (the reference tokens, from scratch) and stores them on disk; engine B starts fresh on
A's directory and must produce A's tokens, all of them, from the latent it loads.

Both run vLLM's PyTorch rotary embedding (``custom_ops: ["-rotary_embedding"]``), not its CPU
kernel. That kernel (``csrc/cpu/pos_encoding.cpp``, reached from ``RotaryEmbedding.forward_cpu``)
takes the token stride of the query and key it is given, and MLA gives it strided views
(``model_executor/layers/mla.py``: ``q[..., nope:]`` of head stride 96, ``k_pe`` split from the
576-wide latent, token stride 576): it rotates other rows than the step's tokens, by positions
that depend on how many tokens the step has and where each request sits in the batch. Its
output is wrong cold too (it differs from transformers' greedy tokens, and with the batch), and
a restored prefill, whose step holds other tokens than a cold one's, is wrong differently: the
latent kvstrata loads is bit-identical to the cold run's, and the rope dimensions of the
recomputed tokens differ (layer 0, the positions after the hit). With the PyTorch op both runs
give transformers' tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.integrations.test_vllm import HIT_TOKENS, PROMPTS, run_children, spec  # noqa: E402

MiB = 1024**2
MLA_BLOCK = 16  # vLLM's CPU MLA kernel's only block size
LATENT = 512 + 64  # kv_lora_rank + qk_rope_head_dim
LAYERS = 3
MLA_BLOCK_BYTES = LAYERS * MLA_BLOCK * LATENT * 4  # layers x tokens x latent x fp32: one copy, no K/V pair
# float32: a restored run prefills the prompt's last tokens against loaded latents, a cold one
# the whole prompt, through other kernels; fp32 keeps their rounding far below the logits' margins.
# CPU_MLA named: on a CPU with AMX tiles vLLM picks its AMX MLA backend, whose weight packing
# takes bf16/fp16/int8 weights only and refuses this float32 model at load.
ENGINE = {"block_size": MLA_BLOCK, "dtype": "float32", "custom_ops": ["-rotary_embedding"], "attention_backend": "CPU_MLA"}


@pytest.fixture(scope="module")
def mla_runs(tiny_mla_dir, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("vllm-mla")
    disk = {"host_bytes": 16 * MiB, "disk_dir": str(tmp / "disk"), "disk_bytes": 64 * MiB}
    runs = run_children({"a": {**spec(Path(tiny_mla_dir), tmp, "a", **disk), **ENGINE}}, tmp)
    runs |= run_children({"b": {**spec(Path(tiny_mla_dir), tmp, "b", **disk), **ENGINE}}, tmp)
    return {**runs, "disk": tmp / "disk"}


def test_mla_latent_is_one_group_of_one_head(mla_runs):
    stats = mla_runs["a"]["passes"][0]["stats"]
    assert [(g["kind"], g["layers"], g["block_bytes"]) for g in stats["groups"]] == [("mla", LAYERS, MLA_BLOCK_BYTES)]
    assert stats["vllm_block_shape"] == [1, MLA_BLOCK, LATENT]  # vLLM's paged latent: [blocks, 1, block_size, 576]


def test_mla_latent_stored_once_serves_a_fresh_engine(mla_runs):
    first, again = mla_runs["a"]["passes"][0], mla_runs["b"]["passes"][0]
    full_blocks = sum(len(p) // MLA_BLOCK for p in PROMPTS)
    assert first["cached"] == [0, 0] and first["stats"]["new_blocks"] == full_blocks
    # one object per block on disk: the latent's one slice, not a copy per rank or per K/V
    assert len(list(mla_runs["disk"].rglob("*.kvb"))) == full_blocks
    stats = again["stats"]
    assert again["cached"] == HIT_TOKENS  # 96 and 64: whole 16-token blocks before the last token
    assert stats["loaded_tokens"] == sum(HIT_TOKENS) and stats["failed_blocks"] == 0
    assert stats["load_paths"] == {"disk -> device": sum(HIT_TOKENS) // MLA_BLOCK}
    assert stats["restored_bytes"] == sum(HIT_TOKENS) // MLA_BLOCK * MLA_BLOCK_BYTES
    # greedy: the prompt's last tokens prefilled against the loaded latent, then every decode
    # step, give the cold run's tokens
    assert again["tokens"] == first["tokens"]


def test_mla_cold_and_restored_tokens_are_transformers_greedy_tokens(mla_runs, tiny_mla_dir):
    """The tokens both engines give are the model's: transformers' own DeepSeek-V2 code, fp32,
    greedy (so the test above compares right tokens, not two runs wrong alike)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_mla_dir, dtype=torch.float32)
    for prompt, tokens in zip(PROMPTS, mla_runs["a"]["passes"][0]["tokens"]):
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=len(tokens), do_sample=False)
        assert out[0, len(prompt):].tolist() == tokens
