"""KV-cache geometry: the bytes of KV one token occupies, and what a model weighs.

Pure: :func:`geometry_from_config` takes an already-parsed Hugging Face ``config.json`` dict;
reading files and presets is :mod:`kvstrata.kv.presets`' job.

Bytes per token (one sequence position, summed over layers):

* MHA / GQA / MQA cache K and V per KV head:
  ``2 * layers * kv_heads * head_dim * dtype bytes``.
* MLA (DeepSeek-V2/V3) caches one compressed latent per layer, ``kv_lora_rank`` values that
  both K and V are expanded from plus ``qk_rope_head_dim`` values of decoupled RoPE key:
  ``layers * (kv_lora_rank + qk_rope_head_dim) * dtype bytes``. It is modelled as a single
  "KV head" of width ``kv_lora_rank + qk_rope_head_dim`` that is stored once, not twice.

Hybrid models sum that over their KV groups (:mod:`kvstrata.kv.groups`): sliding and chunked
layers keep at most a window of tokens, Mamba and gated-delta-net layers a fixed-size state per
sequence instead. Which layer is which, and how big a state is, follows each family's rules
(:mod:`kvstrata.kv.families`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from kvstrata.kv import families
from kvstrata.kv.dtypes import DType
from kvstrata.kv.fields import GeometryError, check_int, get_int, require_int
from kvstrata.kv.groups import GroupKind, KVGroup, check_groups, heads_per_rank
from kvstrata.kv.layerkinds import LayerKind, LayerTypes
from kvstrata.kv.params import count_params


class Attention(Enum):
    """How a model's attention shapes its KV cache."""

    MHA = "mha"  # one KV head per query head
    GQA = "gqa"  # query heads share KV heads in equal groups
    MQA = "mqa"  # one KV head shared by all query heads
    MLA = "mla"  # one low-rank latent per token per layer (DeepSeek)


