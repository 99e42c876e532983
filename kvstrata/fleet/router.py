"""A router's state of its fleet: which servers are up, what each has in flight, who takes a request (pure).

The HTTP front (:mod:`kvstrata.fleet.front`) asks :meth:`Router.pick` for a server, holds the
:class:`Ticket` it is given while the request runs, and tells the router when the first token
came (:meth:`Router.started`) and when the request ended (:meth:`Router.done`). From those the
router keeps, per server:

* ``inflight``: requests sent and not ended (backpressure: at most ``Limits.per_server``);
* ``queued_tokens``: the prompt tokens of requests sent and not yet past their first token, the
  prefill waiting on the server, which every policy weighs (:class:`~kvstrata.fleet.scorer.ServerState`);
* ``decoding``: requests past their first token and not ended, and the pace their tokens come
  at (:class:`~kvstrata.fleet.pace.TokenPace`, fed by :meth:`Router.tokens`), which kvstrata's
  policy weighs against a TPOT target.

A ticket is ``QUEUED`` (sent, no token yet), ``STARTED`` (first token seen: its tokens leave
the queue) or ``DONE`` (ended: it leaves ``inflight``); each step happens once, in that order
(``DONE`` straight from ``QUEUED`` for a request that failed or did not stream).

Backpressure: a request arriving when ``Limits.total`` requests are in flight, or when every
server up is at ``Limits.per_server``, is refused at once (:class:`Busy`, the front's 429): a
client retries it later, nothing waits in the router unseen. A server marked down takes
nothing until marked up again; it comes back holding nothing (:meth:`FleetIndex.reset
<kvstrata.fleet.index.FleetIndex.reset>`): a restarted vLLM's prefix cache is empty.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from kvstrata.fleet.cost import ServerCost
from kvstrata.fleet.index import FleetIndex, UnknownServer
from kvstrata.fleet.pace import TokenPace
from kvstrata.fleet.scorer import Choice, Request, RoutingPolicy, ServerState, predict


class Health(enum.Enum):
    UP = "up"
    DOWN = "down"


class TicketState(enum.Enum):
    QUEUED = "queued"
    STARTED = "started"
    DONE = "done"


class NoServer(RuntimeError):
    """No server is up to take a request (the front's 503)."""


class Busy(RuntimeError):
    """Every server that could take a request is at its limit (the front's 429)."""


BLOCK_TOKENS = 16  # vLLM's default --block-size
# A server's prefill rate where nothing better is given (no calibration): a placeholder of the
# order of a small model's on one GPU, not a measurement; --calibration prices servers as measured.
PREFILL_TOKENS_PER_S = 10_000.0
HEALTH_INTERVAL_S = 2.0  # between a server's /health checks


@dataclass(frozen=True)
class Limits:
    """Requests in flight at most: per server, and through the router overall."""

    per_server: int = 64
    total: int = 256

    def __post_init__(self) -> None:
        if self.per_server < 1 or self.total < 1:
            raise ValueError(f"in-flight limits must be >= 1, got per server {self.per_server}, total {self.total}")


@dataclass
class _Server:
    cost: ServerCost
    health: Health = Health.UP
    inflight: int = 0
    queued_tokens: int = 0
    decoding: int = 0
    pace: TokenPace = field(default_factory=TokenPace)


@dataclass
class Ticket:
    """One request sent to ``server``: its prompt tokens and its predicted time to the first token."""

    server: str
    prompt_tokens: int
    predicted_ttft_s: float
    choice: Choice
    state: TicketState = TicketState.QUEUED
    last_token_s: float | None = None  # when its last token came (STARTED)


@dataclass(frozen=True)
class ServerView:
    """One server as the router holds it now (for health pages and metrics)."""

    server: str
    health: Health
    inflight: int
    queued_tokens: int
    tpot_s: float | None = None  # its decode's time per output token now (None: nothing decodes)


class Router:
    """Servers, a policy, the fleet index and the limits; one owner (the front's event loop).

    Args:
        servers: each server's id and measured costs, in the order ties go.
        policy: chooses among the servers up with room.
        limits: in-flight bounds.
        index: what each server holds (None: a new empty one over ``servers``).
        clock: seconds, for the pace of the servers' tokens.
    """

    def __init__(self, servers: Sequence[tuple[str, ServerCost]], policy: RoutingPolicy,
                 limits: Limits = Limits(), index: FleetIndex | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not servers:
            raise ValueError("no servers to route to")
        self._servers = {name: _Server(cost) for name, cost in servers}
        if len(self._servers) != len(servers):
            raise ValueError(f"a server is listed twice: {[name for name, _ in servers]}")
        self.policy = policy
        self.limits = limits
        self.clock = clock
        self.index = index if index is not None else FleetIndex(self._servers)
        for name in self._servers:
            if name not in self.index.servers:
                self.index.add_server(name)

    @property
    def servers(self) -> tuple[str, ...]:
        return tuple(self._servers)

    @property
    def inflight(self) -> int:
        return sum(s.inflight for s in self._servers.values())

    def view(self) -> tuple[ServerView, ...]:
        now = self.clock()
        return tuple(ServerView(n, s.health, s.inflight, s.queued_tokens, self._pace(n, now))
                     for n, s in self._servers.items())

    def health(self, server: str) -> Health:
        return self._get(server).health

    def pick(self, request: Request, exclude: Collection[str] = ()) -> Ticket:
        """Send ``request`` to the server the policy chooses among those up, with room, not in
        ``exclude`` (servers that already failed it); the server's counts include it from now.

        Raises:
            Busy: the router or every server up (not excluded) is at its limit.
            NoServer: no server is up that was not excluded.
        """
        if self.inflight >= self.limits.total:
            raise Busy(f"{self.inflight} requests in flight, the router's limit ({self.limits.total}): retry later")
        up = [n for n, s in self._servers.items() if s.health is Health.UP and n not in exclude]
        if not up:
            tried = f" ({len(exclude)} tried already)" if exclude else ""
            raise NoServer(f"no server is up to take the request{tried}")
        room = [n for n in up if self._servers[n].inflight < self.limits.per_server]
        if not room:
            raise Busy(f"every server up has {self.limits.per_server} requests in flight, its limit: retry later")
        now = self.clock()
        states = [ServerState(n, self._servers[n].cost, self._servers[n].queued_tokens, self._pace(n, now)) for n in room]
        choice = self.policy.choose(request, states, self.index)
        predicted = next(s.predicted_s for s in choice.scores if s.server == choice.server)
        if predicted is None:  # a policy that does not predict: the prediction, for the metrics
            state = next(s for s in states if s.server == choice.server)
            predicted = predict(request, state, self.index).ttft_s
        server = self._servers[choice.server]
        server.inflight += 1
        server.queued_tokens += request.prompt_tokens
        return Ticket(choice.server, request.prompt_tokens, predicted, choice)

    def started(self, ticket: Ticket) -> None:
        """``ticket``'s first token came: its prompt is no longer waiting on the server."""
        if ticket.state is not TicketState.QUEUED:
            raise ValueError(f"a ticket on {ticket.server!r} started twice or after it ended ({ticket.state.value})")
        server = self._get(ticket.server)
        server.queued_tokens -= ticket.prompt_tokens
        ticket.last_token_s = now = self.clock()
        server.decoding += 1
        if server.decoding == 1:  # the server's decode begins: its open gap counts from here
            server.pace.start(now)
        ticket.state = TicketState.STARTED

    def tokens(self, ticket: Ticket, count: int = 1) -> None:
        """``count`` more tokens of ``ticket``'s answer came (after its first): the server's pace."""
        if ticket.state is not TicketState.STARTED or ticket.last_token_s is None:
            raise ValueError(f"tokens of a ticket on {ticket.server!r} that is not decoding ({ticket.state.value})")
        if count < 1:
            return
        now = self.clock()
        self._get(ticket.server).pace.add(now, (now - ticket.last_token_s) / count, count)
        ticket.last_token_s = now

    def done(self, ticket: Ticket) -> None:
        """``ticket``'s request ended (answered, failed or abandoned); idempotent."""
        if ticket.state is TicketState.DONE:
            return
        if ticket.state is TicketState.QUEUED:
            self.started(ticket)
        server = self._get(ticket.server)
        server.inflight -= 1
        server.decoding -= 1
        ticket.state = TicketState.DONE

    def mark_down(self, server: str) -> bool:
        """``server`` stopped answering; True if it was up."""
        s = self._get(server)
        was_up, s.health = s.health is Health.UP, Health.DOWN
        return was_up

    def mark_up(self, server: str) -> bool:
        """``server`` answers again; True if it was down (then it holds nothing in the index)."""
        s = self._get(server)
        if s.health is Health.UP:
            return False
        s.health = Health.UP
        self.index.reset(server)
        return True

    def _pace(self, server: str, now_s: float) -> float | None:
        """``server``'s time per output token now (None: nothing decodes there)."""
        s = self._servers[server]
        return s.pace.seconds_per_token(now_s) if s.decoding else None

    def _get(self, server: str) -> _Server:
        try:
            return self._servers[server]
        except KeyError:
            raise UnknownServer(server, self._servers) from None
