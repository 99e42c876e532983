"""Which server of a fleet takes a request: routing policies behind one Protocol (pure).

Every policy scores each server with a cost (lower wins) and picks the lowest; a tie goes to the
server listed first, so a choice depends only on its inputs (and a round robin's turn).

* :class:`PredictedTTFT`, kvstrata's: a server's predicted time to the first token,

      ttft = queued_tokens * per_token_s                  (the prefill waiting ahead of it)
           + load(k) + (prompt_tokens - k * block_tokens) * per_token_s

  the second line :meth:`ServerCost.plan <kvstrata.fleet.cost.ServerCost.plan>` on the prefix
  the server reaches (:meth:`FleetIndex.reach <kvstrata.fleet.index.FleetIndex.reach>`: its own
  tiers and the pool, each block by the fastest tier holding it), ``k`` the blocks its connector
  would load: the load-or-recompute decision the server itself makes, with its own numbers.
  Given an SLO, only among the servers predicted to meet it (TTFT within its target, and
  decoding requests well under the TPOT target: :attr:`ServerState.tpot_s`, the pace their tokens
  come at), while any is.
* :class:`OverlapWeights`, today's routers: a prefix's blocks credited by a fixed weight per tier
  (:data:`DYNAMO`: device 1.0, host 0.75, disk 0.25, Dynamo's KV router; :data:`LLM_D`: GPU 1.0,
  CPU 0.8, llm-d's scorer), in Dynamo's shape: the prompt's blocks left to compute, plus the
  server's queue in blocks (``load_weight`` of them).
* :class:`RoundRobin`: each server in turn.
"""

from __future__ import annotations

import enum
import math
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvstrata.fleet.cost import Restore, ServerCost
from kvstrata.fleet.events import BlockHash
from kvstrata.fleet.index import FleetIndex, UnknownServer
from kvstrata.media import Medium
from kvstrata.slo import Slo

TPOT_HEADROOM = 0.6  # a server past 60% of the TPOT target is full: prefills routed to it stall its decodes past


@dataclass(frozen=True)
class ServerState:
    """One server as the router sees it now.

    Attributes:
        server: its id in the fleet index.
        cost: its measured costs.
        queued_tokens: prefill tokens sent to it and not yet computed.
        tpot_s: the time per output token its decoding requests see now
            (:class:`~kvstrata.fleet.pace.TokenPace`); None: nothing decodes there.
    """

    server: str
    cost: ServerCost
    queued_tokens: int = 0
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        if self.queued_tokens < 0:
            raise ValueError(f"queued_tokens must be >= 0, got {self.queued_tokens} for {self.server!r}")
        if self.tpot_s is not None and not (math.isfinite(self.tpot_s) and self.tpot_s >= 0):
            raise ValueError(f"tpot_s must be finite and >= 0 s, got {self.tpot_s} for {self.server!r}")


@dataclass(frozen=True)
class Request:
    """What routing needs of a prompt.

    Attributes:
        block_hashes: vLLM's hashes of its full blocks, in order (:mod:`kvstrata.fleet.events`).
        prompt_tokens: its length in tokens.
    """

    block_hashes: tuple[BlockHash, ...]
    prompt_tokens: int

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"a prompt has at least one token, got {self.prompt_tokens}")


@dataclass(frozen=True)
class Score:
    """One server's cost under a policy (lower wins), the prefix blocks it reaches, and its
    predicted time to the first token where the policy computed it (None: it did not)."""

    server: str
    cost: float
    reached_blocks: int = 0
    predicted_s: float | None = None


@dataclass(frozen=True)
class Choice:
    """The server a policy chose, and every server's score, in the order given."""

    server: str
    scores: tuple[Score, ...]


@dataclass(frozen=True)
class Predicted:
    """A server's predicted time to the first token for a request."""

    server: str
    queue_s: float
    restore: Restore

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.restore.seconds


class RoutingPolicy(Protocol):
    """Chooses a server for a request. Raises :class:`UnknownServer` for a server the index does
    not know, ValueError for no servers."""

    name: str

    def choose(self, request: Request, servers: Sequence[ServerState], index: FleetIndex) -> Choice: ...


def predict(request: Request, state: ServerState, index: FleetIndex) -> Predicted:
    """``state``'s predicted time to the first token for ``request`` (the module text's formula)."""
    reach = index.reach(state.server, request.block_hashes)
    return Predicted(state.server, state.cost.queue_s(state.queued_tokens),
                     state.cost.plan(reach, request.prompt_tokens))


class PredictedTTFT:
    """kvstrata's policy: the least predicted time to the first token, among the servers on which
    the request is predicted to meet its SLO.

    With an SLO, a server is a candidate when its predicted TTFT meets the TTFT target and its
    decoding requests see at most ``headroom`` of the TPOT target per token
    (:attr:`ServerState.tpot_s`: a fuller server's next prefill stalls them past it, and the
    request decodes at that pace too). The least predicted TTFT among the candidates wins; with
    none, among the servers within the TTFT target and under the TPOT target itself; with none
    again, the least of all (the request misses a target anywhere: its first token comes soonest).
    Without the TPOT check a prefix held in one server's HBM draws every request that shares it,
    and the decode of all of them slows past the target while other servers idle. Without an
    SLO, TTFT alone decides.
    """

    name = "predicted-ttft"

    def __init__(self, slo: Slo | None = None, headroom: float = TPOT_HEADROOM) -> None:
        if not 0 < headroom <= 1:
            raise ValueError(f"the TPOT headroom must be in (0, 1], got {headroom}")
        self.slo = slo
        self.headroom = headroom

    def choose(self, request: Request, servers: Sequence[ServerState], index: FleetIndex) -> Choice:
        _check(servers, index)
        scores = []
        for state in servers:
            p = predict(request, state, index)
            scores.append(Score(state.server, p.ttft_s, p.restore.reached_blocks, predicted_s=p.ttft_s))
        if self.slo is not None:
            for pace in (self.headroom * self.slo.tpot_s, self.slo.tpot_s):
                meets = [score.cost <= self.slo.ttft_s and (state.tpot_s is None or state.tpot_s <= pace)
                         for score, state in zip(scores, servers)]
                if any(meets):
                    return _lowest(scores, meets)
        return _lowest(scores)


