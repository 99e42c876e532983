"""vLLM (CPU) with the KVStrata connector on an MLA model: a tiny random-weight DeepSeek-V2-Lite
shape (``make_tiny_mla``), run by vLLM's CPU MLA backend.

vLLM caches MLA's compressed latent (``kv_lora_rank + rope_dim`` = 576 per token and layer, the
same on every TP rank) in one KV cache group of an ``MLAAttentionSpec``; head-sliced blocks
(the connector's default) keep it as one slice per block, stored once whatever the TP size. Its
CPU backend forces 16-token blocks and turns vLLM's prefix caching off. Engine A computes the
prompts (the reference tokens, from scratch) and stores them on disk; engine B starts fresh on
A's directory and must produce A's next token from the latent it loads (see the test for why
not all eight).
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
ENGINE = {"block_size": MLA_BLOCK, "dtype": "float32"}


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
    # greedy: the prompt's last tokens, prefilled against the loaded latent, give the cold run's
    # next token. Later decode steps part on the 100-token prompt, with the TP-matched opaque copy
    # exactly as with head slices (the same tokens), so not in kvstrata's bytes: vLLM's CPU MLA
    # never prefills against cached context on its own (it turns prefix caching and chunked
    # prefill off), and that path is what a connector's hit runs.
    assert [t[0] for t in again["tokens"]] == [t[0] for t in first["tokens"]]
    print(f"MLA restored vs cold tokens: {again['tokens']} vs {first['tokens']}")
