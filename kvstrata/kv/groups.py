"""KV groups: the layers of a model that cache the same kind of thing, and how much of it.

A model's cache is a tuple of :class:`KVGroup` s, one per layer kind. Dense MHA/GQA/MQA and MLA
models are one group over every layer. Hybrid models have several:

* ``FULL``: K and V of every past token (``kv_heads`` x ``head_dim`` each, per layer).
* ``SLIDING``: K and V of the last ``span`` tokens only (Mistral, Gemma 2/3, gpt-oss, Cohere 2).
* ``CHUNKED``: K and V of the current attention chunk, at most ``span`` tokens (Llama 4).
* ``MLA``: one latent of every past token (DeepSeek): ``kv_heads`` is 1 and ``head_dim`` the
  latent plus its RoPE key; stored once, not as K and V.
* ``STATE``: a fixed-size recurrent state per sequence, whatever its length (Mamba / Mamba-2
  conv + SSM state, gated-delta-net linear attention): ``state_bytes`` per layer.

A sequence of ``n`` tokens keeps ``n`` tokens of a FULL/MLA group, ``min(n, span)`` of a
SLIDING or CHUNKED group and one state of a STATE group. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvstrata.kv.dtypes import DType
from kvstrata.kv.fields import GeometryError, check_int


class GroupKind(Enum):
    """What one group of layers caches."""

    FULL = "full"
    SLIDING = "sliding"
    CHUNKED = "chunked"
    MLA = "mla"
    STATE = "state"

    @property
    def per_token(self) -> bool:
        """Caches something per token (every kind but STATE)."""
        return self is not GroupKind.STATE

    @property
    def keeps_every_token(self) -> bool:
        """Grows with every token for good (FULL and MLA): what one more token costs past every window."""
        return self in (GroupKind.FULL, GroupKind.MLA)

    @property
    def windowed(self) -> bool:
        """Keeps at most ``span`` tokens (SLIDING and CHUNKED)."""
        return self in (GroupKind.SLIDING, GroupKind.CHUNKED)


@dataclass(frozen=True)
class KVGroup:
    """One group of layers of the same kind.

    Attributes:
        kind: What the layers cache.
        layers: Decoder layer indices (0-based, increasing) of this group.
        dtype: Element type of what is cached.
        kv_heads: Per-token kinds: KV heads per layer (1 for MLA's latent); 0 for STATE.
        head_dim: Per-token kinds: elements per KV head; 0 for STATE.
        span: SLIDING: the window in tokens; CHUNKED: the chunk in tokens; else None.
        state_bytes: STATE: bytes of one sequence's state in one layer; else 0.
        state_heads: STATE: the heads the state splits into under tensor parallelism; else 0.
        label: The config's name for the kind (``"sliding_attention"``, ``"mamba"``), for display.
    """

    kind: GroupKind
    layers: tuple[int, ...]
    dtype: DType
    kv_heads: int = 0
    head_dim: int = 0
    span: int | None = None
    state_bytes: int = 0
    state_heads: int = 0
    label: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GroupKind):
            raise GeometryError(f"KVGroup field 'kind' must be a GroupKind, got {self.kind!r}")
        if not isinstance(self.dtype, DType):
            raise GeometryError(f"KVGroup field 'dtype' must be a DType, got {self.dtype!r}")
        layers = self.layers
        if not isinstance(layers, tuple) or not layers:
            raise GeometryError(f"KVGroup field 'layers' must be a non-empty tuple, got {layers!r}")
        for layer in layers:
            check_int("KVGroup layer index", layer, minimum=0)
        if any(b <= a for a, b in zip(layers, layers[1:])):
            raise GeometryError(f"KVGroup field 'layers' must increase, got {layers!r}")
        if self.kind.per_token:
            check_int("KVGroup field 'kv_heads'", self.kv_heads)
            check_int("KVGroup field 'head_dim'", self.head_dim)
            if self.state_bytes or self.state_heads:
                raise GeometryError(f"KVGroup of kind {self.kind.value} has no state_bytes/state_heads")
            if self.kind is GroupKind.MLA and self.kv_heads != 1:
                raise GeometryError(f"KVGroup of kind mla has one latent head, got kv_heads={self.kv_heads}")
        else:
            check_int("KVGroup field 'state_bytes'", self.state_bytes)
            check_int("KVGroup field 'state_heads'", self.state_heads)
            if self.kv_heads or self.head_dim:
                raise GeometryError("KVGroup of kind state has no kv_heads/head_dim (its size is state_bytes)")
        if self.kind.windowed:
            check_int(f"KVGroup field 'span' ({self.kind.value})", self.span)
        elif self.span is not None:
            raise GeometryError(f"KVGroup of kind {self.kind.value} has no span, got {self.span!r}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def kv_tensors(self) -> int:
        """Tensors cached per head: K and V, or MLA's one latent; 0 for a state."""
        if not self.kind.per_token:
            return 0
        return 1 if self.kind is GroupKind.MLA else 2

    def heads_per_gpu(self, tp: int = 1) -> int:
        """KV heads (STATE: state heads) each GPU of a ``tp``-way group holds.

        MLA replicates its one latent on every rank. Attention with more ranks than KV heads
        replicates each head on ``tp / kv_heads`` ranks. A state splits over its heads.

        Raises:
            GeometryError: ``tp`` is not positive or does not fit the heads.
        """
        return heads_per_rank(self.kind, self.kv_heads or self.state_heads, tp)

    def token_bytes(self, tp: int = 1) -> int:
        """Bytes one token adds to this group's layers on one GPU (0 for a state)."""
        if not self.kind.per_token:
            return 0
        return self.kv_tensors * self.num_layers * self.heads_per_gpu(tp) * self.head_dim * self.dtype.size_bytes

    def state_bytes_per_gpu(self, tp: int = 1) -> int:
        """Bytes of one sequence's state over this group's layers on one GPU (0 for per-token kinds)."""
        if self.kind.per_token:
            return 0
        return self.num_layers * self.state_bytes * self.heads_per_gpu(tp) // self.state_heads

    def tokens_kept(self, tokens: int) -> int:
        """Tokens of a ``tokens``-long sequence this group holds KV for (0 for a state)."""
        check_int("'tokens'", tokens, minimum=0)
        if not self.kind.per_token:
            return 0
        return min(tokens, self.span) if self.kind.windowed else tokens

    def bytes_for(self, tokens: int, tp: int = 1) -> int:
        """Bytes this group holds for one sequence of ``tokens`` tokens on one GPU: its kept tokens'
        KV, or its state (held from the first token on)."""
        if not self.kind.per_token:
            return self.state_bytes_per_gpu(tp) if tokens else 0
        return self.tokens_kept(tokens) * self.token_bytes(tp)

    def describe(self) -> str:
        """One line: kind, span, layer count, shape."""
        label = f" ({self.label})" if self.label and self.label != self.kind.value else ""
        span = f" {self.span} tok" if self.span else ""
        shape = (f"{self.kv_heads}x{self.head_dim}" if self.kind.per_token
                 else f"{self.state_bytes:,} B state")
        return f"{self.kind.value}{span}{label}: {self.num_layers} layers, {shape}, {self.dtype.value}"


def heads_per_rank(kind: GroupKind, heads: int, tp: int) -> int:
    """Heads of a group that one of ``tp`` ranks holds (see :meth:`KVGroup.heads_per_gpu`)."""
    check_int("'tp'", tp)
    if kind is GroupKind.MLA:
        return heads
    what = "state heads" if kind is GroupKind.STATE else "KV heads"
    if tp <= heads:
        if heads % tp:
            raise GeometryError(f"'tp' ({tp}) must divide the {heads} {what}")
        return heads // tp
    if kind is GroupKind.STATE:
        raise GeometryError(f"'tp' ({tp}) exceeds the {heads} {what}: a state cannot be split finer")
    if tp % heads:
        raise GeometryError(f"'tp' ({tp}) exceeds the {heads} KV heads and is not a multiple of them")
    return 1


def check_groups(groups: tuple[KVGroup, ...], num_layers: int) -> None:
    """Every decoder layer is in at most one per-token group and at most one STATE group, or in
    none (a layer that caches nothing). A layer in both is a hybrid one: Falcon-H1 runs attention
    and a Mamba-2 mixer side by side in every layer, caching K and V and a state.

    Raises:
        GeometryError: groups are empty, or a layer is in two per-token (or two state) groups,
            or past ``num_layers``.
    """
    if not groups:
        raise GeometryError("a model needs at least one KV group")
    seen: dict[bool, set[int]] = {True: set(), False: set()}
    for group in groups:
        if not isinstance(group, KVGroup):
            raise GeometryError(f"KV groups must be KVGroup, got {group!r}")
        taken = seen[group.kind.per_token]
        overlap = taken.intersection(group.layers)
        if overlap:
            what = "per-token" if group.kind.per_token else "state"
            raise GeometryError(f"layer {min(overlap)} is in two {what} KV groups")
        taken.update(group.layers)
    last = max(seen[True] | seen[False])
    if last >= num_layers:
        raise GeometryError(f"KV group layer {last} is past the model's {num_layers} layers")
