"""A model of a real model's shape with random weights, built offline: the published
``config.json`` of a model people serve (a preset such as ``qwen2.5-0.5b``, or any config a
user passes), its layers, heads, widths and vocabulary exactly, with seeded random weights and
the byte-level tokenizer of :mod:`kvstrata.integrations.tiny` padded to the model's vocabulary.

Its prefill costs what the real model's does and its KV has the real model's bytes per token,
which is what a KV cache's gains and costs depend on; its answers mean nothing. The directory is
an ordinary Hugging Face model directory that ``vllm serve`` (and every kvstrata command taking
``--model-dir``) loads as it would the real one. Only the token ids of ``bos``/``eos``/``pad``
change, to the tokenizer's own (the published ids name tokens this tokenizer does not have).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from kvstrata.integrations.tiny import prepare_dir, save_model, train_tokenizer

TRAINED_VOCAB = 4096  # the tokenizer's learned tokens; the rest of the model's vocabulary is filler
DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class ShapedSpec:
    """What to build: ``like``, a preset name or a ``config.json`` (file or directory)."""

    like: str
    dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"model dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"model seed must be a non-negative integer, got {self.seed!r}")


@dataclass(frozen=True)
class ShapedModel:
    """What was built (or found already built) in ``directory``."""

    directory: Path
    name: str
    source: str
    parameters: int
    kv_bytes_per_token: int
    dtype: str


def make_shaped(directory: str | Path, spec: ShapedSpec, overwrite: bool = False) -> ShapedModel:
    """Write a random-weight model shaped as ``spec.like`` into ``directory``.

    A directory this function wrote for the same spec is reused; any other non-empty one is
    refused unless ``overwrite``.

    Raises:
        FileExistsError: ``directory`` holds something else.
        FileNotFoundError, kvstrata.kv.GeometryError: ``spec.like`` is no preset and no config.
        ValueError: transformers knows no model of the config's ``model_type``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvstrata.kv.presets import load_source

    name, config, source = load_source(spec.like)
    kind = config.get("model_type")
    if not isinstance(kind, str):
        raise ValueError(f"{source}: no model_type, so no model class to build")
    vocab = config.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 512:
        raise ValueError(f"{source}: vocab_size must be an integer of at least 512, got {vocab!r}")
    out = Path(directory)
    record = {**asdict(spec), "like": name, "config": config}
    if prepare_dir(out, record, overwrite) is not None:
        fast = train_tokenizer(out, TRAINED_VOCAB, int(config.get("max_position_embeddings", 8192)), spec.seed,
                               size=vocab)
        fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype", "dtype",
                                                                "transformers_version")}
        fields.update(bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
        try:
            hf_config = AutoConfig.for_model(kind, **fields)
        except ValueError as e:
            raise ValueError(f"{source}: transformers has no model {kind!r} ({e})") from None
        hf_config.architectures = config.get("architectures")
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=getattr(torch, spec.dtype))
        save_model(out, model, record)
        published = {**config, "torch_dtype": spec.dtype, "bos_token_id": fast.bos_token_id,
                     "eos_token_id": fast.eos_token_id, "pad_token_id": fast.pad_token_id}
        (out / "config.json").write_text(json.dumps(published, indent=2) + "\n")  # the published file, not a re-save
    return described(out, name, source, spec.dtype)


def described(directory: Path, name: str, source: str, dtype: str) -> ShapedModel:
    """The facts of a built model directory (its size from the safetensors' headers, no load)."""
    from safetensors import safe_open

    from kvstrata.kv.presets import load_geometry

    parameters = 0
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            parameters += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return ShapedModel(directory, name, source, parameters, load_geometry(str(directory), dtype).bytes_per_token, dtype)
