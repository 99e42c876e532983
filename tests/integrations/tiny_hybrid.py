"""A tiny random-weight Gemma 3 text model (sliding-window and full-attention layers), offline.

vLLM's hybrid KV cache manager gives such a model two KV cache groups: the full-attention layers
and the sliding-window ones. The tokenizer is the tiny Llama's (``kvstrata.integrations.tiny``),
copied: vLLM needs one in the directory, and token ids are all the tests feed it.

Layers ``sliding, full, sliding, full``, a window of ``WINDOW`` tokens: vLLM makes two groups
of two layers each (it groups layers in groups of equal size, and two of each kind split evenly).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

WINDOW = 64  # tokens: two vLLM blocks of 32
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_MARKER = "kvstrata-tiny-gemma3.json"


def make_tiny_gemma3(directory: Path, tokenizer_dir: Path) -> Path:
    """Write the model into ``directory`` (reused when already there); returns it."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    spec = {"layer_types": LAYER_TYPES, "window": WINDOW, "seed": 0}
    marker = directory / _MARKER
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, directory / name)
    config = Gemma3TextConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
        max_position_embeddings=8192, sliding_window=WINDOW, layer_types=LAYER_TYPES,
        initializer_range=0.2, tie_word_embeddings=False, dtype="bfloat16",
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = None
    model.save_pretrained(directory, safe_serialization=True)
    marker.write_text(json.dumps(spec))
    return directory
