"""A figure with its basis and source, and the bandwidth/efficiency pair every link carries.

Bandwidth is in decimal GB/s (1e9 bytes per second), as datasheets quote it. Every figure
states its basis (what the number counts) and where it comes from; an effective bandwidth is
``spec x efficiency`` where the efficiency has a basis of its own (encoding, protocol headers,
or a measurement on this host).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def lookup(table: Mapping[K, V], key: K, what: str) -> V:
    """``table[key]``, or a ValueError naming ``what`` and the keys the table knows."""
    try:
        return table[key]
    except KeyError:
        raise ValueError(f"unknown {what} {key!r}; known: {', '.join(map(str, table))}") from None


def require_positive(spec: object, what: str, *fields: str) -> None:
    """A ValueError naming ``what`` and the first of ``spec``'s ``fields`` that is not positive."""
    for name in fields:
        value = getattr(spec, name)
        if not value > 0:
            raise ValueError(f"{what} {name} must be positive, got {value!r}")


class Basis(enum.Enum):
    """What a bandwidth figure counts."""

    LINE_RATE = "line rate"  # bits on the wire per second / 8 (NIC ports)
    RAW = "raw"  # signalling rate before protocol overhead (PCIe 6.0 FLIT mode)
    AFTER_ENCODING = "after encoding"  # raw x line-code efficiency (PCIe 3.0-5.0 128b/130b)
    NOMINAL = "nominal"  # vendor peak (HBM, NVLink, a whole NIC's total)
    VENDOR_TYPICAL = "vendor typical"  # datasheet sequential figures (NVMe)
    DERIVED = "derived"  # computed from other figures (DRAM channels x MT/s x 8 bytes)
    PAYLOAD_ESTIMATE = "payload estimate"  # after stated packet/FLIT overheads
    MEASURED = "measured"  # measured on a host


@dataclass(frozen=True)
class Figure:
    """One number of the catalog, with its unit, basis and source."""

    value: float
    unit: str
    basis: Basis
    source: str


@dataclass(frozen=True)
class Bandwidth:
    """One direction's capacity (or a shared total) of a link or memory.

    Attributes:
        spec_gbps: the catalog figure, decimal GB/s, counted as ``basis`` says.
        basis: what ``spec_gbps`` counts.
        source: where ``spec_gbps`` comes from.
        efficiency: payload fraction of ``spec_gbps`` that carries KV bytes, in (0, 1].
        efficiency_basis: why that efficiency (overhead model, or "measured").
    """

    spec_gbps: float
    basis: Basis
    source: str
    efficiency: float = 1.0
    efficiency_basis: str = "no overhead model (1.0); calibrate to measure"

    def __post_init__(self) -> None:
        require_positive(self, "bandwidth", "spec_gbps")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {self.efficiency!r}")

    @property
    def effective_gbps(self) -> float:
        return self.spec_gbps * self.efficiency

    def with_efficiency(self, efficiency: float, basis: str = "measured") -> "Bandwidth":
        return replace(self, efficiency=efficiency, efficiency_basis=basis)

    def scaled(self, factor: float, note: str) -> "Bandwidth":
        """A bandwidth ``factor`` times this one (e.g. several parallel links)."""
        return replace(self, spec_gbps=self.spec_gbps * factor, source=f"{self.source}; {note}")
