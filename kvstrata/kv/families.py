"""Per-family rules: which decoder layers of a Hugging Face config cache what, and how much.

A config states some of this outright (``layer_types``) and leaves the rest to its family's
config class, which fills defaults and derives each layer's kind in ``__post_init__``: Gemma 2
alternates sliding and full layers, Gemma 3 makes every sixth layer full, Qwen3-Next every
fourth, Jamba puts attention on every ``attn_layer_period``-th layer, Nemotron-H spells its
layers as a pattern string. The rules here mirror transformers 5.19's config classes (the tests
build those classes and compare), and the recurrent state sizes follow its modeling code's
cache shapes. Pure: no torch, no transformers.

Every layer gets one of transformers' layer kinds (``configuration_utils.ALLOWED_ATTN_LAYER_TYPES``,
legacy names remapped as its ``remap_legacy_layer_types`` does):

* ``full_attention``, ``sliding_attention``, ``chunked_attention``: per-token K and V;
* ``linear_attention``: a fixed-size state (Mamba, Mamba-2, gated delta net), ``conv``: LFM2's
  short-convolution state;
* ``hybrid``: attention and a Mamba-2 mixer side by side in one layer (Falcon-H1);
* ``mlp``, ``moe``: a layer without a sequence mixer (Nemotron-H), which caches nothing.

Any other kind (DeepSeek-V3.2's ``indexed_attention``, compressed or sparse attention, a name
this module does not know) is refused, naming the config field it came from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvstrata.kv.dtypes import DType
from kvstrata.kv.fields import GeometryError, check_int

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"
LINEAR = "linear_attention"
CONV = "conv"
HYBRID = "hybrid"
HYBRID_SLIDING = "hybrid_sliding"
MLP = "mlp"
MOE = "moe"

ATTENTION_KINDS = frozenset({FULL, SLIDING, CHUNKED, HYBRID, HYBRID_SLIDING})  # layers with per-token KV
STATE_KINDS = frozenset({LINEAR, CONV, HYBRID, HYBRID_SLIDING})  # layers with a fixed-size state
MODELLED_KINDS = ATTENTION_KINDS | STATE_KINDS | {MLP, MOE}

# transformers' configuration_utils._LEGACY_LAYER_TYPE_REMAP, plus the older spellings kvstrata
# read before (GPT-Neo's "global"/"local", plain "full").
_LEGACY_KINDS = {
    "mamba": LINEAR,
    "attention": FULL,
    "full": FULL,
    "global": FULL,
    "local": SLIDING,
    "deepseek_sparse_attention": "indexed_attention",
    "qwen_sparse_attention": "indexed_attention",
}

# Nemotron-H's hybrid_override_pattern characters (NemotronHConfig._pattern_to_list).
_NEMOTRON_PATTERN = {"M": LINEAR, "E": MOE, "*": FULL, "-": MLP}

# A multimodal wrapper's text model type, for a text_config that does not name its own.
TEXT_MODEL_TYPES = {
    "gemma3": "gemma3_text",
    "llama4": "llama4_text",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
}

# Decoders with no attention layer at all: nothing per token to size, and KVGeometry describes a
# model by its attention heads.
PURE_RECURRENT_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "rwkv", "rwkv5", "rwkv6", "recurrent_gemma", "xlstm",
})
# Hybrids whose layers this module does not model (shared attention blocks, lightning attention).
UNMODELLED_MODEL_TYPES = frozenset({"zamba", "zamba2", "minimax", "kimi_linear", "olmo_hybrid"})


@dataclass(frozen=True)
class LayerTypes:
    """Each decoder layer's kind, as transformers names it.

    Attributes:
        kinds: One per decoder layer (canonical names, see the module docstring).
        labels: The config's own name for each layer's kind (``"mamba"``, ``"M"`` is shown as
            its canonical name), for display.
        field: The config field the kinds were read or derived from, for messages.
    """

    kinds: tuple[str, ...]
    labels: tuple[str, ...]
    field: str


@dataclass(frozen=True)
class StateSize:
    """One layer's fixed-size state for one sequence.

    Attributes:
        conv_elements: Elements of the convolution state (cached in the model's dtype).
        recurrent_elements: Elements of the recurrent (SSM / delta-rule) state, cached in fp32.
        heads: What the state splits by under tensor parallelism.
        model_dtype: The model's dtype (the conv state's).
    """

    conv_elements: int
    recurrent_elements: int
    heads: int
    model_dtype: DType

    @property
    def state_bytes(self) -> int:
        return self.conv_elements * self.model_dtype.size_bytes + self.recurrent_elements * DType.FP32.size_bytes

    @property
    def dtype(self) -> DType:
        """The dtype a state group is shown with: fp32 where a recurrent state dominates, else the conv's."""
        return DType.FP32 if self.recurrent_elements else self.model_dtype


