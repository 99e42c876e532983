"""What the block manager plans for: tiers and their capacities, policies, and how loads are cut."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvstrata.kv.layout import KVLayout
from kvstrata.media import Medium
from kvstrata.policies.eviction import Eviction
from kvstrata.policies.write import WriteRule

# A load this small is copied in one dispatch: below it, handing layer ranges to the engine's
# workers (or even dispatching them one by one) costs more than the copies (measured on the
# tiny model, ~1 MB restores: 0.48 -> 0.21 ms idle, 0.81 -> 0.52 ms right after a forward pass).
# Its layers then become ready together, about 0.1 ms in.
SMALL_LOAD_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class ManagerConfig:
    """What the manager plans for.

    Attributes:
        layout: the block layout (sizes for copy ranges).
        capacities: blocks per tier present; the device tier is required.
        eviction: the order blocks leave a full tier.
        write: when blocks go down the tiers.
        direct: media without an in-memory view whose blocks are read straight into device
            slots (the others are staged in the host tier).
        workers: transfer threads (copy ranges are cut so each gets two or more).
        small_load_bytes: loads up to this size are copied as one range.
        layer_ranges: larger loads are copied in layer ranges (else every load is one range).
    """

    layout: KVLayout
    capacities: Mapping[Medium, int]
    eviction: Eviction = Eviction.LRU
    write: WriteRule = field(default_factory=WriteRule)
    direct: frozenset[Medium] = frozenset()
    workers: int = 2
    small_load_bytes: int = SMALL_LOAD_BYTES
    layer_ranges: bool = True

    def __post_init__(self) -> None:
        if Medium.DEVICE not in self.capacities:
            raise ValueError("the block manager needs a device tier")
