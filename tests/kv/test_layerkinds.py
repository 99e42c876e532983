"""Layer kinds parsed at the edge: a config's names (legacy spellings too) become LayerKinds,
and a name not modelled is refused with the field it came from."""

from __future__ import annotations

import pytest

from kvstrata.kv.families import layer_types
from kvstrata.kv.fields import GeometryError
from kvstrata.kv.layerkinds import LayerKind, LayerTypes, parse_kinds


def test_names_and_legacy_names_parse_to_kinds():
    names = ["full_attention", "global", "local", "mamba", "attention", "conv", "hybrid", "moe"]
    assert parse_kinds(names, "layer_types") == (
        LayerKind.FULL, LayerKind.FULL, LayerKind.SLIDING, LayerKind.LINEAR, LayerKind.FULL, LayerKind.CONV,
        LayerKind.HYBRID, LayerKind.MOE)


def test_a_name_not_modelled_is_refused_naming_the_field():
    with pytest.raises(GeometryError, match=r"'layer_types' declares \['indexed_attention', 'x'\], which is not"):
        parse_kinds(["full_attention", "x", "deepseek_sparse_attention"], "layer_types")


def test_layer_types_reads_the_list_keeping_the_configs_labels():
    types = layer_types({"layer_types": ["mamba", "attention"]}, 2)
    assert types == LayerTypes((LayerKind.LINEAR, LayerKind.FULL), ("mamba", "attention"), "layer_types")


def test_layer_types_derives_by_family_and_by_fields():
    gemma2 = layer_types({"model_type": "gemma2"}, 4)
    assert (gemma2.kinds, gemma2.field) == ((LayerKind.SLIDING, LayerKind.FULL) * 2, "model_type")
    assert gemma2.labels == ("sliding_attention", "full_attention") * 2
    assert layer_types({"sliding_window": 16}, 2).kinds == (LayerKind.SLIDING,) * 2
    assert layer_types({"attention_chunk_size": 16}, 2).kinds == (LayerKind.CHUNKED,) * 2
    assert layer_types({}, 3) == LayerTypes.derived((LayerKind.FULL,) * 3, "num_hidden_layers")


def test_a_family_whose_layers_are_not_modelled_is_refused_by_model_type():
    with pytest.raises(GeometryError, match=r"'model_type' \('deepseek_v32'\) gives its layers the kind"):
        layer_types({"model_type": "deepseek_v32"}, 2)


@pytest.mark.parametrize(("kind", "per_token", "attends", "has_state", "mixerless"), [
    (LayerKind.FULL, True, True, False, False),
    (LayerKind.SLIDING, True, True, False, False),
    (LayerKind.LINEAR, False, False, True, False),
    (LayerKind.HYBRID_SLIDING, False, True, True, False),
    (LayerKind.MOE, False, False, False, True),
])
def test_what_a_kind_caches(kind, per_token, attends, has_state, mixerless):
    assert (kind.per_token, kind.attends, kind.has_state, kind.mixerless) == (per_token, attends, has_state, mixerless)
