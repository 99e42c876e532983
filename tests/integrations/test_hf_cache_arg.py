"""The model's cache goes in by the argument its forward declares: ``cache`` where transformers
renamed ``past_key_values`` (the old name warns, FutureWarning, removed in 5.40), else the old one.

The installed transformers may predate the rename, so a Llama declared as newer releases declare
it (``cache``, ``past_key_values`` deprecated by transformers' own decorator) stands in for it.
"""

from __future__ import annotations

import inspect
import uuid
import warnings

import pytest

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.engine  # the tiny model in transformers (some tests take it at run time)

from transformers.utils.deprecation import deprecate_kwarg  # noqa: E402

from kvstrata.cache import CacheConfig, TieredCache  # noqa: E402
from kvstrata.integrations.hf import KVStrataLM, model_layout  # noqa: E402
from kvstrata.integrations.hf.cache import cache_arg  # noqa: E402
from kvstrata.integrations.recompute import measure_prefill  # noqa: E402

BLOCK = 16


class RenamedCacheLlama(transformers.LlamaForCausalLM):
    """LlamaForCausalLM as transformers >= 5.2x declares it: the cache is ``cache``."""

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(self, input_ids=None, cache=None, **kwargs):
        return super().forward(input_ids=input_ids, past_key_values=cache, **kwargs)


@pytest.fixture(scope="module")
def renamed(tiny_model_dir):
    return RenamedCacheLlama.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def installed(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def cache_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "past_key_values" in str(w.message)]


def test_the_stand_in_warns_for_the_old_name(renamed):
    """What kvstrata must not trigger: the deprecation of newer transformers, live here."""
    import torch

    ids = transformers.DynamicCache(config=renamed.config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        renamed(input_ids=torch.tensor([[1, 2, 3]]), past_key_values=ids, use_cache=True)
    (message,) = cache_warnings(caught)
    assert "deprecated" in message and "cache" in message and "5.40.0" in message


def test_the_argument_is_the_one_forward_declares(renamed, installed):
    assert cache_arg(renamed) == "cache"
    assert cache_arg(installed) in inspect.signature(installed.forward).parameters
    assert cache_arg(installed) in ("cache", "past_key_values")


@pytest.mark.parametrize("which", ["renamed", "installed"])
def test_generate_and_measure_prefill_emit_no_cache_deprecation(which, request, tmp_path):
    model = request.getfixturevalue(which)
    layout = model_layout(model.config, BLOCK, model.dtype)
    config = CacheConfig(layout, f"tiny-{uuid.uuid4().hex[:8]}", device_bytes=64 * layout.block_bytes,
                         host_bytes=64 * layout.block_bytes, device="cpu")
    prompt = list(range(5, 5 + 3 * BLOCK + 5))
    with TieredCache(config) as cache, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm = KVStrataLM(model, cache)
        cold = lm.generate(prompt, 6, reuse=False)
        warm = lm.generate(prompt, 6, store=False)
        split = lm.generate(prompt, 6, store=False, strategy="split", split_tokens=BLOCK)
        streamed = lm.generate(prompt, 6, store=False, streaming=True)
        measure_prefill(model, sizes=(8, 16), cached=(16,), repeats=1)
    assert cache_warnings(caught) == []
    # The cache really went in by that name: the restored prefix is what the tokens build on.
    assert warm.hit_tokens == 3 * BLOCK
    assert warm.tokens == cold.tokens == split.tokens == streamed.tokens


def test_both_models_give_the_same_tokens_from_the_cache(renamed, installed, tmp_path):
    layout = model_layout(installed.config, BLOCK, installed.dtype)
    prompt = list(range(7, 7 + 2 * BLOCK + 3))
    tokens = []
    for model in (installed, renamed):
        config = CacheConfig(layout, f"tiny-{uuid.uuid4().hex[:8]}", device_bytes=64 * layout.block_bytes,
                             host_bytes=0, device="cpu")
        with TieredCache(config) as cache:
            lm = KVStrataLM(model, cache)
            lm.generate(prompt, 4, reuse=False)
            warm = lm.generate(prompt, 4, store=False)
            assert warm.hit_tokens == 2 * BLOCK
            tokens.append(warm.tokens)
    assert tokens[0] == tokens[1]
