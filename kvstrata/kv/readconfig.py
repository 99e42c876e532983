"""Reading a Hugging Face ``config.json`` into a decoder's KV shape and its KV geometry.

Pure: :func:`geometry_from_config` takes an already-parsed config dict (reading files and presets
is :mod:`kvstrata.kv.presets`' job). The decoder's fields are read from the top level, or from
``text_config`` for a multimodal wrapper, over its family's defaults (:mod:`kvstrata.kv.families`);
each layer's kind, window and state follow the family's rules, and the result is a
:class:`~kvstrata.kv.geometry.KVGeometry` of one KV group per kind (:mod:`kvstrata.kv.groups`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvstrata.kv import families
from kvstrata.kv.dtypes import DType
from kvstrata.kv.fields import GeometryError, get_int, require_int
from kvstrata.kv.geometry import Attention, KVGeometry, attention_for_heads
from kvstrata.kv.groups import GroupKind, KVGroup
from kvstrata.kv.layerkinds import LayerKind, LayerTypes
from kvstrata.kv.params import count_params

_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_DTYPE_KEYS = ("torch_dtype", "dtype")

# Model types kv_shape_from_config refuses: no uniform per-token KV (a state beside or instead of
# it). geometry_from_config sizes the hybrids among them through their KV groups.
_RECURRENT_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "rwkv", "rwkv5", "rwkv6", "recurrent_gemma", "xlstm",
    "jamba", "zamba", "zamba2", "bamba", "falcon_h1", "nemotron_h", "granitemoehybrid",
    "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "lfm2", "minimax", "kimi_linear", "olmo_hybrid",
})
# Sub-configs of a multimodal wrapper whose weights the count leaves out (the decoder's are counted).
_NOT_DECODER_CONFIGS = frozenset({"text_config", "quantization_config"})


@dataclass(frozen=True)
class KVShape:
    """The shape of a decoder's KV per token, as its config states it (nothing sized): the
    fields of :class:`KVGeometry` of the same names (attention from the head counts, or MLA's
    latent fields), and ``hidden_size``, the model's width."""

    attention: Attention
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None


def kv_shape_from_config(config: Mapping[str, object]) -> KVShape:
    """Read a Hugging Face decoder config's per-token KV shape: layers, heads, head width.

    This is the one reading of those fields; :func:`geometry_from_config` builds on it. Unlike
    that function it sizes nothing, so it accepts windowed or chunked attention (fewer tokens
    are kept, each of this shape) and MoE layouts (they shape weights, not KV). Recurrent and
    hybrid architectures, which have no uniform per-token KV, are refused, as are layers of
    other kinds (linear attention, Mamba): their KV groups come from :func:`geometry_from_config`.
    Reads the top level, or ``text_config`` when the top level has no layer count.

    Args:
        config: A parsed ``config.json``.

    Raises:
        GeometryError: A required field is missing or not a positive integer, the head counts
            are inconsistent, or the architecture is recurrent or hybrid (by model type or by
            its layers' kinds). The message names the config field.
    """
    config = _checked_mapping(config)
    section = _decoder(config)
    model_type = section.get("model_type")
    if model_type in _RECURRENT_MODEL_TYPES:
        raise GeometryError(
            f"config field 'model_type' is {model_type!r}, a recurrent or hybrid architecture "
            "without a uniform per-token KV cache; it has no one KV shape (see its KV groups)"
        )
    shape = _shape(section)
    types = families.layer_types(section, shape.num_layers)
    other = sorted({kind.value for kind in types.kinds if not kind.per_token})
    if other:
        raise GeometryError(
            f"config field {types.field!r} declares {other} layers, whose cache is not per-token "
            "K and V of one shape (a fixed-size state, a compressed or indexed cache); the model "
            "has no one KV shape"
        )
    return shape


