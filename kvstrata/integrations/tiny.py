"""Small models with random weights and a tokenizer, built offline: a Llama, hybrids
(:func:`make_tiny_hybrid`: Gemma 2's sliding + full attention, Qwen3-Next's linear + full), and
an MLA model shaped as DeepSeek-V2-Lite (:func:`make_tiny_mla`).

Nothing is downloaded: the weights come from a seeded initialisation of the model class and
the tokenizer is a byte-level BPE trained here on a generated corpus (``tokenizers``), wrapped
as a ``PreTrainedTokenizerFast``. The directory it writes is an ordinary Hugging Face model
directory (``config.json``, ``model.safetensors``, ``tokenizer.json``), so every code path that
takes a local model directory takes this one, and a real model directory works the same way.

Random weights make flat logits, whose top two can tie within bf16 rounding; the default
``initializer_range`` is raised so greedy choices are decided by clear margins, which is what
tests comparing restored and recomputed runs need (a real model's logits are peaked anyway).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path

TINY_MARKER = "kvstrata-tiny.json"  # written beside the model: how it was made


@dataclass(frozen=True)
class TinySpec:
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 688
    vocab: int = 4096
    max_positions: int = 8192
    dtype: str = "bfloat16"
    seed: int = 0
    initializer_range: float = 0.2

    def __post_init__(self) -> None:
        _check_positive("tiny model", self, ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab",
                                             "max_positions"))
        if self.hidden % self.heads:
            raise ValueError(f"tiny model hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"tiny model heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"tiny model dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        if self.vocab < 512:
            raise ValueError(f"tiny model vocab must be at least 512 (256 bytes + merges), got {self.vocab}")


def _check_positive(what: str, spec: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(spec, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{what} {name} must be a positive integer, got {value!r}")


_WORDS = (
    "the a an of to in on for with and or but if then when while cache block token layer head key value "
    "memory device host disk remote pool restore store load prefix hit miss evict policy tier path link "
    "bandwidth latency gpu cpu network switch model prompt answer question user assistant system turn "
    "chat agent tool call result plan step time byte page file read write copy move fast slow large small "
    "first last next previous every some many few more less good best new old same other open close"
).split()


def corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    """Deterministic English-like text to train the tokenizer on (no download)."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 24))]
        text = " ".join(words).capitalize() + rng.choice(".?!")
        if rng.random() < 0.2:
            text += f" {rng.randint(0, 100000)}"
        out.append(text)
    return out


def make_tiny(directory: str | Path, spec: TinySpec = TinySpec(), overwrite: bool = False) -> Path:
    """Write a tiny model and tokenizer into ``directory``; returns it.

    An existing directory made by this function with the same spec is reused (tests and the
    demo call this on every run); any other non-empty directory is refused unless
    ``overwrite``.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = prepare_dir(Path(directory), asdict(spec), overwrite)
    if out is None:
        return Path(directory)
    fast = train_tokenizer(out, spec.vocab, spec.max_positions, spec.seed)
    config = LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions,
        initializer_range=spec.initializer_range,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        dtype=spec.dtype,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(getattr(torch, spec.dtype))
    save_model(out, model, asdict(spec))
    return out


class HybridKind(Enum):
    """Which hybrid architecture a tiny hybrid model has."""

    SLIDING = "sliding"  # Gemma 2: sliding-window attention layers alternating with full attention
    LINEAR = "linear"  # Qwen3-Next: gated-delta-net linear attention alternating with full attention


@dataclass(frozen=True)
class TinyHybridSpec:
    """A tiny hybrid model: layers alternate the kind's first layer type with full attention.
    float32 by default: restored and recomputed runs (their prefills split differently) then
    agree to far below the logits' margins."""

    kind: HybridKind = HybridKind.SLIDING
    hidden: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    vocab: int = 1024
    window: int = 40  # SLIDING: the sliding window, tokens
    max_positions: int = 4096
    dtype: str = "float32"
    seed: int = 0
    initializer_range: float = 0.2

    def __post_init__(self) -> None:
        if not isinstance(self.kind, HybridKind):
            raise ValueError(f"tiny hybrid model kind must be a HybridKind, got {self.kind!r}")
        _check_positive("tiny hybrid model", self, ("hidden", "layers", "heads", "kv_heads", "head_dim",
                                                    "intermediate", "window", "max_positions"))
        if self.layers % 2 or self.heads % self.kv_heads:
            raise ValueError(f"tiny hybrid model needs an even layer count and heads a multiple of kv_heads, got "
                             f"layers={self.layers} heads={self.heads} kv_heads={self.kv_heads}")
        if self.vocab < 512:
            raise ValueError(f"tiny hybrid model vocab must be at least 512 (256 bytes + merges), got {self.vocab}")

    def record(self) -> dict:
        return {**asdict(self), "kind": self.kind.value}


