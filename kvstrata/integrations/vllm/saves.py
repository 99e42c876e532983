"""The worker's saves: vLLM's new prompt blocks staged out of its paged KV and stored.

Staged. From vLLM's blocks on a GPU (or with ``sync_save``), each layer's hook, after the
layer's attention, copies that layer of the blocks to save into its group's staging tensor
(``stage_layer``, gathered in the forward's stream); ``wait_for_save`` takes any layer no hook
ran for. From vLLM's blocks in CPU memory the whole copy runs after the step instead, on the
copy thread, and the next forward waits for it first (``fence``: vLLM may write a block it
freed meanwhile only then).

Stored. Each group's staged blocks are stored in its cache under their keys (a windowed
group's run starts at its window: :mod:`kvstrata.integrations.vllm.scheduler`), one put at a
time on the save thread, in step order; the cache's threads write them down. While the saves
in flight hold ``save_backlog_bytes``, more are dropped and counted, never waited for. No save
of a step whose load failed is stored (its forward computed over KV not all there); with
TP > 1 a step that loaded holds its staged saves until the scheduler's verdict on every rank's
loads (:mod:`~kvstrata.integrations.vllm.verdicts`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvstrata.index.keys import BlockKey
from kvstrata.integrations.vllm.feedback import StepClock
from kvstrata.integrations.vllm.metadata import KVStrataMetadata, SaveSpec
from kvstrata.integrations.vllm.paged import staging
from kvstrata.integrations.vllm.reporting import WorkerReport
from kvstrata.integrations.vllm.settings import ConnectorSettings
from kvstrata.integrations.vllm.stats import PendingSave
from kvstrata.transfer.placement import io_thread_started

if TYPE_CHECKING:
    from kvstrata.integrations.vllm.events import TierEvents
    from kvstrata.integrations.vllm.paged import OpaqueGroup, SlicedGroup


_log = logging.getLogger("kvstrata.integrations.vllm")
MAX_HELD_STEPS = 8  # steps whose saves wait for their loads' verdict at most (TP > 1)

# (req, group) -> the save's staging of the group, and which of its layers are staged in it
Staging = dict[tuple[str, int], tuple[torch.Tensor, list[bool]]]
Pending = list[tuple[PendingSave, list[tuple[int, Future]]]]  # stores handed to the caches, to settle


@dataclass
class _StagedSave:
    """A save staged out of vLLM's blocks, not yet stored: per group (group, keys, staged KV)."""

    start: float
    blocks: int  # its blocks (as dropped, if so)
    stores: list[tuple[int, list[BlockKey], torch.Tensor]]


class _CountingSaver(ThreadPoolExecutor):
    """One of the connector's save threads: each task's thread CPU goes to ``on_cpu`` (a store's cost)."""

    def __init__(self, on_cpu: Callable[[float], None], name: str = "kvstrata-save") -> None:
        super().__init__(1, thread_name_prefix=name, initializer=io_thread_started)
        self._on_cpu = on_cpu

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        def counted() -> Any:
            cpu = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self._on_cpu(time.thread_time() - cpu)

        return super().submit(counted)


