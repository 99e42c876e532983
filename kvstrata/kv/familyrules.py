"""Per-family rules: what one model type's config class adds to its ``config.json``.

A config states some of its layout outright (``layer_types``) and leaves the rest to its
family's config class, which fills defaults and derives each layer's kind in ``__post_init__``:
Gemma 2 alternates sliding and full layers, Gemma 3 makes every sixth layer full, Qwen3-Next
every fourth, Jamba puts attention on every ``attn_layer_period``-th layer. The rules and
defaults here mirror transformers 5.19's config classes (``tests/kv/test_families.py`` builds
those classes and compares). Pure: no torch, no transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvstrata.kv.fields import GeometryError
from kvstrata.kv.layerkinds import LayerKind
from kvstrata.kv.states import Section, StateKind, int_field


@dataclass(frozen=True)
class Family:
    """What one model type's config class adds to its config.json.

    Attributes:
        defaults: The config class's defaults for fields that shape the cache or the weights,
            used where config.json leaves a field out (an explicit null stays null).
        derive: The layer kinds ``__post_init__`` derives when the config gives no list.
        state: How its ``linear_attention`` / ``hybrid`` layers' state is sized; None: it has none.
        head_dim: The attention head width the modeling code uses, when not the generic
            ``head_dim`` field (else ``hidden_size // num_attention_heads``).
        unmodelled_kind: transformers' name of the kind its config class gives every layer when
            that kind is not modelled (DeepSeek-V3.2's ``"indexed_attention"``: MLA plus a
            sparse indexer's keys); None: its layers are modelled.
    """

    defaults: Mapping[str, object]
    derive: Callable[[Section, int], list[LayerKind]] | None = None
    state: StateKind | None = None
    head_dim: Callable[[Section], int] | None = None
    unmodelled_kind: str | None = None


def _every(n: int, period: int, hit: LayerKind, other: LayerKind) -> list[LayerKind]:
    """``hit`` on every ``period``-th layer (1-based), ``other`` elsewhere."""
    return [hit if (i + 1) % period == 0 else other for i in range(n)]


def _gemma2(section: Section, n: int) -> list[LayerKind]:
    # Gemma2Config.__post_init__: sliding when (i + 1) % 2, full otherwise.
    return _every(n, 2, LayerKind.FULL, LayerKind.SLIDING)


def _gemma3(section: Section, n: int) -> list[LayerKind]:
    # Gemma3TextConfig: kwargs sliding_window_pattern (6): every 6th layer full.
    return _every(n, int_field(section, "sliding_window_pattern"), LayerKind.FULL, LayerKind.SLIDING)


def _cohere2(section: Section, n: int) -> list[LayerKind]:
    # Cohere2Config: kwargs sliding_window_pattern (4): every 4th layer full.
    return _every(n, int_field(section, "sliding_window_pattern"), LayerKind.FULL, LayerKind.SLIDING)


def _olmo3(section: Section, n: int) -> list[LayerKind]:
    return _every(n, 4, LayerKind.FULL, LayerKind.SLIDING)


def _llama4(section: Section, n: int) -> list[LayerKind]:
    # Llama4TextConfig: no_rope_layers[i] is 1 on RoPE layers, which are chunked; the default
    # makes every no_rope_layer_interval-th layer a full (NoPE) one. An empty list is the default.
    no_rope = section.get("no_rope_layers")
    if not no_rope:
        interval = int_field(section, "no_rope_layer_interval")
        no_rope = [int((i + 1) % interval != 0) for i in range(n)]
    if not isinstance(no_rope, list) or len(no_rope) < n:
        raise GeometryError(f"config field 'no_rope_layers' must list at least {n} layers, got {no_rope!r}")
    return [LayerKind.CHUNKED if flag else LayerKind.FULL for flag in no_rope[:n]]


def _qwen2(section: Section, n: int) -> list[LayerKind]:
    # Qwen2Config / Qwen3Config: the window only with use_sliding_window, on layers >= max_window_layers.
    if not section.get("use_sliding_window") or section.get("sliding_window") is None:
        return [LayerKind.FULL] * n
    first = int_field(section, "max_window_layers", minimum=0)
    return [LayerKind.SLIDING if i >= first else LayerKind.FULL for i in range(n)]


def _qwen2_moe(section: Section, n: int) -> list[LayerKind]:
    # Qwen2MoeConfig: sliding on even layers below max_window_layers, with use_sliding_window.
    if not section.get("use_sliding_window"):
        return [LayerKind.FULL] * n
    below = int_field(section, "max_window_layers", minimum=0)
    return [LayerKind.SLIDING if (i + 1) % 2 and i < below else LayerKind.FULL for i in range(n)]


def _qwen3_moe(section: Section, n: int) -> list[LayerKind]:
    # Qwen3MoeConfig has no layer_types: transformers' cache (get_layer_types_and_kwargs) makes
    # every layer sliding when sliding_window survives use_sliding_window.
    windowed = section.get("use_sliding_window") and section.get("sliding_window") is not None
    return [LayerKind.SLIDING if windowed else LayerKind.FULL] * n


def _gated_delta(section: Section, n: int) -> list[LayerKind]:
    # Qwen3NextConfig / Qwen3_5TextConfig: kwargs full_attention_interval (4): every 4th layer full.
    return _every(n, int_field(section, "full_attention_interval"), LayerKind.FULL, LayerKind.LINEAR)


def _jamba(section: Section, n: int) -> list[LayerKind]:
    # JambaConfig.layers_block_type: attention where i % attn_layer_period == attn_layer_offset.
    period = int_field(section, "attn_layer_period")
    offset = int_field(section, "attn_layer_offset", minimum=0)
    if offset >= period:
        raise GeometryError(f"config field 'attn_layer_offset' ({offset}) must be below 'attn_layer_period' ({period})")
    return [LayerKind.FULL if i % period == offset else LayerKind.LINEAR for i in range(n)]


def _bamba(section: Section, n: int) -> list[LayerKind]:
    # BambaConfig.layers_block_type: attention on attn_layer_indices, Mamba-2 elsewhere.
    indices = section.get("attn_layer_indices") or []
    if not isinstance(indices, list):
        raise GeometryError(f"config field 'attn_layer_indices' must be a list of layer indices, got {indices!r}")
    return [LayerKind.FULL if i in indices else LayerKind.LINEAR for i in range(n)]


def _falcon_h1(section: Section, n: int) -> list[LayerKind]:
    # FalconH1Config.layers_block_type: every layer runs attention and Mamba-2 in parallel.
    return [LayerKind.HYBRID] * n


def _granite_hybrid(section: Section, n: int) -> list[LayerKind]:
    # GraniteMoeHybridConfig: every layer Mamba-2 unless layer_types says otherwise.
    return [LayerKind.LINEAR] * n


def _lfm2(section: Section, n: int) -> list[LayerKind]:
    # Lfm2Config: attention on full_attn_idxs (default: every layer), short convolutions elsewhere.
    indices = section.get("full_attn_idxs")
    if indices is None:
        return [LayerKind.FULL] * n
    if not isinstance(indices, list):
        raise GeometryError(f"config field 'full_attn_idxs' must be a list of layer indices, got {indices!r}")
    return [LayerKind.FULL if i in indices else LayerKind.CONV for i in range(n)]


def _nemotron_h(section: Section, n: int) -> list[LayerKind]:
    # NemotronHConfig: without layers_block_type or a pattern, its four-layer default.
    return [LayerKind.LINEAR, LayerKind.MOE, LayerKind.FULL, LayerKind.MLP]


def _cohere2_head_dim(section: Section) -> int:
    # Cohere2Config.__post_init__ sets head_dim = hidden_size // num_attention_heads, whatever the file says.
    return int_field(section, "hidden_size") // int_field(section, "num_attention_heads")


def _nemotron_head_dim(section: Section) -> int:
    # NemotronHConfig's head_dim (128 by default); its remote-code configs named it attention_head_dim.
    for key in ("head_dim", "attention_head_dim"):
        if section.get(key) is not None:
            return int_field(section, key)
    return 128


_QWEN_MOE = {"decoder_sparse_step": 1, "mlp_only_layers": []}
# The gated-delta-net families' defaults that Qwen3-Next's config set and Qwen3.5's kept.
_GATED_DELTA = {"head_dim": 256, "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                "max_position_embeddings": 32768, "tie_word_embeddings": False}

FAMILIES: dict[str, Family] = {
    "gemma2": Family(
        {"head_dim": 256, "num_key_value_heads": 4, "sliding_window": 4096, "max_position_embeddings": 8192,
         "vocab_size": 256000, "intermediate_size": 9216, "tie_word_embeddings": True},
        _gemma2),
    "gemma3_text": Family(
        {"head_dim": 256, "num_key_value_heads": 4, "sliding_window": 4096, "sliding_window_pattern": 6,
         "max_position_embeddings": 131072, "vocab_size": 262208, "intermediate_size": 9216,
         "tie_word_embeddings": True},
        _gemma3),
    "cohere2": Family(
        {"sliding_window": 4096, "sliding_window_pattern": 4, "max_position_embeddings": 8192,
         "vocab_size": 256000, "intermediate_size": 22528, "tie_word_embeddings": True},
        _cohere2, head_dim=_cohere2_head_dim),
    "olmo3": Family({"sliding_window": 4096, "max_position_embeddings": 2048}, _olmo3),
    "gpt_oss": Family(
        {"head_dim": 64, "num_key_value_heads": 8, "sliding_window": 128, "max_position_embeddings": 131072,
         "num_local_experts": 128, "num_experts_per_tok": 4, "vocab_size": 201088, "intermediate_size": 2880,
         "tie_word_embeddings": False},
        _gemma2),
    "llama4_text": Family(
        {"head_dim": 128, "num_key_value_heads": 8, "attention_chunk_size": 8192, "no_rope_layer_interval": 4,
         "max_position_embeddings": 131072, "num_local_experts": 16, "num_experts_per_tok": 1,
         "interleave_moe_layer_step": 1, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
         "vocab_size": 202048, "tie_word_embeddings": False},
        _llama4),
    "mistral": Family({"num_key_value_heads": 8, "sliding_window": 4096, "max_position_embeddings": 131072}),
    "ministral": Family({"sliding_window": 4096}),
    "mixtral": Family({"num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
                       "max_position_embeddings": 131072}),
    "qwen2": Family({"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}, _qwen2),
    "qwen3": Family({"head_dim": 128, "use_sliding_window": False, "sliding_window": 4096,
                     "max_window_layers": 28}, _qwen2),
    "qwen2_moe": Family(
        {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "num_experts": 60,
         "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
         **_QWEN_MOE},
        _qwen2_moe),
    "qwen3_moe": Family(
        {"num_key_value_heads": 4, "use_sliding_window": False, "sliding_window": 4096, "num_experts": 128,
         "num_experts_per_tok": 8, "moe_intermediate_size": 768, **_QWEN_MOE},
        _qwen3_moe),
    "qwen3_next": Family(
        {"num_key_value_heads": 2, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
         "shared_expert_intermediate_size": 512, "vocab_size": 151936, **_GATED_DELTA, **_QWEN_MOE},
        _gated_delta, state=StateKind.GDN),
    "qwen3_5_text": Family(
        {"num_key_value_heads": 4, "vocab_size": 248320, **_GATED_DELTA},
        _gated_delta, state=StateKind.GDN),
    "qwen3_5_moe_text": Family(
        {"num_key_value_heads": 2, "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
         "shared_expert_intermediate_size": 512, "vocab_size": 248320, **_GATED_DELTA, **_QWEN_MOE},
        _gated_delta, state=StateKind.GDN),
    "jamba": Family(
        {"num_key_value_heads": 8, "attn_layer_period": 8, "attn_layer_offset": 4, "expert_layer_period": 2,
         "expert_layer_offset": 1, "num_experts": 16, "num_experts_per_tok": 2, "mamba_d_state": 16,
         "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": "auto", "mamba_conv_bias": True,
         "mamba_proj_bias": False, "max_position_embeddings": 262144, "vocab_size": 65536,
         "intermediate_size": 14336, "tie_word_embeddings": False},
        _jamba, state=StateKind.MAMBA1),
    "bamba": Family(
        {"num_key_value_heads": 8, "mamba_n_heads": 128, "mamba_d_head": "auto", "mamba_n_groups": 1,
         "mamba_d_state": 256, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_conv_bias": True,
         "mamba_proj_bias": False, "max_position_embeddings": 262144, "vocab_size": 128000,
         "intermediate_size": 14336, "tie_word_embeddings": False},
        _bamba, state=StateKind.MAMBA2),
    "granitemoehybrid": Family(
        {"mamba_n_heads": 128, "mamba_d_head": "auto", "mamba_n_groups": 1, "mamba_d_state": 256,
         "mamba_d_conv": 4, "mamba_expand": 2, "mamba_conv_bias": True, "mamba_proj_bias": False,
         "num_local_experts": 8, "num_experts_per_tok": 2, "shared_intermediate_size": 1024,
         "max_position_embeddings": 2048, "vocab_size": 32000, "intermediate_size": 11008,
         "tie_word_embeddings": False},
        _granite_hybrid, state=StateKind.MAMBA2),
    "falcon_h1": Family(
        {"num_key_value_heads": 8, "mamba_d_ssm": 1024, "mamba_n_heads": 128, "mamba_d_head": "auto",
         "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_conv": 4, "mamba_expand": 2,
         "mamba_conv_bias": True, "mamba_proj_bias": False, "max_position_embeddings": 8192,
         "vocab_size": 128000, "intermediate_size": 14336, "tie_word_embeddings": False},
        _falcon_h1, state=StateKind.MAMBA2),
    "nemotron_h": Family(
        {"num_key_value_heads": 8, "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8,
         "ssm_state_size": 128, "conv_kernel": 4, "expand": 2, "use_conv_bias": True, "mamba_proj_bias": False,
         "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 7688,
         "moe_shared_expert_intermediate_size": 7688, "max_position_embeddings": 4096, "vocab_size": 131072,
         "intermediate_size": 21504, "tie_word_embeddings": False},
        _nemotron_h, state=StateKind.MAMBA2, head_dim=_nemotron_head_dim),
    "lfm2": Family(
        {"num_key_value_heads": 8, "conv_L_cache": 3, "max_position_embeddings": 128000, "vocab_size": 65536,
         "intermediate_size": 12288, "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0,
         "block_multiple_of": 256, "tie_word_embeddings": True},
        _lfm2, state=StateKind.CONV),
    "deepseek_v32": Family({}, unmodelled_kind="indexed_attention"),
}

# Fields whose config.json spelling transformers' config classes rename on the way in
# (``kwargs.pop(old)`` or ``attribute_map``): the new name is read, the old one wins when given.
ALIASES: dict[str, tuple[tuple[str, str], ...]] = {
    "nemotron_h": (("mamba_n_groups", "n_groups"), ("mamba_d_conv", "conv_kernel"), ("mamba_expand", "expand"),
                   ("layer_types", "layers_block_type"), ("num_local_experts", "n_routed_experts")),
    "qwen3_moe": (("num_local_experts", "num_experts"),),
    "jamba": (("num_local_experts", "num_experts"),),
    "gpt_oss": (("num_experts", "num_local_experts"),),
    "mixtral": (("num_experts", "num_local_experts"),),
    "deepseek_v2": (("num_experts", "n_routed_experts"),),
    "deepseek_v3": (("num_local_experts", "n_routed_experts"),),
    "lfm2": (("block_ff_dim", "intermediate_size"), ("tie_embedding", "tie_word_embeddings")),
    "granitemoehybrid": (("layers_block_type", "layer_types"),),
    "falcon_h1": (("layer_types", "layers_block_type"),),
    "bamba": (("layer_types", "layers_block_type"),),
}
