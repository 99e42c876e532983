"""Least-squares fits of measured times: a transfer path's ``latency + bytes / bandwidth`` and a
model's prefill.

``kvstrata calibrate`` measures each path at several sizes and fits

    seconds(bytes) = latency_s + bytes / (gbps * 1e9)

by least squares on the medians (latency clipped at 0). A model's prefill is fitted the same way
on tokens, with the attention term of :mod:`kvstrata.sim.model`:

    seconds(new, cached) = latency_s + new / tokens_per_s + attn_s * new * (cached + new / 2)

Pure arithmetic on numbers already measured: no I/O, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

GB = 1e9  # decimal: bandwidths are GB/s of 1e9 bytes


@dataclass(frozen=True)
class PathFit:
    """``seconds = latency_s + bytes / (gbps * 1e9)`` for one path.

    Attributes:
        latency_s: the fixed cost of one operation.
        gbps: effective bandwidth, decimal GB/s; ``math.inf`` for a fixed cost (the bytes
            take no measurable time).
        spread: the largest relative half-range (max - min) / 2 / median among the sizes'
            repeats: how far one measurement strays.
        sizes: the sizes measured, bytes.
    """

    latency_s: float
    gbps: float
    spread: float = 0.0
    sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"latency_s must be finite and >= 0, got {self.latency_s}")
        if not self.gbps > 0:
            raise ValueError(f"gbps must be > 0 (inf for a fixed cost), got {self.gbps}")

    def seconds(self, nbytes: int, ops: int = 1) -> float:
        """Time for ``nbytes`` moved in ``ops`` operations (each pays the latency)."""
        return ops * self.latency_s + nbytes / (self.gbps * GB)


def fit_path(sizes: Sequence[int], seconds: Sequence[float], spread: float = 0.0, fixed: bool = False,
             relative: bool = False, origin: bool = False) -> PathFit:
    """Least-squares ``latency + bytes / bandwidth`` through (size, seconds) points.

    One size, or a negative fitted latency, gives the bandwidth through the origin of the
    largest size's point (``relative``: through all points, on relative error), the fixed
    cost then unmeasurable, taken as 0. ``fixed``: the bytes take no measurable time (see
    ``FIXED_COST_PATHS``): the latency is the mean time, the bandwidth infinite.
    ``relative``: each point weighted by 1 / seconds, so every size's time is fitted to the
    same relative accuracy (unweighted, the largest size's noise sets the smaller ones'
    predictions). ``origin``: a rate alone, through the origin (see ``RATE_PATHS``).
    """
    if len(sizes) != len(seconds) or not sizes:
        raise ValueError(f"fit needs as many sizes as times, at least one; got {len(sizes)} and {len(seconds)}")
    if any(s <= 0 for s in sizes) or any(not t > 0 for t in seconds):
        raise ValueError("fit needs positive sizes and times")
    n = len(sizes)
    if fixed:
        return PathFit(sum(seconds) / n, math.inf, spread, tuple(sizes))
    w = [1 / t**2 if relative else 1.0 for t in seconds]
    if n >= 2 and len(set(sizes)) >= 2 and not origin:
        sw = sum(w)
        mx = sum(wi * x for wi, x in zip(w, sizes)) / sw
        my = sum(wi * y for wi, y in zip(w, seconds)) / sw
        sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, sizes))
        slope = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, sizes, seconds)) / sxx
        latency = my - slope * mx
        if slope > 0 and latency >= 0:
            return PathFit(latency, 1 / slope / GB, spread, tuple(sizes))
    if relative:  # through the origin: slope = sum(w x y) / sum(w x^2)
        slope = sum(wi * x * y for wi, x, y in zip(w, sizes, seconds)) / sum(wi * x * x for wi, x in zip(w, sizes))
        return PathFit(0.0, 1 / slope / GB, spread, tuple(sizes))
    i = max(range(n), key=lambda k: sizes[k])
    return PathFit(0.0, sizes[i] / seconds[i] / GB, spread, tuple(sizes))


@dataclass(frozen=True)
class PrefillFit:
    """A model's prefill seconds on this host (see the module text)."""

    latency_s: float
    tokens_per_s: float
    attn_s: float = 0.0  # seconds per (new token x attended token)

    def seconds(self, new_tokens: int, cached_tokens: int = 0) -> float:
        if new_tokens <= 0:
            return 0.0
        n = new_tokens
        return self.latency_s + n / self.tokens_per_s + self.attn_s * n * (cached_tokens + n / 2)


def fit_prefill(points: Sequence[tuple[int, int, float]]) -> PrefillFit:
    """Least squares of ``a + b * n + c * n * (cached + n / 2)`` through (new, cached, seconds),
    on relative error (each point weighted by 1 / seconds).

    Why relative: prefill times span orders of magnitude across prompt sizes, and an absolute
    fit lets the largest prompts' noise set the small ones' predictions (measured on the tiny
    model, 2 shared cores: a fitted latency of 31 ms where a 128-token prefill takes 4 ms, or a
    per-token term of zero or less); load-or-recompute needs C(k) right for every k. A negative
    latency or attention term is dropped (refitted without it): every term is a cost, and the
    per-token term must stay.
    """
    import numpy as np

    if len(points) < 3:
        raise ValueError(f"a prefill fit needs at least 3 points, got {len(points)}")
    if any(n <= 0 or c < 0 or not t > 0 for n, c, t in points):
        raise ValueError("prefill fit needs positive sizes and times")
    weight = np.array([1 / t for _, _, t in points])
    rows = np.array([[1.0, n, n * (c + n / 2)] for n, c, _ in points]) * weight[:, None]
    keep = [0, 1, 2]
    while True:
        coef, *_ = np.linalg.lstsq(rows[:, keep], np.ones(len(points)), rcond=None)
        values = dict(zip(keep, coef))
        drop = next((k for k in (0, 2) if k in values and (values[k] < 0 or values[1] <= 0)), None)
        if drop is None:
            break
        keep.remove(drop)
    if values[1] <= 0:
        raise ValueError("prefill fit: time does not grow with tokens; measure larger prompts")
    return PrefillFit(float(values.get(0, 0.0)), float(1 / values[1]), float(values.get(2, 0.0)))
