"""Load or recompute: per request, load the cached prefix, recompute it, or split it.

A prompt of ``hit + tail`` tokens whose first ``hit`` tokens (whole blocks) are cached can start
three ways (predicted seconds to the first token; ``C(new, cached)`` is the model's
:class:`~kvstrata.plan.host.PrefillFit`, ``L(blocks)`` the time to load the *last* ``blocks``
blocks of the hit):

    load       L(hit / B) + C(tail, hit)
    recompute  C(hit + tail, 0)                                  (one forward, as a cold run)
    split k    max(C(k, 0) + X((hit - k) / B), L((hit - k) / B)) + C(tail, hit)
                                                  (0 < k < hit, k a multiple of B)

``X(blocks)`` is the loading's work that delays the computing when both share processors (a
CPU-only host: page-cache reads, checksums and copies run on the cores the model runs on); 0
where a GPU computes while the CPU and DMA engines load. Without it, on 2 shared cores a split
at high read rates was predicted 20.6 ms and took 32 ms (load-only: 23.5 ms).

The split is Cake's ("Compute Or Load KV Cache? Why Not Both?", ICML 2025), in the one order
that works: a token's KV needs the KV of every token before it, so the model computes the
prompt's *beginning* ``[0, k)`` from scratch while the cache loads the blocks ``[k, hit)``; the
loaded KV goes after the computed KV in each layer, then the uncached tail is computed as usual.
``C(k, 0)`` grows with k and ``L((hit - k) / B)`` shrinks, so the best k sits where the two
meet; every block-aligned k is tried (a few hundred at most) and the least predicted time of
all candidates (load, recompute, each split) is the plan, a split only when it wins by
``SPLIT_MARGIN``; so the chosen plan's prediction is never above either pure plan's.

Pure arithmetic: no torch, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from kvstrata.plan.host import PathFit, PrefillFit


class PlanKind(Enum):
    """How a request's cached prefix is brought in."""

    LOAD = "load"  # load every cached block (today's behaviour)
    RECOMPUTE = "recompute"  # ignore the cache, compute the whole prompt
    SPLIT = "split"  # compute [0, k) while loading [k, hit)


class Strategy(Enum):
    """What the caller asks for: a fixed plan, or AUTO (decided by :func:`choose`)."""

    LOAD = "load"
    RECOMPUTE = "recompute"
    SPLIT = "split"
    AUTO = "auto"


@dataclass(frozen=True)
class RecomputePlan:
    """A decision and its predictions (seconds to the first token, lookup excluded).

    Attributes:
        kind: the plan.
        compute_tokens: k, tokens of the hit computed from scratch: 0 for LOAD, ``hit_tokens``
            for RECOMPUTE, strictly between for SPLIT (a multiple of the block size).
        hit_tokens: cached prefix tokens (whole blocks).
        tail_tokens: prompt tokens after the hit (always computed).
        predicted_s: the plan's predicted time.
        load_only_s: the LOAD plan's predicted time.
        recompute_s: the RECOMPUTE plan's predicted time.
        compute_s: predicted time of computing ``[0, k)`` (0 for LOAD), slowed by the load's
            contention in a split.
        load_s: predicted time of loading ``[k, hit)`` (0 for RECOMPUTE).
    """

    kind: PlanKind
    compute_tokens: int
    hit_tokens: int
    tail_tokens: int
    predicted_s: float
    load_only_s: float
    recompute_s: float
    compute_s: float
    load_s: float

    @property
    def loaded_tokens(self) -> int:
        return 0 if self.kind is PlanKind.RECOMPUTE else self.hit_tokens - self.compute_tokens

    def as_dict(self) -> dict:
        return {
            "kind": self.kind.value, "k": self.compute_tokens, "hit_tokens": self.hit_tokens,
            "tail_tokens": self.tail_tokens, "predicted_s": self.predicted_s, "load_only_s": self.load_only_s,
            "recompute_s": self.recompute_s, "compute_s": self.compute_s, "load_s": self.load_s,
        }


