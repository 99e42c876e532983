"""Which decoder layers of a Hugging Face config cache what, and how much, family by family.

A config states some of this outright (``layer_types``) and leaves the rest to its family's
config class (:mod:`kvstrata.kv.familyrules`: defaults, renamed fields, each layer's kind as
``__post_init__`` derives it). This module puts the two together: a decoder section over its
family's defaults (:func:`with_defaults`), each layer's :class:`~kvstrata.kv.layerkinds.LayerKind`
(:func:`layer_types`), the state of its recurrent layers (:func:`state_size`) and its attention
head width. Pure: no torch, no transformers.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvstrata.kv.dtypes import DType
from kvstrata.kv.familyrules import ALIASES, FAMILIES, Family
from kvstrata.kv.fields import GeometryError
from kvstrata.kv.layerkinds import (
    LayerKind,
    LayerTypes,
    chunk_span,
    listed_layer_kinds,
    refuse_unmodelled,
    sliding_span,
)
from kvstrata.kv.states import Mamba2, Section, StateKind, StateSize, mamba2_dims, sized_state, state_by_fields

__all__ = [
    "FAMILIES", "PURE_RECURRENT_MODEL_TYPES", "TEXT_MODEL_TYPES", "UNMODELLED_MODEL_TYPES", "Family", "LayerKind",
    "LayerTypes", "Mamba2", "StateKind", "StateSize", "attention_head_dim", "chunk_span", "derived_layer_count",
    "family", "layer_types", "mamba2_dims", "sliding_span", "state_kind", "state_size", "with_defaults",
]

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


def family(model_type: object) -> Family | None:
    """The rules of ``model_type``; None for a model type with no rules of its own."""
    return FAMILIES.get(model_type) if isinstance(model_type, str) else None


def with_defaults(section: Mapping[str, object], model_type: str | None) -> dict[str, object]:
    """``section`` with its family's renamed fields moved to their new names and the config
    class's defaults filled in where the file leaves a field out."""
    out = dict(section)
    for old, new in ALIASES.get(model_type or "", ()):
        if out.get(old) is not None:
            out[new] = out.pop(old)
    rules = family(model_type)
    if rules is not None:
        for key, value in rules.defaults.items():
            out.setdefault(key, value)
    if model_type is not None:
        out["model_type"] = model_type
    return out


def layer_types(section: Section, num_layers: int) -> LayerTypes:
    """Each decoder layer's kind: the config's own list if it has one, else its family's rule,
    else what transformers' cache assumes (every layer sliding under a ``sliding_window``,
    chunked under an ``attention_chunk_size``, else full).

    Raises:
        GeometryError: the list is not a list of strings, its length is not the layer count, or
            a kind (listed, or the family's) is not modelled: the message names the field.
    """
    listed = listed_layer_kinds(section, num_layers)
    if listed is not None:
        return listed
    model_type = section.get("model_type")
    rules = family(model_type)
    if rules is not None and rules.unmodelled_kind is not None:
        raise refuse_unmodelled([rules.unmodelled_kind],
                                f"config field 'model_type' ({model_type!r}) gives its layers the kind")
    if rules is not None and rules.derive is not None:
        return LayerTypes.derived(rules.derive(section, num_layers), "model_type")
    if section.get("sliding_window") is not None and section.get("use_sliding_window", True):
        return LayerTypes.derived((LayerKind.SLIDING,) * num_layers, "sliding_window")
    if section.get("attention_chunk_size") is not None:
        return LayerTypes.derived((LayerKind.CHUNKED,) * num_layers, "attention_chunk_size")
    return LayerTypes.derived((LayerKind.FULL,) * num_layers, "num_hidden_layers")


def derived_layer_count(section: Section) -> int | None:
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


def state_kind(section: Section) -> StateKind | None:
    """How the family's state layers work; None: it has none that kvstrata models."""
    rules = family(section.get("model_type"))
    return rules.state if rules is not None else state_by_fields(section)


def state_size(section: Section, kind: LayerKind, model_dtype: DType) -> StateSize:
    """One ``linear_attention`` / ``conv`` / ``hybrid`` layer's state, as transformers' cache holds it.

    Raises:
        GeometryError: the family's state is not modelled, or a field it needs is missing or invalid.
    """
    state = state_kind(section)
    if kind is LayerKind.CONV and state is not StateKind.CONV:
        state = StateKind.CONV if section.get("conv_L_cache") is not None else None
    if state is None:
        raise GeometryError(
            f"config field 'model_type' ({section.get('model_type')!r}) has {kind.value!r} layers whose state "
            "is not modelled (known: Mamba, Mamba-2, gated delta net, LFM2 conv)"
        )
    return sized_state(state, section, model_dtype)


def attention_head_dim(section: Section) -> int | None:
    """The attention head width the family's modeling code uses when it is not the generic
    ``head_dim`` field; None: read ``head_dim`` (else ``hidden_size // num_attention_heads``)."""
    rules = family(section.get("model_type"))
    if rules is None or rules.head_dim is None:
        return None
    return rules.head_dim(section)