def geometry_from_config(
    config: Mapping[str, object], *, name: str = "model", dtype: DType | str | None = None
) -> KVGeometry:
    """Derive a model's KV geometry (its KV groups) and parameter counts from its Hugging Face config.

    Reads the decoder fields from the top level, or from ``text_config`` when the top level
    has no layer count (multimodal wrappers), over the defaults of the model type's config class
    (:mod:`kvstrata.kv.families`). Each layer's kind comes from ``layer_types`` (or the family's
    own spelling of it), else from the family's rule, as transformers derives it: full, sliding
    and chunked attention, MLA, Mamba / Mamba-2 / gated-delta-net states, hybrid layers holding
    both.

    Args:
        config: A parsed ``config.json``.
        name: Model name to carry.
        dtype: KV dtype; wins over the config's ``torch_dtype``/``dtype``; bf16 if neither. A
            recurrent state keeps the types transformers caches it in (the conv state the model's
            dtype, the SSM / delta-rule state fp32).

    Returns:
        The geometry.

    Raises:
        GeometryError: A required field is missing or not a positive integer, the head counts
            are inconsistent, a layer kind is not modelled (DeepSeek-V3.2's indexed attention,
            an unknown ``layer_types`` entry), or the model has no attention layer. The message
            names the config field.
    """
    config = _checked_mapping(config)
    section = _decoder(config)
    _reject_unmodelled(section)
    shape = _shape(section)
    types = families.layer_types(section, shape.num_layers)
    kv_dtype = _resolve_dtype(dtype, section, config)
    groups = _groups(section, shape, types, kv_dtype, _resolve_dtype(None, section, config))
    params = count_params(section, shape, types.kinds)
    return KVGeometry(
        name=name,
        attention=shape.attention,
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        dtype=kv_dtype,
        total_params=params.total,
        active_params=params.active,
        num_attention_heads=shape.num_attention_heads,
        kv_lora_rank=shape.kv_lora_rank,
        qk_rope_head_dim=shape.qk_rope_head_dim,
        weight_dtype=_weight_dtype(section, config),
        groups=groups,
        max_context=get_int(section, "max_position_embeddings"),
        uncounted_params=params.uncounted + _other_towers(config),
    )


def _checked_mapping(config: object) -> Mapping[str, object]:
    if not isinstance(config, Mapping):
        raise GeometryError(f"config must be a JSON object, got {type(config).__name__}")
    return config


def _decoder(config: Mapping[str, object]) -> dict[str, object]:
    """The decoder's fields over its family's defaults, its model type resolved (a wrapper's
    ``text_config`` that names none takes the wrapper's text model type)."""
    section = _decoder_section(config)
    model_type = section.get("model_type") or config.get("model_type")
    return families.with_defaults(section, families.TEXT_MODEL_TYPES.get(model_type, model_type))


def _decoder_section(config: Mapping[str, object]) -> Mapping[str, object]:
    text_config = config.get("text_config")
    if any(key in config for key in _LAYER_KEYS) or not isinstance(text_config, Mapping):
        return config
    return text_config


def _reject_unmodelled(section: Mapping[str, object]) -> None:
    model_type = section.get("model_type")
    if model_type in families.PURE_RECURRENT_MODEL_TYPES:
        raise GeometryError(
            f"config field 'model_type' is {model_type!r}, a recurrent architecture without attention "
            "layers: it caches nothing per token, and kvstrata sizes a model by its attention layers"
        )
    if model_type in families.UNMODELLED_MODEL_TYPES:
        raise GeometryError(
            f"config field 'model_type' is {model_type!r}, a hybrid whose layers (shared attention blocks, "
            "lightning or delta attention of its own) are not modelled"
        )


def _shape(section: Mapping[str, object]) -> KVShape:
    layers = families.derived_layer_count(section) or require_int(section, *_LAYER_KEYS)
    heads = require_int(section, "num_attention_heads")
    hidden = require_int(section, "hidden_size")
    kv_lora_rank = get_int(section, "kv_lora_rank")
    if kv_lora_rank is None:
        kv_heads = get_int(section, "num_key_value_heads") or heads
        attention = attention_for_heads(heads, kv_heads, "config field 'num_key_value_heads'")
        head_dim = (families.attention_head_dim(section) or get_int(section, "head_dim")
                    or _head_dim_from_hidden(hidden, heads))
        return KVShape(attention, layers, heads, kv_heads, head_dim, hidden)
    rope_dim = require_int(section, "qk_rope_head_dim")
    return KVShape(Attention.MLA, layers, heads, 1, kv_lora_rank + rope_dim, hidden, kv_lora_rank, rope_dim)


