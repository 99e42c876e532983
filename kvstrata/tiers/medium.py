"""The media a block can live on, fastest first (pure: no torch)."""

from __future__ import annotations

import enum


class Medium(enum.Enum):
    DEVICE = 0  # GPU HBM (a CPU tensor pool stands in where there is no GPU)
    HOST = 1  # host DRAM (pinned when CUDA is present)
    DISK = 2  # local NVMe
    REMOTE = 3  # a shared DRAM pool on other machines

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
