"""A serving run's load generator (``bench serve``'s, and ``calibrate --engine vllm``'s): the
``openai`` package's own async client streaming completions from ``vllm serve`` (an edge: HTTP;
what to send comes from :mod:`kvstrata.calibrate.serving.workload`, what it records is a
:class:`~kvstrata.calibrate.serving.measured.RequestRecord`).

Every request is a completion (the tiny model has no chat template) of a prompt of token ids,
``stream=True``, greedy (``temperature=0``), ``max_tokens`` answer tokens with the end of
sequence ignored (``ignore_eos``, vLLM's extension, through ``extra_body``) so every answer has
the same length, and vLLM's ``return_token_ids`` so the answer's token ids come back exactly (the
next turn appends them, and they are what is compared with the reference). TTFT is taken when
the first chunk carrying a token arrives.

Before a phase's clock starts, the client asks each of its servers for its model list, so the
client library's own first call is not in the first request's TTFT. Conversations run at once,
each a closed loop: a turn is sent at its slot in the schedule
(:func:`~kvstrata.calibrate.serving.workload.arrival_s`) or when the previous answer is back, whichever is
later. A route says where each turn goes: one server, or a :class:`Handoff` (the prompt to a
prefill server for one token, then to a decode server). A failed request fails the phase.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvstrata.calibrate.serving.servers import Instance
from kvstrata.calibrate.serving.workload import TurnPlan, arrival_s
from kvstrata.calibrate.serving.measured import RequestRecord
from kvstrata.progress import NoProgress, Progress

REQUEST_TIMEOUT_S = 300.0  # a request queued behind a busy 2-core host's others


class RequestFailed(RuntimeError):
    """A request that did not complete (the message names the server, the conversation and the turn)."""


@dataclass(frozen=True)
class Endpoint:
    """A server as the client reaches it: its OpenAI base URL and the model name it serves."""

    instance: Instance
    base_url: str
    model: str


@dataclass(frozen=True)
class Handoff:
    """A turn served in two steps: ``prefill`` computes the prompt's KV (one token), ``decode``
    answers with the KV handed over."""

    prefill: Endpoint
    decode: Endpoint


Route = Callable[[int, int], "Endpoint | Handoff"]  # (conversation, turn) -> where it goes


@dataclass(frozen=True)
class Driven:
    """What a phase's client saw: the answers, and the prefill calls of handed-off turns."""

    records: tuple[RequestRecord, ...]
    prefills: tuple[RequestRecord, ...]


def drive(plans: Sequence[TurnPlan], route: Route, max_tokens: int, rate_per_s: float,
          progress: Progress | None = None, label: str = "") -> Driven:
    """Run every conversation of ``plans`` against the servers ``route`` names."""
    return asyncio.run(_drive(plans, route, max_tokens, rate_per_s, progress or NoProgress(), label))


def ask_each(endpoint: Endpoint, prompts: Sequence[Sequence[int]], max_tokens: int, concurrency: int,
             progress: Progress | None = None, label: str = "", leads: bool = False) -> list[RequestRecord]:
    """Each prompt's answer from one server, ``concurrency`` at a time (``leads``: with how far
    each greedy choice led its runner-up)."""
    return asyncio.run(_ask_each(endpoint, prompts, max_tokens, concurrency, progress or NoProgress(), label, leads))


class Clients:
    """One ``AsyncOpenAI`` per server (its connections kept from call to call), closed together."""

    def __init__(self) -> None:
        self._clients: dict[str, object] = {}

    def __call__(self, endpoint: Endpoint):
        import openai

        client = self._clients.get(endpoint.base_url)
        if client is None:
            # no retries (a retried request's time would be wrong) and no proxy from the
            # environment: the servers listen on 127.0.0.1
            client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key="EMPTY", max_retries=0,
                                        timeout=REQUEST_TIMEOUT_S,
                                        http_client=openai.DefaultAsyncHttpxClient(trust_env=False))
            self._clients[endpoint.base_url] = client
        return client

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()


