"""The ids a vLLM request's blocks are keyed by (``keying.py``), from vLLM's own ``Request``: a
plain prompt's own ids; an image, adapter or salt folded in, alike for alike and apart otherwise."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvstrata.integrations.vllm.keying import extras_of, key_tokens  # noqa: E402

BLOCK = 16
TOKENS = list(range(10, 10 + 4 * BLOCK))


def request(name: str, **given) -> Request:
    return Request(name, TOKENS, SamplingParams(max_tokens=1), None, **given)


def image(identifier: str, offset: int = 3) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=8))


def test_a_plain_prompt_is_keyed_by_its_own_ids():
    assert key_tokens(request("plain"), BLOCK) == TOKENS and extras_of(request("plain")) == []


def test_images_are_keyed_alike_for_the_same_item_at_the_same_place_and_apart_otherwise():
    keyed = {name: key_tokens(request(name, mm_features=[feature]), BLOCK)
             for name, feature in (("cat", image("cat")), ("cat again", image("cat")), ("dog", image("dog")),
                                   ("cat later", image("cat", offset=20)))}
    assert keyed["cat"] == keyed["cat again"]
    assert len({tuple(k) for k in keyed.values()}) == 3 and all(k != TOKENS for k in keyed.values())
    assert all(k[BLOCK:] == TOKENS[BLOCK:] for k in keyed.values())  # only the first block's ids carry it


def test_a_request_of_prompt_embeddings_has_no_ids_to_key():
    import torch

    assert key_tokens(request("embeds", prompt_embeds=torch.zeros(len(TOKENS), 8)), BLOCK) is None
