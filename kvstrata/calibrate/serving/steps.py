"""vLLM's prefill and decode step times for a model on this host, measured as a client of
``vllm serve`` sees them: the serving simulator's profile (``kvstrata calibrate --model-dir DIR
--engine vllm``).

The simulator's time model for a GPU comes from its datasheet (:mod:`kvstrata.sim.model`); for
the engine this host actually serves with, it is fitted to what that engine shows. Three
``vllm serve`` processes are set up as ``bench serve`` sets its servers up (prefix caching on,
eager, each one's compute bound to a half of the host's CPUs): on the first half, as ``bench
serve``'s vLLM-alone and kvstrata servers are, one plain and one with the KVStrata connector
(vLLM's own prefix cache off, so a prompt sent again is served by kvstrata alone; a device, host
and disk tier, and the pool when one is given, as ``bench serve``'s kvstrata server has); on the
other half, as its second and decode servers are, a second server with the connector (and the
pool), the other server of ``together``. The connector's cost is what its server took beyond the
plain one's, so the two run on the same CPUs (on different ones, the halves' difference in speed
counted as the connector's). ``bench serve``'s own streaming client sends seeded random token ids, each
prompt new unless a point needs it otherwise:

- prefill of ``n`` new tokens (plain server): one prompt, one token asked for, its time to first
  token; after a cached prefix of ``c`` tokens, that prefix is asked first, untimed, so vLLM's
  prefix cache holds it (``c`` a whole number of blocks);
- a decode step of ``b`` requests of ``ctx`` tokens (plain server): ``b`` prompts sent at once,
  ``T`` tokens each, the time between their tokens: the larger of the median gap the client
  read and the mean gap the engine stamped (vLLM's ``vllm:inter_token_latency_seconds`` over the
  point); the batch then holds ``b * (ctx + T / 2)`` tokens on average. Tokens reach the client
  no faster than the engine makes them, and slower where streaming them out is slower than the
  step (then the client's gap is the step a replay needs); but a client starved for a moment on
  this 2-core host reads a burst of tokens at once, 0.1 ms apart, and there the engine's stamps
  say what the step was (with the client's gaps alone, 2 of 4 test runs here had their
  decode points 80% from their fit);
- the connector (its server): ``STALL_REQUESTS`` new prompts at ``bench serve``'s pace, each
  sent at its slot, to the plain server alone and then to the connector's server alone (a lookup
  that misses, the prompt computed, its blocks stored down every tier, which the connector waits
  for). What the connector's stream took beyond the plain one's (medians), less the store the
  cache's own paths account for, is the connector's cost per request. Measured at the pace
  ``bench serve`` sends, not one request to a quiet server: one request at a time, each after a
  quiet pause, put it at 20-36 ms here, and replays of ``bench serve`` on it were slow at the
  kvstrata phases' TTFT p50 by 12-53%, misses and hits alike; the stream, in the same three
  calibrations, 11-21 ms, and the kvstrata phase's TTFT p50 met its goal in 5 of 6 runs (1 of 6
  before). Then pairs, on a quiet host: a new prompt to the connector's server and the same
  prompt again (every full block short of the last token loaded, the rest computed). What the
  repeat took beyond the prefill fit of what was left and its restore, less what the miss took
  beyond its prefill and store, is its cost per load: the two on one server a moment apart, so
  that what a lone request costs cancels
  (:class:`~kvstrata.plan.steps.ConnectorFit`);
- a load from the pool (with a pool): a new prompt sent to the other half's server (computed,
  stored down to the pool), then to the connector's server, which loads its blocks from the
  pool while the other's worker still spins, as ``bench serve``'s two servers taking turns on
  one pool do. What the cache's own load took (the connector's ``/metrics``) beyond the pool's
  restore path is ``ConnectorFit.remote_load_s``: the bench measured 11-17 ms per load from the
  pool where the path, measured on a quiet host, put 1.6 ms; this measured 6-8 ms beyond it;
- stalls: the two streams above (each server alone), then ``STALL_REQUESTS`` new prompts
  at the same pace taking turns between the connector's server and the other half's
  (as ``bench serve``'s two servers on one pool take turns), and with a pool, handed over: each
  prompt computed by the other half's server, then answered by the connector's from the pool (as
  its P/D pair does): which of their times to first token
  came well past their server's median, and by how much (:class:`~kvstrata.plan.steps.Stalls`).
  The host's tail: on this 2-core host a few requests in every ``bench serve`` phase wait
  100-450 ms, plain servers as often as servers with the connector, and a mean says nothing of it;
- spin (plain server): after a request's last token, the server's processes' CPU use from
  ``/proc`` in windows of ``SPIN_WINDOW_S``: how long it stays above half a CPU
  (``DecodeFit.spin_s``). A vLLM worker busy-polls its queue for a while after its last step.
- together: decode points (taken as above) on the plain server while the server on the other
  half decodes as many requests of its own, longer (sent just before), against the decode fit:
  how much slower a step runs while another server steps (``DecodeFit.together``;
  :mod:`kvstrata.sim.serving.cpus`); and the same points just after the other server answered
  a request, its worker spinning (``DecodeFit.beside_spin``). On a host with few CPUs the servers do not run apart: each
  serving server keeps more than its worker's CPUs busy (its engine core schedules each step,
  its HTTP server streams every token, the client reads them), and that work runs on the
  other's CPUs too. Beside a neighbour that only spins after its last step this was 1.0 in
  one calibration and up to 1.8 in others, beside one decoding 1.5-2.2, while ``bench serve``'s
  two servers on one pool stepped ~1.6x slower than one alone (two plain servers taking turns
  at 4 requests/s: time between tokens 8-11.6 ms, against 5.4-6.5 ms for one server taking them
  all): its neighbours step part of the time and spin the rest.

So the fits hold what serving adds to the engine's own work (the HTTP server, the hand-off to
the engine, streaming each token back, the client's reading it), as ``bench serve`` measures.
Each point is the median of ``repeats`` after one warm-up, fitted with
:func:`kvstrata.plan.host.fit_prefill` and :func:`kvstrata.plan.steps.fit_decode` (where no decode
step grew with the batch or its tokens beyond this host's noise, a step is their median).
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvstrata.plan.host import PrefillFit, fit_prefill
from kvstrata.calibrate.serving.counters import cache_loads, engine_gaps
from kvstrata.plan.steps import ConnectorFit, DecodeFit, Stalls, connector_fit, fit_decode, fit_stalls, remote_load_fit

if TYPE_CHECKING:
    from kvstrata.integrations.vllm.server import ServerSpec

PREFILL_NEW = (32, 64, 128, 256, 512)
PREFILL_CACHED = ((256, 32), (256, 128), (512, 32), (512, 128))  # (cached, new)
DECODE_BATCHES = (1, 2, 4, 8)
DECODE_CONTEXTS = (64, 256)
DECODE_TOKENS = 33  # per decode point: 32 steps after the prefill's
TOGETHER = ((1, 64), (4, 64), (8, 256))  # (batch, context) decoded beside the other server decoding as many
NEIGHBOUR_TOKENS = 4 * DECODE_TOKENS  # the other server's answers: four times a point's, so it decodes through the point
NEIGHBOUR_LEAD_S = 0.05  # its prefill done before the point's requests go
SPIN_WINDOW_S = 0.1  # a few of /proc's 10 ms ticks
SPIN_WATCH_S = 3.0  # vLLM's reader busy-polls 1 s after its last read
CONNECTOR_PROMPTS = (64, 128, 256, 448)
BIND = "VLLM_CPU_OMP_THREADS_BIND"
GAPS_RECORDED_S = 0.05  # the API server records a batch's gaps just after it streams their tokens out
STALL_REQUESTS = 48  # per stream: twice a bench serve phase's requests
STALL_RATE_PER_S = 4.0  # bench serve's default rate
STALL_PROMPT = 128
STALL_TOKENS = 16  # bench serve's answers
MAX_MODEL_LEN = 1024  # the longest point (640 tokens) and its answer fit
KV_BLOCKS = 160  # every point's blocks at once (8 x 289 tokens; 640 and a cached 512), and vLLM's null block


@dataclass(frozen=True)
class EngineSteps:
    """What was measured and what was fitted.

    Attributes:
        prefill_points: ``(new, cached, seconds)``.
        decode_points: ``(batch, held tokens, seconds per step)``.
        connector_points: ``(prompt tokens, TTFT of a new prompt and TTFT of it sent again, on the
            connector's server)``.
        together_points: ``(batch, held tokens, seconds per step alone, beside the other server
            decoding, just after it answered (its worker spinning))``.
        pool_points: ``(blocks, seconds)``: a load from the pool on the connector's server, as the
            cache's own time counts it, just after the other server stored those blocks.
        spin_points: seconds the plain server's processes kept half a CPU or more busy after a request.
        stall_alone: times to first token of a steady stream of requests to the plain server alone.
        connector_alone: the same of a stream to the connector's server alone.
        stall_beside: the same of a stream taking turns between the connector's server and the
            other half's, one sequence per server, and with a pool, of the connector's server's
            answers to prompts the other computed first.
    """

    prefill: PrefillFit
    decode: DecodeFit
    connector: ConnectorFit
    prefill_points: tuple[tuple[int, int, float], ...]
    decode_points: tuple[tuple[int, int, float], ...]
    connector_points: tuple[tuple[int, float, float], ...]
    together_points: tuple[tuple[int, int, float, float, float], ...]
    spin_points: tuple[float, ...]
    pool_points: tuple[tuple[int, float], ...] = ()
    stalls: Stalls = Stalls()
    stall_alone: tuple[float, ...] = ()
    stall_beside: tuple[tuple[float, ...], ...] = ()
    connector_alone: tuple[float, ...] = ()

    @property
    def misfit(self) -> dict[str, float]:
        """How far the points lie from their fit: the median of ``|fit - point| / point``, for the
        prefill and the decode points. A host busy with other work while they were measured
        shows here (a fit with no fixed cost, points 50% away), before a profile made of them
        puts every replay off."""
        return {"prefill": _misfit([(self.prefill.seconds(n, c), t) for n, c, t in self.prefill_points]),
                "decode": _misfit([(self.decode.step_s(b, held), t) for b, held, t in self.decode_points])}


def measure_vllm_steps(model_dir: str | Path, log_dir: Path, restore_s: Callable[[int], float],
                       store_s: Callable[[int], float], dtype: str = "float32", block_size: int = 32,
                       repeats: int = 3, seed: int = 0, cpus: tuple[str, str] | None = None,
                       pool_file: Path | None = None, remote_restore_s: Callable[[int], float] | None = None
                       ) -> EngineSteps:
    """Start the three servers on the model in ``model_dir`` (their logs in ``log_dir``), measure
    and fit (see the module text), stop them.

    Args:
        restore_s, store_s: the cache's own restore of so many blocks from its host tier, and its
            store of so many blocks down every tier the connector's server has (from the path
            calibration), taken out of the connector's cost.
        cpus: the two halves of the host's CPUs (vLLM's CPU lists, e.g. ``("0", "1")``): the plain
            and the connector's server are bound to the first, the other server to the second, as
            ``bench serve`` binds its servers; None: vLLM's own binding.
        pool_file: the pool the connector servers store in too (a pool TOML or ``pool.json``);
            None: device, host and disk tiers only. ``bench serve``'s kvstrata server has all four.
        remote_restore_s: with a pool, the cache's own restore of so many blocks from it (from the
            path calibration), taken out of a load from the pool as served.

    Raises:
        ValueError: ``repeats`` < 1.
        ServerFailed: a server did not start (its log's tail in the message).
    """
    from kvstrata.calibrate.serving.host import model_facts
    from kvstrata.calibrate.serving.client import Endpoint
    from kvstrata.calibrate.serving.servers import Instance
    from kvstrata.integrations.vllm.server import VllmServer, start_together

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    facts = model_facts(Path(model_dir), dtype)
    specs = server_specs(model_dir, log_dir, facts.bytes_per_token * block_size, dtype, block_size, cpus, pool_file)
    with ExitStack() as stack:
        plain, ours, other = servers = [VllmServer(spec, log_dir / f"vllm-serve-{name}.log")
                                        for name, spec in zip(("plain", "connector", "other-half"), specs, strict=True)]
        for server in servers:
            stack.callback(server.stop)
        start_together(servers)
        endpoints = (Endpoint(Instance.BASELINE, plain.base_url, plain.spec.model),
                     Endpoint(Instance.OURS, ours.base_url, ours.spec.model),
                     Endpoint(Instance.SECOND, other.base_url, other.spec.model))
        raw = asyncio.run(_measure(endpoints, _Prompts(facts.vocab, seed), repeats, plain.cpu_seconds,
                                   lambda: engine_gaps(plain.metrics_text()),
                                   (lambda: cache_loads(ours.metrics_text())) if pool_file is not None else None,
                                   block_size))
    prefill_points, decode_points, connector_points, together_points, spin_points, pool_points, streams = raw
    alone, paced, beside = streams
    prefill = fit_prefill(prefill_points)
    try:
        decode = fit_decode(decode_points)
    except ValueError:  # no step grew with the batch, within this host's noise: a step is a step
        decode = DecodeFit(statistics.median(t for _, _, t in decode_points), 0.0)
    # against the fit, not the one point measured alone: a point can be a burst (a client starved
    # for a moment reads every token at once), and a ratio to it would be any number
    decode = dataclasses.replace(decode, together=_stretch(decode, [(b, held, t) for b, held, _, t, _ in together_points]),
                                 beside_spin=_stretch(decode, [(b, held, t) for b, held, _, _, t in together_points]),
                                 spin_s=statistics.median(spin_points) if spin_points else 0.0)
    connector = connector_fit(alone, paced, connector_points, prefill, restore_s, store_s, block_size, STALL_PROMPT)
    if pool_points and remote_restore_s is not None:
        connector = dataclasses.replace(connector, remote_load_s=remote_load_fit(pool_points, remote_restore_s))
    stalls = Stalls(*fit_stalls([alone, paced]), *fit_stalls(beside))
    return EngineSteps(prefill, decode, connector, tuple(prefill_points), tuple(decode_points),
                       tuple(connector_points), tuple(together_points), tuple(spin_points), tuple(pool_points),
                       stalls, tuple(alone), tuple(tuple(t) for t in beside), tuple(paced))


def server_specs(model_dir: str | Path, log_dir: Path, block_bytes: int, dtype: str, block_size: int,
                 cpus: tuple[str, str] | None, pool_file: Path | None) -> tuple[ServerSpec, ServerSpec, ServerSpec]:
    """The plain server's, the connector's server's (both on ``cpus[0]``) and the other half's
    server's (on ``cpus[1]``, with the connector too) specs; see :func:`measure_vllm_steps`."""
    from kvstrata.integrations.vllm.server import ServerSpec

    model_id = f"calibrate-{uuid.uuid4().hex[:8]}"  # both connector servers': one's stores are the other's hits

    def spec(half: int, connector: bool) -> ServerSpec:
        env = {BIND: cpus[half]} if cpus else {}
        extra = None
        if connector:  # the tiers of bench serve's kvstrata server
            extra = {"device_bytes": KV_BLOCKS * block_bytes, "host_bytes": 64 << 20,
                     "disk_dir": str(log_dir / f"disk-{half}"), "disk_bytes": 256 << 20}
            if pool_file is not None:
                extra |= {"pool": str(pool_file), "remote_bytes": 128 << 20, "model_id": model_id}
        return ServerSpec(str(model_dir), kv_blocks=KV_BLOCKS, block_size=block_size, max_model_len=MAX_MODEL_LEN,
                          max_num_seqs=max(DECODE_BATCHES), dtype=dtype, env=env, prefix_caching=not connector,
                          connector=extra)

    return spec(0, False), spec(0, True), spec(1, True)


async def _measure(endpoints, prompts: _Prompts, repeats: int, cpu_seconds: Callable[[], float | None],
                   gaps: Callable[[], tuple[float, int]], loads: Callable[[], tuple[float, int, int]] | None,
                   block_size: int):
    from kvstrata.calibrate.serving.host import wait_quiet
    from kvstrata.calibrate.serving.client import Clients, complete

    async def quiet() -> None:
        await asyncio.to_thread(wait_quiet)

    clients = Clients()
    plain, ours, other = endpoints

    async def ttft(endpoint, prompt: list[int]) -> float:
        return (await complete(clients(endpoint), endpoint, prompt, 1, 0, 0, 0.0)).ttft_s

    async def after(prefix: list[int], new: list[int]) -> float:
        await ttft(plain, prefix)  # untimed: vLLM's prefix cache now holds the prefix's blocks
        return await ttft(plain, prefix + new)

    async def engine_step(batch: list[list[int]]) -> float:
        """The time between the tokens of ``batch`` on the plain server: the larger of the median
        gap the client read and the mean gap the engine stamped (see the module text)."""
        before = await asyncio.to_thread(gaps)
        done = await asyncio.gather(*(complete(clients(plain), plain, p, DECODE_TOKENS, i, 0, 0.0)
                                      for i, p in enumerate(batch)))
        await asyncio.sleep(GAPS_RECORDED_S)
        after = await asyncio.to_thread(gaps)
        count = after[1] - before[1]
        client = statistics.median(r.tpot_s for r in done)
        return max(client, (after[0] - before[0]) / count) if count > 0 else client

    async def beside_spinning(b: int, ctx: int) -> float:
        """The plain server's step just after the other half's server answered: its worker spins."""
        await ttft(other, prompts.new(ctx))
        return await engine_step([prompts.new(ctx) for _ in range(b)])

    async def beside(b: int, ctx: int) -> float:
        """The plain server's step while the other half's server decodes a batch of its own,
        started first and longer than the point, so that it steps throughout."""
        await ttft(other, prompts.new(ctx))  # its worker warm
        busy = asyncio.gather(*(complete(clients(other), other, prompts.new(ctx), NEIGHBOUR_TOKENS, i, 0, 0.0)
                                for i in range(b)))
        try:
            await asyncio.sleep(NEIGHBOUR_LEAD_S)
            return await engine_step([prompts.new(ctx) for _ in range(b)])
        finally:
            await busy

    async def spin() -> float | None:
        """How long the plain server keeps half a CPU or more busy after a request (None: no /proc)."""
        await ttft(plain, prompts.new(64))
        end = last_t = time.perf_counter()
        last, busy = cpu_seconds(), 0.0
        while last_t - end < SPIN_WATCH_S:
            await asyncio.sleep(SPIN_WINDOW_S)
            now_t, now = time.perf_counter(), cpu_seconds()
            if last is None or now is None:
                return None
            if (now - last) / (now_t - last_t) >= 0.5:
                busy = now_t - end
            last, last_t = now, now_t
        return busy

    async def stream(targets, handoff: bool = False) -> list[list[float]]:
        """``STALL_REQUESTS`` new prompts at ``STALL_RATE_PER_S``, taking turns among ``targets``
        (each sent at its slot, whether the last is back or not): each target's times to first
        token. ``handoff``: each prompt computed on ``targets[0]`` first (one token, stored in the
        pool), then answered by ``targets[1]``, as ``bench serve``'s P/D pair does: the answers'."""
        batch = [prompts.new(STALL_PROMPT) for _ in range(STALL_REQUESTS)]
        start = time.perf_counter()

        async def one(i: int) -> float:
            await asyncio.sleep(max(0.0, start + i / STALL_RATE_PER_S - time.perf_counter()))
            if handoff:
                await complete(clients(targets[0]), targets[0], batch[i], 1, i, 0, 0.0)
            endpoint = targets[1] if handoff else targets[i % len(targets)]
            return (await complete(clients(endpoint), endpoint, batch[i], STALL_TOKENS, i, 0, 0.0)).ttft_s

        done = await asyncio.gather(*(one(i) for i in range(STALL_REQUESTS)))
        return [done] if handoff else [done[k::len(targets)] for k in range(len(targets))]

    async def paired(n: int) -> tuple[float, float]:
        """A new prompt's TTFT on the connector's server (on a quiet host: not beside the plain
        server's spinning worker), and that prompt's again."""
        await quiet()
        prompt = prompts.new(n)
        return await ttft(ours, prompt), await ttft(ours, prompt)

    async def from_pool(n: int) -> tuple[int, float] | None:
        """A new prompt computed and stored by the other half's server, then sent to the
        connector's server (the other's worker still spinning): its load from the pool, as the
        cache's own time counts it (None: it did not load from the pool alone)."""
        prompt = prompts.new(n)
        await quiet()
        await ttft(other, prompt)
        before = await asyncio.to_thread(loads)
        await ttft(ours, prompt)
        after = await asyncio.to_thread(loads)
        count, remote = after[1] - before[1], after[2] - before[2]
        return (remote, after[0] - before[0]) if count == 1 and remote == (n - 1) // block_size else None

    try:
        await quiet()  # the servers start together: the others' start-up work done before the first point
        prefill = [(n, 0, await _median(lambda n=n: ttft(plain, prompts.new(n)), repeats)) for n in PREFILL_NEW]
        for c, n in PREFILL_CACHED:
            prefill.append((n, c, await _median(lambda c=c, n=n: after(prompts.new(c), prompts.new(n)), repeats)))
        decode = []
        for ctx in DECODE_CONTEXTS:
            for b in DECODE_BATCHES:
                seconds = await _median(lambda b=b, ctx=ctx: engine_step([prompts.new(ctx) for _ in range(b)]), repeats)
                decode.append((b, b * (ctx + DECODE_TOKENS // 2), seconds))
        await quiet()  # the plain server's worker spins on the CPUs the connector's server runs on
        connector = []
        for i in range(repeats + 1):
            for n in CONNECTOR_PROMPTS:
                miss, hit = await paired(n)
                if i:  # the first round warms the connector's paths up
                    connector.append((n, miss, hit))
        await quiet()  # now the connector's server's
        together = []
        for b, ctx in TOGETHER:
            alone = next(t for bb, held, t in decode if bb == b and held == b * (ctx + DECODE_TOKENS // 2))
            stepping = await _median(lambda b=b, ctx=ctx: beside(b, ctx), repeats)
            await quiet()
            spinning = await _median(lambda b=b, ctx=ctx: beside_spinning(b, ctx), repeats)
            together.append((b, b * (ctx + DECODE_TOKENS // 2), alone, stepping, spinning))
            await quiet()
        pool = []
        if loads is not None:
            for i in range(repeats + 1):
                for n in CONNECTOR_PROMPTS:
                    point = await from_pool(n)
                    if i and point is not None:  # the first round warms the pool's paths up
                        pool.append(point)
        await quiet()
        alone = (await stream([plain]))[0]
        await quiet()
        paced = (await stream([ours]))[0]  # at bench serve's pace: the connector's cost per request
        await quiet()
        beside = await stream([ours, other])  # as bench serve's two servers on one pool take turns
        if loads is not None:  # and as its P/D pair hands prompts over through the pool
            await quiet()
            beside += await stream([other, ours], handoff=True)
        await quiet()
        spins = [s for s in [await spin() for _ in range(repeats)] if s is not None]
    finally:
        await clients.close()
    return prefill, decode, connector, together, spins, pool, (alone, paced, beside)


def _stretch(decode: DecodeFit, points: Sequence[tuple[int, int, float]]) -> float:
    """The median of steps measured beside the other server over the fit's (at least 1)."""
    return max(1.0, statistics.median(t / decode.step_s(b, held) for b, held, t in points))


def _misfit(pairs: Sequence[tuple[float, float]]) -> float:
    return statistics.median(abs(fit - t) / t for fit, t in pairs) if pairs else 0.0


class _Prompts:
    """Seeded random token ids, every prompt new (its first block unlike any other's)."""

    FIRST = 16  # ids below are left out: tokenizers put their special tokens first

    def __init__(self, vocab: int, seed: int) -> None:
        self._rng = np.random.default_rng(seed)
        self._vocab = vocab

    def new(self, n: int) -> list[int]:
        return self._rng.integers(self.FIRST, self._vocab, size=n).tolist()


async def _median(measure: Callable[[], Awaitable[float]], repeats: int) -> float:
    await measure()  # warm-up
    return statistics.median([await measure() for _ in range(repeats)])