@dataclass(frozen=True)
class OverlapWeights:
    """A fixed weight per tier for each block of the prefix a server holds (Dynamo's shape).

    ``cost = (prompt_blocks - overlap) + load_weight * queued_tokens / block_tokens``, ``overlap``
    the sum over the prefix's blocks of the best weight among the tiers holding each (a tier not
    weighted counts 0; the prefix ends at the first block the server does not reach). Dynamo's
    router's cost is its blocks left to prefill (times ``--kv-overlap-score-weight``, 1 by
    default) plus the worker's active blocks; here the server's queued prefill, in blocks, stands
    for its load, the one measure of load every policy here is given.

    Attributes:
        name: the policy's name.
        weights: per tier, the credit of a block held there.
        load_weight: blocks of cost per block of prefill queued on the server.
    """

    name: str
    weights: Mapping[Medium, float]
    load_weight: float = 1.0

    def __post_init__(self) -> None:
        if any(not w >= 0 for w in self.weights.values()) or not self.load_weight >= 0:
            raise ValueError(f"{self.name}: weights must be >= 0, got {dict(self.weights)}, load {self.load_weight}")
        object.__setattr__(self, "weights", types.MappingProxyType(dict(self.weights)))

    def choose(self, request: Request, servers: Sequence[ServerState], index: FleetIndex) -> Choice:
        _check(servers, index)
        scores = []
        for state in servers:
            reached, overlap = 0, 0.0
            for block_hash in request.block_hashes:
                held = index.held(state.server, block_hash)
                if not held:
                    break
                reached += 1
                overlap += max(self.weights.get(m, 0.0) for m in held)
            queued = state.queued_tokens / state.cost.block_tokens
            cost = request.prompt_tokens / state.cost.block_tokens - overlap + self.load_weight * queued
            scores.append(Score(state.server, cost, reached))
        return _lowest(scores)


# The pool's events say medium CPU, locality REMOTE (kvstrata.fleet.events): a router that reads
# the medium alone credits a pool block as host memory, so the baselines do too.
DYNAMO = OverlapWeights("dynamo", {Medium.DEVICE: 1.0, Medium.HOST: 0.75, Medium.DISK: 0.25, Medium.REMOTE: 0.75})
"""Dynamo's KV router's tier weights, as issue 39 cites them (``lib/kv-router``, scheduling/selector.rs)."""
LLM_D = OverlapWeights("llm-d", {Medium.DEVICE: 1.0, Medium.HOST: 0.8, Medium.REMOTE: 0.8})
"""llm-d's KV-cache scorer's default weights (gpu 1.0, cpu 0.8; no storage tier)."""


class RoundRobin:
    """Each server in turn (over the servers as listed at each call)."""

    name = "round-robin"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, request: Request, servers: Sequence[ServerState], index: FleetIndex) -> Choice:
        _check(servers, index)
        n = len(servers)
        pick = self._turn % n
        self._turn += 1
        return Choice(servers[pick].server,
                      tuple(Score(s.server, float((i - pick) % n)) for i, s in enumerate(servers)))


class Policy(enum.Enum):
    """The policies by name, as a command line gives them."""

    PREDICTED_TTFT = "predicted-ttft"
    DYNAMO = "dynamo"
    LLM_D = "llm-d"
    ROUND_ROBIN = "round-robin"

    @classmethod
    def parse(cls, name: str) -> Policy:
        """The policy named ``name``. Raises ValueError naming the known ones."""
        try:
            return cls(name)
        except ValueError:
            known = ", ".join(p.value for p in cls)
            raise ValueError(f"unknown routing policy {name!r} (known: {known})") from None

    def make(self, slo: Slo | None = None) -> RoutingPolicy:
        """A new instance (a round robin's turn is its own); ``slo`` is the targets kvstrata's
        policy routes to meet (the fixed-weight ones and round robin take none)."""
        if self is Policy.PREDICTED_TTFT:
            return PredictedTTFT(slo)
        if self is Policy.DYNAMO:
            return DYNAMO
        if self is Policy.LLM_D:
            return LLM_D
        return RoundRobin()


def _check(servers: Sequence[ServerState], index: FleetIndex) -> None:
    if not servers:
        raise ValueError("no servers to route to")
    known = set(index.servers)
    for state in servers:
        if state.server not in known:
            raise UnknownServer(state.server, index.servers)


def _lowest(scores: list[Score], eligible: Sequence[bool] | None = None) -> Choice:
    """The lowest cost among the ``eligible`` scores (None: all); a tie goes to the first listed."""
    best = min((i for i in range(len(scores)) if eligible is None or eligible[i]), key=lambda i: (scores[i].cost, i))
    return Choice(scores[best].server, tuple(scores))
