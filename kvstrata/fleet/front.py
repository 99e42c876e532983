"""``kvstrata route``'s HTTP front: an OpenAI-compatible server over N ``vllm serve`` (edge: aiohttp).

Routes ``POST /v1/completions`` and ``POST /v1/chat/completions`` (streamed or not), and answers
``GET /v1/models`` (the first server up's), ``GET /health`` (200 while a server is up, with each
server's state) and ``GET /metrics`` (:mod:`kvstrata.fleet.metrics`).

Per request: its prompt's tokens (:mod:`kvstrata.fleet.prompt`: from the body, or a server's
``/tokenize``), their vLLM block hashes when the index is fed by KV events
(:mod:`kvstrata.fleet.hashes`), a server from the policy (:class:`~kvstrata.fleet.router.Router`),
and the request's bytes sent there unchanged. The answer is passed back as it comes: a stream's
SSE chunks as they arrive (its first chunk is the first token: the prompt leaves the server's
queue, and the router measures its TTFT), else the whole body.

No request is lost to a failing server: a connection refused or cut before an answer, or an
answer of 5xx, before any byte went to the client, sends the request to the next server the
policy chooses among those not yet tried (``kvstrata_route_retries_total``); a server that cannot
be connected to is marked down at once. An answer of 4xx is the client's and passed back. Once a
stream has begun, a server that fails mid-way ends it (the client has tokens already). Refused:
429 when every server is at its in-flight limit (no queue in the router: the client retries),
503 when no server is up, 502 when every server up failed the request (its last answer said).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from kvstrata.fleet.cost import ServerCost
from kvstrata.fleet.feed import EventFeed
from kvstrata.fleet.health import check_once, watch_events, watch_health
from kvstrata.fleet.metrics import CONTENT_TYPE, RouteMetrics
from kvstrata.fleet.prompt import AskServer, BadRequest, Endpoint, Tokens, streams, tokenize_ask
from kvstrata.fleet.router import (BLOCK_TOKENS, HEALTH_INTERVAL_S, PREFILL_TOKENS_PER_S, Busy, Health, Limits,
                                   NoServer, Router, Ticket, TicketState)
from kvstrata.fleet.scorer import Policy, Request
from kvstrata.slo import Slo

log = logging.getLogger("kvstrata.route")

FORWARDED_HEADERS = ("Content-Type", "Authorization", "Accept")


@dataclass(frozen=True)
class Upstream:
    """One ``vllm serve``: its base URL (``http://host:port``) and its KV event endpoint, if any."""

    url: str
    events: str | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.path.strip("/"):
            raise ValueError(f"a server is a base URL like http://127.0.0.1:8000, got {self.url!r}")
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if self.events is not None and not self.events.startswith(("tcp://", "ipc://")):
            raise ValueError(f"a KV event endpoint is tcp://host:port or ipc://path, got {self.events!r} "
                             f"for {self.url}")


@dataclass(frozen=True)
class FrontConfig:
    """How ``kvstrata route`` runs.

    Attributes:
        upstreams: the servers, in the order ties go.
        policy: which routing policy chooses.
        block_size: the servers' tokens per block (their ``--block-size``), for the hashes.
        hash_algo: the servers' ``--prefix-caching-hash-algo``.
        limits: in-flight bounds (:class:`~kvstrata.fleet.router.Limits`).
        prefill_tokens_per_s: each server's prefill rate, for the cost model (without ``server_cost``).
        health_interval_s: how often every ``/health`` is asked.
        health_timeout_s: how long a ``/health`` may take.
        connect_timeout_s: how long connecting to a server may take before it counts as down.
        server_cost: every server's cost model, e.g. from a host's calibration (its prefill and its
            tiers' restores: :meth:`ServerCost.from_calibration`); None: ``prefill_tokens_per_s``
            and no tier priced but the device's.
        slo: the targets kvstrata's policy routes to meet (:class:`~kvstrata.fleet.scorer.PredictedTTFT`);
            None: the least predicted TTFT alone.
    """

    upstreams: tuple[Upstream, ...]
    policy: Policy = Policy.PREDICTED_TTFT
    block_size: int = BLOCK_TOKENS
    hash_algo: str = "sha256"
    limits: Limits = field(default_factory=Limits)
    prefill_tokens_per_s: float = PREFILL_TOKENS_PER_S
    health_interval_s: float = HEALTH_INTERVAL_S
    health_timeout_s: float = 2.0
    connect_timeout_s: float = 3.0
    server_cost: ServerCost | None = None
    slo: Slo | None = None

    def __post_init__(self) -> None:
        if not self.upstreams:
            raise ValueError("no servers to route to: give --server URL (one per vllm serve)")
        urls = [u.url for u in self.upstreams]
        if len(set(urls)) != len(urls):
            raise ValueError(f"a server is listed twice: {', '.join(urls)}")
        if self.server_cost is not None and self.server_cost.block_tokens != self.block_size:
            raise ValueError(f"the cost model's blocks of {self.server_cost.block_tokens} tokens are not the servers' "
                             f"{self.block_size}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not self.prefill_tokens_per_s > 0:
            raise ValueError(f"prefill_tokens_per_s must be positive, got {self.prefill_tokens_per_s}")
        for name in ("health_interval_s", "health_timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def hashes(self) -> bool:
        """Whether prompts are hashed: only an index fed by events has blocks to match."""
        return any(u.events for u in self.upstreams)

    def cost(self) -> ServerCost:
        """Every server's cost model: ``server_cost``, else its prefill rate and no restore line
        (only device blocks are priced)."""
        if self.server_cost is not None:
            return self.server_cost
        return ServerCost(self.block_size, 1.0 / self.prefill_tokens_per_s, {})


ROUTER = web.AppKey("router", Router)
METRICS = web.AppKey("metrics", RouteMetrics)
CONFIG = web.AppKey("config", FrontConfig)
SESSION = web.AppKey("session", aiohttp.ClientSession)


def make_app(config: FrontConfig) -> web.Application:
    """The router's aiohttp application (its watchers start and stop with it)."""
    app = web.Application(client_max_size=64 << 20)
    app[CONFIG] = config
    app[ROUTER] = Router([(u.url, config.cost()) for u in config.upstreams], config.policy.make(config.slo),
                           config.limits)
    app[METRICS] = RouteMetrics()
    app.router.add_post(Endpoint.COMPLETIONS.value, _completions)
    app.router.add_post(Endpoint.CHAT.value, _chat)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.cleanup_ctx.append(_watchers)
    return app


async def _watchers(app: web.Application):
    config, router = app[CONFIG], app[ROUTER]
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s)
    # connections: every request in flight and a health check per server (aiohttp's default is 100)
    connector = aiohttp.TCPConnector(limit=config.limits.total + len(config.upstreams))
    app[SESSION] = session = aiohttp.ClientSession(timeout=timeout, connector=connector, auto_decompress=False)
    if config.hashes:
        from kvstrata.fleet.hashes import prompt_block_hashes

        prompt_block_hashes([0] * config.block_size, config.block_size, config.hash_algo)  # vLLM imported, seed set
    await check_once(router, session, config.health_timeout_s)
    feed = EventFeed(router.index)
    tasks = [asyncio.create_task(watch_health(router, session, config.health_interval_s, config.health_timeout_s))]
    tasks += [asyncio.create_task(watch_events(u.url, u.events, feed, app[METRICS]))
              for u in config.upstreams if u.events]
    yield
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await session.close()


def error(status: int, message: str) -> web.Response:
    """An OpenAI-shaped error answer."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _route(request, Endpoint.COMPLETIONS)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _route(request, Endpoint.CHAT)


async def _route(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    app = request.app
    router, metrics, config = app[ROUTER], app[METRICS], app[CONFIG]
    raw = await request.read()
    try:
        body = json.loads(raw)
        ask = tokenize_ask(endpoint, body)
    except json.JSONDecodeError as e:
        return error(400, f"the request body is not JSON: {e}")
    except BadRequest as e:
        return error(400, str(e))
    tokens = ask if isinstance(ask, Tokens) else await _tokenize(app, ask)
    if isinstance(tokens, web.Response):
        return tokens
    hashes = ()
    if config.hashes:
        from kvstrata.fleet.hashes import prompt_block_hashes

        hashes = prompt_block_hashes(tokens.token_ids, config.block_size, config.hash_algo)
    routed = Request(hashes, max(1, len(tokens.token_ids)))
    headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
    tried: list[str] = []
    last = "no answer"
    while True:
        try:
            ticket = router.pick(routed, exclude=tried)
        except Busy as e:
            metrics.rejected.labels("busy").inc()
            return error(429, str(e))
        except NoServer as e:
            if tried:
                metrics.rejected.labels("all_failed").inc()
                return error(502, f"every server up failed the request ({', '.join(tried)}); the last: {last}")
            metrics.rejected.labels("no_server").inc()
            return error(503, str(e))
        metrics.ttft.labels(ticket.server, "predicted").observe(ticket.predicted_ttft_s)
        outcome = await _forward(request, ticket, endpoint, raw, headers, streams(body))
        if isinstance(outcome, web.StreamResponse):
            metrics.requests.labels(ticket.server, config.policy.value, str(outcome.status)).inc()
            return outcome
        reason, last = outcome
        tried.append(ticket.server)
        metrics.retries.labels(ticket.server, reason).inc()
        log.warning("server %s failed a request (%s): %s; trying another", ticket.server, reason, last)


async def _forward(request: web.Request, ticket: Ticket, endpoint: Endpoint, raw: bytes, headers: dict[str, str],
                   stream: bool) -> web.StreamResponse | tuple[str, str]:
    """The server's answer passed to the client, or ``(reason, what)`` when the request may go elsewhere."""
    app = request.app
    router, metrics = app[ROUTER], app[METRICS]
    session = app[SESSION]
    sent = time.monotonic()
    try:
        async with session.post(ticket.server + endpoint.value, data=raw, headers=headers) as answer:
            if answer.status >= 500:
                text = (await answer.read()).decode(errors="replace")
                return "5xx", f"HTTP {answer.status}: {_one_line(text)}"
            if not (stream and answer.status == 200):
                body = await answer.read()
                return web.Response(status=answer.status, body=body,
                                    content_type=answer.content_type, charset=answer.charset)
            out = web.StreamResponse(status=200, headers={"Content-Type": answer.headers.get(
                "Content-Type", "text/event-stream"), "Cache-Control": "no-cache"})
            first = True
            async for chunk in answer.content.iter_any():
                if first:  # the first token: the prompt no longer waits on the server
                    first = False
                    router.started(ticket)
                    metrics.ttft.labels(ticket.server, "measured").observe(time.monotonic() - sent)
                    await out.prepare(request)
                elif (tokens := sse_events(chunk)) > 0:  # the next tokens: the pace of the server's decode
                    router.tokens(ticket, tokens)
                    metrics.streamed.labels(ticket.server).inc(tokens)
                await out.write(chunk)
            if first:
                await out.prepare(request)
            await out.write_eof()
            return out
    except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
        if ticket.state is not TicketState.QUEUED:  # the stream had begun: it cannot be sent elsewhere
            raise
        if isinstance(e, aiohttp.ClientConnectorError) and router.mark_down(ticket.server):
            log.warning("server %s refused a connection: skipped until its /health answers", ticket.server)
        return "connect", _one_line(str(e) or type(e).__name__)
    finally:
        router.done(ticket)


def sse_events(chunk: bytes) -> int:
    """The server-sent events of tokens that begin in ``chunk`` (``data:`` lines; not ``[DONE]``)."""
    return chunk.count(b"data:") - chunk.count(b"data: [DONE]")


async def _tokenize(app: web.Application, ask: AskServer) -> Tokens | web.Response:
    """The prompt's tokens from the first server up that answers ``/tokenize``; its 4xx passed on."""
    router, session = app[ROUTER], app[SESSION]
    last = "no server is up"
    for server in router.servers:
        if router.health(server) is not Health.UP:
            continue
        try:
            async with session.post(f"{server}/tokenize", json=ask.body) as answer:
                if answer.status in (404, 405):  # no /tokenize there (not vLLM): ask another
                    last = f"{server} has no /tokenize (HTTP {answer.status})"
                    continue
                if 400 <= answer.status < 500:  # the prompt itself refused: the client's error
                    return web.Response(status=answer.status, body=await answer.read(),
                                        content_type=answer.content_type)
                if answer.status == 200:
                    tokens = (await answer.json()).get("tokens")
                    if isinstance(tokens, list):
                        return Tokens(tuple(tokens))
                last = f"{server}/tokenize answered HTTP {answer.status}"
        except (aiohttp.ClientError, OSError, ValueError) as e:
            last = f"{server}/tokenize: {_one_line(str(e) or type(e).__name__)}"
    return error(503, f"cannot tokenize the prompt: {last}")


async def _models(request: web.Request) -> web.Response:
    router, session = request.app[ROUTER], request.app[SESSION]
    for server in _up(router):
        try:
            async with session.get(f"{server}/v1/models") as answer:
                if answer.status < 500:
                    return web.Response(status=answer.status, body=await answer.read(),
                                        content_type=answer.content_type)
        except (aiohttp.ClientError, OSError):
            continue
    return error(503, "no server is up to list the models")


async def _health(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    servers = [{"server": v.server, "health": v.health.value, "inflight": v.inflight,
                "queued_prefill_tokens": v.queued_tokens, "tpot_s": v.tpot_s} for v in router.view()]
    up = any(v.health is Health.UP for v in router.view())
    return web.json_response({"policy": request.app[CONFIG].policy.value, "servers": servers},
                             status=200 if up else 503)


async def _metrics(request: web.Request) -> web.Response:
    text = request.app[METRICS].render(request.app[ROUTER])
    return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE})


def _up(router: Router) -> Sequence[str]:
    return [s for s in router.servers if router.health(s) is Health.UP]


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit] + "..."
