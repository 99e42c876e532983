"""Parameter counts derived from a Hugging Face config: total (weight memory), active (compute).

Counted: the token embedding and the LM head (one matrix when ``tie_word_embeddings``); per
layer its sequence mixer (attention, MLA, a Mamba / Mamba-2 mixer, a gated delta net, LFM2's
short convolution, or attention and Mamba-2 side by side), two norms, and its feed-forward
block as the family lays it out: a gated MLP (gate, up, down: ``3 * hidden * intermediate``),
Nemotron-H's two-matrix ReLU² MLP, or a MoE block (router, routed experts, shared experts);
the final norm. Active parameters are the total less the routed experts a token does not visit.

Left out, on purpose:

* Linear biases (Qwen2's q/k/v, gpt-oss' attention and expert biases), attention sinks and
  per-head q/k norms: under 0.1% of any model here.
* DeepSeek-V3's multi-token-prediction module (``num_nextn_predict_layers``, 14B parameters):
  a training / speculative-decoding head outside the 671B main model DeepSeek reports.

A weight field the count needs but the config lacks (``vocab_size``, ``intermediate_size``,
``moe_intermediate_size``...) does not stop the count: that part counts as zero and
:attr:`ParamCount.uncounted` names the field. The KV size never depends on these fields.

An absent ``tie_word_embeddings`` means untied, the default of the Llama, Mistral, Qwen2 and
DeepSeek config classes (family defaults, :mod:`kvstrata.kv.families`, supply the others').
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstrata.kv import families
from kvstrata.kv.layerkinds import LayerKind
from kvstrata.kv.states import Section, StateKind, mamba2_dims
from kvstrata.kv.fields import GeometryError, get_int

if TYPE_CHECKING:  # geometry imports this module; the shape is only read here
    from kvstrata.kv.readconfig import KVShape

# A gated-SiLU MLP holds three hidden x intermediate matrices: gate, up and down.
_MLP_MATRICES = 3
# Norms per decoder layer, where not two (before the mixer, before the feed-forward block): Gemma
# adds one after each; Cohere 2 runs both in parallel off one; a Nemotron-H block is one or the other.
_NORMS_PER_LAYER = {"gemma2": 4, "gemma3_text": 4, "cohere2": 1, "nemotron_h": 1}
# Families whose attention output is gated by a second half of q_proj (q_proj is 2x wide).
_GATED_ATTENTION = frozenset({"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"})


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts of one model.

    Attributes:
        total: Every parameter, all experts included (what could be counted).
        active: Parameters used per token (shared + top-k routed experts for MoE).
        uncounted: Config fields (or parts, e.g. ``"vision_config"``) the count could not
            include; empty when the count is complete. The counts are then lower bounds.
    """

    total: int
    active: int
    uncounted: tuple[str, ...] = ()


@dataclass(frozen=True)
class _FFN:
    """One layer's feed-forward block: all its parameters, and those one token uses."""

    total: int
    active: int


class _Reader:
    """Reads weight fields, noting the missing ones instead of failing."""

    def __init__(self, section: Section) -> None:
        self.section = section
        self.missing: list[str] = []

    def int(self, key: str, minimum: int = 1) -> int:
        value = get_int(self.section, key, minimum=minimum)
        if value is None:
            if key not in self.missing:
                self.missing.append(key)
            return 0
        return value

    def optional(self, key: str, minimum: int = 1) -> int | None:
        return get_int(self.section, key, minimum=minimum)


