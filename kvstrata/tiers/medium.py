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
        return tuple(m for m in Medium if mask & m.bit)

    @staticmethod
    def fastest(mask: int) -> "Medium":
        return next(m for m in Medium if mask & m.bit)
