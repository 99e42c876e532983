"""vLLM (CPU) with the KVStrata connector on a hybrid model: several KV cache groups (HMA).

The connector declares ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager on and gives a
tiny random-weight Gemma 3 (``tiny_hybrid.py``: sliding-window layers 0 and 2, full-attention
layers 1 and 3) two KV cache groups: sliding (window 64 tokens, two blocks) and full. Each
group has a kvstrata cache of its own; a sliding group's blocks before its window are vLLM's
null block and never move.

Engines as in ``test_vllm.py`` (children printing JSON, vLLM's prefix cache off, greedy): engine
A computes the prompts (the reference tokens) and finds them again in its device tier; engine B
starts fresh on A's disk directory and must produce A's tokens from KV loaded from disk, group
by group. Then the groups' parts, without an engine: vLLM's own spec classes mapped to
kvstrata's groups, a Mamba group refused, and how a load and a save read vLLM's block ids.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.integrations.test_vllm import BLOCK, PROMPTS, run_children, spec  # noqa: E402
from tests.integrations.tiny_hybrid import WINDOW, make_tiny_gemma3  # noqa: E402

MiB = 1024**2
GROUP_BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 64 * 2  # a group: 2 layers x K,V x tokens x kv heads x head dim x bf16
# test_vllm's two prompts (100 and 70 tokens) and one of 200, longer than the window plus two blocks
LONG = [random.Random(12).randrange(10, 4000) for _ in range(200)]
HMA_PROMPTS = [*PROMPTS, LONG]
HITS = [96, 64, 192]  # full blocks before each prompt's last token


def saved_window_blocks(prompt_tokens: int) -> int:
    """Blocks of a prompt the sliding group stores: those overlapping the window before the last
    full block's end or one block short of it (where the prompt asked again hits)."""
    full = prompt_tokens // BLOCK
    return full - max(0, (full - 1) * BLOCK - WINDOW) // BLOCK


def window_blocks(hit_tokens: int) -> int:
    """Blocks of a hit vLLM keeps in a sliding group: those its window still reaches."""
    skipped = max(0, hit_tokens - WINDOW + 1) // BLOCK  # vLLM's SlidingWindowManager.get_num_skipped_tokens
    return hit_tokens // BLOCK - skipped


@pytest.fixture(scope="module")
def hybrid_model(tiny_model_dir, tmp_path_factory) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"), Path(tiny_model_dir))


