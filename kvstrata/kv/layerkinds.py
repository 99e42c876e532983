"""Decoder layer kinds: what each layer of a model caches, parsed from a config's own spelling.

Every layer gets one of transformers' layer kinds (``configuration_utils.ALLOWED_ATTN_LAYER_TYPES``,
legacy names remapped as its ``remap_legacy_layer_types`` does):

* ``full_attention``, ``sliding_attention``, ``chunked_attention``: per-token K and V;
* ``linear_attention``: a fixed-size state (Mamba, Mamba-2, gated delta net), ``conv``: LFM2's
  short-convolution state;
* ``hybrid``, ``hybrid_sliding``: attention and a Mamba-2 mixer side by side in one layer (Falcon-H1);
* ``mlp``, ``moe``: a layer without a sequence mixer (Nemotron-H), which caches nothing.

Strings are parsed here, where a config is read (:func:`listed_layer_kinds`); past this module a
kind is a :class:`LayerKind`. Any other name (DeepSeek-V3.2's ``indexed_attention``, compressed
or sparse attention, a name this module does not know) is refused, naming the config field it
came from. Pure: no torch, no transformers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from kvstrata.kv.fields import GeometryError, check_int


class LayerKind(Enum):
    """One decoder layer's kind; the value is transformers' name for it."""

    FULL = "full_attention"
    SLIDING = "sliding_attention"
    CHUNKED = "chunked_attention"
    LINEAR = "linear_attention"
    CONV = "conv"
    HYBRID = "hybrid"
    HYBRID_SLIDING = "hybrid_sliding"
    MLP = "mlp"
    MOE = "moe"

    @property
    def per_token(self) -> bool:
        """Caches K and V of each token it keeps, of the one attention shape, and nothing else."""
        return self in (LayerKind.FULL, LayerKind.SLIDING, LayerKind.CHUNKED)

    @property
    def attends(self) -> bool:
        """Has attention (per-token K and V), alone or beside a state."""
        return self.per_token or self in (LayerKind.HYBRID, LayerKind.HYBRID_SLIDING)

    @property
    def has_state(self) -> bool:
        """Caches a fixed-size state per sequence (Mamba, gated delta net, a short convolution)."""
        return self in (LayerKind.LINEAR, LayerKind.CONV, LayerKind.HYBRID, LayerKind.HYBRID_SLIDING)

    @property
    def mixerless(self) -> bool:
        """Has no sequence mixer at all (an MLP or MoE block alone): caches nothing."""
        return self in (LayerKind.MLP, LayerKind.MOE)


UNMODELLED_TEXT = ("known: full, sliding and chunked attention, linear attention / Mamba, conv, hybrid, "
                   "mlp, moe")

# transformers' configuration_utils._LEGACY_LAYER_TYPE_REMAP, plus the older spellings kvstrata
# read before (GPT-Neo's "global"/"local", plain "full").
_LEGACY_KINDS = {
    "mamba": LayerKind.LINEAR.value,
    "attention": LayerKind.FULL.value,
    "full": LayerKind.FULL.value,
    "global": LayerKind.FULL.value,
    "local": LayerKind.SLIDING.value,
    "deepseek_sparse_attention": "indexed_attention",
    "qwen_sparse_attention": "indexed_attention",
}
_BY_NAME = {kind.value: kind for kind in LayerKind}

# Nemotron-H's hybrid_override_pattern characters (NemotronHConfig._pattern_to_list).
_NEMOTRON_PATTERN = {"M": LayerKind.LINEAR, "E": LayerKind.MOE, "*": LayerKind.FULL, "-": LayerKind.MLP}


@dataclass(frozen=True)
class LayerTypes:
    """Each decoder layer's kind.

    Attributes:
        kinds: One per decoder layer.
        labels: The config's own name for each layer's kind (``"mamba"``; a pattern's ``"M"`` is
            shown as its canonical name), for display.
        field: The config field the kinds were read or derived from, for messages.
    """

    kinds: tuple[LayerKind, ...]
    labels: tuple[str, ...]
    field: str

    @classmethod
    def derived(cls, kinds: Sequence[LayerKind], field: str) -> LayerTypes:
        """Kinds a rule derived (no spelling of the config's own): labelled by their names."""
        return cls(tuple(kinds), tuple(kind.value for kind in kinds), field)


def refuse_unmodelled(names: Sequence[str], origin: str) -> GeometryError:
    """The error for layer kinds not modelled, ``origin`` saying where they came from."""
    return GeometryError(f"{origin} {sorted(set(names))}, which is not modelled ({UNMODELLED_TEXT})")


def parse_kinds(names: Sequence[str], field: str) -> tuple[LayerKind, ...]:
    """transformers' layer-kind names (legacy spellings remapped) as kinds.

    Raises:
        GeometryError: a name is not a modelled kind, naming every such name and ``field``.
    """
    canonical = [_LEGACY_KINDS.get(name, name) for name in names]
    unknown = [name for name in canonical if name not in _BY_NAME]
    if unknown:
        raise refuse_unmodelled(unknown, f"config field {field!r} declares")
    return tuple(_BY_NAME[name] for name in canonical)


def listed_layer_kinds(section: Mapping[str, object], num_layers: int) -> LayerTypes | None:
    """The layers' kinds where the config lists them itself (``layer_types`` or its family's
    spelling of it, Nemotron-H's pattern, GPT-Neo's ``attention_types``); None where it does not.

    Raises:
        GeometryError: the list is malformed, its length is not the layer count, or it names a
            kind not modelled.
    """
    for key in ("layer_types", "layers_block_type"):
        listed = section.get(key)
        if listed is not None:
            return _listed(key, listed, num_layers)
    if section.get("model_type") == "nemotron_h" and section.get("hybrid_override_pattern") is not None:
        return _pattern(section["hybrid_override_pattern"], num_layers)
    if section.get("attention_types") is not None:
        return _gpt_neo(section["attention_types"], num_layers)
    return None


def _listed(key: str, listed: object, num_layers: int) -> LayerTypes:
    if not isinstance(listed, list) or not all(isinstance(kind, str) for kind in listed):
        raise GeometryError(f"config field {key!r} must be a list of layer-kind strings, got {listed!r}")
    if len(listed) != num_layers:
        raise GeometryError(
            f"config field {key!r} lists {len(listed)} layers, but the model has {num_layers} "
            "('num_hidden_layers')"
        )
    return LayerTypes(parse_kinds(listed, key), tuple(listed), key)


def _pattern(pattern: object, num_layers: int) -> LayerTypes:
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
    return LayerTypes.derived([_NEMOTRON_PATTERN[char] for char in pattern], "hybrid_override_pattern")


def _gpt_neo(spec: object, num_layers: int) -> LayerTypes:
    """GPT-Neo's ``[[["global", "local"], 12]]``: kinds repeated (GPTNeoConfig.expand_attention_types_params)."""
    try:
        names = [name for kinds, repeat in spec for _ in range(repeat) for name in kinds]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise GeometryError(f"config field 'attention_types' must be [[kinds, repeat], ...], got {spec!r}") from None
    if not all(isinstance(name, str) for name in names) or len(names) != num_layers:
        raise GeometryError(
            f"config field 'attention_types' expands to {len(names)} layers, but the model has {num_layers}"
        )
    return LayerTypes(parse_kinds(names, "attention_types"), tuple(names), "attention_types")


# --- spans -----------------------------------------------------------------------------------------


def sliding_span(section: Mapping[str, object]) -> int:
    """The tokens a sliding layer keeps: ``sliding_window`` (Gemma 3 with bidirectional attention
    keeps ``sliding_window // 2 + 1``, as Gemma3TextConfig.__post_init__ sets it)."""
    key = "window_size" if section.get("attention_types") is not None else "sliding_window"
    window = section.get(key, 256 if key == "window_size" else None)
    window = check_int(f"config field {key!r} (the window of its sliding layers)", window)
    if section.get("model_type") == "gemma3_text" and section.get("use_bidirectional_attention"):
        return window // 2 + 1
    return window


def chunk_span(section: Mapping[str, object]) -> int:
    """The tokens a chunked layer keeps: ``attention_chunk_size``."""
    return check_int("config field 'attention_chunk_size' (the chunk of its chunked layers)",
                     section.get("attention_chunk_size"))
