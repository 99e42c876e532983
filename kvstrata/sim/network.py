"""Concurrent transfers on a topology, shared max-min fairly, advanced as a fluid.

A job is a sequence of stages; a stage is a set of flows (one or more per GPU shard) that
run together; the stage ends when all its bytes have moved, plus the longest path latency of
its flows. Whenever a flow starts or ends, every active flow's rate is re-shared with
:func:`kvstrata.hardware.flows.max_min_share`; between those instants rates are constant.

Accounting (per resource key: a link direction or a memory): ``sent_bytes`` is credited in
full when a flow starts, ``moved_bytes`` when its fluid has all moved; once every job is done
the two are equal for every resource (conservation): every flow started finished, once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvstrata.hardware.flows import GB, Flow, Resource, max_min_share

_DONE_BYTES = 1e-3  # a flow with less left than this is finished (float dust)


@dataclass
class _Job:
    stages: list[Callable[[], list[Flow]]]
    on_done: Callable[[float], None]
    flows: list[Flow] = field(default_factory=list)
    left: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)  # bytes/s
    stage: int = -1


class Network:
    """The active transfers of one simulation, and the bytes each resource carried.

    The caller owns the clock: it calls :meth:`next_event_s` to learn when the next flow
    finishes, and :meth:`advance` at that time (or any earlier one, after a new start).
    """

    def __init__(self) -> None:
        self._jobs: dict[int, _Job] = {}
        self._next_id = 0
        self._now = 0.0
        self.sent_bytes: dict[str, float] = {}
        self.moved_bytes: dict[str, float] = {}
        self.resources: dict[str, Resource] = {}
        self.version = 0  # bumps on every re-share; a stale wake-up is ignored by the caller
        self._latency_waits: list[tuple[float, int]] = []  # (time, job) stage ends after latency
        # A flow's finish time (now + left / rate) does not move while rates hold, and rates and
        # latency waits only change with a re-share (a version bump): cache it per version.
        self._next: tuple[int, float | None] = (-1, None)

    @property
    def active(self) -> int:
        return len(self._jobs)

    def start(self, now: float, stages: list[Callable[[], list[Flow]]], on_done: Callable[[float], None]) -> None:
        """Start a job of ``stages`` (each builds its flows when it begins) at ``now``."""
        self._move_to(now)
        job_id = self._next_id
        self._next_id += 1
        job = _Job(stages, on_done)
        self._jobs[job_id] = job
        self._begin_next_stage(job_id, now)
        self._reshare()

    def _begin_next_stage(self, job_id: int, now: float) -> None:
        job = self._jobs[job_id]
        job.stage += 1
        if job.stage == len(job.stages):
            del self._jobs[job_id]
            job.on_done(now)
            return
        job.flows = [f for f in job.stages[job.stage]() if f.size_bytes > 0]
        job.left = [float(f.size_bytes) for f in job.flows]
        job.rates = [0.0] * len(job.flows)
        for f in job.flows:
            for r, w in f.uses:
                self.resources[r.key] = r
                self.sent_bytes[r.key] = self.sent_bytes.get(r.key, 0.0) + w * f.size_bytes
        if not job.flows:
            self._begin_next_stage(job_id, now)

    def _move_to(self, now: float) -> None:
        dt = now - self._now
        if dt < 0:
            raise ValueError(f"network time went backwards: {now} < {self._now}")
        if dt > 0:
            for job in self._jobs.values():
                left, rates = job.left, job.rates
                for i in range(len(left)):
                    if rates[i] > 0 and left[i] > 0:
                        left[i] = max(0.0, left[i] - rates[i] * dt)
        self._now = now

    def _reshare(self) -> None:
        self.version += 1
        pairs = [(job, i) for job in self._jobs.values() for i in range(len(job.flows)) if job.left[i] > 0]
        if not pairs:
            return
        shares = max_min_share([job.flows[i] for job, i in pairs])
        for (job, i), share in zip(pairs, shares):
            job.rates[i] = share.gbps * GB

    def next_event_s(self) -> float | None:
        """When the next flow finishes (or a stage's latency ends), at current rates."""
        if self._next[0] == self.version:
            return self._next[1]
        best = min((t for t, _ in self._latency_waits), default=None)
        for job in self._jobs.values():
            for left, rate in zip(job.left, job.rates):
                if left > 0 and rate > 0:
                    t = self._now + left / rate
                    best = t if best is None or t < best else best
        self._next = (self.version, best)
        return best

    def advance(self, now: float) -> None:
        """Move the fluid to ``now``; finish flows, stages and jobs due by then."""
        self._move_to(now)
        changed = False
        for job in self._jobs.values():
            # A flow that ends while others of its stage run frees its links now (a re-share,
            # as the module says); that also drops the cached next event, its own finish. Float
            # dust counts as ended: its finish may lie under one ulp of the clock ahead.
            for i, (left, rate) in enumerate(zip(job.left, job.rates)):
                if rate > 0 and left <= _DONE_BYTES + rate * 1e-9:
                    job.left[i], job.rates[i] = 0.0, 0.0
                    changed = True
        for job_id, job in list(self._jobs.items()):
            # A flow due now may keep float dust proportional to its rate: finish it too.
            due_now = all(left <= _DONE_BYTES + rate * 1e-9 for left, rate in zip(job.left, job.rates))
            if job.flows and due_now and not any(
                j == job_id for _, j in self._latency_waits
            ):
                for i, f in enumerate(job.flows):  # a finished flow credits what it moved, once
                    for r, w in f.uses:
                        self.moved_bytes[r.key] = self.moved_bytes.get(r.key, 0.0) + w * f.size_bytes
                    job.left[i], job.rates[i] = 0.0, 0.0
                latency = max(f.latency_s for f in job.flows)
                self._latency_waits.append((now + latency, job_id))
                changed = True
        due = [(t, j) for t, j in self._latency_waits if t <= now]
        if due:
            self._latency_waits = [(t, j) for t, j in self._latency_waits if t > now]
            for _, job_id in sorted(due):
                self._begin_next_stage(job_id, now)
            changed = True
        if changed:
            self._reshare()