@pytest.fixture(scope="module")
def hma_runs(hybrid_model, tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("vllm-hma")
    disk = {"host_bytes": 16 * MiB, "disk_dir": str(tmp / "disk"), "disk_bytes": 64 * MiB}
    a = run_children({"a": spec(hybrid_model, tmp, "a", passes=[HMA_PROMPTS, HMA_PROMPTS], **disk)}, tmp)
    b = run_children({"b": spec(hybrid_model, tmp, "b", passes=[HMA_PROMPTS], **disk)}, tmp)
    return {**a, **b, "a": {**a["a"], "disk_dir": str(tmp / "disk")}}


def groups_by_kind(stats: dict) -> dict[str, dict]:
    return {g["kind"]: g for g in stats["groups"]}


def test_hybrid_model_has_a_sliding_and_a_full_group(hma_runs):
    first = hma_runs["a"]["passes"][0]
    assert first["cached"] == [0, 0, 0]
    groups = first["stats"]["groups"]
    # two groups: vLLM kept its hybrid manager on (off, it makes one full-attention group)
    assert [(g["kind"], g["span"], g["layers"], g["block_bytes"]) for g in groups] == [
        ("sliding", WINDOW, 2, GROUP_BLOCK_BYTES), ("full", None, 2, GROUP_BLOCK_BYTES)]
    assert [g["namespace"] for g in groups] == [f"0-sliding{WINDOW}", "1-full"]
    # the full group stores every full prompt block; the sliding group only its windows: blocks
    # before both windows a later lookup needs are never written
    full_blocks = sum(len(p) // BLOCK for p in HMA_PROMPTS)
    window = sum(saved_window_blocks(len(p)) for p in HMA_PROMPTS)
    assert window == full_blocks - 3  # the 200-token prompt's blocks 0-2 lie before both windows
    sliding, full = groups
    assert full["new_blocks"] == full_blocks and full["stored_bytes"] == full_blocks * GROUP_BLOCK_BYTES
    assert sliding["new_blocks"] == window and sliding["stored_bytes"] == window * GROUP_BLOCK_BYTES
    assert first["stats"]["stored_bytes"] == (full_blocks + window) * GROUP_BLOCK_BYTES


def test_host_tier_serves_each_group_its_blocks(hma_runs):
    first, again = hma_runs["a"]["passes"]
    assert again["cached"] == HITS
    assert again["tokens"] == first["tokens"]
    stats = again["stats"]
    assert stats["failed_blocks"] == 0 and stats["loaded_tokens"] == sum(HITS)
    groups = groups_by_kind(stats)
    assert groups["full"]["loaded_blocks"] == sum(HITS) // BLOCK
    assert groups["sliding"]["loaded_blocks"] == sum(window_blocks(h) for h in HITS) < sum(HITS) // BLOCK
    # saves go straight to the host tier (no copy through kvstrata's device tier)
    assert groups["sliding"]["load_paths"] == {"host -> device": sum(window_blocks(h) for h in HITS)}
    # a hit's own blocks are never offered again on save: nothing new in either group since the
    # first pass (the counters are the engine's)
    before = groups_by_kind(first["stats"])
    assert [groups[k]["new_blocks"] for k in ("full", "sliding")] == [before[k]["new_blocks"] for k in ("full", "sliding")]


def test_disk_tier_serves_a_fresh_engine_group_by_group(hma_runs):
    reference = hma_runs["a"]["passes"][0]["tokens"]
    run = hma_runs["b"]["passes"][0]
    assert run["cached"] == HITS
    assert run["tokens"] == reference
    stats = run["stats"]
    assert stats["failed_blocks"] == 0 and stats["loaded_tokens"] == sum(HITS)
    groups = groups_by_kind(stats)
    loaded = {"full": sum(HITS) // BLOCK, "sliding": sum(window_blocks(h) for h in HITS)}
    for kind, blocks in loaded.items():
        assert groups[kind]["loaded_blocks"] == blocks
        assert groups[kind]["load_paths"] == {"disk -> device": blocks}
        assert groups[kind]["restored_bytes"] == blocks * GROUP_BLOCK_BYTES
    assert stats["restored_bytes"] == (loaded["full"] + loaded["sliding"]) * GROUP_BLOCK_BYTES
    assert stats["new_blocks"] == 0  # every block it saved was on disk already


def test_a_failed_load_of_a_hybrid_model_is_recomputed_per_request(hybrid_model, hma_runs, tmp_path):
    """vLLM takes failed blocks only from a one-group model; a hybrid model's loads run off the
    step, so a failure is reported per request (``failed_recving``) and recomputed, never
    crashing the engine. Engine D starts on a copy of A's disk whose every block's payload
    has one byte flipped: each load fails its checksum, and D computes the tokens engine E
    computes cold. Both are sent one prompt at a time: in bfloat16 a request's tokens depend on
    what it is batched with (the tiny model's prompt 0, computed alone, differs from A's batch
    of three at its sixth token), and where each failed load is reported decides D's batches."""
    bad = tmp_path / "bad"
    shutil.copytree(hma_runs["a"]["disk_dir"], bad)
    blocks = sorted(bad.rglob("*.kvb"))
    for path in blocks:
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    one_by_one = [[prompt] for prompt in HMA_PROMPTS]
    runs = run_children({"d": spec(hybrid_model, tmp_path, "d", passes=one_by_one, host_bytes=16 * MiB,
                                   disk_dir=str(bad), disk_bytes=64 * MiB),
                         "e": spec(hybrid_model, tmp_path, "e", passes=one_by_one, host_bytes=16 * MiB,
                                   disk_dir=str(tmp_path / "empty"), disk_bytes=64 * MiB)}, tmp_path)
    d = [p["tokens"][0] for p in runs["d"]["passes"]]
    e = [p["tokens"][0] for p in runs["e"]["passes"]]
    assert blocks and d == e
    run = runs["d"]["passes"][-1]
    stats = run["stats"]
    assert stats["failed_blocks"] > 0 and stats["recomputed_blocks"] == stats["failed_blocks"]
    assert stats["loaded_tokens"] == 0 and stats["async_loads"] >= 1


def test_a_prompt_prefilled_in_chunks_stores_its_windows_and_hits(hybrid_model, hma_runs, tmp_path):
    """64 tokens a step: vLLM prefills the 200-token prompt in four chunks and drops the sliding
    group's early blocks between them; the windows stored at each step's end still serve the
    whole 192-token hit, and the tokens are those of the prompt computed in one step."""
    reference = hma_runs["a"]["passes"][0]["tokens"][HMA_PROMPTS.index(LONG)]
    chunked = {**spec(hybrid_model, tmp_path, "c", passes=[[LONG], [LONG]], host_bytes=16 * MiB),
               "max_num_batched_tokens": 64}
    runs = run_children({"c": chunked}, tmp_path)
    first, again = runs["c"]["passes"]
    assert first["cached"] == [0] and again["cached"] == [HITS[-1]]
    assert first["tokens"] == again["tokens"] == [reference]
    # each chunk's end stored its own windows (ends 64, 128, 192: blocks 0-1, 1-3, 3-5), where the
    # prompt computed in one step stores only the last ones
    assert groups_by_kind(first["stats"])["sliding"]["new_blocks"] == 6 > saved_window_blocks(len(LONG)) == 3
    groups = groups_by_kind(again["stats"])
    assert groups["sliding"]["loaded_blocks"] == window_blocks(HITS[-1]) and again["stats"]["failed_blocks"] == 0


# --- the parts, without an engine ------------------------------------------------------------------


def _config(*specs):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in layers], s) for layers, s in specs]
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


