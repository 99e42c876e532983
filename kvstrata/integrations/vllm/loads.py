"""The worker's loads: kvstrata's blocks into vLLM's, in the step and off it.

In the step. ``start`` starts, per :class:`LoadSpec`, one kvstrata load per group that has
blocks to fill, of exactly those blocks (a sliding group: its window; blocks vLLM found in its
own prefix cache: none); before each layer's attention ``wait_for_layer`` waits for that layer
and copies it into vLLM's blocks. A load that cannot be served whole in every group (its blocks
left kvstrata after the scheduler's lookup, a load failed or stopped early, a layer was never
copied, or it held the step up past its budget, a multiple of the prefill of its tokens:
:class:`LoadSpec` ``budget_s``) has every block it writes reported through ``failed_blocks``
(vLLM's ``get_block_ids_with_load_errors``); vLLM recomputes them
(``kv_load_failure_policy="recompute"``) or fails the request, and never reads them as valid KV.

Off the step (``async_loads``: vLLM's asynchronous loads, from a disk or the pool where holding
the running requests up would cost more than a step, and every load of a hybrid model: the
scheduler decides). They start with the step's other loads and are polled in ``get_finished``:
one that arrived is copied into vLLM's blocks there, whole, and reported finished; one that
failed, ran past its budget or whose request ended is given up (released once it ends) and
reported, a failure as ``failed_recving`` (vLLM recomputes it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstrata.integrations.vllm.feedback import LoadOutcome, StepClock
from kvstrata.integrations.vllm.metadata import KVStrataMetadata, LoadSpec
from kvstrata.integrations.vllm.reporting import WorkerReport

if TYPE_CHECKING:
    from kvstrata.integrations.vllm.paged import OpaqueGroup, SlicedGroup


IDLE_WAIT_S = 0.002  # a step with nothing to compute waits this long for a load off the step to end


@dataclass
class _ActiveLoad:
    spec: LoadSpec
    handles: list[Any]  # per group, a LoadHandle or SlicedLoad; None: the group fills no blocks
    layers_done: list[int]  # per group, layers copied
    failed: bool = False
    left: bool = False  # failed because its blocks left kvstrata after the scheduler's lookup
    held_s: float = 0.0  # how long it has held vLLM's step up (waiting for it, copying it)
    started: float = 0.0  # perf_counter when it started (off the step: its time is from here to its end)
    off_step: bool = False  # vLLM's asynchronous load: reported through get_finished, not in the step

    @property
    def outcome(self) -> LoadOutcome:
        if not self.failed:
            return LoadOutcome.ARRIVED
        return LoadOutcome.LEFT if self.left else LoadOutcome.FAILED


class Loads:
    """A worker's loads in flight, in the step and off it, and the blocks of those that failed.

    Args:
        groups: the worker's groups (filled once vLLM's KV caches are registered).
        report: the worker's counters.
        clock: the step's measurements (each load's time and outcome go back to the scheduler).
        recomputes: vLLM recomputes a failed load's blocks (``kv_load_failure_policy``).
        sync_save: a step's reader expects the stats file written by the step's end.
    """

    def __init__(self, groups: list[OpaqueGroup | SlicedGroup], report: WorkerReport, clock: StepClock,
                 recomputes: bool, sync_save: bool) -> None:
        self._groups = groups
        self._report = report
        self._stats = report.stats
        self._clock = clock
        self._recomputes = recomputes
        self._sync_save = sync_save
        self._active: list[_ActiveLoad] = []
        self._recving: dict[str, _ActiveLoad] = {}  # req -> its load off the step, until reported
        self._abandoned: list[Any] = []  # loads given up while in flight: released once they end, never waited for
        self._failed_blocks: set[int] = set()

    @property
    def receiving(self) -> bool:
        """Loads off the step are in flight, or loads given up are yet to end (``get_finished``
        reports the ones, releases the others)."""
        return bool(self._recving or self._abandoned)

    def start(self, meta: KVStrataMetadata) -> None:
        """Start this step's loads: per spec, one per group with blocks to fill. Those for the
        forward (``loads``: before it) hold the step up from here; those off the step
        (``async_loads``) are reported once they end (``get_finished``)."""
        for spec in meta.loads:
            active = self._start_load(spec)
            self._active.append(active)
            active.held_s = time.perf_counter() - active.started
            self._clock.charge(spec.req_id, active.held_s)
        for spec in meta.async_loads:
            self._recving[spec.req_id] = self._start_load(spec, off_step=True)

    def _start_load(self, spec: LoadSpec, off_step: bool = False) -> _ActiveLoad:
        active = _ActiveLoad(spec, [], [0] * len(self._groups), started=time.perf_counter(), off_step=off_step)
        for group, blocks in zip(self._groups, spec.groups):
            if not blocks.block_ids:
                active.handles.append(None)
                continue
            # only the blocks vLLM asks for: not those before a window, nor its own prefix hit
            keys = group.keys(spec.tokens)[blocks.first_block : blocks.end_block]
            load = group.load(keys)
            if load is None:  # left since the lookup, or (TP > 1) this rank's slices were never there
                self._fail_load(active, f"group {group.spec.index}'s blocks left kvstrata after the "
                                "scheduler's lookup")
                active.left = True
                break
            active.handles.append(load)
        return active

    def wait_for_layer(self, group: int, layer: int) -> None:
        """Before a layer's attention: copy that layer (``layer`` of ``group``) of every load into vLLM's blocks."""
        for active in self._active:
            if not active.failed:
                started = time.perf_counter()
                self._copy_layer(active, group, layer)
                took = time.perf_counter() - started
                active.held_s += took
                self._clock.charge(active.spec.req_id, took)

    def _copy_layer(self, active: _ActiveLoad, group: int, layer: int) -> None:
        handle = active.handles[group] if group < len(active.handles) else None
        if handle is None:
            return
        block_ids = active.spec.groups[group].block_ids
        budget = active.spec.budget_s
        try:
            handle.wait_layer(layer, None if budget is None else max(0.0, budget - active.held_s))
        except TimeoutError as exc:
            if handle.done():  # the load's own error (a timeout of its tier's), not this wait's
                self._fail_load(active, f"load failed: {exc}")
                return
            # past its budget: computing its tokens is quicker than waiting on
            self._stats.late()
            self._fail_load(active, f"the load held the step up past its budget of {budget * 1e3:.1f} ms "
                            "(set from the prefill of its tokens): its blocks are computed")
            return
        except Exception as exc:  # noqa: BLE001 - the blocks are reported, vLLM recomputes them
            self._fail_load(active, f"load failed: {exc}")
            return
        if handle.blocks < len(block_ids):
            self._fail_load(active, "the load stopped early")
            return
        self._groups[group].copy_layer(handle, layer, block_ids)
        active.layers_done[group] += 1

    def finish_step(self) -> bool:
        """End of the forward: release the loads, and report any whose layers were not all
        copied (their blocks were read as they were: vLLM must recompute them). A failed load
        still in flight (given up past its budget) is not waited for: released once it ends.
        Returns whether a load failed this step."""
        self._abandoned = [h for h in self._abandoned if not _released_if_done(h)]
        failed = False
        for active in self._active:
            self._finish(active)
            failed = failed or active.failed
            self._clock.load_done(active.spec.req_id, active.outcome)
        self._active.clear()
        return failed

    def _finish(self, active: _ActiveLoad) -> float:
        """Release a load's handles (a failed one's still in flight: once it ends), failing it
        where not every layer was copied; count it if it arrived. Returns its own time (its
        slowest group's: the tiers' reading, not waiting for a thread)."""
        results = []
        for g, handle in enumerate(active.handles):
            if handle is None:
                continue
            if active.failed and not handle.done():
                self._abandoned.append(handle)
                continue
            try:
                results.append((g, len(active.spec.groups[g].block_ids), handle.wait()))
            except Exception as exc:  # noqa: BLE001 - reported here or in wait_for_layer
                if not active.failed:
                    self._fail_load(active, f"load failed: {exc}")
            if not active.failed and active.layers_done[g] < self._groups[g].spec.group.num_layers:
                self._fail_load(active, "not every layer was copied")
            handle.release()
        if not active.failed:
            self._stats.loaded(active.spec.external_tokens, results)
        return max((result.seconds for _, _, result in results), default=0.0)

    def get_finished(self, finished_req_ids: set[str], idle: bool) -> tuple[set[str], set[str]]:
        """Loads off the step that ended since the last call: (every one, the failed ones).

        One that arrived is copied into vLLM's blocks here, whole, and counted as arrived. One
        past its budget (its request has waited longer than computing its tokens would take)
        is given up, as is one whose request ended (vLLM frees the request's blocks once it is
        reported); either is released once it ends, never waited for. A failed one's request
        is recomputed (``failed_recving``). ``idle``: the step computed nothing (every request
        waits), so wait briefly for a load to end rather than spin vLLM's loop.
        """
        self._abandoned = [h for h in self._abandoned if not _released_if_done(h)]
        if not self._recving:
            return set(), set()
        if idle:
            _settle(self._recving.values(), IDLE_WAIT_S)
        finished, failed = set(), set()
        for req_id, active in list(self._recving.items()):
            aborted = req_id in finished_req_ids
            if not self._ended(active, aborted):
                continue
            copying = time.perf_counter()
            if not active.failed:
                for g, group in enumerate(self._groups):
                    for layer in range(group.spec.group.num_layers):
                        if not active.failed:
                            self._copy_layer(active, g, layer)
            own = self._finish(active) + time.perf_counter() - copying
            # the scheduler learns the tier's speed: an arrived load's own time, not the steps it waited through
            self._clock.charge(req_id, own if not active.failed else time.perf_counter() - active.started)
            self._clock.load_done(req_id, active.outcome)
            del self._recving[req_id]
            self._stats.off_step()
            finished.add(req_id)
            if active.failed and not aborted:
                failed.add(req_id)
                if self._recomputes:
                    self._stats.recomputed(len(active.spec.block_ids))
        if finished:
            self._report.changed()
            self._report.write(now=self._sync_save)
        return finished, failed

    def _ended(self, active: _ActiveLoad, aborted: bool) -> bool:
        """Whether a load off the step is to be reported now: it ended, failed, its request
        ended (given up), or it ran past its budget (given up, failed)."""
        if active.failed:
            return True
        if aborted:
            self._cancel(active)
            return True
        if all(h is None or h.done() for h in active.handles):
            return True
        budget = active.spec.budget_s
        if budget is None or time.perf_counter() - active.started <= budget:
            return False
        self._stats.late()
        self._fail_load(active, f"its request waited past the load's budget of {budget * 1e3:.1f} ms (set from "
                        "the prefill of its tokens): its blocks are computed")
        return True

    def _cancel(self, active: _ActiveLoad) -> None:
        """Give up a load whose request ended: nothing to report but its end."""
        active.failed = True
        for handle in active.handles:
            if handle is not None:
                handle.cancel()

    def failed_blocks(self) -> set[int]:
        """vLLM blocks whose load failed since the last call (vLLM recomputes them, or fails
        their requests: ``kv_load_failure_policy``)."""
        failed, self._failed_blocks = self._failed_blocks, set()
        if failed and self._recomputes:
            self._stats.recomputed(len(failed))
            self._report.changed()
        return failed

    def _fail_load(self, active: _ActiveLoad, why: str) -> None:
        """Every block the load writes, in every group, is reported (a load off the step
        reports its request instead: ``get_finished``): its KV is not all there."""
        self._cancel(active)  # its bytes will not be used: what it has not started reading, it does not read
        block_ids = active.spec.block_ids
        if not active.off_step:
            self._failed_blocks.update(block_ids)
        self._stats.failed(len(block_ids), why)

    def close(self) -> None:
        """Give up the loads off the step still in flight (never reported now) and release
        every load given up, waiting for each to end: it writes into the caches' memory."""
        for active in self._recving.values():
            self._cancel(active)
            self._abandoned += [h for h in active.handles if h is not None]
        self._recving = {}
        for handle in self._abandoned:
            handle.release()  # waits for it to end: it writes into the caches' memory
        self._abandoned = []


def _settle(loads: Any, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for the first of ``loads`` still in flight to end."""
    for active in loads:
        for handle in active.handles:
            if handle is not None and not handle.done():
                try:
                    handle.wait(timeout)
                except Exception:  # noqa: BLE001 - a timeout, or the load's error: get_finished sees it
                    pass
                return


def _released_if_done(handle: Any) -> bool:
    """Release a load given up in flight once it has ended; whether it has."""
    if not handle.done():
        return False
    handle.release()
    return True
