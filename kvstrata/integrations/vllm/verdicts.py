"""Whether a step's loads arrived on every TP rank: the verdict that step's saves wait for.

With TP > 1 each rank loads its own part of a hit. A rank whose part failed (its slices were not
there, the pool timed out) reports those blocks, and vLLM recomputes them. But the step's forward
already ran on every rank over that rank's missing KV, so every rank's new blocks of the step are
wrong past the first layer. A rank cannot see another's failure; the scheduler can. vLLM merges
every rank's :class:`~kvstrata.integrations.vllm.feedback.KVStrataWorkerMeta` of a step, each
load's ``ok`` ANDed over the ranks.

So the scheduler tracks each step that both loaded and saved. Once every load of that step has
reported, the verdict travels in the next step's metadata. Workers hold such a step's staged
saves until it arrives: they store them on a good verdict and drop them (counted) on a bad one.
With one rank the worker knows at once and holds nothing.
"""

from __future__ import annotations

from collections.abc import Iterable


class StepVerdicts:
    """The scheduler's side (pure): steps awaiting their loads' outcomes, and the verdicts known."""

    def __init__(self) -> None:
        self._waiting: dict[int, set[str]] = {}  # step -> its loads not yet reported
        self._step_of: dict[str, int] = {}  # req_id -> the step its load ran in (while waiting)
        self._failed: set[int] = set()  # steps waiting on which a load has failed already
        self._known: dict[int, bool] = {}  # step -> every load arrived on every rank, not yet sent

    def track(self, step: int, req_ids: Iterable[str]) -> None:
        """Step ``step`` loads for ``req_ids`` (at least one) and saves: its saves wait for their outcomes."""
        self._waiting[step] = set(req_ids)
        for req_id in self._waiting[step]:
            self._step_of[req_id] = step

    def reported(self, req_id: str, ok: bool) -> None:
        """A load's outcome over every rank (a load not tracked is ignored)."""
        step = self._step_of.pop(req_id, None)
        if step is None:
            return
        if not ok:
            self._failed.add(step)
        waiting = self._waiting[step]
        waiting.discard(req_id)
        if not waiting:
            del self._waiting[step]
            self._known[step] = step not in self._failed
            self._failed.discard(step)

    def take(self) -> dict[int, bool]:
        """The verdicts known since the last call: step -> its saves may be stored."""
        known, self._known = self._known, {}
        return known
