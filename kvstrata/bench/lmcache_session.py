"""LMCache turn by turn on a real transformers model: one model and one LMCache engine per tier
(:class:`~kvstrata.bench.lmcache_tier.LMCacheTier`), given prompts one at a time.

On each prompt (each extends an earlier prompt, or shares a system prompt with one):

1. cold: greedy decoding with Hugging Face (a fresh ``DynamicCache``) from scratch; TTFT is the
   prefill of the whole prompt up to the first token's argmax.
2. warm, per tier: a fresh ``DynamicCache``; LMCache's ``lookup`` gives the longest stored
   prefix, ``retrieve`` copies it into a KV buffer ``[layers, kv, tokens, kv_heads, head_dim]``,
   each layer is put into the cache (``[batch, kv_heads, tokens, head_dim]``), and only the rest
   of the prompt is prefilled (positions follow from the cache's length). TTFT = lookup +
   retrieve + cache fill + suffix prefill up to the first token's argmax. The same number of
   tokens is decoded greedily and compared with the cold run's.
3. then, untimed, the prompt's KV (its full chunks, as the cold prefill computed it) is stored
   into LMCache with ``store``; later prompts hit it.

So a prompt hits only what earlier prompts stored (an earlier turn of its conversation, or
another conversation's shared system prompt), never its own KV. torch, transformers and LMCache
are imported when a session is made: this module imports in a venv without them.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from kvstrata.bench.lmcache_tier import TIERS, LMCacheTier


def _quiet_lmcache() -> None:
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")


def _layout_of(model: Any, chunk_tokens: int) -> Any:
    from kvstrata.kv.geometry import DType
    from kvstrata.kv.layout import KVLayout

    cfg = model.config.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    dtype = DType.parse(str(model.dtype))
    return KVLayout(cfg.num_hidden_layers, chunk_tokens, kv_heads, head_dim, dtype)


def _greedy(model: Any, cache: Any, input_ids: Any, max_new_tokens: int) -> tuple[list[int], float]:
    """Prefill ``input_ids`` on top of ``cache``, then decode greedily. Returns (generated ids,
    seconds from the call to the first token's argmax)."""
    from kvstrata.integrations.hf.cache import cache_arg

    kw = {cache_arg(model): cache, "use_cache": True, "logits_to_keep": 1}
    start = time.perf_counter()
    logits = model(input_ids, **kw).logits
    token = logits[:, -1].argmax(-1, keepdim=True)
    first_s = time.perf_counter() - start
    out = [int(token)]
    for _ in range(max_new_tokens - 1):
        logits = model(token, **kw).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        out.append(int(token))
    return out, first_s


def _kv_of(cache: Any, tokens: int) -> Any:
    """The first ``tokens`` of a DynamicCache as one ``[layers, kv, tokens, kv_heads, head_dim]``."""
    import torch

    layers = cache.layers
    first = layers[0].keys
    kv = torch.empty(len(layers), 2, tokens, first.shape[1], first.shape[3], dtype=first.dtype)
    for i, layer in enumerate(layers):
        kv[i, 0].copy_(layer.keys[0, :, :tokens].transpose(0, 1))
        kv[i, 1].copy_(layer.values[0, :, :tokens].transpose(0, 1))
    return kv


def _fill_cache(cache: Any, kv: Any) -> None:
    """Put ``kv`` ``[layers, kv, tokens, kv_heads, head_dim]`` into an empty DynamicCache."""
    for i in range(kv.shape[0]):
        keys = kv[i, 0].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, tokens, head_dim]
        values = kv[i, 1].transpose(0, 1).unsqueeze(0)
        cache.update(keys, values, i)