def count_params(
    section: Section, shape: KVShape, layer_kinds: Sequence[LayerKind] | None = None
) -> ParamCount:
    """Count a decoder's parameters from its config and its already-read KV shape.

    Args:
        section: The decoder's config fields (family defaults filled in).
        shape: Its layers, hidden size, query heads and KV heads and width (MLA: the latent's).
        layer_kinds: Each layer's kind (:mod:`kvstrata.kv.families`); None: every layer full
            attention.

    Raises:
        GeometryError: a field the count reads is present but invalid, or the MoE layout is
            inconsistent (more experts per token than experts).
    """
    read = _Reader(section)
    layers, hidden = shape.num_layers, shape.hidden_size
    kinds = tuple(layer_kinds) if layer_kinds is not None else (LayerKind.FULL,) * layers
    vocab = read.int("vocab_size")
    embeddings = vocab * hidden * (1 if section.get("tie_word_embeddings") else 2)
    attention = _attention_params(section, shape)
    mixer = {kind: _mixer_params(read, section, shape, kind, attention) for kind in set(kinds)}
    ffn = _ffn_layout(read, section, kinds, hidden)
    norms = _NORMS_PER_LAYER.get(section.get("model_type"), 2) * hidden
    total = active = embeddings + hidden
    for index, kind in enumerate(kinds):
        block = ffn(index, kind)
        total += mixer[kind] + norms + block.total
        active += mixer[kind] + norms + block.active
    return ParamCount(total=total, active=active, uncounted=tuple(read.missing))


# --- sequence mixers -------------------------------------------------------------------------------


def _attention_params(section: Section, shape: KVShape) -> int:
    hidden, heads = shape.hidden_size, shape.num_attention_heads
    if shape.kv_lora_rank is not None:
        return _mla_attention_params(section, hidden, heads, shape.kv_lora_rank, shape.qk_rope_head_dim)
    # q and o: hidden x (heads * head_dim); k and v: hidden x (kv_heads * head_dim).
    params = 2 * hidden * shape.head_dim * (heads + shape.num_kv_heads)
    if section.get("model_type") in _GATED_ATTENTION:
        params += hidden * heads * shape.head_dim  # q_proj's second half: the output gate
    return params


def _mla_attention_params(
    section: Section, hidden: int, heads: int, kv_lora_rank: int, rope_dim: int
) -> int:
    """One MLA layer's projections, as in DeepSeek-V2/V3's modeling code."""
    from kvstrata.kv.fields import require_int

    nope_dim = require_int(section, "qk_nope_head_dim")
    v_dim = require_int(section, "v_head_dim")
    q_lora_rank = get_int(section, "q_lora_rank")
    q_out = heads * (nope_dim + rope_dim)
    if q_lora_rank is None:  # V2-Lite: a plain q_proj
        q = hidden * q_out
    else:  # q_a_proj, its RMSNorm, q_b_proj
        q = hidden * q_lora_rank + q_lora_rank + q_lora_rank * q_out
    # kv_a_proj_with_mqa (latent + RoPE key), its RMSNorm, kv_b_proj (latent -> per-head k_nope, v)
    kv_a = hidden * (kv_lora_rank + rope_dim) + kv_lora_rank
    kv_b = kv_lora_rank * heads * (nope_dim + v_dim)
    o = heads * v_dim * hidden
    return q + kv_a + kv_b + o


def _mixer_params(read: _Reader, section: Section, shape: KVShape, kind: LayerKind, attention: int) -> int:
    """One layer's sequence mixer of ``kind``."""
    if kind.mixerless:
        return 0
    if kind.per_token:
        return attention
    state = _state_params(section, shape.hidden_size)
    return attention + state if kind.attends else state


def _state_params(section: Section, hidden: int) -> int:
    kind = families.state_kind(section)
    if kind is StateKind.MAMBA1:
        return _mamba1_params(section, hidden)
    if kind is StateKind.MAMBA2:
        return _mamba2_params(section, hidden)
    if kind is StateKind.GDN:
        return _gdn_params(section, hidden)
    if kind is StateKind.CONV:
        return _conv_params(section, hidden)
    raise GeometryError(f"config field 'model_type' ({section.get('model_type')!r}): its state layers are not modelled")


def _bias(section: Section, key: str, size: int) -> int:
    return size if section.get(key) else 0


