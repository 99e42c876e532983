"""KV-cache geometry: the bytes of KV one token occupies, and what a model weighs.

Pure. A geometry is read from a Hugging Face ``config.json`` by
:func:`kvstrata.kv.readconfig.geometry_from_config`; reading files and presets is
:mod:`kvstrata.kv.presets`' job.

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
from dataclasses import dataclass
from enum import Enum

from kvstrata.kv.dtypes import DType
from kvstrata.kv.fields import GeometryError, check_int
from kvstrata.kv.groups import GroupKind, KVGroup, check_groups, heads_per_rank


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
