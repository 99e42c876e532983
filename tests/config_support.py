"""The tiny Llama's config as the tests write it: the fields that size its KV, as in the
``tiny-llama`` preset (``tests/kv/test_presets.py`` checks that they agree)."""

from __future__ import annotations

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
}