class LMCacheSession:
    """One model and one LMCache engine per tier, for turns given one at a time (see the module
    text): :meth:`turn` runs a prompt cold, then warm through each tier, then stores it.

    ``capacity_tokens`` sizes every engine (tokens of KV it must hold); ``repeats`` > 1 times
    each first token that many times and keeps the fastest.
    """

    def __init__(
        self, model_dir: str | os.PathLike[str], tiers: Iterable[str], capacity_tokens: int, chunk_tokens: int = 256,
        disk_dir: str | os.PathLike[str] | None = None, drop_page_cache: bool = True, repeats: int = 1,
    ) -> None:
        _quiet_lmcache()
        import torch
        from transformers import AutoModelForCausalLM, DynamicCache

        self.tiers = list(dict.fromkeys(tiers))
        for tier in self.tiers:
            if tier not in TIERS:
                raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        if not self.tiers:
            raise ValueError("no tier to run")
        if repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {repeats}")
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens
        self.repeats = repeats
        self.drop_page_cache = drop_page_cache
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir))
        self.model.eval()
        self.layout = _layout_of(self.model, chunk_tokens)
        self.token_bytes = self.layout.num_layers * self.layout.token_bytes
        self._owned_tmp = None
        if "disk" in self.tiers and disk_dir is None:
            self._owned_tmp = tempfile.TemporaryDirectory(prefix="kvstrata-lmcache-e2e-")
            disk_dir = self._owned_tmp.name
        tag = f"{int(time.time() * 1e6) % 10**9}"
        self.engines: dict[str, LMCacheTier] = {}
        try:
            for tier in self.tiers:
                directory = Path(disk_dir) / f"lmcache-{tag}" if tier == "disk" else None
                self.engines[tier] = LMCacheTier(tier, self.layout, max(capacity_tokens, 1) * self.token_bytes,
                                                 directory, drop_page_cache, tag)
            with torch.inference_mode():  # first-call overheads out of the first TTFT
                _greedy(self.model, DynamicCache(config=self.model.config), torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]]), 2)
        except BaseException:
            self.close()
            raise

    def turn(
        self, index: int, prompt: Sequence[int], max_new_tokens: int, tiers: Iterable[str] | None = None
    ) -> dict[str, dict[str, Any]]:
        """``prompt`` cold, then warm through each of ``tiers`` (None: every tier of the session),
        then stored into each: per tier the turn's figures (see :func:`_warm_turn`)."""
        import torch
        from transformers import DynamicCache

        engines = self.engines if tiers is None else {t: self._engine(t) for t in tiers}
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("a prompt must have at least one token")
        model, chunk = self.model, self.chunk_tokens
        out: dict[str, dict[str, Any]] = {}
        with torch.inference_mode():
            ids = torch.tensor([prompt], dtype=torch.long)
            tokens = ids[0]
            cache = DynamicCache(config=model.config)
            cold_ids, cold_s = _greedy(model, cache, ids, max_new_tokens)
            full = len(prompt) // chunk * chunk
            cold_kv = _kv_of(cache, full) if full else None
            del cache
            for _ in range(self.repeats - 1):  # timing only: the first token
                cold_s = min(cold_s, _greedy(model, DynamicCache(config=model.config), ids, 1)[1])
            for tier, engine in engines.items():
                turn = _warm_turn(model, engine, index, tokens, cold_ids, cold_s, cold_kv, max_new_tokens, self.layout)
                for _ in range(self.repeats - 1):
                    again = _warm_turn(model, engine, index, tokens, cold_ids[:1], cold_s, cold_kv, 1, self.layout)
                    turn["tokens_identical"] &= again["tokens_identical"]
                    for key in ("ttft_warm_s", "lookup_s", "retrieve_s", "suffix_prefill_s"):
                        turn[key] = min(turn[key], again[key])
                if full:
                    turn["store_s"] = engine.store(tokens[:full], cold_kv)
                out[tier] = turn
        return out

    def _engine(self, tier: str) -> LMCacheTier:
        if tier not in self.engines:
            raise ValueError(f"tier {tier!r} is not one of this session's: {', '.join(self.engines)}")
        return self.engines[tier]

    def about(self) -> dict[str, Any]:
        """What ran: versions, geometry, threads."""
        import importlib.metadata

        import torch

        return {
            "lmcache": importlib.metadata.version("lmcache"),
            "transformers": importlib.metadata.version("transformers"),
            "torch": torch.__version__,
            "chunk_tokens": self.chunk_tokens,
            "bytes_per_token": self.token_bytes,
            "repeats": self.repeats,
            "torch_threads": torch.get_num_threads(),
        }

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.engines = {}
        if self._owned_tmp is not None:
            self._owned_tmp.cleanup()
            self._owned_tmp = None


def _warm_turn(
    model: Any, engine: LMCacheTier, index: int, tokens: Any, cold_ids: list[int], cold_s: float, cold_kv: Any,
    max_new_tokens: int, layout: Any,
) -> dict[str, Any]:
    import torch
    from transformers import DynamicCache

    from kvstrata.timing import VerificationError

    n = len(tokens)
    # The restore buffer (the "GPU" KV the connector writes) is allocated and faulted in before
    # the clock starts, as a serving engine's KV memory is; its size is the prompt's full chunks.
    capacity = n // layout.block_tokens * layout.block_tokens
    buf = torch.zeros(layout.num_layers, 2, capacity, layout.kv_heads, layout.head_dim, dtype=cold_kv.dtype) \
        if cold_kv is not None else None
    engine.before_lookup(tokens)
    cache = DynamicCache(config=model.config)

    start = time.perf_counter()
    hit = engine.engine.lookup(tokens) if capacity else 0
    lookup_s = time.perf_counter() - start
    retrieve_s = 0.0
    if hit:
        view = buf[:, :, :hit]
        t0 = time.perf_counter()
        mask = engine.engine.retrieve(tokens[:hit], kvcaches=view)
        retrieve_s = time.perf_counter() - t0
        got = int(mask.sum())
        if got != hit:
            raise VerificationError(f"LMCache {engine.name} looked up {hit} tokens but retrieved {got}")
        # The whole prompt restored: its last token is still prefilled, for the first token's logits.
        _fill_cache(cache, view[:, :, : min(hit, n - 1)])
    suffix = tokens[cache.get_seq_length():].unsqueeze(0)
    setup_s = time.perf_counter() - start
    warm_ids, prefill_s = _greedy(model, cache, suffix, max_new_tokens)
    warm_s = setup_s + prefill_s

    # Restored KV against what this prompt's own cold prefill computed for the same tokens.
    kv_max_abs_diff = float((buf[:, :, :hit].float() - cold_kv[:, :, :hit].float()).abs().max()) if hit else 0.0
    return {
        "turn": index,
        "prompt_tokens": n,
        "hit_tokens": hit,
        "bytes_restored": hit * layout.num_layers * layout.token_bytes,
        "ttft_cold_s": cold_s,
        "ttft_warm_s": warm_s,
        "lookup_s": lookup_s,
        "retrieve_s": retrieve_s,
        "suffix_prefill_s": prefill_s,
        "tokens_identical": warm_ids == cold_ids,
        "kv_max_abs_diff": kv_max_abs_diff,
        "store_s": 0.0,
    }
