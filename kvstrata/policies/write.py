"""Write policies: when a block stored in a fast tier is also written to the slower ones."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class WritePolicy(enum.Enum):
    WRITE_THROUGH = "write-through"  # every new block goes on down to host and disk at once
    WRITE_BACK = "write-back"  # a block goes down only when evicted from above
    SELECTIVE = "selective"  # a block goes down once it has been hit N times (hot blocks only)


@dataclass(frozen=True)
class WriteRule:
    policy: WritePolicy = WritePolicy.WRITE_THROUGH
    selective_hits: int = 2

    def __post_init__(self) -> None:
        if self.selective_hits < 1:
            raise ValueError(f"selective_hits must be >= 1, got {self.selective_hits}")

    def on_store(self) -> bool:
        """Write a newly stored block down to every lower tier now?"""
        return self.policy is WritePolicy.WRITE_THROUGH

    def on_hit(self, hits: int) -> bool:
        """Write a block down now that it has been hit ``hits`` times? (>=, not ==: two
        concurrent hits may step past N; writing down a block already below is a no-op.)"""
        return self.policy is WritePolicy.SELECTIVE and hits >= self.selective_hits

    def on_evict(self, hits: int) -> bool:
        """Copy an evicted block to the next tier down (if it is not there already)?"""
        if self.policy is WritePolicy.WRITE_BACK:
            return True
        if self.policy is WritePolicy.SELECTIVE:
            return hits >= self.selective_hits
        return False  # write-through: the lower tiers already have it
