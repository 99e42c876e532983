"""What the block manager decides, as small frozen values the transfer worker carries out.

A plan names blocks by key and by ``Slot`` (a medium and a slot index); it moves nothing. Every
byte a plan needs moved is a ``Leg`` (one block, source slot -> destination slot). Room made for
a plan's reservations is a ``Room``: victims leaving their tier, each with the demotion leg that
copies it one tier down first (write policy permitting). The worker runs a plan's room before
its legs, deepest tier first (``Room.stages``), since a reservation may reuse a victim's slot.
Bytes that come from, or go to, a caller's own memory (``PutPlan``, ``GetPlan``) have one end in
a slot: a ``Placement`` (a block of the caller's batch, and that slot).

The worker reports per leg (or placement) ``None`` (moved) or a ``Failure``; the manager's ``complete_*`` turn
those into state changes, the same way for every plan (see ``BlockManager``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from kvstrata.index.keys import BlockKey
from kvstrata.media import Medium, Route


class StopReason(enum.Enum):
    """Why a load brought fewer blocks than its match held (it stops at the first it cannot have)."""

    GONE = "gone"  # the block left every tier between the lookup and the load
    DEVICE_FULL = "device-full"  # no device slot: every one pinned or being written
    LOADING_ELSEWHERE = "loading-elsewhere"  # another request is bringing this block to the device
    NO_STAGING = "no-staging"  # a disk or pool block needs a host tier to stage in, and there is none
    STAGING_FULL = "staging-full"  # the host tier is full of pinned blocks
    STAGING_ELSEWHERE = "staging-elsewhere"  # another request is promoting this block to the host
    CORRUPT = "corrupt"  # the block failed verification and was dropped from its tier
    MISSING = "missing"  # the block was gone from its tier (a shared pool evicted it, say)
    UNAVAILABLE = "unavailable"  # the tier's service is down (nothing was exposed to it)
    ABANDONED = "abandoned"  # the tier stopped answering mid-transfer; the destination slot is retired
    CANCELLED = "cancelled"  # the caller gave the load up (past its budget) before this block was read
    FAILED = "failed"  # moving the block raised an unexpected error (the load raises it)


class Failure(enum.Enum):
    """How moving one leg failed, as far as the slots involved are concerned."""

    CORRUPT = "corrupt"  # the source's bytes do not verify: drop the source copy
    MISSING = "missing"  # the source is gone (a shared pool evicted it): drop it from our view
    UNAVAILABLE = "unavailable"  # the tier is down; nothing was exposed: the destination is reusable
    ABANDONED = "abandoned"  # timed out with the destination exposed: it may still be written, retire it
    NO_SPACE = "no-space"  # the destination's medium is full below its capacity: hold no more there
    CANCELLED = "cancelled"  # the load was given up before this leg ran: nothing touched, both slots reusable
    ERROR = "error"  # anything else: the destination is discarded, the error surfaces

    @property
    def stop(self) -> StopReason:
        return _STOPS[self]

    @property
    def drops_source(self) -> bool:
        return self in (Failure.CORRUPT, Failure.MISSING)


_STOPS = {
    Failure.CORRUPT: StopReason.CORRUPT,
    Failure.MISSING: StopReason.MISSING,
    Failure.UNAVAILABLE: StopReason.UNAVAILABLE,
    Failure.ABANDONED: StopReason.ABANDONED,
    Failure.NO_SPACE: StopReason.FAILED,
    Failure.CANCELLED: StopReason.CANCELLED,
    Failure.ERROR: StopReason.FAILED,
}


@dataclass(frozen=True)
class Slot:
    """Where a block's bytes are: a medium and a slot of its tier."""

    medium: Medium
    index: int


@dataclass(frozen=True)
class Leg:
    """One block's bytes from ``src`` to ``dst`` (both slots held by the plan: src pinned or
    evicting, dst reserved WRITING)."""

    key: BlockKey
    src: Slot
    dst: Slot


@dataclass(frozen=True)
class Victim:
    """A block leaving ``slot`` (EVICTING), after ``demotion`` copies it a tier down, if any."""

    key: BlockKey
    slot: Slot
    demotion: Leg | None = None


@dataclass(frozen=True)
class Room:
    """Victims to carry out before the legs that write into their slots."""

    victims: tuple[Victim, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.victims)

    def __add__(self, other: Room) -> Room:
        return Room(self.victims + other.victims)

    def stages(self) -> list[tuple[Victim, ...]]:
        """The victims by tier, deepest tier first: a demotion writes into the tier below, whose
        own victims (made room for it) must have left first."""
        media = sorted({v.slot.medium for v in self.victims}, key=lambda m: m.value, reverse=True)
        return [tuple(v for v in self.victims if v.slot.medium is m) for m in media]


class Step(enum.Enum):
    """Where one block of a load is on its way to the device."""

    RESIDENT = "resident"  # on the device already (pinned there): nothing moves
    FETCH = "fetch"  # from a medium without a view (disk, pool): into the host (staged) or the device
    COPY = "copy"  # from memory (host, or the device stand-in) into the device slot, layer by layer
    LANDED = "landed"  # every byte is in the device slot (fetched straight in)


