"""Parameter counts derived from a Hugging Face config: total (weight memory), active (compute).

Counted: the token embedding and the LM head (one matrix when ``tie_word_embeddings``); per
layer the attention projections, two RMSNorms and either a gated-SiLU MLP (gate, up, down:
``3 * hidden * intermediate``) or a MoE block (router plus experts, each such an MLP); the
final norm. Active parameters are the total less the routed experts a token does not visit.

Left out, on purpose:

* Linear biases (Qwen2's q/k/v): under 0.01% of any model here.
* DeepSeek-V3's multi-token-prediction module (``num_nextn_predict_layers``, 14B parameters):
  a training / speculative-decoding head outside the 671B main model DeepSeek reports.

An absent ``tie_word_embeddings`` means untied, the default of the Llama, Mistral, Qwen2 and
DeepSeek config classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstrata.kv.fields import GeometryError, get_int, require_int

if TYPE_CHECKING:  # geometry imports this module; the shape is only read here
    from kvstrata.kv.geometry import KVShape

# A gated-SiLU MLP holds three hidden x intermediate matrices: gate, up and down.
_MLP_MATRICES = 3


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts of one model.

    Attributes:
        total: Every parameter, all experts included.
        active: Parameters used per token (shared + top-k routed experts for MoE).
    """

    total: int
    active: int


@dataclass(frozen=True)
class _MoE:
    """A MoE layout: which layers route, and how many experts of what width."""

    routed_experts: int
    experts_per_token: int
    shared_experts: int
    expert_intermediate: int
    moe_layers: int


def count_params(section: Mapping[str, Any], shape: KVShape) -> ParamCount:
    """Count a decoder's parameters from its config and its already-read KV shape.

    Args:
        section: The decoder's config fields.
        shape: Its layers, hidden size, query heads and KV heads and width (MLA: the latent's).

    Raises:
        GeometryError: a field the count needs is missing or invalid, or the MoE layout is
            one this module does not know.
    """
    layers, hidden, heads = shape.num_layers, shape.hidden_size, shape.num_attention_heads
    vocab = require_int(section, "vocab_size")
    embeddings = vocab * hidden * (1 if section.get("tie_word_embeddings") else 2)
    if shape.kv_lora_rank is None:
        # q and o: hidden x (heads * head_dim); k and v: hidden x (kv_heads * head_dim).
        attention = 2 * hidden * shape.head_dim * (heads + shape.num_kv_heads)
    else:
        attention = _mla_attention_params(section, hidden, heads, shape.kv_lora_rank, shape.qk_rope_head_dim)
    moe = _moe_layout(section, layers)
    moe_layers = moe.moe_layers if moe else 0
    dense_layers = layers - moe_layers
    dense_mlp = 0
    if dense_layers:
        dense_mlp = _MLP_MATRICES * hidden * require_int(section, "intermediate_size")
    common = embeddings + hidden + layers * (attention + 2 * hidden) + dense_layers * dense_mlp
    if moe is None:
        return ParamCount(total=common, active=common)
    expert = _MLP_MATRICES * hidden * moe.expert_intermediate
    router = hidden * moe.routed_experts
    stored_experts = moe.routed_experts + moe.shared_experts
    visited_experts = moe.experts_per_token + moe.shared_experts
    return ParamCount(
        total=common + moe_layers * (router + stored_experts * expert),
        active=common + moe_layers * (router + visited_experts * expert),
    )


def _mla_attention_params(
    section: Mapping[str, Any], hidden: int, heads: int, kv_lora_rank: int, rope_dim: int
) -> int:
    """One MLA layer's projections, as in DeepSeek-V2/V3's modeling code."""
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


def _moe_layout(section: Mapping[str, Any], layers: int) -> _MoE | None:
    if get_int(section, "num_local_experts") is not None:
        # Mixtral: every layer routes among experts of width intermediate_size; no shared expert.
        moe = _MoE(
            routed_experts=require_int(section, "num_local_experts"),
            experts_per_token=require_int(section, "num_experts_per_tok"),
            shared_experts=0,
            expert_intermediate=require_int(section, "intermediate_size"),
            moe_layers=layers,
        )
    elif get_int(section, "n_routed_experts") is not None:
        # DeepSeek: the first first_k_dense_replace layers are dense, then every moe_layer_freq-th
        # layer routes; shared experts run for every token.
        first_dense = get_int(section, "first_k_dense_replace", minimum=0) or 0
        every = get_int(section, "moe_layer_freq") or 1
        moe = _MoE(
            routed_experts=require_int(section, "n_routed_experts"),
            experts_per_token=require_int(section, "num_experts_per_tok"),
            shared_experts=get_int(section, "n_shared_experts", minimum=0) or 0,
            expert_intermediate=require_int(section, "moe_intermediate_size"),
            moe_layers=sum(1 for layer in range(first_dense, layers) if layer % every == 0),
        )
    elif section.get("num_experts"):
        raise GeometryError(
            "config field 'num_experts' declares a MoE layout that is not supported; supported: "
            "Mixtral ('num_local_experts') and DeepSeek ('n_routed_experts')"
        )
    else:
        return None
    if moe.experts_per_token > moe.routed_experts:
        raise GeometryError(
            f"config field 'num_experts_per_tok' ({moe.experts_per_token}) exceeds the "
            f"{moe.routed_experts} routed experts"
        )
    return moe
