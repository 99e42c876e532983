"""The vocabulary every part shares (pure: no torch, no I/O): the media a block can live on,
the routes blocks take between them, and how a block without an in-memory view reaches the device.

Defined once, below the tiers, the block manager, the planner, the simulator, the benchmarks and
the integrations, which all speak of the same four places.
"""

from __future__ import annotations

import enum


class Medium(enum.Enum):
    """Where a block's bytes can be, fastest first (``value`` orders them)."""

    DEVICE = 0  # GPU HBM (a CPU tensor pool stands in where there is no GPU)
    HOST = 1  # host DRAM (pinned when CUDA is present)
    DISK = 2  # local NVMe
    REMOTE = 3  # a shared DRAM pool on other machines

    # Members are singletons compared by identity: hash them by identity too, in C. Enum's own
    # __hash__ (of the name, in Python) cost ~0.4 us a call, ~100 calls a load in the cache.
    __hash__ = object.__hash__

    @property
    def bit(self) -> int:
        return 1 << self.value

    @property
    def label(self) -> str:
        return self.name.lower()

    @staticmethod
    def from_mask(mask: int) -> tuple["Medium", ...]:
        return _FROM_MASK[mask]

    @staticmethod
    def fastest(mask: int) -> "Medium":
        medium = FASTEST_BY_MASK[mask]
        if medium is None:
            raise ValueError("an empty medium mask has no fastest medium")
        return medium


# Lookup tables on the hot path (one tuple index per block): 4 media -> 16 masks.
_FROM_MASK = tuple(tuple(m for m in Medium if mask & m.bit) for mask in range(1 << len(Medium)))
FASTEST_BY_MASK = tuple(media[0] if media else None for media in _FROM_MASK)

Route = tuple[Medium, ...]
"""The media a block passed through on its way to the device, source first: ``(DEVICE,)`` for
a block already there, ``(DISK, DEVICE)`` read straight into it, ``(REMOTE, HOST, DEVICE)``
staged in host memory."""


def route_text(route: Route) -> str:
    """``"remote -> host -> device"``: how reports and logs write a route."""
    return " -> ".join(m.label for m in route)


def parse_route(text: str) -> Route:
    """The inverse of :func:`route_text` (reports read back from JSON)."""
    try:
        return tuple(Medium[part.strip().upper()] for part in text.split("->"))
    except KeyError:
        raise ValueError(f"not a route: {text!r} (expected media like 'disk -> host -> device')") from None


class FetchPath(enum.Enum):
    """How a block from a medium without an in-memory view (disk, the pool) reaches the device."""

    AUTO = "auto"  # straight in where the source can address device memory, else staged
    DIRECT = "direct"  # source -> device (GPUDirect, or a CPU stand-in for HBM)
    STAGED = "staged"  # source -> host -> device