_STEPS = {(Step.FETCH, Step.COPY), (Step.FETCH, Step.LANDED), (Step.COPY, Step.LANDED)}


@dataclass(frozen=True)
class LoadBlock:
    """One block of a load: the device slot it lands in, how it gets there, and the leg its
    current step runs (None when RESIDENT or LANDED)."""

    key: BlockKey
    device_slot: int
    route: Route
    step: Step
    leg: Leg | None = None

    def advanced(self, step: Step, leg: Leg | None = None) -> LoadBlock:
        if (self.step, step) not in _STEPS:
            raise ValueError(f"a load block cannot go {self.step.name} -> {step.name}")
        return replace(self, step=step, leg=leg)


@dataclass(frozen=True)
class LoadPlan:
    """The blocks of a match a load will bring to the device, in order, and the room it needs.

    Attributes:
        blocks: the leading blocks that can be had (all of the match unless ``stopped``).
        room: evictions the device (and staging) reservations need, to carry out first.
        stopped: why the plan ends before the match does; ``stopped_at`` the medium of the
            block it stopped at.
        ranges: layer ranges the COPY steps move in, in order (events fire per range).
    """

    blocks: tuple[LoadBlock, ...]
    room: Room = field(default_factory=Room)
    stopped: StopReason | None = None
    stopped_at: Medium | None = None
    ranges: tuple[range, ...] = ()

    def legs(self, step: Step) -> tuple[Leg, ...]:
        return tuple(b.leg for b in self.blocks if b.step is step)

    @property
    def keys(self) -> tuple[BlockKey, ...]:
        return tuple(b.key for b in self.blocks)

    @property
    def device_slots(self) -> tuple[int, ...]:
        return tuple(b.device_slot for b in self.blocks)

    @property
    def one_copy(self) -> bool:
        """No room to make, nothing to fetch, the copies in one range: one copy between memory tiers."""
        return not self.room and len(self.ranges) == 1 and all(b.step is not Step.FETCH for b in self.blocks)

    def moving(self) -> Iterator[LoadBlock]:
        """Blocks that were not on the device when planned."""
        return (b for b in self.blocks if b.route != (Medium.DEVICE,))


@dataclass(frozen=True)
class StoreBlock:
    """Block ``position`` of the stored sequence, into device slot ``slot``."""

    position: int
    key: BlockKey
    slot: int


@dataclass(frozen=True)
class StorePlan:
    """Device slots for the new blocks among the first ``consumed`` keys of a store.

    Keys already on the device (or on their way) are skipped; ``stopped`` is DEVICE_FULL when
    the plan ends before the keys do (every device slot pinned or in flight).
    """

    blocks: tuple[StoreBlock, ...]
    consumed: int
    room: Room = field(default_factory=Room)
    stopped: StopReason | None = None


@dataclass(frozen=True)
class CopyPlan:
    """Copies of READY blocks into other tiers (write-downs, promotions): one leg per copy."""

    legs: tuple[Leg, ...] = ()
    room: Room = field(default_factory=Room)


@dataclass(frozen=True)
class Placement:
    """Block ``position`` of a caller's batch, and a slot holding (or reserved for) its bytes."""

    position: int
    key: BlockKey
    slot: Slot


@dataclass(frozen=True)
class PutPlan:
    """Slots reserved (WRITING) for a caller's blocks, straight from its memory, in the tiers
    they go to (none where a block is already, in any state), and the room they need.
    ``present``: the positions of blocks some of those tiers held already (READY or on their
    way); ``full``: those of blocks that got no slot in a tier that lacks them (nothing there
    could leave: every block pinned or in flight)."""

    placements: tuple[Placement, ...] = ()
    room: Room = field(default_factory=Room)
    present: frozenset[int] = frozenset()
    full: frozenset[int] = frozenset()


@dataclass(frozen=True)
class GetPlan:
    """The leading run of a caller's keys, each pinned in the fastest tier holding it READY,
    to read straight into the caller's memory."""

    sources: tuple[Placement, ...] = ()


def copy_ranges(num_layers: int, blocks: int, layer_bytes: int, workers: int, small_load_bytes: int,
                task_bytes: int) -> tuple[range, ...]:
    """Layer ranges for copying ``blocks`` blocks into the device.

    A range of a block is contiguous (blocks are layer-major), so each copy stays large; the
    load's events fire per range. A load of at most ``small_load_bytes`` is one range (handing
    ranges to threads would cost more than the copies); otherwise ranges of about
    ``task_bytes`` across the blocks, at least two per worker, so early layers land (and are
    used) while later ones still move.
    """
    if not blocks:
        return ()
    if blocks * num_layers * layer_bytes <= small_load_bytes:
        per = num_layers
    else:
        big_enough = -(-task_bytes // (blocks * layer_bytes))
        per = max(1, min(big_enough, -(-num_layers // (2 * workers))))
    return tuple(range(a, min(a + per, num_layers)) for a in range(0, num_layers, per))