def _mamba1_params(section: Section, hidden: int) -> int:
    """JambaMambaMixer (transformers/models/jamba/modeling_jamba.py)."""
    inner = section["mamba_expand"] * hidden
    state, kernel = section["mamba_d_state"], section["mamba_d_conv"]
    rank = section.get("mamba_dt_rank", "auto")
    rank = math.ceil(hidden / 16) if rank in (None, "auto") else int(rank)
    in_proj = hidden * 2 * inner + _bias(section, "mamba_proj_bias", 2 * inner)
    conv = inner * kernel + _bias(section, "mamba_conv_bias", inner)
    x_proj = inner * (rank + 2 * state)
    dt_proj = rank * inner + inner
    a_log_d = inner * state + inner
    out_proj = inner * hidden + _bias(section, "mamba_proj_bias", hidden)
    norms = rank + 2 * state  # dt, B and C RMSNorms
    return in_proj + conv + x_proj + dt_proj + a_log_d + out_proj + norms


def _mamba2_params(section: Section, hidden: int) -> int:
    """BambaMixer and its kin (transformers/models/bamba/modeling_bamba.py): in_proj to
    intermediate + conv_dim + heads, depthwise conv, dt_bias / A_log / D per head, gated norm, out_proj."""
    dims = mamba2_dims(section)
    proj_bias = "mamba_proj_bias"
    conv_bias = "use_conv_bias" if section.get("model_type") == "nemotron_h" else "mamba_conv_bias"
    projection = dims.intermediate + dims.conv_dim + dims.heads
    in_proj = hidden * projection + _bias(section, proj_bias, projection)
    conv = dims.conv_dim * dims.conv_kernel + _bias(section, conv_bias, dims.conv_dim)
    out_proj = dims.intermediate * hidden + _bias(section, proj_bias, hidden)
    # The gated RMSNorm over the intermediate width; Falcon-H1 has it only with mamba_rms_norm.
    norm = dims.intermediate if section.get("model_type") != "falcon_h1" or section.get("mamba_rms_norm") else 0
    return in_proj + conv + 3 * dims.heads + norm + out_proj