def make_tiny_hybrid(directory: str | Path, spec: TinyHybridSpec = TinyHybridSpec(), overwrite: bool = False) -> Path:
    """Write a tiny hybrid model (see :class:`TinyHybridSpec`) and tokenizer into ``directory``,
    reused as :func:`make_tiny` reuses its own."""
    import torch
    import transformers

    out = prepare_dir(Path(directory), spec.record(), overwrite)
    if out is None:
        return Path(directory)
    fast = train_tokenizer(out, spec.vocab, spec.max_positions, spec.seed)
    common = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                  num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                  head_dim=spec.head_dim, max_position_embeddings=spec.max_positions,
                  initializer_range=spec.initializer_range, bos_token_id=fast.bos_token_id,
                  eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, dtype=spec.dtype,
                  tie_word_embeddings=False)  # untied: tied random embeddings repeat one token
    if spec.kind is HybridKind.SLIDING:
        config = transformers.Gemma2Config(**common, sliding_window=spec.window,
                                           layer_types=["sliding_attention", "full_attention"] * (spec.layers // 2))
        model_class = transformers.Gemma2ForCausalLM
    else:
        config = transformers.Qwen3NextConfig(
            **common, layer_types=["linear_attention", "full_attention"] * (spec.layers // 2),
            linear_num_key_heads=spec.kv_heads, linear_num_value_heads=spec.heads, linear_key_head_dim=spec.head_dim,
            linear_value_head_dim=spec.head_dim, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=spec.intermediate // 2, shared_expert_intermediate_size=spec.intermediate // 2)
        model_class = transformers.Qwen3NextForCausalLM
    torch.manual_seed(spec.seed)
    model = model_class(config).to(getattr(torch, spec.dtype))
    save_model(out, model, spec.record())
    return out


@dataclass(frozen=True)
class TinyMLASpec:
    """A tiny DeepSeek-V2-Lite-shaped model (``DeepseekV2ForCausalLM``): multi-head latent
    attention without a query LoRA, a first dense layer, then MoE layers with shared experts
    and greedy top-k routing, as V2-Lite has them, all tiny. The latent keeps V2-Lite's
    ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64: vLLM's CPU MLA kernel takes only a
    576-wide latent."""

    hidden: int = 128
    layers: int = 3
    heads: int = 4
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    intermediate: int = 256  # the dense layer's MLP
    moe_intermediate: int = 64
    routed_experts: int = 4
    shared_experts: int = 1
    experts_per_token: int = 2
    first_dense_layers: int = 1
    vocab: int = 4096
    max_positions: int = 4096
    dtype: str = "bfloat16"
    seed: int = 0
    initializer_range: float = 0.2

    def __post_init__(self) -> None:
        _check_positive("tiny MLA model", self, ("hidden", "layers", "heads", "kv_lora_rank", "qk_rope_head_dim",
                                                 "qk_nope_head_dim", "v_head_dim", "intermediate", "moe_intermediate",
                                                 "routed_experts", "shared_experts", "experts_per_token",
                                                 "max_positions"))
        if self.experts_per_token > self.routed_experts:
            raise ValueError(f"tiny MLA model experts_per_token {self.experts_per_token} exceeds routed_experts "
                             f"{self.routed_experts}")
        if self.vocab < 512:
            raise ValueError(f"tiny MLA model vocab must be at least 512 (256 bytes + merges), got {self.vocab}")

    def record(self) -> dict:
        return {**asdict(self), "arch": "deepseek_v2"}


def make_tiny_mla(directory: str | Path, spec: TinyMLASpec = TinyMLASpec(), overwrite: bool = False) -> Path:
    """Write a tiny MLA model (see :class:`TinyMLASpec`) and tokenizer into ``directory``,
    reused as :func:`make_tiny` reuses its own."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    out = prepare_dir(Path(directory), spec.record(), overwrite)
    if out is None:
        return Path(directory)
    fast = train_tokenizer(out, spec.vocab, spec.max_positions, spec.seed)
    config = DeepseekV2Config(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.heads,
        max_position_embeddings=spec.max_positions, initializer_range=spec.initializer_range,
        q_lora_rank=None, kv_lora_rank=spec.kv_lora_rank, qk_rope_head_dim=spec.qk_rope_head_dim,
        qk_nope_head_dim=spec.qk_nope_head_dim, v_head_dim=spec.v_head_dim,
        head_dim=spec.qk_rope_head_dim,  # transformers' rotary embedding spans the rope part
        n_routed_experts=spec.routed_experts, n_shared_experts=spec.shared_experts,
        num_experts_per_tok=spec.experts_per_token, moe_intermediate_size=spec.moe_intermediate,
        first_k_dense_replace=spec.first_dense_layers, topk_method="greedy", n_group=1, topk_group=1,
        norm_topk_prob=False, routed_scaling_factor=1.0,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False, dtype=spec.dtype)
    torch.manual_seed(spec.seed)
    model = DeepseekV2ForCausalLM(config).to(getattr(torch, spec.dtype))
    save_model(out, model, spec.record())
    return out


def prepare_dir(out: Path, record: dict, overwrite: bool) -> Path | None:
    """``out`` ready to write a model of ``record`` into; None if it already holds that model."""
    marker = out / TINY_MARKER
    if marker.exists() and not overwrite:
        if json.loads(marker.read_text()) == record:
            return None
        raise FileExistsError(f"{out} holds a kvstrata-made model of another spec; pass overwrite to replace it")
    if out.exists() and any(out.iterdir()) and not overwrite and not marker.exists():
        raise FileExistsError(f"{out} is not empty and not a kvstrata tiny model; choose an empty directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


def train_tokenizer(out: Path, vocab: int, max_positions: int, seed: int, size: int | None = None):
    """A byte-level BPE tokenizer of ``vocab`` tokens trained on :func:`corpus`, saved into ``out``.

    ``size``: the vocabulary the model has, when larger than ``vocab`` (a real model's 150K): the
    ids past the trained ones are filler tokens (`` <t123456>``, which no merge makes), so every id
    the model can emit decodes, and the tokenizer stays a small file's training."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed=seed), trainer=trainer)
    if size is not None and size > tok.get_vocab_size():
        tok = _padded(tok, size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=max_positions
    )
    fast.save_pretrained(out)
    return fast


def _padded(tok, size: int):
    """``tok`` with filler tokens appended to its BPE vocabulary up to ``size`` ids."""
    from tokenizers import Tokenizer

    doc = json.loads(tok.to_str())
    vocab = doc["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in doc.get("added_tokens", ())}
    for i in range(size):
        if i not in taken:
            vocab[f"\u0120<t{i}>"] = i  # byte-level's space, then printable ASCII
    return Tokenizer.from_str(json.dumps(doc))


def save_model(out: Path, model, record: dict) -> None:
    from transformers.utils import logging

    model.generation_config.eos_token_id = None  # random weights: never stop early, lengths stay fixed
    logging.disable_progress_bar()  # a test's or the CLI's output is not for a shard bar
    model.save_pretrained(out, safe_serialization=True)
    (out / TINY_MARKER).write_text(json.dumps(record, indent=2))
