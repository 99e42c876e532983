"""A request's service-level objective and goodput at it (pure): shared by the simulator's
summaries (:mod:`kvstrata.sim.results`) and the real fleet's benchmark (``bench route``), so the
two count goodput the same way.

A request meets the SLO when its TTFT is at most ``Slo.ttft_s`` and its TPOT (mean time per
output token after the first) at most ``Slo.tpot_s``; a one-token answer has no TPOT and is
judged by TTFT alone. Goodput is the share of requests that meet it, and those requests per
second of a stated span (the offered load's rate of useful answers), as DistServe counts goodput
at one rate rather than searching rates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Timed(Protocol):
    """What a request's record must say to be judged: its TTFT, and its TPOT (None: one token)."""

    @property
    def ttft_s(self) -> float: ...

    @property
    def tpot_s(self) -> float | None: ...


@dataclass(frozen=True)
class Slo:
    """A request's targets: time to the first token and time per output token, seconds."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"the SLO's {name} must be a number of seconds > 0, got {value!r}")

    def met(self, record: Timed) -> bool:
        tpot_s = record.tpot_s
        return record.ttft_s <= self.ttft_s and (tpot_s is None or tpot_s <= self.tpot_s)


@dataclass(frozen=True)
class Goodput:
    """Requests that met the SLO: how many, their share, and per second of the span given."""

    met: int
    requests: int
    share: float  # NaN: no request
    per_s: float  # NaN: no span

    def to_json(self) -> dict:
        clean = lambda x: None if math.isnan(x) else x  # noqa: E731
        return {"met": self.met, "requests": self.requests, "share": clean(self.share), "per_s": clean(self.per_s)}


def goodput(records: Sequence[Timed], slo: Slo, span_s: float) -> Goodput:
    """``records``' goodput under ``slo`` over ``span_s`` seconds (see the module text)."""
    met = sum(1 for r in records if slo.met(r))
    return Goodput(met, len(records), met / len(records) if records else math.nan,
                   met / span_s if span_s > 0 else math.nan)
