"""vLLM's prefill and decode step times for a model on this host, measured through vLLM itself.

The simulator's time model for a GPU comes from its datasheet (:mod:`kvstrata.sim.model`); for
the engine this host actually serves with, it is fitted to what that engine shows
(``kvstrata calibrate --model-dir DIR --engine vllm``). Everything goes through vLLM's ``LLM``
(its scheduler, worker and sampler, prefix caching on as a server runs it), on seeded random
token ids, each prompt new unless a point needs a cached prefix:

- prefill of ``n`` new tokens: one prompt, one token generated (the prefill's own), timed from the
  call to its return; after a cached prefix of ``c`` tokens, that prefix is generated first,
  untimed, so vLLM's prefix cache holds it (``c`` a whole number of blocks);
- a decode step of ``b`` requests of ``ctx`` tokens: ``b`` prompts generating ``T`` tokens, less
  ``b`` other prompts of the same length generating one, over ``T - 1`` steps; the batch then holds
  ``b * (ctx + T / 2)`` tokens on average.

Each point is the median of ``repeats`` after one warm-up, fitted with
:func:`kvstrata.plan.host.fit_prefill` and :func:`kvstrata.plan.steps.fit_decode`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvstrata.plan.host import PrefillFit, fit_prefill
from kvstrata.plan.steps import DecodeFit, fit_decode

PREFILL_NEW = (32, 64, 128, 256, 512)
PREFILL_CACHED = ((256, 32), (256, 128), (512, 32), (512, 128))  # (cached, new)
DECODE_BATCHES = (1, 2, 4, 8)
DECODE_CONTEXTS = (64, 256)
DECODE_TOKENS = 33  # per decode point: 32 steps after the prefill's (a difference of two calls: more steps, less noise)


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


def measure_vllm_steps(model_dir: str | Path, dtype: str = "float32", block_size: int = 32, repeats: int = 3,
                       seed: int = 0, llm: Any = None) -> EngineSteps:
    """Measure and fit vLLM's steps for the model in ``model_dir`` (an ``LLM`` made here unless
    one is given: prefix caching on, eager, ``block_size`` tokens a block).

    Raises:
        ValueError: ``repeats`` < 1, or a point beyond the model's positions.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if llm is None:
        llm = _engine(str(model_dir), dtype, block_size)
    config = llm.llm_engine.model_config
    limit = config.max_model_len
    need = max([n for n in PREFILL_NEW] + [c + n for c, n in PREFILL_CACHED] + [c + DECODE_TOKENS for c in DECODE_CONTEXTS])
    if need > limit:
        raise ValueError(f"vLLM steps: points up to {need} tokens exceed the model's {limit}")
    prompts = _Prompts(config.get_vocab_size(), seed)
    run = _Runner(llm)
    prefill = [(n, 0, _median(lambda: run.prefill_s(prompts.new(n)), repeats)) for n in PREFILL_NEW]
    for c, n in PREFILL_CACHED:
        prefill.append((n, c, _median(lambda c=c, n=n: run.prefill_after_s(prompts.new(c), prompts.new(n)), repeats)))
    decode = []
    for ctx in DECODE_CONTEXTS:
        for b in DECODE_BATCHES:
            step = _median(lambda b=b, ctx=ctx: run.decode_step_s([prompts.new(ctx) for _ in range(b)],
                                                                  [prompts.new(ctx) for _ in range(b)]), repeats)
            decode.append((b, b * (ctx + DECODE_TOKENS // 2), step))
    return EngineSteps(fit_prefill(prefill), fit_decode(decode), tuple(prefill), tuple(decode))


def _engine(model_dir: str, dtype: str, block_size: int) -> Any:
    from vllm import LLM

    return LLM(model=model_dir, dtype=dtype, enforce_eager=True, block_size=block_size, enable_prefix_caching=True,
               kv_cache_memory_bytes=256 * 1024**2, max_num_seqs=max(DECODE_BATCHES), seed=0)


class _Prompts:
    """Seeded random token ids, every prompt new (its first block unlike any other's)."""

    def __init__(self, vocab: int, seed: int) -> None:
        self._rng = np.random.default_rng(seed)
        self._vocab = vocab

    def new(self, n: int) -> list[int]:
        return self._rng.integers(0, self._vocab, size=n).tolist()


class _Runner:
    def __init__(self, llm: Any) -> None:
        from vllm import SamplingParams

        self._llm = llm
        self._params = {t: SamplingParams(temperature=0.0, max_tokens=t, ignore_eos=True) for t in (1, DECODE_TOKENS)}

    def _generate_s(self, prompts: list[list[int]], tokens: int) -> float:
        start = time.perf_counter()
        self._llm.generate([{"prompt_token_ids": p} for p in prompts], self._params[tokens], use_tqdm=False)
        return time.perf_counter() - start

    def prefill_s(self, prompt: list[int]) -> float:
        return self._generate_s([prompt], 1)

    def prefill_after_s(self, prefix: list[int], new: list[int]) -> float:
        self._generate_s([prefix], 1)  # untimed: vLLM's prefix cache now holds the prefix's blocks
        return self._generate_s([prefix + new], 1)

    def decode_step_s(self, decoding: list[list[int]], prefilling: list[list[int]]) -> float:
        """Seconds per step of ``decoding`` generating ``DECODE_TOKENS``, less ``prefilling`` (as
        long) generating one: the prefill and the call's fixed costs cancel."""
        full = self._generate_s(decoding, DECODE_TOKENS)
        first = self._generate_s(prefilling, 1)
        return max(full - first, 1e-9) / (DECODE_TOKENS - 1)


def _median(measure: Callable[[], float], repeats: int) -> float:
    measure()  # warm-up
    return statistics.median(measure() for _ in range(repeats))

