"""Several calibrations of one host, one profile (pure): each figure the median of its sittings.

On a shared host one calibration is one sitting's weather. Two ``kvstrata calibrate --engine
vllm`` runs of the same code four minutes apart measured a step beside another server 1.6x and
2.2x slower, and the connector's cost per request 14 and 23 ms; replays of the same six ``bench
serve`` runs met 56 and 37 of 90 time goals. Calibrations taken between the runs they are to
predict, combined, stand for the sitting as a whole:

- each path's fit, prefill, decode and connector figure: the median over the calibrations that
  have it (a fit's terms each on their own; the worst spread is kept, and every size measured);
- the stalls: pooled, since each calibration saw a few of them: the share of requests that
  stalled averaged, the stalls measured all kept;
- measured efficiencies: the median of each.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvstrata.plan.host import HostCalibration, PathFit
from kvstrata.plan.steps import Stalls

F = TypeVar("F")


def combine(calibrations: Sequence[HostCalibration]) -> HostCalibration:
    """One calibration of the host ``calibrations`` measured (see the module text).

    Raises:
        ValueError: none given, or they are of different hosts, devices or thread counts (names them).
    """
    if not calibrations:
        raise ValueError("combining calibrations needs at least one")
    first = calibrations[0]
    for c in calibrations[1:]:
        mine, theirs = (first.host, first.device, first.threads), (c.host, c.device, c.threads)
        if mine != theirs:
            raise ValueError(f"calibrations of different hosts cannot be combined: {mine} and {theirs} "
                             f"(host, device, threads)")
    return HostCalibration(
        first.host, first.device, first.threads,
        paths=_each(calibrations, lambda c: c.paths, _paths),
        prefill=_each(calibrations, lambda c: c.prefill, _medians),
        efficiency=_each(calibrations, lambda c: c.efficiency, statistics.median),
        decode=_each(calibrations, lambda c: c.decode, _medians),
        connector=_each(calibrations, lambda c: c.connector, _medians),
        stalls=_each(calibrations, lambda c: c.stalls, _pooled),
    )


def _each(calibrations: Sequence[HostCalibration], table: Callable[[HostCalibration], dict[str, F]],
          merge: Callable[[list[F]], F]) -> dict[str, F]:
    """``merge`` of each key's values over the calibrations that have it, in first-seen order."""
    keys = dict.fromkeys(k for c in calibrations for k in table(c))
    return {k: merge([table(c)[k] for c in calibrations if k in table(c)]) for k in keys}


def _medians(fits: list[F]) -> F:
    """The fit whose every number is the median of the fits' (a fit's own checks rerun)."""
    return dataclasses.replace(fits[0], **{
        f.name: statistics.median(getattr(x, f.name) for x in fits)
        for f in dataclasses.fields(fits[0]) if isinstance(getattr(fits[0], f.name), (int, float))})


def _paths(fits: list[PathFit]) -> PathFit:
    return PathFit(statistics.median(p.latency_s for p in fits), statistics.median(p.gbps for p in fits),
                   max(p.spread for p in fits), tuple(sorted({s for p in fits for s in p.sizes})))


def _pooled(stalls: list[Stalls]) -> Stalls:
    return Stalls(statistics.fmean(s.alone for s in stalls), tuple(sorted(x for s in stalls for x in s.alone_s)),
                  statistics.fmean(s.beside for s in stalls), tuple(sorted(x for s in stalls for x in s.beside_s)))
