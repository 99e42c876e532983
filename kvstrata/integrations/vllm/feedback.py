"""What the workers measured, back to the scheduler, through vLLM's own worker -> scheduler channel.

The scheduler decides per request whether a hit is worth loading
(:class:`~kvstrata.policies.payoff.LoadOrRecompute`), from two measurements only the workers
can take: how long a step's forward took for the tokens it computed, and how long each load held
it up. vLLM carries a connector's :class:`KVConnectorWorkerMetadata` from every worker with the
step's output, merges the TP ranks' with ``aggregate`` and hands it to the scheduler side's
``update_connector_output``: no channel of kvstrata's own.

A step's compute time is the time from vLLM binding the step's metadata (before the forward) to
``wait_for_save`` (after it), less what the connector's own hooks took in between (loads
waited for, layers staged for saves). A load's time is from ``start_load_kv`` to its last layer
copied into vLLM's blocks (or its failure), counting only the stretches the step spent on
it (in ``start_load_kv`` and each layer's wait): with layer-wise copies, the forward's own
layers in between are compute, not load. The ranks of one step wait for each other, so the
merge keeps the slower rank's figures.

A load whose blocks left kvstrata between the scheduler's lookup and the load (evicted meanwhile)
comes back as :attr:`LoadOutcome.LEFT`: recomputed, and no verdict on its tier's speed.

A probe of a tier the scheduler stopped loading from (a capped disk) is a read of one block it
alone holds, on a thread of the worker's own, off the step: its time comes back as a
:class:`ProbeTiming` (``read`` False: the tier held no such block).

A store's cost is the CPU it took: staging its layers in the step, and the put on the connector's
save thread (which finishes after the step; its CPU arrives with a later step's metadata). The
scheduler weighs it against what the stored blocks later save
(:class:`~kvstrata.policies.saving.SaveOrSkip`). Ranks store in parallel: the merge keeps the
costlier rank's.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from kvstrata.media import Medium


class LoadOutcome(enum.Enum):
    """How a load ended, as the scheduler judges its tier by it (``value`` orders them: two TP
    ranks' outcomes merge as the worse)."""

    ARRIVED = 0  # every block is in vLLM's blocks: a sample of the tier's speed
    LEFT = 1  # its blocks left kvstrata after the lookup (evicted meanwhile): recomputed, no verdict on the tier
    FAILED = 2  # given up past its budget, or an error: its tier counts as failing


@dataclass(frozen=True)
class LoadTiming:
    """One request's load: ``seconds`` it held the step up, and how it ended."""

    req_id: str
    seconds: float
    outcome: LoadOutcome

    @property
    def ok(self) -> bool:
        """Every block arrived."""
        return self.outcome is LoadOutcome.ARRIVED


@dataclass(frozen=True)
class ProbeTiming:
    """A probe read of one block from ``medium``: ``seconds`` it took; ``ok``: it arrived,
    verified; ``read``: there was a block to read (False: the tier held none only it holds)."""

    medium: Medium
    seconds: float
    ok: bool
    read: bool = True

    def worse(self, other: ProbeTiming) -> ProbeTiming:
        """Two ranks' probes of one tier as one: the slower, failed if either failed."""
        return ProbeTiming(self.medium, max(self.seconds, other.seconds), self.ok and other.ok,
                           self.read and other.read)


@dataclass
class KVStrataWorkerMeta(KVConnectorWorkerMetadata):
    """A step's measurements: the forward's compute (tokens, seconds), each load's time, and the
    stores': blocks sent to store, and the CPU seconds stores took since the last report. The
    first report also says whether the caches started empty (None: not said in this one)."""

    computed_tokens: int = 0
    compute_s: float = 0.0
    loads: list[LoadTiming] = field(default_factory=list)
    saved_blocks: int = 0
    save_cpu_s: float = 0.0
    caches_started_empty: bool | None = None
    probes: list[ProbeTiming] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVStrataWorkerMeta):
            return self
        loads = {t.req_id: t for t in self.loads}
        for t in other.loads:
            mine = loads.get(t.req_id)
            loads[t.req_id] = t if mine is None else LoadTiming(t.req_id, max(t.seconds, mine.seconds),
                                                                max(t.outcome, mine.outcome, key=lambda o: o.value))
        said = [m.caches_started_empty for m in (self, other) if m.caches_started_empty is not None]
        probes = {p.medium: p for p in self.probes}
        for p in other.probes:
            probes[p.medium] = p.worse(probes[p.medium]) if p.medium in probes else p
        return KVStrataWorkerMeta(max(self.computed_tokens, other.computed_tokens),
                                  max(self.compute_s, other.compute_s), list(loads.values()),
                                  max(self.saved_blocks, other.saved_blocks), max(self.save_cpu_s, other.save_cpu_s),
                                  all(said) if said else None, list(probes.values()))


class StepClock:
    """The worker's side of the measurements, taken on its one step thread.

    ``begin`` when vLLM binds a step's metadata, ``hooked`` for each stretch a connector hook
    took within the step, ``end`` after the forward; ``charge`` the stretches spent on a
    request's load, ``load_done`` when it ends; ``saved`` the blocks a step sends to store, and
    ``save_cpu`` (from any thread: the save thread's too) the CPU stores took. ``take`` hands over
    what was measured since the last call.
    """

    def __init__(self) -> None:
        self._begin: float | None = None
        self._hooks_s = 0.0
        self._tokens = 0
        self._load_s: dict[str, float] = {}
        self._pending = KVStrataWorkerMeta()
        self._lock = threading.Lock()
        self._save_cpu_s = 0.0
        self._saved_blocks = 0
        self._probes: list[ProbeTiming] = []

    def begin(self, tokens: int) -> None:
        self._begin, self._hooks_s, self._tokens = time.perf_counter(), 0.0, tokens

    def hooked(self, seconds: float) -> None:
        self._hooks_s += seconds

    def end(self) -> None:
        if self._begin is None:
            return
        compute = time.perf_counter() - self._begin - self._hooks_s
        self._begin = None
        if self._tokens > 0 and compute > 0:
            self._pending.computed_tokens += self._tokens
            self._pending.compute_s += compute

    def charge(self, req_id: str, seconds: float) -> None:
        self._load_s[req_id] = self._load_s.get(req_id, 0.0) + seconds

    def load_done(self, req_id: str, outcome: LoadOutcome) -> None:
        self._pending.loads.append(LoadTiming(req_id, self._load_s.pop(req_id, 0.0), outcome))

    def saved(self, blocks: int) -> None:
        with self._lock:  # the copy thread's saves too
            self._saved_blocks += blocks

    def started(self, empty: bool) -> None:
        """The caches are open; ``empty``: they held no block (the next report says so)."""
        self._pending.caches_started_empty = empty

    def probed(self, timing: ProbeTiming) -> None:
        """A probe read ended (on the probe thread)."""
        with self._lock:
            self._probes.append(timing)

    def save_cpu(self, seconds: float) -> None:
        with self._lock:
            self._save_cpu_s += seconds

    def take(self) -> KVStrataWorkerMeta | None:
        meta = self._pending
        with self._lock:
            meta.save_cpu_s, self._save_cpu_s = meta.save_cpu_s + self._save_cpu_s, 0.0
            meta.saved_blocks, self._saved_blocks = meta.saved_blocks + self._saved_blocks, 0
            meta.probes, self._probes = meta.probes + self._probes, []
        if (not meta.loads and not meta.computed_tokens and not meta.saved_blocks and not meta.save_cpu_s
                and meta.caches_started_empty is None and not meta.probes):
            return None
        self._pending = KVStrataWorkerMeta()
        return meta
