"""vLLM's prefill and decode step times for a model on this host, measured as a client of
``vllm serve`` sees them.

The simulator's time model for a GPU comes from its datasheet (:mod:`kvstrata.sim.model`); for
the engine this host actually serves with, it is fitted to what that engine shows
(``kvstrata calibrate --model-dir DIR --engine vllm``). Everything goes through a ``vllm serve``
process set up as ``bench serve`` sets its servers up (prefix caching on, eager, its compute bound
to the CPUs given) and ``bench serve``'s own streaming client, on seeded random token ids, each
prompt new unless a point needs a cached prefix:

- prefill of ``n`` new tokens: one prompt, one token asked for, its time to first token; after a
  cached prefix of ``c`` tokens, that prefix is asked first, untimed, so vLLM's prefix cache holds
  it (``c`` a whole number of blocks);
- a decode step of ``b`` requests of ``ctx`` tokens: ``b`` prompts sent at once, ``T`` tokens each,
  the median over them of the time between tokens (first to last over ``T - 1``); the batch then
  holds ``b * (ctx + T / 2)`` tokens on average.

So the fits hold what serving adds to the engine's own work (the HTTP server, the hand-off to
the engine, streaming each token back, the client's reading it), as ``bench serve`` measures.
While the decode points run, the host's CPUs busy (``/proc/stat``) are measured too: what one
serving server (and its client) keeps busy, which the simulator needs where servers and kvstrata's
stores share few CPUs.
Each point is the median of ``repeats`` after one warm-up, fitted with
:func:`kvstrata.plan.host.fit_prefill` and :func:`kvstrata.plan.steps.fit_decode`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import statistics
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstrata.plan.host import PrefillFit, fit_prefill
from kvstrata.plan.steps import ConnectorFit, DecodeFit, fit_decode

PREFILL_NEW = (32, 64, 128, 256, 512)
PREFILL_CACHED = ((256, 32), (256, 128), (512, 32), (512, 128))  # (cached, new)
DECODE_BATCHES = (1, 2, 4, 8)
DECODE_CONTEXTS = (64, 256)
BIND = "VLLM_CPU_OMP_THREADS_BIND"
DECODE_TOKENS = 33  # per decode point: 32 steps after the prefill's
MAX_MODEL_LEN = 1024  # the longest point (640 tokens) and its answer fit
KV_BLOCKS = 160  # every point's blocks at once (8 x 289 tokens; 640 and a cached 512), and vLLM's null block


@dataclass(frozen=True)
class EngineSteps:
    """What was measured and what was fitted.

    Attributes:
        prefill_points: ``(new, cached, seconds)``.
        decode_points: ``(batch, held tokens, seconds per step)``.
    """

    prefill: PrefillFit
    decode: DecodeFit
    prefill_points: tuple[tuple[int, int, float], ...]
    decode_points: tuple[tuple[int, int, float], ...]


def measure_vllm_steps(model_dir: str | Path, log_path: Path, dtype: str = "float32", block_size: int = 32,
                       repeats: int = 3, seed: int = 0, cpus: str | None = None) -> EngineSteps:
    """Start ``vllm serve`` on the model in ``model_dir`` (its log to ``log_path``), measure and fit
    its steps, stop it. ``cpus``: bind its compute to these CPUs (vLLM's CPU list, e.g. ``"0"``),
    as ``bench serve`` binds each server to half the host's (None: vLLM's own binding).

    Raises:
        ValueError: ``repeats`` < 1.
        ServerFailed: the server did not start (its log's tail in the message).
    """
    from kvstrata.bench.serve_client import Endpoint
    from kvstrata.bench.serve_config import Instance
    from kvstrata.integrations.vllm.server import ServerSpec, VllmServer

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    spec = ServerSpec(str(model_dir), kv_blocks=KV_BLOCKS, block_size=block_size, max_model_len=MAX_MODEL_LEN,
                      max_num_seqs=max(DECODE_BATCHES), dtype=dtype, env={BIND: cpus} if cpus else {})
    with VllmServer(spec, log_path) as server:
        endpoint = Endpoint(Instance.BASELINE, server.base_url, spec.model)
        vocab = _vocab(model_dir)
        return asyncio.run(_measure(endpoint, _Prompts(vocab, seed), repeats))


async def _measure(endpoint, prompts: _Prompts, repeats: int) -> EngineSteps:
    from kvstrata.bench.serve_client import Clients, complete

    clients = Clients()
    client = clients(endpoint)

    async def ttft(prompt: list[int]) -> float:
        return (await complete(client, endpoint, prompt, 1, 0, 0, 0.0)).ttft_s

    async def after(prefix: list[int], new: list[int]) -> float:
        await ttft(prefix)  # untimed: vLLM's prefix cache now holds the prefix's blocks
        return await ttft(prefix + new)

    busy: list[float] = []

    async def step(batch: list[list[int]]) -> float:
        before = _cpu_ticks()
        done = await asyncio.gather(*(complete(client, endpoint, p, DECODE_TOKENS, i, 0, 0.0) for i, p in enumerate(batch)))
        after = _cpu_ticks()
        if before is not None and after is not None and after[1] > before[1]:
            busy.append((after[0] - before[0]) / (after[1] - before[1]) * os.cpu_count())
        return statistics.median(r.tpot_s for r in done)

    try:
        prefill = [(n, 0, await _median(lambda n=n: ttft(prompts.new(n)), repeats)) for n in PREFILL_NEW]
        for c, n in PREFILL_CACHED:
            prefill.append((n, c, await _median(lambda c=c, n=n: after(prompts.new(c), prompts.new(n)), repeats)))
        decode = []
        for ctx in DECODE_CONTEXTS:
            for b in DECODE_BATCHES:
                seconds = await _median(lambda b=b, ctx=ctx: step([prompts.new(ctx) for _ in range(b)]), repeats)
                decode.append((b, b * (ctx + DECODE_TOKENS // 2), seconds))
    finally:
        await clients.close()
    fit = fit_decode(decode)
    if busy:
        fit = dataclasses.replace(fit, busy_cpus=statistics.median(busy), cpus=os.cpu_count() or 0)
    return EngineSteps(fit_prefill(prefill), fit, tuple(prefill), tuple(decode))


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, all) ticks of every CPU so far, from ``/proc/stat``; None where there is none.
    Busy: user, nice, system, irq, softirq; all: those and idle and iowait (a VM's steal, time
    the hypervisor gave others, is neither: this host's own work is what is asked)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 7:
        return None
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6]
    return busy, busy + fields[3] + fields[4]


CONNECTOR_PROMPTS = (64, 128, 256, 448)


def measure_connector(model_dir: str | Path, log_path: Path, prefill: PrefillFit, restore_s: Callable[[int], float],
                      store_s: Callable[[int], float], dtype: str = "float32", block_size: int = 32, repeats: int = 3,
                      seed: int = 1, cpus: str | None = None) -> ConnectorFit:
    """What the KVStrata connector adds to a served request: ``vllm serve`` with the connector (a
    host tier, vLLM's own prefix cache off, so a prompt sent again is served by kvstrata alone),
    bound as :func:`measure_vllm_steps` binds its server.

    For each prompt size: a new prompt (a lookup that misses, the prompt computed, its blocks
    stored), then the same prompt again (a hit of every full block short of the last token,
    loaded, the rest computed). Against ``prefill`` (the server without the connector):
    ``request_s`` is the median of what the new prompts took beyond the prefill and their store
    (``store_s`` of their blocks); ``load_s`` what the repeats took beyond the prefill of what
    was left, ``request_s`` and the restore (``restore_s`` of their blocks). Both at least 0.
    """
    from kvstrata.bench.serve import model_facts
    from kvstrata.bench.serve_client import Endpoint
    from kvstrata.bench.serve_config import Instance
    from kvstrata.integrations.vllm.server import ServerSpec, VllmServer

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    facts = model_facts(Path(model_dir), dtype)
    block_bytes = facts.bytes_per_token * block_size
    spec = ServerSpec(str(model_dir), kv_blocks=KV_BLOCKS, block_size=block_size, max_model_len=MAX_MODEL_LEN,
                      max_num_seqs=max(DECODE_BATCHES), dtype=dtype, env={BIND: cpus} if cpus else {},
                      prefix_caching=False, connector={"device_bytes": KV_BLOCKS * block_bytes, "host_bytes": 64 << 20})
    with VllmServer(spec, log_path) as server:
        endpoint = Endpoint(Instance.OURS, server.base_url, spec.model)
        pairs = asyncio.run(_miss_then_hit(endpoint, _Prompts(facts.vocab, seed), repeats))
    bt = block_size
    request = statistics.median(miss - prefill.seconds(n) - store_s(n // bt) for n, miss, _ in pairs)
    request = max(0.0, request)
    load = statistics.median(hit - prefill.seconds(n - (n - 1) // bt * bt, (n - 1) // bt * bt) - request
                             - restore_s((n - 1) // bt) for n, _, hit in pairs)
    return ConnectorFit(request, max(0.0, load))


async def _miss_then_hit(endpoint, prompts: _Prompts, repeats: int) -> list[tuple[int, float, float]]:
    """(prompt tokens, TTFT new, TTFT sent again) per prompt size and repeat, after a warm-up."""
    from kvstrata.bench.serve_client import Clients, complete

    clients = Clients()
    client = clients(endpoint)

    async def ttft(prompt: list[int]) -> float:
        return (await complete(client, endpoint, prompt, 1, 0, 0, 0.0)).ttft_s

    out = []
    try:
        for i in range(repeats + 1):
            for n in CONNECTOR_PROMPTS:
                prompt = prompts.new(n)
                miss, hit = await ttft(prompt), await ttft(prompt)
                if i:  # the first round warms the connector's paths up
                    out.append((n, miss, hit))
    finally:
        await clients.close()
    return out


def _vocab(model_dir: str | Path) -> int:
    from kvstrata.bench.serve import model_facts

    return model_facts(Path(model_dir), "float32").vocab


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