# A split runs two things at once whose prediction errs more than either alone: a second
# forward's fixed cost, a second load dispatch, and (on a CPU-only host) both on the same cores.
# Measured on the tiny model on 2 cores: a split predicted 22.5 ms took 29.6 ms where load-only
# took 24.4 ms. So a split must be predicted this much faster than the better pure plan.
SPLIT_MARGIN = 0.15

LoadTime = Callable[[int], float]  # blocks (the last ones of the hit) -> predicted seconds


def path_load_time(fit: PathFit, block_bytes: int) -> LoadTime:
    """``L(blocks)`` from one path's fit: one operation per block (each pays the latency)."""
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    return lambda blocks: fit.seconds(blocks * block_bytes, ops=blocks) if blocks > 0 else 0.0


def choose(
    hit_tokens: int,
    tail_tokens: int,
    block_tokens: int,
    bytes_per_token: int,
    load: PathFit | LoadTime,
    prefill: PrefillFit,
    contention: LoadTime | None = None,
    split_margin: float = SPLIT_MARGIN,
) -> RecomputePlan:
    """The plan of least predicted time to the first token (see the module text).

    Args:
        hit_tokens: cached prefix, a multiple of ``block_tokens`` (may be 0: then LOAD, nothing
            to load or to decide).
        tail_tokens: prompt tokens after the hit, >= 1 (the last prompt token is always computed).
        block_tokens: tokens per block.
        bytes_per_token: KV bytes per token (all layers), for a PathFit.
        load: ``L(blocks)``, seconds to load the last ``blocks`` blocks of the hit, or a PathFit
            (one operation per block).
        prefill: the model's prefill fit on this host.
        contention: ``X(blocks)``, seconds by which loading the last ``blocks`` blocks delays
            computing (see the module text); None: none (compute and load overlap fully).
        split_margin: a split is chosen only when predicted at least this fraction faster than
            the better pure plan (see ``SPLIT_MARGIN``).

    Raises:
        ValueError: a size out of range, or a hit not of whole blocks.
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    if hit_tokens < 0 or hit_tokens % block_tokens:
        raise ValueError(f"hit_tokens must be a non-negative multiple of block_tokens {block_tokens}, got {hit_tokens}")
    if tail_tokens < 1:
        raise ValueError(f"tail_tokens must be >= 1 (the last prompt token is always computed), got {tail_tokens}")
    if isinstance(load, PathFit):
        if bytes_per_token <= 0:
            raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token}")
        load = path_load_time(load, block_tokens * bytes_per_token)
    blocks = hit_tokens // block_tokens
    tail_s = prefill.seconds(tail_tokens, hit_tokens)
    full_load_s = _checked(load(blocks), blocks)
    load_only = full_load_s + tail_s
    recompute = prefill.seconds(hit_tokens + tail_tokens, 0)
    best = RecomputePlan(PlanKind.LOAD, 0, hit_tokens, tail_tokens, load_only, load_only, recompute, 0.0, full_load_s)
    if blocks == 0:
        return best
    if recompute < best.predicted_s:
        best = RecomputePlan(PlanKind.RECOMPUTE, hit_tokens, hit_tokens, tail_tokens, recompute, load_only, recompute,
                             prefill.seconds(hit_tokens, 0), 0.0)
    split = None  # the best split; on a tie the larger k (nearer where compute and load meet)
    for j in range(1, blocks):
        k = j * block_tokens
        compute_s, load_s = prefill.seconds(k, 0), _checked(load(blocks - j), blocks - j)
        if contention is not None:
            compute_s += _checked(contention(blocks - j), blocks - j)
        predicted = max(compute_s, load_s) + tail_s
        if split is None or predicted <= split.predicted_s:
            split = RecomputePlan(PlanKind.SPLIT, k, hit_tokens, tail_tokens, predicted, load_only, recompute,
                                  compute_s, load_s)
    if split is not None and split.predicted_s < (1 - split_margin) * best.predicted_s:
        best = split
    return best


def _checked(seconds: float, blocks: int) -> float:
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise ValueError(f"load time of {blocks} blocks must be finite and >= 0, got {seconds}")
    return seconds
