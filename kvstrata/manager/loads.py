"""Load plans: bringing a matched prefix onto the device, block by block, in order.

``prepare`` pins every matched block where it is (all of them first: room made for one block of
the plan must not evict a later one), then reserves a device slot for each block not on the
device (and a host slot to stage in, where the source has no in-memory view and no direct path),
until the first block that cannot be had. Each block then goes RESIDENT (on the device already),
COPY (from a memory tier) or FETCH (from disk or a pool, straight into the device slot or staged
in the host); ``complete_fetch`` settles the FETCH legs (staged blocks go on to COPY), and
``complete`` makes every block READY on the device, pinned for the caller.

Not thread-safe: ``BlockManager`` calls it under its one lock. No torch, no threads, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvstrata.index.keys import BlockKey
from kvstrata.index.prefix import Match
from kvstrata.manager.config import ManagerConfig
from kvstrata.manager.plans import Failure, Leg, LoadBlock, LoadPlan, Room, Slot, Step, StopReason, Victim, copy_ranges
from kvstrata.manager.residency import Residency
from kvstrata.manager.table import TierFull
from kvstrata.media import Medium

COPY_TASK_BYTES = 32 * 1024 * 1024  # bytes per layer-range copy of a load: large copies, few dispatches
MEMORY_MEDIA = frozenset({Medium.DEVICE, Medium.HOST})  # slots readable in place


class LoadPlanner:
    """The load plans of one ``BlockManager``, over its ``Residency`` (under its lock)."""

    def __init__(self, config: ManagerConfig, residency: Residency) -> None:
        self.config = config
        self._res = residency
        self._tables = residency.tables
        self._copy_ranges: dict[int, tuple[range, ...]] = {}  # blocks -> layer ranges (a pure function of it)

    def prepare(self, match: Match) -> LoadPlan:
        """``BlockManager.prepare_load`` (module docstring)."""
        blocks: list[LoadBlock] = []
        victims: list[Victim] = []
        stop: tuple[StopReason, Medium] | None = None
        # Every block pinned where it is first: room made for one block of the plan must
        # not evict a later one (it stopped loads at blocks READY on the device a moment before).
        held = [self._hold(key) for key in match.keys]
        for i, (key, medium) in enumerate(zip(match.keys, match.media)):
            block = self._plan_block(key, held[i], victims)
            if isinstance(block, StopReason):
                stop = block, medium
                for later, slot in zip(match.keys[i + 1 :], held[i + 1 :]):
                    if slot is not None:
                        self._tables[slot.medium].unpin(later)
                break
            blocks.append(block)
        reason, at = stop or (None, None)
        copies = sum(1 for b in blocks if b.step is Step.COPY)
        return LoadPlan(tuple(blocks), Room(tuple(victims)), reason, at, self._ranges(copies))

    def _hold(self, key: BlockKey) -> Slot | None:
        """Pin ``key`` on the device, or else in the fastest tier below holding it READY."""
        slot = self._tables[Medium.DEVICE].pin(key)
        if slot is not None:
            return Slot(Medium.DEVICE, slot)
        return self._res.pin_source(key, below=Medium.DEVICE, hit=True)

    def _plan_block(self, key: BlockKey, source: Slot | None, victims: list[Victim]) -> LoadBlock | StopReason:
        """The block's load from ``source`` (pinned by ``_hold``; unpinned here if it stops)."""
        if source is None:
            return StopReason.GONE
        if source.medium is Medium.DEVICE:
            return LoadBlock(key, source.index, (Medium.DEVICE,), Step.RESIDENT)
        reserved = self._reserve_or_stop(Medium.DEVICE, key, victims, StopReason.DEVICE_FULL,
                                         StopReason.LOADING_ELSEWHERE)
        if isinstance(reserved, StopReason):
            self._tables[source.medium].unpin(key)
            return reserved
        target = Slot(Medium.DEVICE, reserved)
        if source.medium in MEMORY_MEDIA:
            return LoadBlock(key, reserved, (source.medium, Medium.DEVICE), Step.COPY, Leg(key, source, target))
        if source.medium in self.config.direct:
            return LoadBlock(key, reserved, (source.medium, Medium.DEVICE), Step.FETCH, Leg(key, source, target))
        staged = (StopReason.NO_STAGING if Medium.HOST not in self._tables else
                  self._reserve_or_stop(Medium.HOST, key, victims, StopReason.STAGING_FULL,
                                        StopReason.STAGING_ELSEWHERE))
        if isinstance(staged, StopReason):
            self._tables[source.medium].unpin(key)
            self._tables[Medium.DEVICE].complete_store(key, ok=False)
            return staged
        leg = Leg(key, source, Slot(Medium.HOST, staged))
        return LoadBlock(key, reserved, (source.medium, Medium.HOST, Medium.DEVICE), Step.FETCH, leg)

    def _reserve_or_stop(self, medium: Medium, key: BlockKey, victims: list[Victim], full: StopReason,
                         present: StopReason) -> int | StopReason:
        try:
            reservation = self._res.reserve(medium, key, victims)
        except TierFull:
            return full
        return present if reservation is None else reservation.slot

    def complete_fetch(self, plan: LoadPlan, failures: Sequence[Failure | None]) -> tuple[LoadPlan, Room]:
        """``BlockManager.complete_fetch``, once legs were fetched (``failures`` not empty)."""
        drops: list[Victim] = []
        outcomes = iter(failures)
        blocks = list(plan.blocks)
        cut: tuple[int, Failure] | None = None
        for i, block in enumerate(blocks):
            if block.step is not Step.FETCH:
                continue
            failure = next(outcomes)
            if failure is None:
                blocks[i] = self._fetched(block)
                continue
            self._res.settle(block.leg, failure, drops)
            if block.leg.dst.medium is not Medium.DEVICE:
                self._tables[Medium.DEVICE].complete_store(block.key, ok=False)
            blocks[i] = None
            cut = cut or (i, failure)
        if cut is not None:
            i, failure = cut
            self.abandon(b for b in blocks[i:] if b is not None)
            blocks = blocks[:i]
        stopped, at = (cut[1].stop, plan.blocks[cut[0]].route[0]) if cut else (plan.stopped, plan.stopped_at)
        copies = sum(1 for b in blocks if b.step is Step.COPY)
        return LoadPlan(tuple(blocks), Room(), stopped, at, self._ranges(copies)), Room(tuple(drops))

    def _fetched(self, block: LoadBlock) -> LoadBlock:
        leg = block.leg
        self._tables[leg.src.medium].unpin(block.key)
        if leg.dst.medium is Medium.DEVICE:
            return block.advanced(Step.LANDED)
        self._tables[Medium.HOST].complete_store(block.key, ok=True, pin=True)  # pinned: the copy's source
        self._res.index.add(block.key, Medium.HOST)
        return block.advanced(Step.COPY, Leg(block.key, leg.dst, Slot(Medium.DEVICE, block.device_slot)))

    def complete(self, plan: LoadPlan) -> tuple[BlockKey, ...]:
        """``BlockManager.complete_load``."""
        device = self._tables[Medium.DEVICE]
        for block in plan.blocks:
            if block.step is Step.RESIDENT:
                continue
            device.complete_store(block.key, ok=True, pin=True)
            self._res.index.add(block.key, Medium.DEVICE)
            if block.step is Step.COPY:
                self._tables[block.leg.src.medium].unpin(block.key)
        return tuple(b.key for b in plan.blocks if self.config.write.on_hit(device.hits(b.key)))

    def abandon(self, blocks: Iterable[LoadBlock]) -> None:
        """Undo blocks of a plan that will not complete: reservations freed, pins dropped."""
        device = self._tables[Medium.DEVICE]
        for block in blocks:
            if block.step is Step.RESIDENT:
                device.unpin(block.key)
                continue
            if block.leg is not None:
                self._tables[block.leg.src.medium].unpin(block.key)
                if block.leg.dst.medium is not Medium.DEVICE:
                    self._tables[block.leg.dst.medium].complete_store(block.key, ok=False)
            device.complete_store(block.key, ok=False)

    def _ranges(self, blocks: int) -> tuple[range, ...]:
        ranges = self._copy_ranges.get(blocks)
        if ranges is None:
            c, layout = self.config, self.config.layout
            small = c.small_load_bytes if c.layer_ranges else blocks * layout.block_bytes
            ranges = copy_ranges(layout.num_layers, blocks, layout.layer_bytes, c.workers, small, COPY_TASK_BYTES)
            self._copy_ranges[blocks] = ranges
        return ranges
