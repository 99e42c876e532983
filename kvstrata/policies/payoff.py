"""Load or recompute, per request, from what this server measures: never slower than recomputing (pure).

A hit kvstrata holds is worth loading only where bringing its blocks back takes less time than
computing their tokens would. Both sides are measured online by the engine it runs in:

* the prefill: each step's compute time against the tokens it scheduled, a straight line
  (``seconds = fixed + per_token * tokens``) fitted over recent steps (:class:`DecayingFit`);
* each tier's loads: a load's time against its blocks, per tier it waited for (the slowest of
  its blocks' tiers), a straight line of the same kind.

For a request whose usable hit is blocks ``0 .. n-1``, each from a tier, loading the first ``k``
costs ``load(k)`` (per tier, its fit at its blocks; tiers summed, a conservative bound) and saves
``k * block_tokens * per_token`` of prefill. :meth:`LoadOrRecompute.grant` takes the ``k`` that
saves the most, if that is more than ``margin`` of what it costs; else 0: vLLM recomputes.

Until a side has been measured it cannot be judged: without a prefill fit, or with a tier never
loaded from in the hit, the whole hit is granted (that load measures it). A tier measured at one
size only is predicted flat above it (a cold first load is no slope). A tier that stops paying
(a capped disk, a pool that times out) is not used again until, ``probe_every_s`` later, one
request may load one block from it: a bounded cost that tells whether it recovered. Each probe
that finds it still slow doubles the wait, up to ``PROBE_MAX_S``. Until a probe is due, nothing
needs writing to it either (:meth:`LoadOrRecompute.declined_tiers`).

A tier below memory whose last load failed (given up past its budget, or an error) is
*failing*: a hit is granted only up to its first block there, however the rest of the hit was
measured, until a load from it (its probe) arrives. A failure's time is only a lower bound on
what that load would have taken, so no line fitted through it may price a larger load (predicted
flat above one size, a failed 4-block load would price 11 blocks at the same time and grant
them), and an unmeasured tier elsewhere in the hit is no reason to load from it again. A failing
tier's probe needs no request: when it falls due the workers read one block only it holds, off
the step (:meth:`LoadOrRecompute.probes_due`), and the read's time is judged as a one-block
load's (:meth:`~LoadOrRecompute.probed`): within the budget that load would have had, the tier is
judged by its loads again (and written to again); past it, or failed, it is still failing. A tier
holding no such block (:meth:`~LoadOrRecompute.unprobed`) is written again, so that it has one.
A load from memory is a copy: one that fails (a thread stalled past the budget's floor, blocks
evicted since the lookup) says the host had a hiccup, not that memory turned slow, and counts
only as a slow sample.

A grant carries a budget once any step was measured: ``BUDGET_FACTOR`` times the time computing
its tokens would take, at least ``BUDGET_MIN_S``; before the prefill's line is trusted, at the
steps' seconds per token so far, fixed costs and all (a generous estimate, but a bound). A grant
is predicted to take well under its prefill, so a load past twice that is a tier gone slow, not
a noisy host. A load that holds the
step up longer is given up and its blocks are computed instead, so a tier that turned slow since
it was measured, or was never measured (the first load from a capped disk), costs a request at
most about three times the prefill of its hit, not whatever the tier takes; and the failure it
reports tells the decision the tier no longer pays.

Off the step. A grant that waits for a tier below memory (a disk, the pool) while other requests
are running may run off vLLM's step (``Grant.off_step``: vLLM's asynchronous load, the request
waiting while the others' steps go on). Held in the step, a load of ``L`` seconds stretches the
step of each of the ``running`` others by up to ``L``; off it, it costs its own request about one
step more (``step_s``, a moving average of the recent steps' compute: vLLM learns it arrived at
the end of a step, and schedules the request in the next). So it runs off the step where
``L * running`` exceeds a step, or where ``L`` is unknown (a tier never measured, which may be
slow). Alone, a load stays in the step: it holds up nobody else, and its budget bounds it. A
load from memory takes a copy: in the step.

No clocks are read here: callers pass ``now_s``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from kvstrata.media import Medium

PREFILL_MIN_STEPS = 4  # steps before the prefill fit is trusted
PREFILL_MIN_SPREAD = 16  # ... and the spread of their token counts (a slope from one size is no slope)
PROBE_EVERY_S = 5.0
PROBE_MAX_S = 60.0
MARGIN = 1.25  # a grant must save this many times what it costs (estimates are noisy)
BUDGET_FACTOR = 2.0  # a load may hold the step up this many times the prefill it saves
BUDGET_MIN_S = 0.005  # ... and never less: a stalled thread or a page fault is not a slow tier
STEP_WEIGHT = 0.2  # the weight of each new step in the steps' moving average (``step_s``)
_IN_MEMORY = frozenset((Medium.DEVICE, Medium.HOST))  # a load from these is a copy: in the step


class ProbeOutcome(enum.Enum):
    """What a probe read of a failing tier told (:meth:`LoadOrRecompute.probed`)."""

    PAYS = "pays"  # within a one-block load's budget: the tier is judged by its loads again
    SLOW = "slow"  # arrived past that budget: still failing
    FAILED = "failed"  # did not arrive: still failing
    EMPTY = "empty"  # the tier held no block only it holds: written again (:meth:`LoadOrRecompute.unprobed`)


@dataclass
class DecayingFit:
    """``y = a + b * x`` by least squares over samples weighted ``decay ** age``: recent ones count most.

    Attributes:
        decay: each new sample multiplies older weights by this (0.9: about the last 10 count).
    """

    decay: float = 0.9
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    samples: int = 0
    lo: float = math.inf
    hi: float = -math.inf

    @property
    def ratio(self) -> float | None:
        """``y / x`` over the samples (fixed cost and all; None before any sample with ``x > 0``)."""
        return self.sy / self.sx if self.sx > 0 else None

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.n, self.sx, self.sy = self.n * d + 1, self.sx * d + x, self.sy * d + y
        self.sxx, self.sxy = self.sxx * d + x * x, self.sxy * d + x * y
        self.samples += 1
        self.lo, self.hi = min(self.lo, x), max(self.hi, x)

    @property
    def slope(self) -> float | None:
        """``b`` (never below 0), or None while every sample has one ``x``."""
        var = self.sxx * self.n - self.sx * self.sx
        if self.n <= 0 or var <= 1e-12 * max(1.0, self.sxx * self.n):
            return None
        return max(0.0, (self.sxy * self.n - self.sx * self.sy) / var)

    def predict(self, x: float) -> float | None:
        """``a + b * x``; None before any sample. With one ``x`` seen so far the line's slope is
        unknown: above that ``x``, ``y`` as seen (all of it taken as fixed cost); below it, in
        proportion. A first load is often one block on cold code paths: scaled up in proportion,
        it would refuse the larger load that measures the slope."""
        if self.n <= 0:
            return None
        b = self.slope
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        if b is None:
            return mean_y * min(1.0, x / mean_x) if mean_x > 0 else mean_y
        return max(0.0, mean_y + b * (x - mean_x))


def best_prefix(tiers: Sequence[Medium], saved_per_block_s: float, margin: float,
                load_s: Callable[[Mapping[Medium, int]], float | None], whole: bool = False) -> tuple[int, float]:
    """Of a hit whose block ``i`` loads from ``tiers[i]``, the prefix of ``k`` blocks whose load
    saves the most: ``k * saved_per_block_s - margin * load_s(its blocks by tier)``, 0 blocks where
    none saves anything; ``whole``: all of it or none. ``(k, its predicted load seconds)``. The
    connector's grant (:class:`LoadOrRecompute`) and a router's prediction of it
    (:class:`~kvstrata.fleet.cost.ServerCost`) both decide by it."""
    best, best_gain, best_load = 0, 0.0, 0.0
    by_tier: dict[Medium, int] = {}
    for k, medium in enumerate(tiers, 1):
        by_tier[medium] = by_tier.get(medium, 0) + 1
        if whole and k < len(tiers):
            continue
        load = load_s(by_tier) or 0.0
        gain = k * saved_per_block_s - margin * load
        if gain > best_gain:
            best, best_gain, best_load = k, gain, load
    return best, best_load


@dataclass(frozen=True)
class Grant:
    """What :meth:`LoadOrRecompute.grant` decided for one request.

    Attributes:
        blocks: blocks of the hit to load, from the first (0: recompute them all).
        declined: per tier, blocks of the hit not granted.
        load_s: predicted time to load the granted blocks (None: not measured yet).
        saved_s: predicted prefill time those blocks save (None: not measured yet).
        probe: the grant is one block from a tier that stopped paying, to measure it again.
        budget_s: how long the load may hold the step up (off the step: keep its request
            waiting) before it is given up and its blocks computed (None: the prefill not
            measured yet, no budget).
        off_step: the load runs off vLLM's step (asynchronously): it waits for a tier below
            memory while others run, and would hold them up longer in all than a step.
    """

    blocks: int
    declined: dict[Medium, int] = field(default_factory=dict)
    load_s: float | None = None
    saved_s: float | None = None
    probe: Medium | None = None
    budget_s: float | None = None
    off_step: bool = False


@dataclass
class LoadOrRecompute:
    """The per-request decision and the measurements it rests on (one per server's scheduler).

    Attributes:
        block_tokens: tokens per block.
        margin: a grant must save ``margin`` times what it costs.
        probe_every_s: how often a tier that stopped paying is tried with one block.
        budget_factor: a grant's budget in prefills of its tokens (None: grants carry no budget).
    """

    block_tokens: int
    margin: float = MARGIN
    probe_every_s: float = PROBE_EVERY_S
    budget_factor: float | None = BUDGET_FACTOR
    prefill: DecayingFit = field(default_factory=lambda: DecayingFit(0.95))
    loads: dict[Medium, DecayingFit] = field(default_factory=dict)
    _declined_since: dict[Medium, float] = field(default_factory=dict)
    _probed_at: dict[Medium, float] = field(default_factory=dict)
    _probe_wait_s: dict[Medium, float] = field(default_factory=dict)  # per declined tier, until its next probe
    _failing: set[Medium] = field(default_factory=set)  # tiers whose last load failed (see the module text)
    _unprobed: set[Medium] = field(default_factory=set)  # failing tiers with no block to probe: written again
    step_s: float | None = None  # the recent steps' compute, a moving average (None: none measured)

    # --- measurements ----------------------------------------------------------------------------

    def step_computed(self, tokens: int, seconds: float) -> None:
        """A forward step computed ``tokens`` tokens in ``seconds`` (loads excluded)."""
        if tokens > 0 and seconds > 0:
            self.prefill.add(tokens, seconds)
            self.step_s = seconds if self.step_s is None else self.step_s + STEP_WEIGHT * (seconds - self.step_s)

    def loaded(self, medium: Medium, blocks: int, seconds: float) -> None:
        """A load of ``blocks`` blocks that waited for ``medium`` (its slowest tier) arrived in ``seconds``."""
        if blocks <= 0 or seconds < 0:
            return
        self._failing.discard(medium)
        self._unprobed.discard(medium)
        self._sample(medium, blocks, seconds)

    def _sample(self, medium: Medium, blocks: int, seconds: float) -> None:
        fit = self.loads.get(medium)
        expected = fit.predict(blocks) if fit is not None else None
        if fit is None or (expected is not None and seconds < expected / 4):
            fit = self.loads[medium] = DecayingFit(0.7)  # new, or recovered: the old samples no longer hold
        fit.add(blocks, seconds)

    def failed(self, medium: Medium, blocks: int, seconds: float, now_s: float | None = None) -> None:
        """A load from ``medium`` failed after ``seconds``: it cost that and saved nothing, so it
        counts as a load as slow as the prefill of its blocks twice over (or as measured, if
        slower), and, ``now_s`` given, the tier counts as declined from then (its probe waits)."""
        per_token = self.per_token_s
        worst = 2 * blocks * self.block_tokens * per_token if per_token is not None else 0.0
        if blocks > 0 and seconds >= 0:
            self._sample(medium, blocks, max(seconds, worst))
        if medium not in _IN_MEMORY:
            self._failing.add(medium)
            self._unprobed.discard(medium)
        if now_s is not None:
            self._declined_since.setdefault(medium, now_s)

    @property
    def per_token_s(self) -> float | None:
        """The prefill's measured seconds per token, once trusted."""
        fit = self.prefill
        if fit.samples < PREFILL_MIN_STEPS or fit.hi - fit.lo < PREFILL_MIN_SPREAD:
            return None
        return fit.slope

    def load_s(self, blocks_by_tier: dict[Medium, int]) -> float | None:
        """Predicted time to load these blocks (None if a tier among them is unmeasured)."""
        total = 0.0
        for medium, blocks in blocks_by_tier.items():
            fit = self.loads.get(medium)
            predicted = fit.predict(blocks) if fit is not None else None
            if predicted is None:
                return None
            total += predicted
        return total

    # --- the decision ------------------------------------------------------------------------------

    def grant(self, tiers: tuple[Medium, ...], now_s: float, whole: bool = False, running: int = 0) -> Grant:
        """How many of a hit's blocks (``tiers[i]``: block i's tier) to load, and whether off the
        step, with ``running`` other requests in vLLM's batch. ``whole``: all or none (a model
        with sliding-window groups stores their windows only where a hit may end)."""
        grant = self._grant(tiers, now_s, whole)
        if not grant.blocks:
            return grant
        return replace(grant, off_step=self._off_step(tiers[: grant.blocks], running))

    def _off_step(self, granted: tuple[Medium, ...], running: int) -> bool:
        """Whether a load of ``granted`` runs off the step: it waits for a tier below memory, and
        would hold the ``running`` others up longer in all than a step (or its time is unknown)."""
        if running <= 0 or _IN_MEMORY.issuperset(granted):
            return False
        load = self.load_s(_count(granted))
        return load is None or self.step_s is None or load * running > self.step_s

    def _grant(self, tiers: tuple[Medium, ...], now_s: float, whole: bool) -> Grant:
        if not tiers:
            return Grant(0)
        per_token = self.per_token_s
        # up to the first block on a failing tier (all or none: nothing past one)
        cut = next((i for i, m in enumerate(tiers) if m in self._failing), len(tiers))
        if whole and cut < len(tiers):
            cut = 0
        best, best_load = 0, 0.0
        measured = per_token is not None and all(m in self.loads for m in tiers[:cut])
        if not measured:
            best = cut  # not measured yet: loading it is how it gets measured (within the prefill's time, once known)
        else:
            best, best_load = best_prefix(tiers[:cut], self.block_tokens * per_token, self.margin, self.load_s,
                                          whole=whole)
        declined = _count(tiers[best:])
        granted = _count(tiers[:best])
        for medium in declined.keys() - granted.keys():
            self._declined_since.setdefault(medium, now_s)
        for medium in granted:
            self._recovered(medium)
        if best < len(tiers) and best in (0, cut) and self._probe(tiers[best], now_s):
            probe = len(tiers) if whole else best + 1  # the blocks that pay and one from the tier probed
            return Grant(probe, _count(tiers[probe:]), probe=tiers[best], budget_s=self._budget(probe, per_token))
        budget = self._budget(best, per_token) if best else None
        if not measured:
            return Grant(best, declined, budget_s=budget)
        return Grant(best, declined, best_load, best * self.block_tokens * per_token, budget_s=budget)

    def declined_tiers(self, now_s: float) -> frozenset[Medium]:
        """The tiers whose loads do not pay now: declined, their next probe not due yet. A block
        written down to one would not be loaded while that lasts. From when a probe is due until
        it is taken (a request with a hit there), a tier is not among them: blocks go down again,
        so that it has blocks to be probed with."""
        out = []
        for medium, since in self._declined_since.items():
            if medium in self._unprobed:  # nothing there to probe with: written again
                continue
            last = self._probed_at.get(medium, since)
            if now_s - last < self._probe_wait_s.get(medium, self.probe_every_s):
                out.append(medium)
        return frozenset(out)

    def probes_due(self, now_s: float) -> tuple[Medium, ...]:
        """The failing tiers whose probe is due, each taken now (the next waits twice as long):
        the workers read a block of each off the step, and no request waits on it. Its time
        comes back through :meth:`loaded` (or :meth:`failed`, or :meth:`unprobed`)."""
        return tuple(m for m in sorted(self._failing, key=lambda m: m.value) if self._probe(m, now_s))

    def probed(self, medium: Medium, seconds: float, ok: bool, now_s: float) -> ProbeOutcome:
        """A probe read of one block from ``medium`` took ``seconds`` (``ok``: it arrived): a
        load, if within the budget a one-block load would have had (no budget yet: arrived);
        else a failure."""
        budget = self._budget(1, self.per_token_s)
        if ok and (budget is None or seconds <= budget):
            self.loaded(medium, 1, seconds)
            self._recovered(medium)
            return ProbeOutcome.PAYS
        self.failed(medium, 1, seconds, now_s)
        return ProbeOutcome.SLOW if ok else ProbeOutcome.FAILED

    def _recovered(self, medium: Medium) -> None:
        """``medium`` is loaded from again: not declined (written to as before), no probe pending."""
        self._declined_since.pop(medium, None)
        self._probe_wait_s.pop(medium, None)
        self._probed_at.pop(medium, None)

    def unprobed(self, medium: Medium) -> ProbeOutcome:
        """A probe found no block held only in ``medium``: it is written again (not declined)
        until a load or probe from it comes back; a probe of a request's hit can take it meanwhile."""
        if medium in self._failing:
            self._unprobed.add(medium)
        return ProbeOutcome.EMPTY

    def _budget(self, blocks: int, per_token: float | None) -> float | None:
        """``budget_factor`` times the prefill of ``blocks`` blocks (at least ``BUDGET_MIN_S``);
        before the fit is trusted, at the steps' seconds per token so far; None before any step."""
        if per_token is None:
            per_token = self.prefill.ratio
        if per_token is None or self.budget_factor is None:
            return None
        return max(BUDGET_MIN_S, self.budget_factor * blocks * self.block_tokens * per_token)

    def _probe(self, medium: Medium, now_s: float) -> bool:
        """Whether a tier declined since its last probe (or for ``probe_every_s``) may be tried
        with one block now; each probe doubles the wait for the next, up to ``PROBE_MAX_S``."""
        since = self._declined_since.get(medium)
        last = self._probed_at.get(medium, since)
        wait = self._probe_wait_s.get(medium, self.probe_every_s)
        if since is None or last is None or now_s - last < wait:
            return False
        self._probed_at[medium] = now_s
        self._probe_wait_s[medium] = min(2 * wait, PROBE_MAX_S)
        return True


def _count(tiers: tuple[Medium, ...]) -> dict[Medium, int]:
    out: dict[Medium, int] = {}
    for medium in tiers:
        out[medium] = out.get(medium, 0) + 1
    return out
