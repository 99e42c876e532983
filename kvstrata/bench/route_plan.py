"""``bench route``'s plan (pure): which routing policy runs when and on which tokens, the SLO a
request is judged by, and the prefill rate kvstrata's scorer is given.

Passes. Each round runs every policy once, one pass each, the order rotating from round to
round (:func:`kvstrata.rounds.rotated`), so none always goes first. Every pass sends the same
conversations (the same trace, lengths and pace) with token ids of its own
(:func:`~kvstrata.calibrate.serving.workload.plan_conversations`' ``variant``: one per pass,
never reused in the run), so no pass finds another's KV on any server or in the pool.

Goodput (:mod:`kvstrata.slo`, as the simulator counts it): a pass's share of requests with TTFT
and TPOT within the SLO, and those requests over the pass's wall time.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from kvstrata.calibrate.serving.servers import ServeBenchConfig
from kvstrata.fleet.scorer import Policy
from kvstrata.rounds import rotated
from kvstrata.slo import Slo

BASELINE = Policy.ROUND_ROBIN  # every ratio is over it
POLICIES = (Policy.ROUND_ROBIN, Policy.DYNAMO, Policy.LLM_D, Policy.PREDICTED_TTFT)
SERVERS = (2, 3)  # on one pool; CPU halves are dealt in turn


@dataclass(frozen=True)
class RouteBenchConfig:
    """What ``bench route`` runs.

    Attributes:
        serve: the workload, model, servers' KV and tiers, rounds, pool and directory, as
            ``bench serve`` takes them (:class:`~kvstrata.calibrate.serving.servers.ServeBenchConfig`).
        servers: ``vllm serve`` processes with the connector, on one pool.
        policies: the routing policies compared (round robin always among them: the ratios' base).
        slo: what a request must meet to count in the goodput.
    """

    serve: ServeBenchConfig
    servers: int = 2
    policies: tuple[Policy, ...] = POLICIES
    slo: Slo = Slo(ttft_s=0.1, tpot_s=0.05)  # the tiny model on a CPU host

    def __post_init__(self) -> None:
        if self.servers not in SERVERS:
            raise ValueError(f"bench route: servers must be one of {', '.join(map(str, SERVERS))}, got {self.servers!r}")
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"bench route: a policy is listed twice: {', '.join(p.value for p in self.policies)}")
        if BASELINE not in self.policies:
            object.__setattr__(self, "policies", (BASELINE, *self.policies))


@dataclass(frozen=True)
class Pass:
    """One policy's pass: its round, its place in the round, and its token ids' variant."""

    round: int
    position: int
    policy: Policy
    variant: int


def plan_passes(policies: Sequence[Policy], rounds: int) -> tuple[tuple[Pass, ...], ...]:
    """Each round's passes in the order they run: ``policies`` rotated by the round, each pass
    a variant of its own (round x policies + position)."""
    if rounds < 1 or not policies:
        raise ValueError(f"bench route: needs >= 1 round and >= 1 policy, got {rounds} and {len(policies)}")
    return tuple(tuple(Pass(r, i, p, r * len(policies) + i) for i, p in enumerate(rotated(policies, r)))
                 for r in range(rounds))


def per_token_s(short: Sequence[tuple[int, float]], long: Sequence[tuple[int, float]]) -> float:
    """A server's prefill seconds per token from cold prompts' (tokens, TTFT) at two lengths: the
    slope between the lengths' median TTFTs; where noise makes that slope not positive, the long
    prompts' median TTFT over their tokens (an upper bound: it holds the fixed cost too).

    Raises:
        ValueError: either length has no samples, or the long prompts are not longer.
    """
    if not short or not long:
        raise ValueError("a prefill fit needs prompts of two lengths")
    short_tokens, long_tokens = statistics.median(t for t, _ in short), statistics.median(t for t, _ in long)
    if long_tokens <= short_tokens:
        raise ValueError(f"the long prompts ({long_tokens} tokens) must be longer than the short ({short_tokens})")
    short_s, long_s = statistics.median(s for _, s in short), statistics.median(s for _, s in long)
    slope = (long_s - short_s) / (long_tokens - short_tokens)
    return slope if slope > 0 else long_s / long_tokens
