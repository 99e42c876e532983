"""What a model's KV groups hold, move and cost: the one sizing rule of the planner and the simulator.

A model's KV is a tuple of groups (:mod:`kvstrata.kv.groups`). For a sequence of ``n`` tokens:

* held (in HBM, by a running request) and read by every decode step: each per-token group's KV
  of the tokens it keeps (FULL/MLA every token, SLIDING/CHUNKED at most ``span``), and each
  STATE group's one state (:meth:`KVGeometry.kv_bytes`);
* restored, for a cached prefix of ``P`` tokens: the same, as of the prefix end, so a windowed
  group moves only the ``min(P, span)`` tokens before ``P`` and a state group one snapshot (the
  state after token ``P``). A restore from several tiers splits the prefix into segments; a
  segment moves what of that falls inside it, and the snapshot travels with the last one;
* stored, by an off-GPU prefix store, for each place a hit may end: what a restore from there
  moves. The data plane (:mod:`kvstrata.cache.grouped`) writes a windowed group's blocks only
  where some end's window needs them and drops the rest, and takes one state snapshot per end:
  a windowed group keeps at most ``ends * span`` tokens. The planner's store keeps each
  request's prefix with one end, so it stores what it restores; the simulator's block stores
  let a hit end at any block, and a block (shorter than any window) keeps every group's KV of
  its tokens and a snapshot at its end.

Token granular: a paged engine holds a windowed group in whole pages, at most
``ceil(span / page) + 1`` of them per request, i.e. under two pages more than ``span`` tokens;
at vLLM's 16-token pages that is second order and not counted.

Bytes are per GPU of a ``tp``-way group (``tp=1``: the logical copy, what a store keeps).
Pure arithmetic: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.kv.geometry import KVGeometry
from kvstrata.kv.groups import KVGroup


@dataclass(frozen=True)
class GroupShare:
    """One group's part of a size.

    Attributes:
        group: the KV group.
        tokens: tokens of KV it holds or moves (0 for a state group).
        size_bytes: its bytes (per GPU, or logical at ``tp=1``).
    """

    group: KVGroup
    tokens: int
    size_bytes: int


@dataclass(frozen=True)
class GroupBytes:
    """A size split by KV group, in the geometry's group order."""

    shares: tuple[GroupShare, ...]

    @property
    def size_bytes(self) -> int:
        return sum(s.size_bytes for s in self.shares)


def restore_bytes(
    geometry: KVGeometry, prefix_tokens: int, tp: int = 1, segment: tuple[int, int] | None = None
) -> GroupBytes:
    """Bytes a restore of a cached prefix ending at ``prefix_tokens`` moves, whole or for one
    segment of it (what one tier serves when several do).

    Args:
        geometry: the model.
        prefix_tokens: P, where the cached prefix ends.
        tp: tensor-parallel degree; bytes are one GPU's.
        segment: ``(start, stop)``, the tokens ``[start, stop)`` of the prefix this part
            serves; None: all of it, ``(0, P)``, which is what a request of P tokens holds.

    Raises:
        ValueError: a segment outside ``[0, P]`` or reversed.
    """
    start, stop = (0, prefix_tokens) if segment is None else segment
    if not 0 <= start <= stop <= prefix_tokens:
        raise ValueError(f"segment ({start}, {stop}) must lie in the prefix [0, {prefix_tokens}] in order")
    shares = []
    for group in geometry.groups:
        if group.kind.per_token:
            kept_from = prefix_tokens - group.tokens_kept(prefix_tokens)
            tokens = max(0, stop - max(start, kept_from))
            shares.append(GroupShare(group, tokens, tokens * group.token_bytes(tp)))
        else:  # the snapshot as of P travels with the segment that reaches P
            reaches = stop == prefix_tokens and start < stop
            shares.append(GroupShare(group, 0, group.state_bytes_per_gpu(tp) if reaches else 0))
    return GroupBytes(tuple(shares))


def request_bytes(geometry: KVGeometry, tokens: int, tp: int = 1) -> int:
    """Bytes one sequence of ``tokens`` tokens holds on one GPU, and every decode step reads."""
    return geometry.kv_bytes(tokens, tp)


def stored_bytes(geometry: KVGeometry, tokens: int, ends: int = 1, tp: int = 1) -> int:
    """Bytes a prefix store keeps for ``tokens`` tokens that a hit may end in ``ends`` places:
    every token of FULL/MLA groups, the windows before the ends of windowed ones (at most
    ``ends * span`` tokens), and a state snapshot per end (see the module text)."""
    geometry.kv_heads_per_gpu(tp)
    return stored_groups(geometry, tokens, ends, tp).size_bytes


def stored_groups(geometry: KVGeometry, tokens: int, ends: int = 1, tp: int = 1) -> GroupBytes:
    """:func:`stored_bytes` split by KV group (a state group's share is its ``ends`` snapshots)."""
    shares = []
    for group in geometry.groups:
        if group.kind.per_token:
            kept = min(tokens, ends * group.span) if group.kind.windowed else tokens
            shares.append(GroupShare(group, kept, kept * group.token_bytes(tp)))
        else:
            shares.append(GroupShare(group, 0, ends * group.state_bytes_per_gpu(tp)))
    return GroupBytes(tuple(shares))


def held_bytes(geometry: KVGeometry, held: tuple[int, ...], tp: int = 1) -> int:
    """Bytes of what a batch holds, given per group (in the geometry's order) the tokens a
    per-token group keeps or the states a state group holds."""
    return sum(
        count * (group.token_bytes(tp) if group.kind.per_token else group.state_bytes_per_gpu(tp))
        for group, count in zip(geometry.groups, held, strict=True)
    )


def first_layer_bytes(geometry: KVGeometry, tokens: int, tp: int = 1) -> int:
    """Bytes the lowest layer that caches anything holds for ``tokens`` tokens on one GPU: what a
    layer-by-layer stream moves before the first layer can run."""
    group = min(geometry.groups, key=lambda g: g.layers[0])
    return group.bytes_for(tokens, tp) // group.num_layers


def attended_tokens(cached: int, new: int, span: int | None) -> float:
    """Tokens ``new`` tokens after ``cached`` attend to, summed over the new tokens: the integral
    of ``min(x, span)`` over ``[cached, cached + new]`` (``span`` None: no window, the causal
    ``new * (cached + new / 2)``)."""
    end = cached + new
    if span is None or end <= span:
        return new * (cached + new / 2)
    if cached >= span:
        return new * span
    return (span * span - cached * cached) / 2 + (end - span) * span