class Saves:
    """A worker's saves: staged, copied out, held for a verdict, in flight to the caches.

    Args:
        groups: the worker's groups (filled once vLLM's KV caches are registered).
        settings: the parsed extra config (``sync_save``, ``save_backlog_bytes``).
        report: the worker's counters.
        clock: the step's measurements (each store's blocks and CPU go back to the scheduler).
        enabled: the role stores KV (``kv_both``, ``kv_producer``).
    """

    def __init__(self, groups: list[OpaqueGroup | SlicedGroup], settings: ConnectorSettings, report: WorkerReport,
                 clock: StepClock, enabled: bool) -> None:
        self._groups = groups
        self._settings = settings
        self._report = report
        self._stats = report.stats
        self._clock = clock
        self._enabled = enabled
        self._staged: Staging = {}  # staged by the per-layer hook this step
        self._taken: dict[str, bool] = {}  # req -> whether this step stores its save (the backlog's room)
        self._held: dict[int, list[_StagedSave]] = {}  # step -> its saves, until the verdict on its loads (TP > 1)
        self._holds = False  # TP > 1: set once the caches are registered
        self._saving_blocks = 0  # blocks of saves not yet stored (the cache's threads finish them)
        self._saving_lock = threading.Lock()
        # the saves' puts into the tiers, one at a time, in step order, on the I/O CPUs
        self._saver = _CountingSaver(clock.save_cpu)
        # vLLM's blocks in CPU memory: a step's saves are copied out of them after the step, on a
        # thread of their own, and the next step's forward waits for those copies first (``fence``)
        self._copier = _CountingSaver(clock.save_cpu, "kvstrata-copy")
        self._copies_off_step = False  # set once the caches are registered
        self._copying: list[Future] = []  # copies out of vLLM's blocks not yet fenced
        self._events: TierEvents | None = None  # set once the caches are registered, where KV events are on

    def registered(self, holds: bool, copies_off_step: bool, events: TierEvents | None = None) -> None:
        """vLLM's KV caches are registered: whether saves wait for verdicts (TP > 1), whether
        they are copied out after the step (vLLM's blocks in CPU memory, no ``sync_save``), and
        the recorder each save teaches vLLM's hashes of its blocks (None: no KV events)."""
        self._holds = holds
        self._copies_off_step = copies_off_step
        self._events = events

    @property
    def stages_layers(self) -> bool:
        """Saves are staged layer by layer in the forward (``stage_layer``): vLLM's blocks on a
        GPU (a gather in the forward's stream), or ``sync_save``."""
        return self._enabled and not self._copies_off_step

    def stage_layer(self, group: int, layer: int, meta: KVStrataMetadata) -> None:
        """Stage ``layer`` of ``group`` of every block to save; called after the layer's
        attention, when its KV (the new tokens' too) is in the paged cache."""
        if not self._groups[group].writes:  # an earlier rank stores these heads
            return
        for spec in meta.saves:
            block_ids = spec.groups[group].block_ids
            if block_ids and self._taking(spec):
                kv, staged = self._staging(spec, group, self._staged)
                self._groups[group].stage_layer(kv, layer, block_ids)  # the paged KV registered
                staged[layer] = True

    def _taking(self, spec: SaveSpec) -> bool:
        """Whether this step stores ``spec``: not when the saves still in flight hold
        ``save_backlog_bytes`` or more (the tiers below cannot keep up: a slow disk, a pool that
        stalls). Such a save is dropped and counted, never waited for: its blocks are recomputed
        if asked for again. Decided once per spec and step."""
        taking = self._taken.get(spec.req_id)
        if taking is None:
            with self._saving_lock:
                taking = self._saving_blocks * self._stats.block_bytes < self._settings.save_backlog_bytes
            self._taken[spec.req_id] = taking
            if not taking:
                self._stats.dropped(spec.blocks)
        return taking

    def _saved(self, blocks: int) -> None:
        with self._saving_lock:
            self._saving_blocks -= blocks
        self._report.changed()
        self._report.write()  # the store's counts, off the step

    def wait_for_save(self, meta: KVStrataMetadata, loads_failed: bool) -> None:
        """End of the step, its loads finished (``loads_failed``: one failed): start storing the
        blocks to save (the cache's threads store them and write them down; ``sync_save``: wait
        for that here). From vLLM's blocks in CPU memory, the copy out of them runs after the
        step too, on the copy thread, and the next forward waits for it (:meth:`fence`). With
        TP > 1 a step that loaded holds its staged saves until the scheduler's verdict on its
        loads; earlier steps' verdicts are applied here."""
        cpu = time.thread_time()
        pending = self._judged(meta.verdicts)
        taken: list[SaveSpec] = []
        for spec in meta.saves if self._enabled else ():
            if loads_failed:
                # A load failed this step: its request, and any other that found the same blocks
                # in vLLM's prefix cache this step, computed over KV that is not all there; their
                # new blocks' later layers are wrong (vLLM recomputes them). Which requests read
                # those blocks is vLLM's to know: no save of the step is stored.
                self._stats.dropped(spec.blocks)
                continue
            if self._taking(spec):
                taken.append(spec)
        hold = bool(meta.loads) and self._holds  # another rank's load may have failed: wait for the verdict
        staged: list[_StagedSave] = []
        if taken and self._copies_off_step and not hold:
            self._copying.append(self._copier.submit(self._copy_out, taken))
        else:
            staged = [save for save in (self._staged_save(spec, self._staged) for spec in taken) if save.stores]
        self._staged.clear()
        self._taken.clear()
        if staged and hold:
            self._held[meta.step] = staged
            self._drop_stale_holds()
        else:
            pending += self._store(staged)
        if meta.saves or pending:
            self._clock.save_cpu(time.thread_time() - cpu)
        self._settle(pending)
        if meta.loads or meta.saves or pending:
            self._report.changed()
            self._report.write(now=self._settings.sync_save)  # a pass's reader expects its saves there

    def _settle(self, pending: Pending) -> None:
        """Count each store as it ends (``sync_save``: wait for it here)."""
        for save, futures in pending:
            for g, future in futures:
                if self._settings.sync_save:
                    save.done(g, future)
                    future.result()  # a failed store fails the step, as it always has with sync_save
                else:
                    future.add_done_callback(lambda f, s=save, g=g: s.done(g, f))

    def _copy_out(self, specs: list[SaveSpec]) -> None:
        """On the copy thread, after the step: copy the saves out of vLLM's blocks and hand them to
        the caches. Never raises: a save that cannot be copied is dropped and counted."""
        try:
            staged = [save for save in (self._staged_save(spec, {}) for spec in specs) if save.stores]
        except Exception as error:  # noqa: BLE001 - the step has moved on: count it, never raise into vLLM
            for spec in specs:
                self._stats.dropped(spec.blocks)
            self._report.changed()
            _log.warning("KVStrataConnector: a save could not be copied out of vLLM's blocks (%s); dropped", error)
            return
        self._settle(self._store(staged))

    def fence(self) -> None:
        """Before a forward (vLLM's ``handle_preemptions``): the copies out of vLLM's blocks that
        the last steps started have ended, so a block vLLM freed since (a request finished or
        preempted) may be written again."""
        copying, self._copying = self._copying, []
        if copying:
            wait(copying)

    def _staged_save(self, spec: SaveSpec, prestaged: Staging) -> _StagedSave:
        """A save's every group staged (the layers not in ``prestaged``, staged by the per-layer
        hook, are taken now, the forward over)."""
        save = _StagedSave(time.perf_counter(), spec.blocks, [])
        for g, group in enumerate(self._groups):
            block_ids = spec.groups[g].block_ids
            if not block_ids or not group.writes:
                continue
            kv, staged = self._staging(spec, g, prestaged)
            for layer, done in enumerate(staged):
                if not done:
                    group.stage_layer(kv, layer, block_ids)
            first = spec.groups[g].first_block
            keys = group.keys(spec.tokens)[first : first + len(block_ids)]
            if g == 0 and self._events is not None and spec.block_hashes:  # before the store: its events name them
                self._events.learn(keys, spec.block_hashes[first : first + len(keys)])
            save.stores.append((g, keys, kv))
        return save

    def _store(self, staged: list[_StagedSave]) -> Pending:
        """Hand the staged saves to the caches; what is pending, to settle once each store ends."""
        pending = []
        for save in staged:
            futures = [(g, self._groups[g].store_keys(keys, kv, self._saver)) for g, keys, kv in save.stores]
            blocks = max(len(keys) for _, keys, _ in save.stores)
            self._clock.saved(blocks)
            with self._saving_lock:
                self._saving_blocks += blocks
            pending.append((PendingSave(self._stats, save.start, len(futures), lambda n=blocks: self._saved(n)),
                            futures))
        return pending

    def _judged(self, verdicts: dict[int, bool]) -> Pending:
        """Store the held saves of steps whose loads arrived on every rank; drop (and count)
        those of steps where one failed."""
        pending = []
        for step, ok in verdicts.items():
            held = self._held.pop(step, None)
            if held is None:
                continue
            if ok:
                pending += self._store(held)
            else:
                for save in held:
                    self._stats.dropped(save.blocks)
        return pending

    def _drop_stale_holds(self) -> None:
        """A verdict always follows within a step or two; holds past MAX_HELD_STEPS (a verdict
        lost) are dropped, counted, so their staging is not kept for ever."""
        while len(self._held) > MAX_HELD_STEPS:
            step = min(self._held)
            for save in self._held.pop(step):
                self._stats.dropped(save.blocks)
            _log.warning("KVStrataConnector: no verdict on the loads of step %d; its saves are dropped", step)

    def _staging(self, spec: SaveSpec, group: int, prestaged: Staging) -> tuple[torch.Tensor, list[bool]]:
        staged = prestaged.get((spec.req_id, group))
        if staged is None:
            layout = self._groups[group].layout
            # [blocks, layers, kv, block_tokens, this rank's kv_heads, head_dim] on vLLM's device:
            # a GPU gathers device to device in the forward's stream, never a host copy inside it
            kv = staging(layout, len(spec.groups[group].block_ids), self._groups[group].layers[0])
            staged = prestaged[(spec.req_id, group)] = (kv, [False] * layout.num_layers)
        return staged

    def drop_held(self) -> None:
        """Shutting down: the saves held for a verdict will get none; never stored, counted."""
        for held in self._held.values():
            for save in held:
                self._stats.dropped(save.blocks)
        self._held = {}

    def close(self) -> None:
        """Wait for the copies in flight (they hand their saves to the save thread first), then
        for the puts in flight (they write into the caches), and stop both threads."""
        self._copier.shutdown(wait=True)
        self._saver.shutdown(wait=True)
