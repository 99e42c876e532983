"""A transformers model's prefill time on this host, measured and fitted (:class:`PrefillFit`).

The load-or-recompute decision (:mod:`kvstrata.plan.recompute`) weighs loading a cached prefix
against computing it; the compute side is this measurement. Prefill is timed as
:class:`~kvstrata.integrations.hf.KVStrataLM` runs it (one forward, ``use_cache=True``, the last
position's logits only), on seeded random token ids, at several prompt sizes from scratch and
at some sizes after a cached prefix (the attention term), each after one warm-up, the median of
``repeats``; then fitted with :func:`~kvstrata.plan.host.fit_prefill` (on relative error: see
there why).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from kvstrata.integrations.hf.cache import cache_arg
from kvstrata.plan.host import PrefillFit, fit_prefill

DEFAULT_SIZES = (128, 512, 1024, 2048, 4096)  # new tokens, nothing cached
DEFAULT_CACHED = (1024, 4096)  # cached-prefix sizes, each with CACHED_NEW new tokens
CACHED_NEW = (64, 512)


def measure_prefill(
    model: Any,
    sizes: Sequence[int] = DEFAULT_SIZES,
    cached: Sequence[int] = DEFAULT_CACHED,
    repeats: int = 3,
    seed: int = 0,
) -> PrefillFit:
    """Fit ``model``'s prefill seconds on this host.

    Args:
        model: a transformers causal LM (on its device, in eval mode).
        sizes: prompt sizes (new tokens) timed with nothing cached; at least 2 distinct.
        cached: cached-prefix sizes; after each, ``CACHED_NEW`` new tokens are timed.
        repeats: timed runs per point after one warm-up (the median is kept), >= 1.
        seed: for the random token ids.

    Raises:
        ValueError: sizes out of range (non-positive, beyond the model's positions).
    """
    return fit_prefill(prefill_points(model, sizes, cached, repeats, seed))


def prefill_points(
    model: Any, sizes: Sequence[int], cached: Sequence[int], repeats: int = 3, seed: int = 0
) -> list[tuple[int, int, float]]:
    """The measured ``(new_tokens, cached_tokens, median seconds)`` points of :func:`measure_prefill`."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if len(set(sizes)) < 2:
        raise ValueError(f"prefill sizes need at least 2 distinct values, got {list(sizes)}")
    points = [(n, 0) for n in sizes] + [(n, c) for c in cached for n in CACHED_NEW]
    limit = getattr(model.config, "max_position_embeddings", None)
    for n, c in points:
        if n <= 0 or c < 0:
            raise ValueError(f"prefill sizes must be positive, got {n} new after {c} cached")
        if limit is not None and n + c > limit:
            raise ValueError(f"prefill of {n} new after {c} cached exceeds the model's {limit} positions")
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    arg = cache_arg(model)
    out = []
    with torch.inference_mode():
        for n, c in points:
            ids = torch.randint(0, vocab, (1, c + n), generator=generator).to(device)
            past = DynamicCache()
            if c:
                model(input_ids=ids[:, :c], **{arg: past}, use_cache=True, logits_to_keep=1)
            times = []
            for i in range(repeats + 1):  # the first is the warm-up
                start = time.perf_counter()
                logits = model(input_ids=ids[:, c:], **{arg: past}, use_cache=True, logits_to_keep=1).logits
                logits[0, -1].float().cpu()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i:
                    times.append(time.perf_counter() - start)
                past.crop(-n)  # back to the cached prefix alone
            out.append((n, c, statistics.median(times)))
    return out