async def _drive(plans: Sequence[TurnPlan], route: Route, max_tokens: int, rate_per_s: float,
                 progress: Progress, label: str) -> Driven:
    clients = Clients()
    records: list[RequestRecord] = []
    prefills: list[RequestRecord] = []
    steps = sum(p.turns * (2 if isinstance(route(p.index, 0), Handoff) else 1) for p in plans)
    progress.start(steps)
    await _ready(clients, [route(p.index, t) for p in plans for t in range(p.turns)])
    start = time.perf_counter()

    def done(record: RequestRecord) -> None:
        progress.step(f"{label}: {len(records) + len(prefills)}/{steps} requests")

    async def conversation(position: int, plan: TurnPlan) -> None:
        answers: list[tuple[int, ...]] = []
        for turn in range(plan.turns):
            wait = start + arrival_s(position, turn, len(plans), rate_per_s) - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            prompt = plan.prompt(turn, answers)
            target = route(plan.index, turn)
            if isinstance(target, Handoff):
                first = await complete(clients(target.prefill), target.prefill, prompt, 1, plan.index, turn, start)
                prefills.append(first)
                done(first)
                target = target.decode
            record = await complete(clients(target), target, prompt, max_tokens, plan.index, turn, start)
            records.append(record)
            done(record)
            answers.append(record.output_ids)

    try:
        await _all([conversation(position, plan) for position, plan in enumerate(plans)])
    finally:
        await clients.close()
    return Driven(tuple(sorted(records, key=lambda r: r.sent_s)), tuple(sorted(prefills, key=lambda r: r.sent_s)))


async def _ready(clients: Clients, targets: Sequence[Endpoint | Handoff]) -> None:
    """Each server the phase will send to answers a request of the client's own (its model list)
    before the clock starts: the client library's first call (its set-up, the first connection)
    is then not in the phase's first TTFT."""
    import openai

    endpoints = {}
    for target in targets:
        for e in (target.prefill, target.decode) if isinstance(target, Handoff) else (target,):
            endpoints[e.base_url] = e
    for e in endpoints.values():
        try:
            await clients(e).models.list()
        except openai.OpenAIError as exc:
            raise RequestFailed(f"{e.instance.value} server: {type(exc).__name__}: {' '.join(str(exc).split())}") from None


async def _ask_each(endpoint: Endpoint, prompts: Sequence[Sequence[int]], max_tokens: int, concurrency: int,
                    progress: Progress, label: str, leads: bool) -> list[RequestRecord]:
    clients = Clients()
    gate = asyncio.Semaphore(concurrency)
    answers: list[RequestRecord | None] = [None] * len(prompts)
    progress.start(len(prompts))
    start = time.perf_counter()

    async def one(i: int) -> None:
        async with gate:
            answers[i] = await complete(clients(endpoint), endpoint, prompts[i], max_tokens, i, 0, start, leads)
        progress.step(f"{label}: {sum(a is not None for a in answers)}/{len(prompts)} prompts")

    try:
        await _all([one(i) for i in range(len(prompts))])
    finally:
        await clients.close()
    return [a for a in answers if a is not None]


async def _all(coroutines: Sequence[Any]) -> None:
    """Run them at once; the first failure cancels the rest and is raised as itself."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def complete(client, endpoint: Endpoint, prompt: Sequence[int], max_tokens: int, conversation: int,
                   turn: int, start: float, leads: bool = False) -> RequestRecord:
    """One streamed completion, timed from just before it is sent (``leads``: asking the top two
    log-probabilities of each answer token too, for how far the choice led the runner-up)."""
    import openai

    where = f"{endpoint.instance.value} server, conversation {conversation} turn {turn}"
    token_times: list[float] = []
    ids: list[int] = []
    margins: list[float] = []
    sent = time.perf_counter()
    asked = {"logprobs": 2} if leads else {}
    try:
        stream = await client.completions.create(
            model=endpoint.model, prompt=list(prompt), max_tokens=max_tokens, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": leads}, **asked,
        )
        async for chunk in stream:
            for choice in chunk.choices:
                new = (choice.model_extra or {}).get("token_ids") or ()
                if new:
                    token_times.append(time.perf_counter())
                    ids.extend(new)
                if leads and choice.logprobs is not None:
                    margins.extend(lead(top) for top in choice.logprobs.top_logprobs or ())
    except openai.OpenAIError as exc:
        raise RequestFailed(f"{where}: {type(exc).__name__}: {' '.join(str(exc).split())}") from None
    end = time.perf_counter()
    if len(ids) != max_tokens:
        raise RequestFailed(f"{where}: {len(ids)} token ids came back of {max_tokens} asked for (does the server "
                            "support vLLM's return_token_ids and ignore_eos?)")
    tpot = (token_times[-1] - token_times[0]) / (len(ids) - 1) if len(ids) > 1 else None
    if leads and len(margins) != len(ids):
        raise RequestFailed(f"{where}: {len(margins)} top log-probabilities came back for {len(ids)} tokens")
    return RequestRecord(conversation, turn, endpoint.instance, len(prompt), tuple(ids), token_times[0] - sent, tpot,
                         end - sent, sent - start, prompt=tuple(prompt), leads=tuple(margins))


def lead(top: Mapping[str, float] | None) -> float:
    """How far a position's greedy choice led its runner-up: the top two log-probabilities'
    difference (inf: no runner-up given)."""
    values = sorted((top or {}).values(), reverse=True)
    return values[0] - values[1] if len(values) > 1 else math.inf
