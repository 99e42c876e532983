"""LMCache end to end on a real transformers model: the LMCache column of ``kvstrata bench e2e``.

On the same prompts the kvstrata side runs (turns in order; each turn's prompt extends an
earlier prompt, and conversations share system prompts), each prompt runs cold, then warm
through each tier, then is stored (:mod:`kvstrata.bench.lmcache_session` says how), so a
prompt hits only what earlier prompts stored. Tiers (host: CPU memory; disk: the local disk,
page cache dropped) are one LMCache engine each (:mod:`kvstrata.bench.lmcache_tier`); LMCache's
chunk is ``chunk_tokens``. Here: a whole workload's run, its per-tier summary, and the CLI.

LMCache lives in a venv of its own (see :mod:`kvstrata.bench.lmcache` for setup); the main
bench, in a venv without it, drives this module there turn by turn through
:class:`~kvstrata.bench.lmcache_side.SideSession` (``python -m kvstrata.bench.lmcache_e2e
--serve ...``); standalone, it runs a whole list of prompts (``--model DIR --prompts FILE.json
--tier host --json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any, Iterable, Sequence

from kvstrata.bench.lmcache_session import LMCacheSession
from kvstrata.bench.lmcache_side import serve
from kvstrata.bench.lmcache_tier import TIERS

GB = 1e9  # decimal, as everywhere in kvstrata


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


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


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
