"""``kvstrata route`` in front of two real ``vllm serve`` on the tiny model: the router's aiohttp app on
a loopback port, its answers compared with the servers' own.

The servers share one model directory and greedy decoding, so either gives the same answer: a
routed request must be answered exactly as asking a server directly. Server ``a`` publishes
vLLM's own KV events (``--kv-events-config``), which the router's index takes in. The test that
kills a server, and the one that starts it again, run last (the module's servers are shared).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvstrata.fleet.hashes import prompt_block_hashes
from kvstrata.fleet.front import ROUTER, FrontConfig, Upstream, make_app
from kvstrata.fleet.router import Health, Limits
from kvstrata.fleet.scorer import Policy
from kvstrata.integrations.vllm.server import ServerSpec, VllmServer, free_port, start_together
from kvstrata.media import Medium

pytestmark = pytest.mark.engine

BLOCK = 32
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPT = " ".join(f"word{i}" for i in range(60))  # a few full blocks of the tiny tokenizer's tokens
CHAT = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("route")
    (tmp / "chat.jinja").write_text(TEMPLATE)
    events = f"tcp://127.0.0.1:{free_port()}"
    chat = ("--chat-template", str(tmp / "chat.jinja"))
    kv_events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                            "endpoint": events.replace("127.0.0.1", "*")})
    a = VllmServer(ServerSpec(str(tiny_model_dir), block_size=BLOCK, extra_args=(*chat, "--kv-events-config", kv_events)),
                   tmp / "a.log", start_timeout_s=240)
    b = VllmServer(ServerSpec(str(tiny_model_dir), block_size=BLOCK, extra_args=chat), tmp / "b.log", start_timeout_s=240)
    start_together([a, b])
    try:
        yield a, b, events
    finally:
        a.stop(grace_s=5)
        b.stop(grace_s=5)


SCENARIO_S = 300.0


def config(upstreams, policy=Policy.ROUND_ROBIN) -> FrontConfig:
    return FrontConfig(tuple(upstreams), policy, block_size=BLOCK, health_interval_s=0.5, health_timeout_s=2.0)


def around(config_: FrontConfig, scenario):
    async def go():
        async with TestClient(TestServer(make_app(config_))) as client, aiohttp.ClientSession() as direct:
            return await asyncio.wait_for(scenario(client, direct), SCENARIO_S)  # a hang fails, never stalls the run
    return asyncio.run(go())


def completion(stream=False):
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": stream}


def chat(stream=False):
    return {"model": "tiny", "messages": CHAT, "max_tokens": 6, "temperature": 0, "stream": stream}


async def model_name(direct, url) -> str:
    async with direct.get(f"{url}/v1/models") as answer:
        return (await answer.json())["data"][0]["id"]


async def ask(session_or_client, url, path, body):
    async with session_or_client.post(f"{url}{path}", json=body) as answer:
        return answer.status, await answer.read()


def text_of(path, raw: bytes) -> str:
    choice = json.loads(raw)["choices"][0]
    return choice["text"] if path == "/v1/completions" else choice["message"]["content"]


def streamed_text(path, raw: bytes) -> tuple[str, list[str]]:
    lines = [ln for ln in raw.decode().splitlines() if ln.startswith("data: ")]
    text = ""
    for line in lines[:-1]:
        choice = json.loads(line.removeprefix("data: "))["choices"]
        if choice:
            text += choice[0]["text"] if path == "/v1/completions" else (choice[0]["delta"].get("content") or "")
    return text, lines


def bodies(name):
    return [("/v1/completions", {**completion(), "model": name}), ("/v1/chat/completions", {**chat(), "model": name})]


def test_answers_through_the_router_are_the_servers_own_and_the_index_takes_vllms_events(servers):
    """Predicted TTFT with ``a``'s events: the first request goes to ``a`` (a tie goes to the first
    listed); ``a``'s vLLM publishes the prompt's blocks, which the router's own hashes of the
    prompt then reach in its index."""
    a, b, events = servers

    async def scenario(client, direct):
        name = await model_name(direct, a.url)
        out = []
        for path, body in bodies(name):
            routed = await ask(client, "", path, body)
            own = [await ask(direct, s.url, path, body) for s in (a, b)]
            out.append((path, routed, own))
        router = client.server.app[ROUTER]
        async with direct.post(f"{a.url}/tokenize", json={"model": name, "prompt": PROMPT}) as answer:
            hashes = prompt_block_hashes((await answer.json())["tokens"], BLOCK)
        deadline = time.monotonic() + 20
        while len(router.index.reach(a.url, hashes)) < len(hashes) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        models = await client.get("/v1/models")
        return out, hashes, router.index.reach(a.url, hashes), models.status, await models.json()

    out, hashes, reach, models_status, models = around(
        config([Upstream(a.url, events), Upstream(b.url)], Policy.PREDICTED_TTFT), scenario)
    for path, (status, raw), own in out:
        assert status == 200, raw
        assert [s for s, _ in own] == [200, 200]
        assert text_of(path, raw) == text_of(path, own[0][1]) == text_of(path, own[1][1])
    # vLLM's own BlockStored events name the prompt's blocks by the hashes the router computes
    assert len(hashes) >= 2 and reach == (Medium.DEVICE,) * len(hashes)
    assert models_status == 200 and models["data"]


def test_a_stream_passes_through_chunk_by_chunk(servers):
    a, b, _ = servers

    async def scenario(client, direct):
        name = await model_name(direct, a.url)
        out = []
        for path, body in bodies(name):
            streamed = await ask(client, "", path, {**body, "stream": True})
            whole = await ask(direct, a.url, path, body)
            out.append((path, streamed, whole))
        metrics = await (await client.get("/metrics")).text()
        return out, metrics

    out, metrics = around(config([Upstream(a.url), Upstream(b.url)]), scenario)
    for path, (status, raw), (_, whole) in out:
        assert status == 200
        text, lines = streamed_text(path, raw)
        assert lines[-1] == "data: [DONE]" and len(lines) >= 3
        assert text == text_of(path, whole)
    assert 'kvstrata_route_ttft_seconds_count{kind="measured"' in metrics
    # every token after the first fed the servers' pace: 6 tokens an answer, less the first (a
    # chat stream's first event carries the role alone, and its last the finish: up to 2 more; a
    # first chunk that brought two events counts one less)
    streamed = sum(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("kvstrata_route_streamed_tokens_total{"))
    assert 8 <= streamed <= 2 * 5 + 2 + 2, metrics


def test_a_server_answering_500_costs_a_retry_not_a_request(servers):
    """A server that answers 500 is a minimal aiohttp app standing in for a broken server (vLLM
    gives no route that fails on demand): ``/health`` 200, everything else 500. Round robin offers
    it every request first (a retry on the other server takes the next turn), and its ``/tokenize``
    is asked first too: each request is answered by the real one, as the real one answers."""
    a, _, _ = servers

    async def broken(request: web.Request) -> web.Response:
        if request.path == "/health":
            return web.Response(text="ok")
        return web.json_response({"error": "engine dead"}, status=500)

    async def scenario(client, direct):
        name = await model_name(direct, a.url)
        out = []
        for _ in range(2):
            for path, body in bodies(name):
                out.append((path, await ask(client, "", path, body), await ask(direct, a.url, path, body)))
        return out, await (await client.get("/metrics")).text()

    async def go():
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", broken)
        async with TestServer(app, host="127.0.0.1") as fake:
            bad = f"http://127.0.0.1:{fake.port}"
            cfg = config([Upstream(bad), Upstream(a.url)])
            async with TestClient(TestServer(make_app(cfg))) as client, aiohttp.ClientSession() as direct:
                return bad, await scenario(client, direct)

    bad, (out, metrics) = asyncio.run(go())
    for path, (status, raw), (_, own) in out:
        assert status == 200 and text_of(path, raw) == text_of(path, own)
    assert f'kvstrata_route_retries_total{{reason="5xx",server="{bad}"}} 4.0' in metrics
    assert f'kvstrata_route_requests_total{{code="200",policy="round-robin",server="{a.url}"}} 4.0' in metrics


def test_beyond_the_in_flight_limit_a_request_is_refused_at_once(servers):
    """One request in flight through the router at most: a second sent while the first is in
    flight is a 429 saying so; the first is answered in full."""
    a, _, _ = servers

    async def scenario(client, direct):
        name = await model_name(direct, a.url)
        body = {"model": name, "prompt": list(range(100, 140)), "max_tokens": 400, "temperature": 0,
                "ignore_eos": True}
        router = client.server.app[ROUTER]
        for _ in range(50):  # a health check slowed by a loaded host may mark ``a`` down a moment: again
            first = asyncio.create_task(ask(client, "", "/v1/completions", body))
            while router.inflight == 0 and not first.done():
                await asyncio.sleep(0.005)
            if not first.done():
                break
            await asyncio.sleep(0.2)
        second = await ask(client, "", "/v1/completions", body)
        in_flight = router.inflight
        return in_flight, second, await first

    # checks that cannot mark ``a`` down while the test runs: a loaded host's slow /health did, and
    # the first request was then refused at once (CI, with other servers busy beside it)
    limited = replace(config([Upstream(a.url)]), limits=Limits(per_server=1, total=1), health_interval_s=600,
                      health_timeout_s=60.0)
    in_flight, (status, raw), (first_status, first_raw) = around(limited, scenario)
    assert in_flight == 1 and status == 429
    assert "1 requests in flight, the router's limit (1): retry later" in json.loads(raw)["error"]["message"]
    assert first_status == 200 and json.loads(first_raw)["usage"]["completion_tokens"] == 400


def test_a_killed_server_loses_no_request(servers):
    """Round robin over both; ``b`` is killed (SIGKILL, no goodbye): every request after is
    answered by ``a``, ``b`` is marked down by the request that could not connect to it (the
    health checks are slowed here so that no check does it first), and ``/health`` says so.
    ``b`` stays down for the next test."""
    a, b, _ = servers

    async def scenario(client, direct):
        name = await model_name(direct, a.url)
        path, body = bodies(name)[0]
        before = [await ask(client, "", path, body) for _ in range(2)]
        b.stop(grace_s=0)
        after = [await ask(client, "", path, body) for _ in range(4)]
        own = await ask(direct, a.url, path, body)
        router = client.server.app[ROUTER]
        health = await (await client.get("/health")).json()
        metrics = await (await client.get("/metrics")).text()
        return path, before + after, own, router.health(b.url), health, metrics

    slow_checks = replace(config([Upstream(a.url), Upstream(b.url)]), health_interval_s=600)
    path, answers, own, b_health, health, metrics = around(slow_checks, scenario)
    assert [s for s, _ in answers] == [200] * 6
    assert {text_of(path, raw) for _, raw in answers} == {text_of(path, own[1])}
    assert b_health is Health.DOWN
    assert [s["health"] for s in health["servers"]] == ["up", "down"]
    assert f'kvstrata_route_retries_total{{reason="connect",server="{b.url}"}} 1.0' in metrics
    assert f'kvstrata_route_server_up{{server="{b.url}"}} 0.0' in metrics


def test_a_server_that_returns_is_routed_to_again(servers):
    """After the test above: ``b`` is started again on its port while the router runs; its health
    check marks it up (holding nothing in the index), and round robin sends it requests again,
    answered as ``a`` answers them."""
    a, b, _ = servers

    async def scenario(client, direct):
        name = await model_name(direct, a.url)
        path, body = bodies(name)[0]
        router = client.server.app[ROUTER]
        await ask(client, "", path, body)  # b is down: a answers
        assert router.health(b.url) is Health.DOWN
        await asyncio.to_thread(b.start)
        deadline = time.monotonic() + 30
        while router.health(b.url) is Health.DOWN and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        answers = [await ask(client, "", path, body) for _ in range(2)]
        own = await ask(direct, a.url, path, body)
        return path, answers, own, router.health(b.url), await (await client.get("/metrics")).text()

    path, answers, own, b_health, metrics = around(config([Upstream(a.url), Upstream(b.url)]), scenario)
    assert b_health is Health.UP
    assert [s for s, _ in answers] == [200, 200]
    assert {text_of(path, raw) for _, raw in answers} == {text_of(path, own[1])}
    assert f'kvstrata_route_requests_total{{code="200",policy="round-robin",server="{b.url}"}} 1.0' in metrics
