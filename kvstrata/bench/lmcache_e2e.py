"""LMCache end to end on a real transformers model: the LMCache column of ``kvstrata bench e2e``.

On the same prompts the kvstrata side runs (turns in order; each turn's prompt extends an
earlier prompt, and conversations share system prompts), for each prompt:

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
another conversation's shared system prompt), never its own KV. Tiers (one LMCache engine each;
LMCache's chunk is ``chunk_tokens``):

- host: ``local_cpu`` only; chunks are retrieved from CPU memory.
- disk: ``local_cpu`` and ``local_disk``; after a store, the engine waits until every chunk is
  on disk; before each lookup its CPU copies are cleared and (``drop_page_cache``) the files
  evicted from the page cache, so every restored chunk is read from the disk.

The engine glue (a CPU "GPU connector", the broadcast stubs) comes from
:mod:`kvstrata.bench.lmcache`. LMCache lives in a venv of its own (see that module for setup);
the main bench, in a venv without it, drives this module there turn by turn through
:class:`SideSession` (``python -m kvstrata.bench.lmcache_e2e --serve ...``); standalone, it runs
a whole list of prompts (``--model DIR --prompts FILE.json --tier host --json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any, Iterable, Sequence

TIERS = ("host", "disk")
GB = 1e9  # decimal, as everywhere in kvstrata
CPU = "LocalCPUBackend"
DISK = "LocalDiskBackend"
DISK_WAIT_S = 300.0  # a chunk not on disk by then means LMCache dropped the write


def _quiet_lmcache() -> None:
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")


# --- one tier: an LMCache engine ------------------------------------------------------------------


class _Tier:
    """One LMCache engine (host: CPU only; disk: CPU + local disk) over KV buffers of one model."""

    def __init__(
        self, name: str, layout: Any, capacity_bytes: int, directory: Path | None, drop_pages: bool, tag: str
    ) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig

        from kvstrata.bench.lmcache import (
            _connector_class,
            _no_broadcast,
            _no_broadcast_object,
            engine_defaults,
            engine_metadata,
        )

        if name not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {name!r}")
        self.name = name
        self.directory = directory
        self.drop_pages = drop_pages
        self.chunk_tokens = layout.block_tokens
        self._builder = LMCacheEngineBuilder
        size_gib = capacity_bytes / (1 << 30)
        metadata = engine_metadata(layout, f"kvstrata-e2e-{tag}")
        common = engine_defaults(layout)
        if name == "host":
            config = LMCacheEngineConfig.from_defaults(**common, max_local_cpu_size=size_gib + 0.05)
        else:
            assert directory is not None
            directory.mkdir(parents=True, exist_ok=True)
            config = LMCacheEngineConfig.from_defaults(
                **common, max_local_cpu_size=size_gib + 0.05, local_disk=str(directory),
                max_local_disk_size=size_gib + 0.05,
            )
        self.instance_id = f"kvstrata-e2e-{name}-{tag}-{os.getpid()}"
        self.engine = LMCacheEngineBuilder.get_or_create(
            self.instance_id, config, metadata, _connector_class()(layout), _no_broadcast, _no_broadcast_object
        )
        self.engine.post_init()

    def before_lookup(self, tokens: Any) -> None:
        """Disk: only the disk holds chunks now (and, with drop_pages, not the page cache)."""
        if self.name != "disk":
            return
        from kvstrata.timing import drop_page_cache

        self.engine.clear(locations=[CPU])
        if len(tokens) >= self.chunk_tokens and self.engine.lookup(tokens, search_range=[CPU]):
            raise RuntimeError("LMCache still holds chunks in CPU memory after clearing it")
        if self.drop_pages:
            drop_page_cache(self.disk_files())

    def store(self, tokens: Any, kv: Any) -> float:
        """Store ``kv`` (``[layers, kv, len(tokens), kv_heads, head_dim]``); seconds until it is
        held (host: in CPU memory; disk: every chunk on disk)."""
        start = time.perf_counter()
        self.engine.store(tokens, kvcaches=kv)
        where = CPU if self.name == "host" else DISK
        deadline = start + DISK_WAIT_S
        while (found := self.engine.lookup(tokens, search_range=[where])) < len(tokens):
            if self.name == "host" or time.perf_counter() > deadline:
                raise RuntimeError(f"LMCache {self.name} holds {found} of {len(tokens)} stored tokens in {where}")
            time.sleep(0.0005)
        return time.perf_counter() - start

    def disk_files(self) -> list[Path]:
        if self.directory is None:
            return []
        return sorted(p for p in self.directory.rglob("*.pt") if p.is_file())

    def close(self) -> None:
        self._builder.destroy(self.instance_id)


# --- the model side -------------------------------------------------------------------------------


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


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


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
        self.engines: dict[str, _Tier] = {}
        try:
            for tier in self.tiers:
                directory = Path(disk_dir) / f"lmcache-{tag}" if tier == "disk" else None
                self.engines[tier] = _Tier(tier, self.layout, max(capacity_tokens, 1) * self.token_bytes, directory,
                                           drop_page_cache, tag)
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

    def _engine(self, tier: str) -> _Tier:
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


def lmcache_e2e_tiers(
    model_dir: str | os.PathLike[str],
    prompts: Sequence[Sequence[int]],
    tiers: Iterable[str] = TIERS,
    max_new_tokens: int = 16,
    chunk_tokens: int = 256,
    disk_dir: str | os.PathLike[str] | None = None,
    drop_page_cache: bool = True,
    repeats: int = 1,
) -> dict[str, Any]:
    """Run the workload once, cold, and warm through every tier in ``tiers`` (see the module doc).

    The model is loaded once; each prompt's cold run is shared by the tiers, whose engines are
    independent. ``repeats`` > 1 times each prompt's cold and warm first token that many times
    (the first run of each also decodes and is compared) and keeps the fastest: on a shared
    machine, the least disturbed figure. Returns ``{"lmcache": version, "model": ..., "tiers": {tier: result}, ...}``,
    each result as :func:`lmcache_e2e` describes.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts or any(not p for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
    wall_start = time.perf_counter()
    capacity = sum(len(p) // chunk_tokens * chunk_tokens for p in prompts)
    session = LMCacheSession(model_dir, tiers, capacity, chunk_tokens, disk_dir, drop_page_cache, repeats)
    turns: dict[str, list[dict[str, Any]]] = {t: [] for t in session.tiers}
    try:
        for index, prompt in enumerate(prompts):
            for tier, turn in session.turn(index, prompt, max_new_tokens).items():
                turns[tier].append(turn)
        about = session.about()
    finally:
        session.close()
    return {
        **about,
        "model": str(model_dir),
        "prompts": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "max_new_tokens": max_new_tokens,
        "wall_s": time.perf_counter() - wall_start,
        "tiers": {tier: summary(tier, turns[tier], drop_page_cache) for tier in turns},
    }


def _warm_turn(
    model: Any, engine: _Tier, index: int, tokens: Any, cold_ids: list[int], cold_s: float, cold_kv: Any,
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


def summary(tier: str, turns: list[dict[str, Any]], drop_pages: bool) -> dict[str, Any]:
    """One tier's result over its turns (:func:`lmcache_e2e` lists the keys)."""
    hits = [t for t in turns if t["hit_tokens"]]
    prompt_tokens = sum(t["prompt_tokens"] for t in turns)
    hit_tokens = sum(t["hit_tokens"] for t in turns)
    bytes_restored = sum(t["bytes_restored"] for t in turns)
    retrieve_s = sum(t["retrieve_s"] for t in turns)
    return {
        "tier": tier,
        "read_from": "cpu" if tier == "host" else ("disk, page cache dropped" if drop_pages else "disk (page cache)"),
        "turns": len(turns),
        "ttft_cold_s": _median([t["ttft_cold_s"] for t in turns]),
        "ttft_warm_s": _median([t["ttft_warm_s"] for t in turns]),
        "ttft_cold_mean_s": _mean([t["ttft_cold_s"] for t in turns]),
        "ttft_warm_mean_s": _mean([t["ttft_warm_s"] for t in turns]),
        # over the turns that hit: what a restore buys
        "ttft_cold_hit_turns_s": _median([t["ttft_cold_s"] for t in hits]),
        "ttft_warm_hit_turns_s": _median([t["ttft_warm_s"] for t in hits]),
        "prompt_tokens": prompt_tokens,
        "hit_tokens": hit_tokens,
        "hit_rate": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        "bytes_restored": bytes_restored,
        "retrieve_s": retrieve_s,
        "restore_gbps": bytes_restored / retrieve_s / GB if retrieve_s > 0 else None,
        "tokens_identical": all(t["tokens_identical"] for t in turns),
        "kv_max_abs_diff": max((t["kv_max_abs_diff"] for t in turns), default=0.0),
        "per_turn": turns,
    }


def lmcache_e2e(
    model_dir: str | os.PathLike[str],
    prompts: Sequence[Sequence[int]],
    tier: str,
    max_new_tokens: int,
    chunk_tokens: int = 256,
    disk_dir: str | os.PathLike[str] | None = None,
    drop_page_cache: bool = True,
    repeats: int = 1,
) -> dict[str, Any]:
    """One tier's result on ``prompts`` (turns in order).

    Returns: ``ttft_cold_s`` and ``ttft_warm_s`` (medians over turns; ``*_mean_s`` means;
    ``*_hit_turns_s`` medians over the turns that hit), ``hit_tokens``, ``hit_rate`` (hit over
    prompt tokens), ``bytes_restored``, ``retrieve_s``, ``restore_gbps`` (bytes restored over the
    seconds in ``retrieve()``, decimal GB/s), ``tokens_identical`` (warm decoding equal to cold on
    every turn), ``kv_max_abs_diff`` (restored against recomputed KV) and ``per_turn``.
    """
    result = lmcache_e2e_tiers(
        model_dir, prompts, [tier], max_new_tokens, chunk_tokens, disk_dir, drop_page_cache, repeats
    )
    return result["tiers"][tier]


# --- a workload for standalone runs ----------------------------------------------------------------


def synthetic_turns(
    conversations: int, turns: int, system_tokens: int, turn_tokens: int, answer_tokens: int,
    vocab: int, systems: int = 1, seed: int = 0,
) -> list[list[int]]:
    """Multi-turn prompts, turn-major (every conversation's turn 0, then turn 1, ...).

    Conversation ``c`` opens with system prompt ``c % systems`` (shared across conversations);
    each turn appends ``turn_tokens`` user tokens, and the next turn first appends
    ``answer_tokens`` standing in for the answer (random ids: only the prompt's KV is stored, so
    what the answer says does not change what hits).
    """
    import random

    rng = random.Random(seed)
    draw = lambda k: [rng.randrange(3, vocab) for _ in range(k)]  # noqa: E731 - ids 0..2 are special
    system = [draw(system_tokens) for _ in range(systems)]
    history = [list(system[c % systems]) for c in range(conversations)]
    out = []
    for turn in range(turns):
        for c in range(conversations):
            if turn:
                history[c] += draw(answer_tokens)
            history[c] += draw(turn_tokens)
            out.append(list(history[c]))
    return out


# --- from the main venv ----------------------------------------------------------------------------


class SideSession:
    """An :class:`LMCacheSession` in another interpreter (the venv that has LMCache), driven
    one turn at a time, so a benchmark can interleave LMCache's turns with its own.

    The child (``python -m kvstrata.bench.lmcache_e2e --serve ...``) answers one JSON line per
    request line on its stdout; everything LMCache and transformers print goes to its stderr
    (kept in a temporary file, whose tail an error names). Use as a context manager.

    Raises (from the constructor and :meth:`turn`):
        SideSessionError: the interpreter is missing, LMCache does not import there, the child
            failed or did not answer within ``timeout_s``.
    """

    def __init__(
        self, python_exe: str | os.PathLike[str], model_dir: str | os.PathLike[str], tiers: Iterable[str],
        capacity_tokens: int, chunk_tokens: int = 256, drop_page_cache: bool = True, timeout_s: float = 600.0,
    ) -> None:
        exe = Path(python_exe)
        if not exe.is_file() or not os.access(exe, os.X_OK):
            raise SideSessionError(f"no Python interpreter at {exe} (LMCache's venv: see kvstrata/bench/lmcache.py)")
        self.timeout_s = timeout_s
        self._stderr = tempfile.TemporaryFile(mode="w+")
        cmd = [str(exe), "-m", "kvstrata.bench.lmcache_e2e", "--serve", "--model", str(model_dir),
               "--capacity-tokens", str(capacity_tokens), "--chunk-tokens", str(chunk_tokens)]
        for tier in tiers:
            cmd += ["--tier", tier]
        if not drop_page_cache:
            cmd.append("--keep-page-cache")
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                      text=True, env=_side_env())
        try:
            self.about: dict[str, Any] = self._answer()["ready"]
        except BaseException:
            self.close()
            raise

    def turn(
        self, index: int, prompt: Sequence[int], max_new_tokens: int, tiers: Iterable[str] | None = None
    ) -> dict[str, dict[str, Any]]:
        """LMCache's turn on ``prompt`` (see :meth:`LMCacheSession.turn`)."""
        request = {"index": index, "prompt": [int(t) for t in prompt], "max_new_tokens": max_new_tokens,
                   "tiers": None if tiers is None else list(tiers)}
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        except OSError as exc:
            raise SideSessionError(f"the LMCache side ended: {exc}; {self._tail()}") from None
        return self._answer()["turns"]

    def _answer(self) -> dict[str, Any]:
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)
            if not sel.select(self.timeout_s):
                raise SideSessionError(f"the LMCache side did not answer within {self.timeout_s:.0f} s; {self._tail()}")
        line = self._proc.stdout.readline()
        if not line:
            raise SideSessionError(f"the LMCache side exited ({self._proc.wait()}): {self._tail()}")
        answer = json.loads(line)
        if "error" in answer:
            raise SideSessionError(f"the LMCache side failed: {answer['error']}")
        return answer

    def _tail(self) -> str:
        self._stderr.seek(0)
        return _tail(self._stderr.read())

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._stderr.close()

    def __enter__(self) -> SideSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SideSessionError(RuntimeError):
    """The LMCache side could not run (the message says why)."""


def _side_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    env.setdefault("LMCACHE_TRACK_USAGE", "false")
    return env


def serve(session: LMCacheSession, requests: Any, answers: Any) -> None:
    """Answer each JSON request line of ``requests`` with one JSON line on ``answers``: first
    ``{"ready": ...}``, then per request ``{"turns": {tier: figures}}`` or ``{"error": text}``."""

    def send(obj: dict[str, Any]) -> None:
        answers.write(json.dumps(obj) + "\n")
        answers.flush()

    send({"ready": session.about()})
    for line in requests:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            turns = session.turn(int(request["index"]), request["prompt"], int(request["max_new_tokens"]),
                                 request.get("tiers"))
            send({"turns": turns})
        except Exception as exc:  # noqa: BLE001 - the caller reads it as one line
            send({"error": f"{type(exc).__name__}: {exc}"})


def _tail(text: str, lines: int = 8) -> str:
    return " | ".join(text.strip().splitlines()[-lines:]) or "(no output)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstrata.bench.lmcache_e2e", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--prompts", help="JSON file: a list of token-id lists, turns in order")
    parser.add_argument("--serve", action="store_true",
                        help="answer one turn per JSON line on stdin (see SideSession) instead of --prompts")
    parser.add_argument("--capacity-tokens", type=int, default=1 << 16, help="with --serve: tokens each engine holds")
    parser.add_argument("--tier", action="append", choices=TIERS, help="host and/or disk (repeatable; default both)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1, help="time each first token this many times, keep the fastest")
    parser.add_argument("--disk-dir", default=None, help="LMCache's local disk directory (default: a temp dir)")
    parser.add_argument("--keep-page-cache", action="store_true", help="disk tier: do not drop the page cache")
    parser.add_argument("--out", default=None, help="also write the JSON result to this file")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON document (the default)")
    args = parser.parse_args(argv)
    if args.serve:
        answers = sys.stdout
        with redirect_stdout(sys.stderr):  # only the answers on stdout
            session = LMCacheSession(args.model, args.tier or TIERS, args.capacity_tokens, args.chunk_tokens,
                                     args.disk_dir, not args.keep_page_cache, args.repeats)
            try:
                serve(session, sys.stdin, answers)
            finally:
                session.close()
        return 0
    if not args.prompts:
        parser.error("--prompts is required (or --serve)")
    prompts = json.loads(Path(args.prompts).read_text())
    # LMCache and transformers may print; stdout carries only the JSON document.
    with redirect_stdout(sys.stderr):
        result = lmcache_e2e_tiers(
            args.model, prompts, args.tier or TIERS, args.max_new_tokens, args.chunk_tokens, args.disk_dir,
            not args.keep_page_cache, args.repeats,
        )
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
