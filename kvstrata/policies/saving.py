"""Save or skip, per request, from what this server measures: a store is paid for only where its blocks come back (pure).

Storing a prompt's blocks costs the workers CPU time (staging them out of the engine's KV, copying
them into the host tier, writing them down); on a CPU server that time is taken from the forward
itself. It pays back only when a later request is served those blocks by kvstrata instead of
recomputing them, beyond what the engine's own prefix cache still holds. So, per stored block:

* its value: the blocks later granted from kvstrata per block stored (``reuse``), times the
  prefill time a granted block saves (the prefill's measured seconds per token, the same fit
  :class:`~kvstrata.policies.payoff.LoadOrRecompute` decides loads with);
* its cost: the workers' measured CPU seconds per block stored.

Reuse is known late. A stored block is asked of kvstrata only once the engine's own KV has dropped
it, which takes at least the engine's capacity (``horizon_blocks``) of newly computed blocks; so a
store counts toward the reuse only after ``MATURE_HORIZONS`` horizons of blocks were computed
since (it has *matured*). A prompt's blocks come back together, so the evidence is counted in
requests, by the rule of three: with ``h`` blocks granted against ``m`` matured requests of ``b``
blocks each on average, reuse is taken as at most ``(h + 3 b) / (m b)``, and stores are judged not
to pay only when even that bound is worth less than they cost. With no hits at all that takes
``3 * saving / cost`` matured requests.

Reuse is also bounded early. A block kvstrata serves repeats an earlier prompt's, so the share of
prompt blocks that repeat one (:class:`~kvstrata.index.seen.SeenBlocks`: the engine's own hits
count too) bounds the reuse a store can have, and it needs no store to come back: it is counted
at each request's admission (``observed``), from when the engine could have dropped a block
(``MATURE_HORIZONS`` horizons of computed blocks since the start). As this evidence flows whether
or not anything is stored, a skip it causes by mistake is undone by the next repeats, and it is
taken as an estimate rather than a 95% bound: the repeats seen plus ``REPEAT_PRIOR_REQUESTS``
request of them, by Laplace's rule of succession. A workload whose prompts share nothing stops
storing after about ``saving / cost`` requests instead of ``3 * saving / cost`` matured ones.
The reuse weighed is the lower of the two.

While stores do not pay, one request in ``sample_every`` is still stored: a return of reuse
shows in its hits. The evidence decays by half every ``HALF_LIFE_REQUESTS`` matured requests, so
the judgement follows a change of workload without being worn away while it samples.

Until the cost and the prefill are measured, every request is stored. A producer that hands KV to
another engine, or one storing into a pool other servers read, cannot see its stores' hits here:
callers do not ask this policy there (they store everything).

No clocks are read here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MATURE_HORIZONS = 2  # the engine's capacities of computed blocks before a store's reuse is judged
CONFIDENCE_REQUESTS = 3.0  # the rule of three: no hit in 3/p requests bounds reuse below p (95%)
HALF_LIFE_REQUESTS = 64.0  # matured requests over which the evidence halves
_KEEP = 0.5 ** (1.0 / HALF_LIFE_REQUESTS)  # what one more matured request leaves of the evidence
SAMPLE_EVERY = 16  # while stores do not pay, one request in this many is still stored
REPEAT_PRIOR_REQUESTS = 1.0  # the repeat estimate's prior: one request whose blocks all repeat (Laplace)
COST_DECAY = 0.9  # each new cost measurement multiplies the older ones' weight by this


@dataclass
class SaveOrSkip:
    """The per-request decision and the measurements it rests on (one per server's scheduler).

    Attributes:
        block_tokens: tokens per block.
        horizon_blocks: the engine's own KV capacity in blocks.
        sample_every: while stores do not pay, one request in this many is stored anyway.
        skipped_blocks: blocks not stored because storing them did not pay (a running total).
    """

    block_tokens: int
    horizon_blocks: int
    sample_every: int = SAMPLE_EVERY
    skipped_blocks: int = 0
    _computed: int = 0  # prompt blocks computed so far, stored or not
    _pending: deque[tuple[int, int]] = field(default_factory=deque)  # (computed when stored, blocks), not matured
    _matured_blocks: float = 0.0
    _matured_requests: float = 0.0
    _hit_blocks: float = 0.0
    _cost_blocks: float = 0.0
    _cost_s: float = 0.0
    _since_sample: int = 0
    _seen_requests: float = 0.0
    _seen_blocks: float = 0.0
    _repeated_blocks: float = 0.0

    def __post_init__(self) -> None:
        if self.block_tokens <= 0 or self.horizon_blocks < 0 or self.sample_every < 1:
            raise ValueError(f"SaveOrSkip needs block_tokens > 0, horizon_blocks >= 0 and sample_every >= 1, got "
                             f"{self.block_tokens}, {self.horizon_blocks}, {self.sample_every}")

    # --- measurements ----------------------------------------------------------------------------

    def computed(self, blocks: int, stored: bool) -> None:
        """A request's prompt computed ``blocks`` new full blocks; ``stored``: they are being stored."""
        if blocks <= 0:
            return
        self._computed += blocks
        if stored:
            self._pending.append((self._computed, blocks))
        else:
            self.skipped_blocks += blocks
        mature_at = self._computed - MATURE_HORIZONS * self.horizon_blocks
        while self._pending and self._pending[0][0] <= mature_at:
            _, n = self._pending.popleft()
            self._matured_requests = self._matured_requests * _KEEP + 1
            self._matured_blocks = self._matured_blocks * _KEEP + n
            self._hit_blocks *= _KEEP

    def granted(self, blocks: int) -> None:
        """A request was admitted with ``blocks`` blocks from kvstrata beyond the engine's own hit."""
        if blocks > 0:
            self._hit_blocks += blocks

    def observed(self, blocks: int, repeated: int) -> None:
        """A request was admitted with ``blocks`` full prompt blocks, the first ``repeated`` of
        which an earlier prompt had (the engine's own hit and kvstrata's included)."""
        if blocks <= 0 or self._computed < MATURE_HORIZONS * self.horizon_blocks:
            return  # a block the engine still holds is never asked of kvstrata: too early to tell
        self._seen_requests = self._seen_requests * _KEEP + 1
        self._seen_blocks = self._seen_blocks * _KEEP + blocks
        self._repeated_blocks = self._repeated_blocks * _KEEP + min(repeated, blocks)

    def stored_cost(self, blocks: int, cpu_s: float) -> None:
        """The workers sent ``blocks`` blocks to store, and stores took ``cpu_s`` CPU seconds,
        since the last report (a store's CPU may come a report after its blocks)."""
        if blocks > 0:
            self._cost_blocks = self._cost_blocks * COST_DECAY + blocks
            self._cost_s *= COST_DECAY
        if cpu_s > 0:
            self._cost_s += cpu_s

    @property
    def cost_per_block_s(self) -> float | None:
        """Measured CPU seconds a stored block costs (None: not measured yet)."""
        return self._cost_s / self._cost_blocks if self._cost_blocks > 0 and self._cost_s > 0 else None

    def reuse_bound(self) -> float | None:
        """The most blocks granted per block stored the evidence allows: the lower of the hits of
        matured stores' bound and the repeats' estimate (None: neither is there yet)."""
        bounds = [b for b in (self._hits_bound(), self.repeat_share()) if b is not None]
        return min(bounds) if bounds else None

    def _hits_bound(self) -> float | None:
        if self._matured_requests <= 0 or self._matured_blocks <= 0:
            return None
        per_request = self._matured_blocks / self._matured_requests
        return (self._hit_blocks + CONFIDENCE_REQUESTS * per_request) / self._matured_blocks

    def repeat_share(self) -> float | None:
        """The share of prompt blocks that repeat an earlier prompt's, with its prior (None: none observed)."""
        if self._seen_requests <= 0 or self._seen_blocks <= 0:
            return None
        per_request = self._seen_blocks / self._seen_requests
        return (self._repeated_blocks + REPEAT_PRIOR_REQUESTS * per_request) / (
            self._seen_blocks + REPEAT_PRIOR_REQUESTS * per_request)

    def pays(self, per_token_s: float | None) -> bool:
        """Whether storing pays, by what is measured (True until it can be judged)."""
        cost, reuse = self.cost_per_block_s, self.reuse_bound()
        if cost is None or reuse is None or per_token_s is None:
            return True
        return reuse * per_token_s * self.block_tokens >= cost

    # --- the decision ------------------------------------------------------------------------------

    def save(self, per_token_s: float | None) -> bool:
        """Whether to store a request's prompt blocks (asked once per request); ``per_token_s``:
        the prefill's measured seconds per token (None: not measured yet)."""
        if self.pays(per_token_s):
            self._since_sample = 0
            return True
        self._since_sample += 1
        if self._since_sample >= self.sample_every:
            self._since_sample = 0
            return True  # a sample: does reuse return?
        return False