def test_vllm_groups_map_vllm_specs_to_kvstrata_groups():
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

    from kvstrata.integrations.vllm import vllm_groups
    from kvstrata.kv.dtypes import DType
    from kvstrata.kv.groups import GroupKind

    kw = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    groups = vllm_groups(_config(([2, 0], SlidingWindowSpec(**kw, sliding_window=128)),
                                 ([1, 3], FullAttentionSpec(**kw)),
                                 ([4], ChunkedLocalAttentionSpec(**kw, attention_chunk_size=256))), (DType.BF16,))
    assert [(g.index, g.kind, g.group.layers, g.group.span, g.namespace) for g in groups] == [
        (0, GroupKind.SLIDING, (0, 2), 128, "0-sliding128"),
        (1, GroupKind.FULL, (1, 3), None, "1-full"),
        (2, GroupKind.CHUNKED, (4,), 256, "2-chunked256")]
    assert groups[0].layer_names == ("model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn")
    # one group: the namespace a dense model's blocks had before groups existed
    (dense,) = vllm_groups(_config(([0, 1], FullAttentionSpec(**kw))), (DType.BF16,))
    assert dense.namespace == "" and dense.group.token_bytes() == 2 * 2 * 2 * 64 * 2


def test_vllm_groups_refuse_what_they_cannot_cache():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, HiddenStateCacheSpec, MambaSpec, MLAAttentionSpec

    from kvstrata.integrations.vllm import vllm_groups
    from kvstrata.kv.dtypes import DType
    from kvstrata.kv.groups import GroupKind

    kw = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    mamba = MambaSpec(block_size=BLOCK, shapes=((3, 128), (4, 16, 16)), dtypes=(torch.bfloat16, torch.bfloat16))
    with pytest.raises(ValueError, match="Mamba state groups are not cached"):
        vllm_groups(_config(([0], mamba), ([1], FullAttentionSpec(**kw))), (DType.BF16,))
    with pytest.raises(ValueError, match="HiddenStateCacheSpec is not cached"):  # an MLA subclass: not a latent
        vllm_groups(_config(([0], HiddenStateCacheSpec(**{**kw, "num_kv_heads": 1}))), (DType.BF16,))
    # MLA's latent is taken: one "head" of kv_lora_rank + rope_dim, no V
    (mla,) = vllm_groups(_config(([0, 1], MLAAttentionSpec(**{**kw, "num_kv_heads": 1, "head_size": 576}))),
                         (DType.BF16,))
    assert (mla.kind, mla.group.kv_heads, mla.group.head_dim, mla.group.kv_tensors) == (GroupKind.MLA, 1, 576, 1)
    with pytest.raises(ValueError, match="KV cache group 0: KV dtype torch.float8_e4m3fn is not supported"):
        vllm_groups(_config(([0], FullAttentionSpec(**{**kw, "dtype": torch.float8_e4m3fn}))), (DType.BF16,))


def test_loads_skip_blocks_before_the_window_and_saves_keep_only_windows():
    from kvstrata.integrations.vllm import GroupBlocks
    from kvstrata.integrations.vllm.windows import load_window as _window
    from kvstrata.integrations.vllm.windows import save_window as _saved

    null = 0
    # a load of blocks 1..4 (block 0: vLLM's own prefix hit): the sliding group's first two are null
    assert _window([0, 0, 7, 8], 1, null) == GroupBlocks(3, [7, 8])
    assert _window([5, 6, 7, 8], 1, null) == GroupBlocks(1, [5, 6, 7, 8])
    assert _window([0, 0], 2, null) == GroupBlocks(4, [])  # the window lies past the hit: nothing to fill
    with pytest.raises(ValueError, match="null block inside the window"):
        _window([5, 0, 7], 0, null)
    # a full group saves every block, up to one vLLM dropped
    assert _saved([4, 5, 6], None, 16, null) == GroupBlocks(0, [4, 5, 6])
    assert _saved([4, 0, 6], None, 16, null) == GroupBlocks(0, [4])
    # a 32-token window over 8 blocks of 16: the windows before token 128 and 112 cover blocks 5..7
    assert _saved([1, 2, 3, 4, 5, 6, 7, 8], 32, 16, null) == GroupBlocks(5, [6, 7, 8])
    # vLLM already dropped blocks 0..5 (a chunked prefill): the windows' blocks it still holds
    assert _saved([0, 0, 0, 0, 0, 0, 7, 8], 32, 16, null) == GroupBlocks(6, [7, 8])
    assert _saved([0, 0], 32, 16, null) == GroupBlocks(0, [])