def attention_for_heads(num_attention_heads: int, num_kv_heads: int, kv_label: str) -> Attention:
    """Classify standard (non-MLA) attention from its head counts.

    Args:
        num_attention_heads: Query heads.
        num_kv_heads: KV heads.
        kv_label: How to name the KV-head field in an error, e.g. ``"config field 'x'"``.

    Raises:
        GeometryError: the KV heads do not split the query heads into equal groups.
    """
    if num_kv_heads > num_attention_heads or num_attention_heads % num_kv_heads:
        raise GeometryError(
            f"{kv_label} ({num_kv_heads}) must divide the {num_attention_heads} attention heads"
        )
    if num_kv_heads == num_attention_heads:
        return Attention.MHA
    return Attention.MQA if num_kv_heads == 1 else Attention.GQA


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one model's KV cache, and the parameter counts that size its weights.

    Attributes:
        name: Model name, for display.
        attention: Attention kind; must agree with the head counts.
        num_layers: Decoder layers that keep KV.
        num_kv_heads: KV heads per layer; 1 for MLA (one latent per token per layer).
        head_dim: Elements per KV head; ``kv_lora_rank + qk_rope_head_dim`` for MLA.
        dtype: Element type of the cached KV (and the default for weights).
        total_params: All parameters, every expert of a MoE included (sizes weight memory).
        active_params: Parameters used per token: MoE counts shared + top-k routed experts
            (sizes compute).
        num_attention_heads: Query heads (for the attention FLOPs term).
        kv_lora_rank: MLA latent width; None otherwise.
        qk_rope_head_dim: MLA decoupled-RoPE key width; None otherwise.
        groups: The layers' KV groups (:mod:`kvstrata.kv.groups`). Empty: one group of every
            layer, FULL (or MLA) attention of ``num_kv_heads`` x ``head_dim`` as ``dtype``.
            The scalar fields above describe the attention layers' heads; the groups say
            which layers keep what.
        max_context: The longest context the model takes (``max_position_embeddings``); None
            when the config does not say.
        uncounted_params: What the parameter counts leave out for want of config fields (the
            fields' names, e.g. ``"vocab_size"``) or of a model of the part (``"vision_config"``):
            the counts and weight bytes are then lower bounds. Empty: counted in full.
    """

    name: str
    attention: Attention
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DType
    total_params: int
    active_params: int
    num_attention_heads: int
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    weight_dtype: DType | None = None  # None: weights stored as the KV dtype
    groups: tuple[KVGroup, ...] = ()
    max_context: int | None = None
    uncounted_params: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise GeometryError(
                f"KVGeometry field 'name' must be a non-empty string, got {self.name!r}"
            )
        for field_name, enum_type in (("attention", Attention), ("dtype", DType)):
            if not isinstance(getattr(self, field_name), enum_type):
                raise GeometryError(
                    f"KVGeometry field {field_name!r} must be a {enum_type.__name__}, "
                    f"got {getattr(self, field_name)!r}"
                )
        for field_name in (
            "num_layers", "num_kv_heads", "head_dim", "total_params", "active_params",
            "num_attention_heads",
        ):
            check_int(f"KVGeometry field {field_name!r}", getattr(self, field_name))
        if self.active_params > self.total_params:
            raise GeometryError(
                f"KVGeometry field 'active_params' ({self.active_params}) exceeds "
                f"'total_params' ({self.total_params})"
            )
        if self.attention is Attention.MLA:
            self._check_mla()
        else:
            for field_name in ("kv_lora_rank", "qk_rope_head_dim"):
                if getattr(self, field_name) is not None:
                    raise GeometryError(
                        f"KVGeometry field {field_name!r} is only for MLA attention"
                    )
            kind = attention_for_heads(
                self.num_attention_heads, self.num_kv_heads, "KVGeometry field 'num_kv_heads'"
            )
            if kind is not self.attention:
                raise GeometryError(
                    f"KVGeometry field 'attention' is {self.attention.name}, but "
                    f"{self.num_kv_heads} KV heads for {self.num_attention_heads} query heads "
                    f"is {kind.name}"
                )

        if not self.groups:
            kind = GroupKind.MLA if self.attention is Attention.MLA else GroupKind.FULL
            object.__setattr__(self, "groups", (KVGroup(
                kind, tuple(range(self.num_layers)), self.dtype, self.num_kv_heads, self.head_dim,
                label="full_attention"),))
        if not isinstance(self.groups, tuple):
            raise GeometryError(f"KVGeometry field 'groups' must be a tuple, got {self.groups!r}")
        check_groups(self.groups, self.num_layers)
        if self.max_context is not None:
            check_int("KVGeometry field 'max_context'", self.max_context)
        if not isinstance(self.uncounted_params, tuple) or not all(
            isinstance(item, str) for item in self.uncounted_params
        ):
            raise GeometryError(
                f"KVGeometry field 'uncounted_params' must be a tuple of strings, got {self.uncounted_params!r}"
            )

    def _check_mla(self) -> None:
        for field_name in ("kv_lora_rank", "qk_rope_head_dim"):
            check_int(f"KVGeometry field {field_name!r}", getattr(self, field_name))
        if self.num_kv_heads != 1:
            raise GeometryError(
                f"KVGeometry field 'num_kv_heads' must be 1 for MLA, got {self.num_kv_heads}"
            )
        latent = self.kv_lora_rank + self.qk_rope_head_dim
        if self.head_dim != latent:
            raise GeometryError(
                f"KVGeometry field 'head_dim' must be kv_lora_rank + qk_rope_head_dim = {latent} "
                f"for MLA, got {self.head_dim}"
            )

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one more token adds once past every window, on all GPUs together: the
        layers that keep every token (FULL and MLA groups)."""
        return self.bytes_per_token_per_gpu(1)

    @property
    def kv_tensors(self) -> int:
        """Tensors cached per KV head: K and V, or MLA's one latent that serves as both."""
        return 1 if self.attention is Attention.MLA else 2

    @property
    def hybrid(self) -> bool:
        """More than one group, or a group that is not FULL/MLA attention of every layer."""
        return len(self.groups) > 1 or not self.groups[0].kind.keeps_every_token

    def kv_heads_per_gpu(self, tp: int = 1) -> int:
        """KV heads of the attention layers each GPU of a tensor-parallel group holds.

        MLA replicates its one latent on every rank (DeepSeek's reference code, vLLM, SGLang
        split the query heads); more ranks than KV heads replicate each head on
        ``tp / kv_heads`` ranks, so every rank still holds one whole head.

        Args:
            tp: Tensor-parallel degree.

        Raises:
            GeometryError: ``tp`` is not positive, or it does not fit the heads of a group.
        """
        for group in self.groups:
            group.heads_per_gpu(tp)
        kind = GroupKind.MLA if self.attention is Attention.MLA else GroupKind.FULL
        return heads_per_rank(kind, self.num_kv_heads, tp)

    def bytes_per_token_per_gpu(self, tp: int = 1) -> int:
        """KV bytes one more token adds (past every window) on each GPU of a TP group.

        Raises:
            GeometryError: as :meth:`kv_heads_per_gpu`.
        """
        self.kv_heads_per_gpu(tp)
        return sum(group.token_bytes(tp) for group in self.groups if group.kind.keeps_every_token)

    def block_token_bytes(self, tp: int = 1) -> int:
        """Bytes one token occupies in every per-token group (windowed ones included) on one GPU:
        the bytes of a paged block while the block is inside every window."""
        self.kv_heads_per_gpu(tp)
        return sum(group.token_bytes(tp) for group in self.groups)

    def bytes_per_block(self, block_tokens: int, tp: int = 1) -> int:
        """KV bytes of one paged-cache block on one GPU, every per-token group's layers.

        Args:
            block_tokens: Tokens per block.
            tp: Tensor-parallel degree.
        """
        check_int("'block_tokens'", block_tokens)
        return block_tokens * self.block_token_bytes(tp)

    def state_bytes(self, tp: int = 1) -> int:
        """Bytes of one sequence's recurrent state (STATE groups) on one GPU; 0 without any."""
        self.kv_heads_per_gpu(tp)
        return sum(group.state_bytes_per_gpu(tp) for group in self.groups)

    def kv_bytes(self, tokens: int, tp: int = 1) -> int:
        """KV bytes one sequence of ``tokens`` tokens holds on one GPU (all of them when ``tp``
        is 1): every token of FULL/MLA layers, at most a window of windowed ones, plus its state.

        Args:
            tokens: Number of tokens; zero is allowed.
            tp: Tensor-parallel degree.
        """
        check_int("'tokens'", tokens, minimum=0)
        self.kv_heads_per_gpu(tp)
        return sum(group.bytes_for(tokens, tp) for group in self.groups)

    @property
    def effective_weight_dtype(self) -> DType:
        """The weights' element type: the config's (fp8 under an fp8 quantization_config), else the KV dtype."""
        return self.weight_dtype or self.dtype

    def weight_bytes(self, weight_dtype: DType | None = None) -> int:
        """Bytes of all weights, unsharded.

        Args:
            weight_dtype: Element type of the weights; defaults to ``effective_weight_dtype``.
        """
        return self.total_params * (weight_dtype or self.effective_weight_dtype).size_bytes

    def with_dtype(self, dtype: DType) -> KVGeometry:
        """The same geometry with KV stored as ``dtype`` (every per-token group; a recurrent
        state keeps its own type)."""
        groups = tuple(dataclasses.replace(group, dtype=dtype) if group.kind.per_token else group
                       for group in self.groups)
        return dataclasses.replace(self, dtype=dtype, groups=groups)


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