def _groups(
    section: Mapping[str, object], shape: KVShape, types: LayerTypes, kv_dtype: DType, model_dtype: DType
) -> tuple[KVGroup, ...]:
    """The layers' KV groups: one per attention kind (FULL or MLA, SLIDING, CHUNKED) and one for
    the layers with a state, in the order their first layers come. A hybrid layer is in an
    attention group and in the state group."""
    attention_kind = {LayerKind.FULL: GroupKind.FULL, LayerKind.HYBRID: GroupKind.FULL,
                      LayerKind.SLIDING: GroupKind.SLIDING, LayerKind.HYBRID_SLIDING: GroupKind.SLIDING,
                      LayerKind.CHUNKED: GroupKind.CHUNKED}
    mla = shape.attention is Attention.MLA
    members: dict[GroupKind, list[int]] = {}
    labels: dict[GroupKind, str] = {}
    for index, (kind, label) in enumerate(zip(types.kinds, types.labels)):
        parts = []
        if kind in attention_kind:
            parts.append(attention_kind[kind])
        if kind.has_state:
            parts.append(GroupKind.STATE)
        for part in parts:
            members.setdefault(part, []).append(index)
            labels.setdefault(part, label)
    if not any(part.per_token for part in members):
        raise GeometryError(
            f"config field {types.field!r} gives the model no attention layer: nothing is cached per token, "
            "and kvstrata sizes a model by its attention layers"
        )
    if mla and set(members) - {GroupKind.FULL}:
        windowed = sorted(part.value for part in members if part is not GroupKind.FULL)
        raise GeometryError(
            f"config field {types.field!r} declares {windowed} layers in an MLA model (kv_lora_rank), "
            "which is not modelled"
        )
    groups = []
    for part, layers in members.items():
        label = labels[part]
        if part is GroupKind.STATE:
            size = families.state_size(section, types.kinds[layers[0]], model_dtype)
            groups.append(KVGroup(part, tuple(layers), size.dtype, state_bytes=size.state_bytes,
                                  state_heads=size.heads, label=label))
        elif part is GroupKind.FULL and mla:
            groups.append(KVGroup(GroupKind.MLA, tuple(layers), kv_dtype, 1, shape.head_dim, label=label))
        else:
            span = None
            if part is GroupKind.SLIDING:
                span = families.sliding_span(section)
            elif part is GroupKind.CHUNKED:
                span = families.chunk_span(section)
            groups.append(KVGroup(part, tuple(layers), kv_dtype, shape.num_kv_heads, shape.head_dim,
                                  span=span, label=label))
    return tuple(groups)


def _other_towers(config: Mapping[str, object]) -> tuple[str, ...]:
    """A multimodal wrapper's other sub-configs (a vision tower, an audio encoder): their weights
    are not counted."""
    if _decoder_section(config) is config:
        return ()
    return tuple(sorted(key for key, value in config.items()
                        if key.endswith("_config") and key not in _NOT_DECODER_CONFIGS
                        and isinstance(value, Mapping)))


def _weight_dtype(section: Mapping[str, object], config: Mapping[str, object]) -> DType:
    """The weights' element type: fp8 under an fp8 ``quantization_config`` (DeepSeek-V3 ships
    so), else the config's own dtype. A KV dtype override never changes it."""
    quant = config.get("quantization_config") or section.get("quantization_config")
    if isinstance(quant, Mapping) and str(quant.get("quant_method", "")).lower() == "fp8":
        return DType.FP8
    return _resolve_dtype(None, section, config)


def _head_dim_from_hidden(hidden: int, heads: int) -> int:
    if hidden % heads:
        raise GeometryError(
            f"config field 'hidden_size' ({hidden}) is not divisible by 'num_attention_heads' "
            f"({heads}) and no 'head_dim' is given"
        )
    return hidden // heads


def _resolve_dtype(
    dtype: DType | str | None, section: Mapping[str, object], config: Mapping[str, object]
) -> DType:
    if isinstance(dtype, DType):
        return dtype
    if dtype is not None:
        return DType.parse(dtype)
    # Multimodal wrappers often keep torch_dtype only at the top level.
    for source in (section, config):
        for key in _DTYPE_KEYS:
            if source.get(key) is not None:
                try:
                    return DType.parse(source[key])
                except GeometryError as exc:
                    raise GeometryError(f"config field {key!r}: {exc}") from None
    return DType.BF16