def _gdn_params(section: Section, hidden: int) -> int:
    """Qwen3NextGatedDeltaNet (transformers/models/qwen3_next/modeling_qwen3_next.py)."""
    key_dim = section["linear_num_key_heads"] * section["linear_key_head_dim"]
    value_heads = section["linear_num_value_heads"]
    value_dim = value_heads * section["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    in_proj = hidden * (2 * key_dim + 2 * value_dim) + hidden * 2 * value_heads  # qkvz, then b and a
    conv = conv_dim * section["linear_conv_kernel_dim"]
    return in_proj + conv + 2 * value_heads + section["linear_value_head_dim"] + value_dim * hidden


def _conv_params(section: Section, hidden: int) -> int:
    """Lfm2ShortConv (transformers/models/lfm2/modeling_lfm2.py): in_proj to 3 x hidden, a
    depthwise conv of conv_L_cache taps, out_proj."""
    bias = section.get("conv_bias")
    in_proj = hidden * 3 * hidden + (3 * hidden if bias else 0)
    conv = hidden * section["conv_L_cache"] + (hidden if bias else 0)
    out_proj = hidden * hidden + (hidden if bias else 0)
    return in_proj + conv + out_proj


# --- feed-forward blocks ---------------------------------------------------------------------------


def _dense(hidden: int, intermediate: int, matrices: int = _MLP_MATRICES) -> _FFN:
    params = matrices * hidden * intermediate
    return _FFN(params, params)


def _moe(hidden: int, experts: int, per_token: int, expert_params: int, shared: int = 0, router: int | None = None) -> _FFN:
    if per_token > experts:
        raise GeometryError(
            f"config field 'num_experts_per_tok' ({per_token}) exceeds the {experts} routed experts"
        )
    router = hidden * experts if router is None else router
    return _FFN(router + experts * expert_params + shared, router + per_token * expert_params + shared)


def _ffn_layout(read: _Reader, section: Section, kinds: Sequence[LayerKind], hidden: int):
    """A function of (layer index, layer kind) giving that layer's feed-forward block."""
    model_type = section.get("model_type")
    layers = len(kinds)
    none = _FFN(0, 0)
    if model_type == "nemotron_h":
        return _nemotron_ffn(read, section, hidden)
    if model_type == "granitemoehybrid":
        return _granite_ffn(read, section, hidden)
    if model_type == "lfm2":
        block = _dense(hidden, _lfm2_intermediate(read, section))
        return lambda index, kind: block
    if model_type == "llama4_text":
        return _llama4_ffn(read, section, hidden, layers)
    if read.optional("n_routed_experts") is not None:
        return _deepseek_ffn(read, section, hidden, layers)
    if model_type == "jamba":
        return _jamba_ffn(read, section, hidden)
    if section.get("num_experts"):
        return _qwen_moe_ffn(read, section, hidden)
    if read.optional("num_local_experts") is not None:
        # Mixtral, gpt-oss: every layer routes among experts of width intermediate_size.
        experts = read.int("num_local_experts")
        block = _moe(hidden, experts, read.int("num_experts_per_tok"),
                     _MLP_MATRICES * hidden * read.int("intermediate_size"))
        return lambda index, kind: block
    dense = _dense(hidden, read.int("intermediate_size"))
    return lambda index, kind: none if kind.mixerless else dense


def _qwen_moe_ffn(read: _Reader, section: Section, hidden: int):
    """Qwen2-MoE / Qwen3-MoE / Qwen3-Next / Qwen3.5-MoE: layers route unless in mlp_only_layers or
    off the decoder_sparse_step; experts of moe_intermediate_size, a shared expert (and its
    one-output gate) where shared_expert_intermediate_size is set."""
    experts, per_token = read.int("num_experts"), read.int("num_experts_per_tok")
    step = read.optional("decoder_sparse_step") or 1
    dense_only = set(section.get("mlp_only_layers") or [])
    shared_width = read.optional("shared_expert_intermediate_size")
    shared = _MLP_MATRICES * hidden * shared_width + hidden if shared_width else 0
    moe = _moe(hidden, experts, per_token, _MLP_MATRICES * hidden * read.int("moe_intermediate_size"), shared)
    return _routed_or_dense(read, hidden, moe, lambda index: index not in dense_only and (index + 1) % step == 0,
                            "intermediate_size")


def _deepseek_ffn(read: _Reader, section: Section, hidden: int, layers: int):
    # DeepSeek: the first first_k_dense_replace layers are dense, then every moe_layer_freq-th
    # layer routes; shared experts run for every token.
    first_dense = read.optional("first_k_dense_replace", minimum=0) or 0
    every = read.optional("moe_layer_freq") or 1
    shared = read.optional("n_shared_experts", minimum=0) or 0
    expert = _MLP_MATRICES * hidden * read.int("moe_intermediate_size")
    moe = _moe(hidden, read.int("n_routed_experts"), read.int("num_experts_per_tok"), expert, shared * expert)
    return _routed_or_dense(read, hidden, moe, lambda index: index >= first_dense and index % every == 0,
                            "intermediate_size")


def _jamba_ffn(read: _Reader, section: Section, hidden: int):
    # JambaConfig.layers_num_experts: experts where i % expert_layer_period == expert_layer_offset.
    period, offset = read.int("expert_layer_period"), read.int("expert_layer_offset", minimum=0)
    width = read.int("intermediate_size")
    moe = _moe(hidden, read.int("num_experts"), read.int("num_experts_per_tok"), _MLP_MATRICES * hidden * width)
    dense = _dense(hidden, width)
    return lambda index, kind: moe if period and index % period == offset else dense


def _llama4_ffn(read: _Reader, section: Section, hidden: int, layers: int):
    # Llama4TextConfig.moe_layers (else every interleave_moe_layer_step-th layer): experts and a
    # shared expert of intermediate_size; the other layers a dense MLP of intermediate_size_mlp.
    moe_layers = section.get("moe_layers")
    if moe_layers is None:
        step = read.int("interleave_moe_layer_step") or 1
        moe_layers = range(step - 1, layers, step)
    moe_layers = set(moe_layers)
    width = read.int("intermediate_size")
    expert = _MLP_MATRICES * hidden * width
    moe = _moe(hidden, read.int("num_local_experts"), read.int("num_experts_per_tok"), expert, expert)
    return _routed_or_dense(read, hidden, moe, moe_layers.__contains__, "intermediate_size_mlp")


def _routed_or_dense(read: _Reader, hidden: int, moe: _FFN, routes: Callable[[int], bool], dense_width: str):
    """The FFN of layer ``index``: ``moe`` where ``routes(index)``, else a dense MLP of the
    ``dense_width`` field, read only once a layer is dense (a config whose layers all route may
    leave it out)."""
    dense: list[_FFN] = []

    def block(index: int, kind: LayerKind) -> _FFN:
        if routes(index):
            return moe
        if not dense:
            dense.append(_dense(hidden, read.int(dense_width)))
        return dense[0]

    return block


def _granite_ffn(read: _Reader, section: Section, hidden: int):
    # GraniteMoeHybridDecoderLayer: every layer a gated shared MLP of shared_intermediate_size, plus
    # (with num_local_experts > 0) routed experts of intermediate_size.
    shared = _MLP_MATRICES * hidden * read.int("shared_intermediate_size")
    experts = read.optional("num_local_experts", minimum=0) or 0
    if experts:
        block = _moe(hidden, experts, read.int("num_experts_per_tok"),
                     _MLP_MATRICES * hidden * read.int("intermediate_size"), shared)
    else:
        block = _FFN(shared, shared)
    return lambda index, kind: block


def _nemotron_ffn(read: _Reader, section: Section, hidden: int):
    # NemotronH (transformers/models/nemotron_h/modeling_nemotron_h.py): "mlp" layers a two-matrix
    # ReLU² MLP of intermediate_size; "moe" layers routed experts (up and down over the latent or
    # hidden width), a router, one shared two-matrix MLP of
    # moe_shared_expert_intermediate_size and, with moe_latent_size, the latent projections.
    cache: dict[LayerKind, _FFN] = {}

    def block(index: int, kind: LayerKind) -> _FFN:
        if not kind.mixerless:
            return _FFN(0, 0)
        if kind not in cache:
            if kind is LayerKind.MLP:
                cache[kind] = _dense(hidden, read.int("intermediate_size"), matrices=2)
            else:
                latent = read.optional("moe_latent_size")
                width = latent or hidden
                experts = read.int("n_routed_experts")
                shared = 2 * hidden * read.int("moe_shared_expert_intermediate_size")
                shared += 2 * hidden * latent if latent else 0
                cache[kind] = _moe(hidden, experts, read.int("num_experts_per_tok"),
                                   2 * width * read.int("moe_intermediate_size"), shared)
        return cache[kind]

    return block


def _lfm2_intermediate(read: _Reader, section: Section) -> int:
    """Lfm2MLP's width: with block_auto_adjust_ff_dim, 2/3 of intermediate_size, scaled by
    block_ffn_dim_multiplier and rounded up to block_multiple_of."""
    width = read.int("intermediate_size")
    if section.get("block_auto_adjust_ff_dim"):
        width = int(2 * width / 3)
        multiplier = section.get("block_ffn_dim_multiplier")
        if multiplier is not None:
            multiple = read.int("block_multiple_of")
            width = int(multiplier * width)
            width = multiple * ((width + multiple - 1) // multiple) if multiple else width
    return width