# --- family records --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """What one model type's config class adds to its config.json.

    Attributes:
        defaults: The config class's defaults for fields that shape the cache or the weights,
            used where config.json leaves a field out (an explicit null stays null).
        derive: The layer kinds ``__post_init__`` derives when the config gives no list.
        state: How its ``linear_attention`` / ``hybrid`` layers' state is sized: ``"mamba1"``,
            ``"mamba2"``, ``"gdn"`` (gated delta net), ``"conv"`` (LFM2); None: it has none.
        head_dim: The attention head width the modeling code uses, when not the generic
            ``head_dim`` field (else ``hidden_size // num_attention_heads``).
    """

    defaults: Mapping[str, Any]
    derive: Callable[[Mapping[str, Any], int], list[str]] | None = None
    state: str | None = None
    head_dim: Callable[[Mapping[str, Any]], int] | None = None


def _every(n: int, period: int, hit: str, other: str) -> list[str]:
    """``hit`` on every ``period``-th layer (1-based), ``other`` elsewhere."""
    return [hit if (i + 1) % period == 0 else other for i in range(n)]


def _int_field(section: Mapping[str, Any], key: str, minimum: int = 1) -> int:
    return check_int(f"config field {key!r}", section.get(key), minimum=minimum)


def _gemma2(section: Mapping[str, Any], n: int) -> list[str]:
    # Gemma2Config.__post_init__: sliding when (i + 1) % 2, full otherwise.
    return _every(n, 2, FULL, SLIDING)


def _gemma3(section: Mapping[str, Any], n: int) -> list[str]:
    # Gemma3TextConfig: kwargs sliding_window_pattern (6): every 6th layer full.
    return _every(n, _int_field(section, "sliding_window_pattern"), FULL, SLIDING)


def _cohere2(section: Mapping[str, Any], n: int) -> list[str]:
    # Cohere2Config: kwargs sliding_window_pattern (4): every 4th layer full.
    return _every(n, _int_field(section, "sliding_window_pattern"), FULL, SLIDING)


def _olmo3(section: Mapping[str, Any], n: int) -> list[str]:
    return _every(n, 4, FULL, SLIDING)


def _llama4(section: Mapping[str, Any], n: int) -> list[str]:
    # Llama4TextConfig: no_rope_layers[i] is 1 on RoPE layers, which are chunked; the default
    # makes every no_rope_layer_interval-th layer a full (NoPE) one. An empty list is the default.
    no_rope = section.get("no_rope_layers")
    if not no_rope:
        interval = _int_field(section, "no_rope_layer_interval")
        no_rope = [int((i + 1) % interval != 0) for i in range(n)]
    if not isinstance(no_rope, list) or len(no_rope) < n:
        raise GeometryError(f"config field 'no_rope_layers' must list at least {n} layers, got {no_rope!r}")
    return [CHUNKED if flag else FULL for flag in no_rope[:n]]


def _qwen2(section: Mapping[str, Any], n: int) -> list[str]:
    # Qwen2Config / Qwen3Config: the window only with use_sliding_window, on layers >= max_window_layers.
    if not section.get("use_sliding_window") or section.get("sliding_window") is None:
        return [FULL] * n
    first = _int_field(section, "max_window_layers", minimum=0)
    return [SLIDING if i >= first else FULL for i in range(n)]


def _qwen2_moe(section: Mapping[str, Any], n: int) -> list[str]:
    # Qwen2MoeConfig: sliding on even layers below max_window_layers, with use_sliding_window.
    if not section.get("use_sliding_window"):
        return [FULL] * n
    below = _int_field(section, "max_window_layers", minimum=0)
    return [SLIDING if (i + 1) % 2 and i < below else FULL for i in range(n)]


def _qwen3_moe(section: Mapping[str, Any], n: int) -> list[str]:
    # Qwen3MoeConfig has no layer_types: transformers' cache (get_layer_types_and_kwargs) makes
    # every layer sliding when sliding_window survives use_sliding_window.
    windowed = section.get("use_sliding_window") and section.get("sliding_window") is not None
    return [SLIDING if windowed else FULL] * n


def _gated_delta(section: Mapping[str, Any], n: int) -> list[str]:
    # Qwen3NextConfig / Qwen3_5TextConfig: kwargs full_attention_interval (4): every 4th layer full.
    return _every(n, _int_field(section, "full_attention_interval"), FULL, LINEAR)


def _jamba(section: Mapping[str, Any], n: int) -> list[str]:
    # JambaConfig.layers_block_type: attention where i % attn_layer_period == attn_layer_offset.
    period = _int_field(section, "attn_layer_period")
    offset = _int_field(section, "attn_layer_offset", minimum=0)
    if offset >= period:
        raise GeometryError(f"config field 'attn_layer_offset' ({offset}) must be below 'attn_layer_period' ({period})")
    return [FULL if i % period == offset else LINEAR for i in range(n)]


def _bamba(section: Mapping[str, Any], n: int) -> list[str]:
    # BambaConfig.layers_block_type: attention on attn_layer_indices, Mamba-2 elsewhere.
    indices = section.get("attn_layer_indices") or []
    if not isinstance(indices, list):
        raise GeometryError(f"config field 'attn_layer_indices' must be a list of layer indices, got {indices!r}")
    return [FULL if i in indices else LINEAR for i in range(n)]


def _falcon_h1(section: Mapping[str, Any], n: int) -> list[str]:
    # FalconH1Config.layers_block_type: every layer runs attention and Mamba-2 in parallel.
    return [HYBRID] * n


def _granite_hybrid(section: Mapping[str, Any], n: int) -> list[str]:
    # GraniteMoeHybridConfig: every layer Mamba-2 unless layer_types says otherwise.
    return [LINEAR] * n


def _lfm2(section: Mapping[str, Any], n: int) -> list[str]:
    # Lfm2Config: attention on full_attn_idxs (default: every layer), short convolutions elsewhere.
    indices = section.get("full_attn_idxs")
    if indices is None:
        return [FULL] * n
    if not isinstance(indices, list):
        raise GeometryError(f"config field 'full_attn_idxs' must be a list of layer indices, got {indices!r}")
    return [FULL if i in indices else CONV for i in range(n)]


def _nemotron_h(section: Mapping[str, Any], n: int) -> list[str]:
    # NemotronHConfig: without layers_block_type or a pattern, its four-layer default.
    return [LINEAR, MOE, FULL, MLP]


def _deepseek_v32(section: Mapping[str, Any], n: int) -> list[str]:
    # DeepseekV32Config: every layer is "indexed_attention" (MLA plus a sparse indexer's keys).
    return ["indexed_attention"] * n


def _cohere2_head_dim(section: Mapping[str, Any]) -> int:
    # Cohere2Config.__post_init__ sets head_dim = hidden_size // num_attention_heads, whatever the file says.
    return _int_field(section, "hidden_size") // _int_field(section, "num_attention_heads")


def _nemotron_head_dim(section: Mapping[str, Any]) -> int:
    # NemotronHConfig's head_dim (128 by default); its remote-code configs named it attention_head_dim.
    for key in ("head_dim", "attention_head_dim"):
        if section.get(key) is not None:
            return _int_field(section, key)
    return 128


_QWEN_MOE = {"decoder_sparse_step": 1, "mlp_only_layers": []}

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
        {"head_dim": 256, "num_key_value_heads": 2, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
         "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
         "linear_num_value_heads": 32, "num_experts": 512, "num_experts_per_tok": 10,
         "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "max_position_embeddings": 32768,
         "vocab_size": 151936, "tie_word_embeddings": False, **_QWEN_MOE},
        _gated_delta, state="gdn"),
    "qwen3_5_text": Family(
        {"head_dim": 256, "num_key_value_heads": 4, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
         "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
         "linear_num_value_heads": 32, "max_position_embeddings": 32768, "vocab_size": 248320,
         "tie_word_embeddings": False},
        _gated_delta, state="gdn"),
    "qwen3_5_moe_text": Family(
        {"head_dim": 256, "num_key_value_heads": 2, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
         "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
         "linear_num_value_heads": 32, "num_experts": 256, "num_experts_per_tok": 8,
         "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "max_position_embeddings": 32768,
         "vocab_size": 248320, "tie_word_embeddings": False, **_QWEN_MOE},
        _gated_delta, state="gdn"),
    "jamba": Family(
        {"num_key_value_heads": 8, "attn_layer_period": 8, "attn_layer_offset": 4, "expert_layer_period": 2,
         "expert_layer_offset": 1, "num_experts": 16, "num_experts_per_tok": 2, "mamba_d_state": 16,
         "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": "auto", "mamba_conv_bias": True,
         "mamba_proj_bias": False, "max_position_embeddings": 262144, "vocab_size": 65536,
         "intermediate_size": 14336, "tie_word_embeddings": False},
        _jamba, state="mamba1"),
    "bamba": Family(
        {"num_key_value_heads": 8, "mamba_n_heads": 128, "mamba_d_head": "auto", "mamba_n_groups": 1,
         "mamba_d_state": 256, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_conv_bias": True,
         "mamba_proj_bias": False, "max_position_embeddings": 262144, "vocab_size": 128000,
         "intermediate_size": 14336, "tie_word_embeddings": False},
        _bamba, state="mamba2"),
    "granitemoehybrid": Family(
        {"mamba_n_heads": 128, "mamba_d_head": "auto", "mamba_n_groups": 1, "mamba_d_state": 256,
         "mamba_d_conv": 4, "mamba_expand": 2, "mamba_conv_bias": True, "mamba_proj_bias": False,
         "num_local_experts": 8, "num_experts_per_tok": 2, "shared_intermediate_size": 1024,
         "max_position_embeddings": 2048, "vocab_size": 32000, "intermediate_size": 11008,
         "tie_word_embeddings": False},
        _granite_hybrid, state="mamba2"),
    "falcon_h1": Family(
        {"num_key_value_heads": 8, "mamba_d_ssm": 1024, "mamba_n_heads": 128, "mamba_d_head": "auto",
         "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_conv": 4, "mamba_expand": 2,
         "mamba_conv_bias": True, "mamba_proj_bias": False, "max_position_embeddings": 8192,
         "vocab_size": 128000, "intermediate_size": 14336, "tie_word_embeddings": False},
        _falcon_h1, state="mamba2"),
    "nemotron_h": Family(
        {"num_key_value_heads": 8, "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8,
         "ssm_state_size": 128, "conv_kernel": 4, "expand": 2, "use_conv_bias": True, "mamba_proj_bias": False,
         "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 7688,
         "moe_shared_expert_intermediate_size": 7688, "max_position_embeddings": 4096, "vocab_size": 131072,
         "intermediate_size": 21504, "tie_word_embeddings": False},
        _nemotron_h, state="mamba2", head_dim=_nemotron_head_dim),
    "lfm2": Family(
        {"num_key_value_heads": 8, "conv_L_cache": 3, "max_position_embeddings": 128000, "vocab_size": 65536,
         "intermediate_size": 12288, "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0,
         "block_multiple_of": 256, "tie_word_embeddings": True},
        _lfm2, state="conv"),
    "deepseek_v32": Family({}, _deepseek_v32),
}

# Fields whose config.json spelling transformers' config classes rename on the way in
# (``kwargs.pop(old)`` or ``attribute_map``): the new name is read, the old one wins when given.
_ALIASES: dict[str, tuple[tuple[str, str], ...]] = {
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


def family(model_type: str | None) -> Family | None:
    """The rules of ``model_type``; None for a model type with no rules of its own."""
    return FAMILIES.get(model_type or "")


def with_defaults(section: Mapping[str, Any], model_type: str | None) -> dict[str, Any]:
    """``section`` with its family's renamed fields moved to their new names and the config
    class's defaults filled in where the file leaves a field out."""
    out = dict(section)
    for old, new in _ALIASES.get(model_type or "", ()):
        if out.get(old) is not None:
            out[new] = out.pop(old)
    rules = family(model_type)
    if rules is not None:
        for key, value in rules.defaults.items():
            out.setdefault(key, value)
    if model_type is not None:
        out["model_type"] = model_type
    return out


# --- layer kinds -----------------------------------------------------------------------------------


def layer_types(section: Mapping[str, Any], num_layers: int) -> LayerTypes:
    """Each decoder layer's kind: the config's own list if it has one, else its family's rule,
    else what transformers' cache assumes (every layer sliding under a ``sliding_window``,
    chunked under an ``attention_chunk_size``, else full).

    Raises:
        GeometryError: the list is not a list of strings, or its length is not the layer count.
    """
    model_type = section.get("model_type")
    for key in ("layer_types", "layers_block_type"):
        listed = section.get(key)
        if listed is not None:
            return _listed(key, listed, num_layers)
    if model_type == "nemotron_h" and section.get("hybrid_override_pattern") is not None:
        return _pattern(section["hybrid_override_pattern"], num_layers)
    if section.get("attention_types") is not None:
        return _gpt_neo(section["attention_types"], num_layers)
    rules = family(model_type)
    if rules is not None and rules.derive is not None:
        kinds = tuple(rules.derive(section, num_layers))
        return LayerTypes(kinds, kinds, "model_type")
    if section.get("sliding_window") is not None and section.get("use_sliding_window", True):
        kinds = (SLIDING,) * num_layers
        return LayerTypes(kinds, kinds, "sliding_window")
    if section.get("attention_chunk_size") is not None:
        kinds = (CHUNKED,) * num_layers
        return LayerTypes(kinds, kinds, "attention_chunk_size")
    kinds = (FULL,) * num_layers
    return LayerTypes(kinds, kinds, "num_hidden_layers")


def derived_layer_count(section: Mapping[str, Any]) -> int | None:
    """The layer count a family takes from its layer list rather than ``num_hidden_layers``
    (Nemotron-H: the length of ``layers_block_type`` or of the pattern); None for the others."""
    if section.get("model_type") != "nemotron_h":
        return None
    listed = section.get("layers_block_type")
    if isinstance(listed, list) and listed:
        return len(listed)
    pattern = section.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        return len(pattern)
    return 4  # NemotronHConfig's default layers_block_type: four layers, whatever num_hidden_layers says


def _listed(key: str, listed: Any, num_layers: int) -> LayerTypes:
    if not isinstance(listed, list) or not all(isinstance(kind, str) for kind in listed):
        raise GeometryError(f"config field {key!r} must be a list of layer-kind strings, got {listed!r}")
    if len(listed) != num_layers:
        raise GeometryError(
            f"config field {key!r} lists {len(listed)} layers, but the model has {num_layers} "
            "('num_hidden_layers')"
        )
    kinds = tuple(_LEGACY_KINDS.get(kind, kind) for kind in listed)
    return LayerTypes(kinds, tuple(listed), key)


def _pattern(pattern: Any, num_layers: int) -> LayerTypes:
    if not isinstance(pattern, str):
        raise GeometryError(f"config field 'hybrid_override_pattern' must be a string, got {pattern!r}")
    unknown = sorted(set(pattern) - set(_NEMOTRON_PATTERN))
    if unknown:
        raise GeometryError(
            f"config field 'hybrid_override_pattern' holds {unknown}: only M (Mamba-2), * (attention), "
            "- (MLP) and E (MoE) are known"
        )
    if len(pattern) != num_layers:
        raise GeometryError(
            f"config field 'hybrid_override_pattern' has {len(pattern)} layers, but the model has {num_layers}"
        )
    kinds = tuple(_NEMOTRON_PATTERN[char] for char in pattern)
    return LayerTypes(kinds, kinds, "hybrid_override_pattern")


def _gpt_neo(spec: Any, num_layers: int) -> LayerTypes:
    """GPT-Neo's ``[[["global", "local"], 12]]``: kinds repeated (GPTNeoConfig.expand_attention_types_params)."""
    try:
        names = [name for kinds, repeat in spec for _ in range(repeat) for name in kinds]
    except (TypeError, ValueError):
        raise GeometryError(f"config field 'attention_types' must be [[kinds, repeat], ...], got {spec!r}") from None
    if not all(isinstance(name, str) for name in names) or len(names) != num_layers:
        raise GeometryError(
            f"config field 'attention_types' expands to {len(names)} layers, but the model has {num_layers}"
        )
    kinds = tuple(_LEGACY_KINDS.get(name, name) for name in names)
    return LayerTypes(kinds, tuple(names), "attention_types")


def check_modelled(types: LayerTypes, model_type: str | None) -> None:
    """Refuse a layer kind that is not modelled, naming the field it came from."""
    unknown = sorted(set(types.kinds) - MODELLED_KINDS)
    if not unknown:
        return
    origin = (f"config field 'model_type' ({model_type!r}) gives its layers the kind"
              if types.field == "model_type" else f"config field {types.field!r} declares")
    raise GeometryError(
        f"{origin} {unknown}, which is not modelled (known: full, sliding and chunked attention, "
        "linear attention / Mamba, conv, hybrid, mlp, moe)"
    )


# --- spans and states ------------------------------------------------------------------------------


def sliding_span(section: Mapping[str, Any]) -> int:
    """The tokens a sliding layer keeps: ``sliding_window`` (Gemma 3 with bidirectional attention
    keeps ``sliding_window // 2 + 1``, as Gemma3TextConfig.__post_init__ sets it)."""
    key = "window_size" if section.get("attention_types") is not None else "sliding_window"
    window = section.get(key, 256 if key == "window_size" else None)
    window = check_int(f"config field {key!r} (the window of its sliding layers)", window)
    if section.get("model_type") == "gemma3_text" and section.get("use_bidirectional_attention"):
        return window // 2 + 1
    return window


def chunk_span(section: Mapping[str, Any]) -> int:
    """The tokens a chunked layer keeps: ``attention_chunk_size``."""
    return check_int("config field 'attention_chunk_size' (the chunk of its chunked layers)",
                     section.get("attention_chunk_size"))


def state_size(section: Mapping[str, Any], kind: str, model_dtype: DType) -> StateSize:
    """One ``linear_attention`` / ``conv`` / ``hybrid`` layer's state, as transformers' cache holds it.

    Raises:
        GeometryError: the family's state is not modelled, or a field it needs is missing or invalid.
    """
    model_type = section.get("model_type")
    rules = family(model_type)
    state = rules.state if rules is not None else _state_by_fields(section)
    if kind == CONV and state != "conv":
        state = "conv" if section.get("conv_L_cache") is not None else None
    if state is None:
        raise GeometryError(
            f"config field 'model_type' ({model_type!r}) has {kind!r} layers whose state is not modelled "
            "(known: Mamba, Mamba-2, gated delta net, LFM2 conv)"
        )
    return _STATE_RULES[state](section, model_dtype)


def _state_by_fields(section: Mapping[str, Any]) -> str | None:
    """A model type without rules: its state kind from the fields it has."""
    if section.get("linear_key_head_dim") is not None:
        return "gdn"
    if section.get("mamba_n_heads") is not None:
        return "mamba2"
    if section.get("mamba_d_state") is not None:
        return "mamba1"
    if section.get("conv_L_cache") is not None:
        return "conv"
    return None


def _mamba1(section: Mapping[str, Any], model_dtype: DType) -> StateSize:
    # transformers/models/jamba/modeling_jamba.py (JambaMambaMixer): intermediate_size =
    # mamba_expand * hidden_size; conv state [intermediate, mamba_d_conv] in the model's dtype,
    # recurrent (SSM) state [intermediate, mamba_d_state] in fp32 (the selective scan's last state).
    intermediate = _int_field(section, "mamba_expand") * _int_field(section, "hidden_size")
    conv = intermediate * _int_field(section, "mamba_d_conv")
    ssm = intermediate * _int_field(section, "mamba_d_state")
    return StateSize(conv, ssm, intermediate, model_dtype)


@dataclass(frozen=True)
class Mamba2:
    """A Mamba-2 mixer's dimensions, from whichever names its family uses."""

    heads: int
    head_dim: int
    groups: int
    state: int
    conv_kernel: int
    intermediate: int

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.groups * self.state


def mamba2_dims(section: Mapping[str, Any]) -> Mamba2:
    """The Mamba-2 mixer of Bamba, Granite-4.0-H, Falcon-H1 (``mamba_*`` fields) or Nemotron-H.

    Intermediate size: Nemotron-H ``mamba_num_heads * mamba_head_dim``; Falcon-H1 ``mamba_d_ssm``
    (else ``mamba_expand * hidden_size``); the others ``mamba_expand * hidden_size``. A head width
    of ``"auto"`` is the intermediate size over the heads.
    """
    if section.get("model_type") == "nemotron_h":
        heads, head_dim = _int_field(section, "mamba_num_heads"), _int_field(section, "mamba_head_dim")
        return Mamba2(heads, head_dim, _int_field(section, "n_groups"), _int_field(section, "ssm_state_size"),
                      _int_field(section, "conv_kernel"), heads * head_dim)
    hidden = _int_field(section, "hidden_size")
    heads = _int_field(section, "mamba_n_heads")
    if section.get("mamba_d_ssm") is not None:
        intermediate = _int_field(section, "mamba_d_ssm")
    else:
        intermediate = _int_field(section, "mamba_expand") * hidden
    head_dim = section.get("mamba_d_head", "auto")
    if head_dim == "auto":
        if intermediate % heads:
            raise GeometryError(f"config field 'mamba_n_heads' ({heads}) must divide the Mamba-2 width {intermediate}")
        head_dim = intermediate // heads
    else:
        head_dim = _int_field(section, "mamba_d_head")
    return Mamba2(heads, head_dim, _int_field(section, "mamba_n_groups"), _int_field(section, "mamba_d_state"),
                  _int_field(section, "mamba_d_conv"), intermediate)


def _mamba2(section: Mapping[str, Any], model_dtype: DType) -> StateSize:
    # transformers/models/bamba/modeling_bamba.py (BambaMixer; Granite-4.0-H, Falcon-H1, Nemotron-H
    # alike): conv_dim = intermediate + 2 * n_groups * d_state; conv state [conv_dim, d_conv] in the
    # model's dtype, SSM state [num_heads, head_dim, d_state] in fp32.
    dims = mamba2_dims(section)
    return StateSize(dims.conv_dim * dims.conv_kernel, dims.heads * dims.head_dim * dims.state, dims.heads,
                     model_dtype)


def _gdn(section: Mapping[str, Any], model_dtype: DType) -> StateSize:
    # transformers/models/qwen3_next/modeling_qwen3_next.py (Qwen3NextGatedDeltaNet): conv over
    # q, k and v, conv_dim = 2 * key_dim + value_dim (key_dim = linear_num_key_heads *
    # linear_key_head_dim, value_dim = linear_num_value_heads * linear_value_head_dim), state
    # [conv_dim, linear_conv_kernel_dim] in the model's dtype; recurrent state [linear_num_value_heads,
    # linear_key_head_dim, linear_value_head_dim] in fp32.
    key_heads, value_heads = _int_field(section, "linear_num_key_heads"), _int_field(section, "linear_num_value_heads")
    key_dim, value_dim = _int_field(section, "linear_key_head_dim"), _int_field(section, "linear_value_head_dim")
    if value_heads % key_heads:
        raise GeometryError(
            f"config field 'linear_num_value_heads' ({value_heads}) must be a multiple of "
            f"'linear_num_key_heads' ({key_heads})"
        )
    conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
    conv = conv_dim * _int_field(section, "linear_conv_kernel_dim")
    return StateSize(conv, value_heads * key_dim * value_dim, key_heads, model_dtype)


def _lfm2_conv(section: Mapping[str, Any], model_dtype: DType) -> StateSize:
    # transformers/models/lfm2/modeling_lfm2.py (Lfm2ShortConv): a depthwise conv over hidden_size
    # channels, state [hidden_size, conv_L_cache] in the model's dtype; no recurrent state.
    hidden = _int_field(section, "hidden_size")
    return StateSize(hidden * _int_field(section, "conv_L_cache"), 0, hidden, model_dtype)


_STATE_RULES: dict[str, Callable[[Mapping[str, Any], DType], StateSize]] = {
    "mamba1": _mamba1,
    "mamba2": _mamba2,
    "gdn": _gdn,
    "conv": _lfm2_conv,
}


def state_kind(section: Mapping[str, Any]) -> str | None:
    """``"mamba1"``, ``"mamba2"``, ``"gdn"``, ``"conv"`` or None: how the family's state layers work."""
    rules = family(section.get("model_type"))
    return rules.state if rules is not None else _state_by_fields(section)


def attention_head_dim(section: Mapping[str, Any]) -> int | None:
    """The attention head width the family's modeling code uses when it is not the generic
    ``head_dim`` field; None: read ``head_dim`` (else ``hidden_size // num_attention_heads``)."""
    rules = family(section.get("model_type"))
    if rules is None or rules.head_dim is None:
        return None
    return rules.head_dim(section)
