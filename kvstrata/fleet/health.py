"""Watching the fleet: each server's ``/health`` polled, and its KV events fed to the index (edge: aiohttp, zmq).

:func:`watch_health` asks every server's ``GET /health`` (vLLM's: 200 once its engine is up)
every ``interval_s``; a server that does not answer 200 within ``timeout_s`` is marked down
(the front skips it), one that answers again is marked up, holding nothing in the index
(:meth:`Router.mark_up <kvstrata.fleet.router.Router.mark_up>`). The front also marks a server
down at once when a request cannot connect to it, so a dead server costs at most one retry.

:func:`watch_events` subscribes to one server's KV event socket (vLLM's ``--kv-events-config``
endpoint, or kvstrata's publisher) and hands each message to the
:class:`~kvstrata.fleet.feed.EventFeed`; a refused message is logged, one line, and counted.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from kvstrata.fleet.feed import EventFeed
from kvstrata.fleet.metrics import RouteMetrics
from kvstrata.fleet.router import Router

log = logging.getLogger("kvstrata.route")


async def healthy(session: aiohttp.ClientSession, url: str, timeout_s: float) -> bool:
    """Whether ``url``'s ``/health`` answers 200 within ``timeout_s``."""
    try:
        async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as answer:
            return answer.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False


async def check_once(router: Router, session: aiohttp.ClientSession, timeout_s: float) -> None:
    """Ask every server's ``/health`` at once and mark each up or down."""
    servers = router.servers
    answers = await asyncio.gather(*(healthy(session, s, timeout_s) for s in servers))
    for server, ok in zip(servers, answers):
        if ok and router.mark_up(server):
            log.warning("server %s is back: routing to it again (its index entries reset)", server)
        elif not ok and router.mark_down(server):
            log.warning("server %s does not answer /health: skipped until it does", server)


async def watch_health(router: Router, session: aiohttp.ClientSession, interval_s: float, timeout_s: float) -> None:
    """:func:`check_once` every ``interval_s``, until cancelled."""
    while True:
        await check_once(router, session, timeout_s)
        await asyncio.sleep(interval_s)


async def watch_events(server: str, endpoint: str, feed: EventFeed, metrics: RouteMetrics) -> None:
    """Feed ``server``'s KV events from ``endpoint`` (a ZMQ PUB socket it binds) until cancelled."""
    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context.instance()
    socket = context.socket(zmq.SUB)
    try:
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(endpoint)
        while True:
            frames = await socket.recv_multipart()
            taken = feed.take(server, frames)
            if taken.error is not None:
                metrics.event_batches.labels(server, "refused").inc()
                log.warning("%s", taken.error)
            else:
                metrics.event_batches.labels(server, "applied").inc()
    finally:
        socket.close(linger=0)
