"""The router's health checks: a server whose ``/health`` fails is skipped, and when it answers again
it is routed to again, holding nothing in the index (its restarted vLLM's prefix cache is empty).
The server is a minimal aiohttp app whose ``/health`` answers as told: only its health is at stake."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvstrata.fleet.cost import ServerCost
from kvstrata.fleet.events import Batch, Stored
from kvstrata.fleet.health import check_once
from kvstrata.fleet.router import Health, Router
from kvstrata.fleet.scorer import RoundRobin
from kvstrata.media import Medium


def test_a_server_that_disappears_and_returns():
    status = {"code": 200}

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=status["code"])

    async def go():
        app = web.Application()
        app.router.add_get("/health", health)
        async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{server.port}"
            router = Router([(url, ServerCost(16, 1e-4, {}))], RoundRobin())
            router.index.apply(url, Batch(0.0, (Stored((1, 2, 3), Medium.DEVICE),)))
            seen = []
            for code in (200, 503, 503, 200):
                status["code"] = code
                await check_once(router, session, timeout_s=2.0)
                seen.append((router.health(url), router.index.count(url, Medium.DEVICE)))
            return seen

    assert asyncio.run(go()) == [(Health.UP, 3), (Health.DOWN, 3), (Health.DOWN, 3), (Health.UP, 0)]
