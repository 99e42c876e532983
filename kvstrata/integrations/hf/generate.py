"""Greedy generation with a transformers model whose prompt's prefix KV comes from kvstrata.

:class:`KVStrataLM` wraps a causal LM (``transformers`` 5.x) and a :class:`~kvstrata.cache.TieredCache`.
For a prompt it looks up the longest cached prefix (never the last token: one token must be
computed to give the next token's logits), starts an asynchronous load of it, and runs the
model on the rest only, through a :class:`~kvstrata.integrations.hf.cache.KVStrataCache` (layer
*i* computes while later layers are still arriving). When generation ends, the full blocks of
everything computed (prompt and answer) are stored, so the next turn of a conversation finds
its history.

Load or recompute: ``generate(strategy=...)`` brings the cached prefix in by loading it (the
default), recomputing it, or splitting it: the model computes the prompt's beginning ``[0, k)``
from scratch while the cache loads blocks ``[k, hit)``, the loaded KV is appended after the
computed KV in each layer, then the rest of the prompt is computed (Cake's split; the decision,
``"auto"``, is :func:`kvstrata.plan.recompute.choose` on this host's calibration, its load times
from :mod:`kvstrata.plan.loadtime`).

Tensor parallelism: under transformers' own TP (:mod:`kvstrata.integrations.hf.tp`) each
process is one rank and its model's KV cache holds its KV heads. Its cache is either head-sliced
(a TieredCache of :func:`~kvstrata.integrations.hf.cache.model_slice_layout`, looked at through
a :class:`~kvstrata.cache.sliced.SlicedRank`: the rank stores and loads its heads' slices, which
ranks of every TP size share) or TP-matched (of :func:`model_layout` at the model's TP, its
namespace naming the rank). The ranks agree on every count that decides their forwards (the
cached prefix, the split) by an all-reduce of the least.

One sequence at a time (batch 1): this integration proves bytes and timing, a serving engine
batches (see :mod:`kvstrata.integrations.vllm`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.cache import LoadHandle, LoadResult, TieredCache
from kvstrata.cache.sliced import SlicedLoad, SlicedMatch, SlicedRank
from kvstrata.index.prefix import Match
from kvstrata.integrations.hf.cache import (KVStrataCache, RestoredPrefix, cache_arg, model_heads, model_layout,
                                            model_slice_layout)
from kvstrata.integrations.hf.streaming import StreamedKV
from kvstrata.integrations.hf.tp import TensorParallel
from kvstrata.kv.heads import HeadSlicing
from kvstrata.plan.host import HostCalibration, PrefillFit
from kvstrata.plan.loadtime import calibrated_contention, calibrated_load_time
from kvstrata.plan.recompute import PlanKind, RecomputePlan, Strategy, choose

_RESTORE_WAIT_S = 120.0  # how long the first layer of a restore may take before it is recomputed


@dataclass
class Generation:
    """One greedy generation and what the cache did for it.

    Attributes:
        tokens: the generated token ids.
        first_logits: logits of the first generated token (float32, on the CPU).
        ttft_s: lookup + restore + prefill to the first token.
        seconds: the whole generation.
        hit_tokens: prompt tokens whose KV came from kvstrata (not recomputed).
        load: the restore's result (bytes, seconds, route per block), or None without a hit.
        stored_blocks: blocks the store wrote (0 when not storing).
        stream_bytes_per_step: with streaming, host -> device bytes per decode step (mean).
        plan: how the cached prefix came in (LOAD also when nothing was cached).
        compute_tokens: k of the plan: tokens of the cached prefix computed rather than loaded
            (0 for LOAD; the whole hit for RECOMPUTE).
        decision: with strategy "auto", the decision and its predictions.
    """

    tokens: list[int]
    first_logits: torch.Tensor
    ttft_s: float
    seconds: float
    hit_tokens: int = 0
    load: LoadResult | None = None
    stored_blocks: int = 0
    stream_bytes_per_step: float = 0.0
    plan: PlanKind = PlanKind.LOAD
    compute_tokens: int = 0
    decision: RecomputePlan | None = None


class KVStrataLM:
    """Greedy generation with a transformers causal LM whose prefix KV comes from kvstrata.

    The TieredCache's layout must be the model's (checked), so blocks stored by one model never
    load into another (the namespace carries model id and layout): :func:`model_layout` at the
    model's TP size (whole blocks of this rank's heads; at TP > 1 the cache's ``tp_rank`` and
    ``tp_size`` must be this rank's), or :func:`model_slice_layout` (head slices, shared by
    every TP size). ``tp`` defaults to the model's own (:meth:`TensorParallel.of_model`).
    With a head-sliced cache, ``packs`` is this rank's own tiers, which keep its slices of a
    block as one object (:mod:`kvstrata.cache.sliced`; ``pack_layout`` of the rank's heads).

    ``calibration`` and ``prefill`` feed ``strategy="auto"``: load times come from the
    calibration's paths (:meth:`HostCalibration.restore_s` per source tier), prefill time from
    ``prefill``, else the calibration's fit for the cache's model id. ``calibration`` defaults to
    the cache's ``config.calibration``.
    """

    def __init__(
        self,
        model: Any,
        cache: TieredCache | None,
        tenant: str = "",
        *,
        calibration: HostCalibration | None = None,
        prefill: PrefillFit | None = None,
        tp: TensorParallel | None = None,
        packs: TieredCache | None = None,
    ) -> None:
        self.model = model
        self._cache_arg = cache_arg(model)  # "cache" (transformers >= 5.2x) or "past_key_values"
        self.cache = cache
        self.tenant = tenant
        self.calibration = calibration
        self.prefill = prefill
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.num_layers = model.config.num_hidden_layers
        self.tp = tp if tp is not None else TensorParallel.of_model(model)
        # What this rank stores and loads through: the cache itself (whole blocks of its heads)
        # or, head-sliced, its SlicedRank (the same calls, over its heads' slices).
        self.kv: TieredCache | SlicedRank | None = self._rank_kv(cache, packs) if cache is not None else None

    def _rank_kv(self, cache: TieredCache, packs: TieredCache | None) -> TieredCache | SlicedRank:
        layout, tp = cache.layout, self.tp
        if layout.head_sliced:
            want = model_slice_layout(self.model.config, layout.block_tokens, self.dtype, layout.kv_heads)
            if layout != want:
                raise ValueError(f"cache layout {layout.describe()} does not fit the model's {want.describe()}")
            slicing = HeadSlicing(model_heads(self.model.config, self.dtype), layout.kv_heads)
            return SlicedRank(cache, slicing, tp.size, tp.rank, packs=packs)
        want = model_layout(self.model.config, layout.block_tokens, self.dtype, tp.size)
        if layout != want:
            raise ValueError(f"cache layout {layout.describe()} does not fit the model's {want.describe()}")
        if packs is not None:
            raise ValueError("packs= takes a head-sliced cache's rank packs; this cache is TP-matched")
        if (cache.config.tp_rank, cache.config.tp_size) != (tp.rank, tp.size):
            raise ValueError(f"cache config tp_rank/tp_size {cache.config.tp_rank}/{cache.config.tp_size} is not "
                             f"the model's rank {tp.rank} of {tp.size}: a TP-matched cache names its rank (or use "
                             "a head-sliced cache, model_slice_layout)")
        return cache

    @torch.inference_mode()
    def generate(
        self,
        prompt: list[int],
        max_new_tokens: int,
        *,
        reuse: bool = True,
        store: bool = True,
        streaming: bool = False,
        strategy: Strategy | str = Strategy.LOAD,
        split_tokens: int | None = None,
    ) -> Generation:
        """Greedy generation of ``max_new_tokens`` after ``prompt``.

        Args:
            reuse: look up and use the cached prefix (False: a cold run).
            store: store the full blocks of everything computed when done.
            streaming: per-step DRAM streaming (strategies load and recompute only).
            strategy: "load" the cached prefix (the default), "recompute" it, "split" it at
                ``split_tokens``, or "auto" (:func:`kvstrata.plan.recompute.choose`; needs a
                calibration and a prefill fit).
            split_tokens: with "split", k: the tokens ``[0, k)`` computed while ``[k, hit)``
                loads; a multiple of the block size, at most the cached prefix. 0 is the load
                plan, the whole prefix the recompute plan.

        Raises:
            ValueError: bad arguments, named; with "auto", no calibration or prefill fit.
        """
        if not prompt:
            raise ValueError("prompt is empty: at least one token is needed")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        strategy = _strategy(strategy)
        if (strategy is Strategy.SPLIT) != (split_tokens is not None):
            raise ValueError(f"split_tokens goes with strategy 'split' and only with it (strategy {strategy.value!r}, "
                             f"split_tokens {split_tokens})")
        if streaming and strategy in (Strategy.SPLIT, Strategy.AUTO):
            raise ValueError(f"streaming supports strategies 'load' and 'recompute', not {strategy.value!r}")
        if strategy is Strategy.SPLIT and self.cache is not None and split_tokens % self.cache.layout.block_tokens:
            raise ValueError(f"split_tokens {split_tokens} is not a multiple of the block size "
                             f"{self.cache.layout.block_tokens}")
        if strategy is Strategy.AUTO:
            self._auto_inputs()  # fail before any work
        return self._generate_planned(prompt, max_new_tokens, reuse, store, streaming, strategy, split_tokens)

    def _decode_and_store(
        self, prompt: list[int], token: int, max_new_tokens: int, kv_cache: KVStrataCache,
        stream: StreamedKV | None, store: bool,
    ) -> tuple[list[int], float, int]:
        """Greedy decode after the first token, then store; (tokens, stream bytes per step, stored blocks)."""
        tokens = [token]
        moved_before = stream.bytes_moved if stream is not None else 0
        for _ in range(max_new_tokens - 1):
            ids = torch.tensor([[token]], device=self.device)
            logits = self.model(input_ids=ids, **{self._cache_arg: kv_cache}, use_cache=True).logits[0, -1]
            token = int(logits.argmax())
            tokens.append(token)
        steps = max_new_tokens - 1
        per_step = (stream.bytes_moved - moved_before) / steps if stream is not None and steps else 0.0
        stored = 0
        if store and self.kv is not None:
            computed = list(prompt) + tokens[:-1]  # the last token's KV is never computed
            stored = self.kv.store(computed, kv_cache.kv(), self.tenant).result().new_blocks
        return tokens, per_step, stored

    def _generate_planned(
        self, prompt: list[int], max_new_tokens: int, reuse: bool, store: bool, streaming: bool,
        strategy: Strategy, split_tokens: int | None,
    ) -> Generation:
        """Every strategy (see :meth:`generate`); load is the split at k = 0."""
        start = time.perf_counter()
        match = self._lookup(prompt[:-1]) if reuse and self.kv is not None else None
        hit = match.tokens if match is not None else 0
        k, decision = self._compute_tokens(match, len(prompt), strategy, split_tokens)
        if strategy is Strategy.AUTO:
            k = self.tp.agree(k, self.device)  # ranks' predictions may differ: the least is a plan for all
        kind = PlanKind.LOAD if k == 0 else PlanKind.RECOMPUTE if k == hit else PlanKind.SPLIT
        stream = StreamedKV(self.num_layers, torch.device("cpu"), self.device.type == "cuda") if streaming else None
        kv_cache = KVStrataCache(self.num_layers, stream)
        prefix, handle, load = None, None, None
        try:
            done = 0  # tokens whose KV is in kv_cache
            if kind is not PlanKind.RECOMPUTE and hit:
                # Start loading [k, hit), then compute [0, k) while it loads (nothing when k = 0).
                handle = self.kv.load(match.after(k // self.cache.layout.block_tokens))
                if k:
                    self._forward(prompt[:k], kv_cache)
                handle, prefix = self._first_layer(handle)
                if prefix is not None:
                    kv_cache.append_restored(prefix)  # after [0, k)
                done = k + (prefix.tokens if prefix is not None else 0)
            logits = self._forward(prompt[done:], kv_cache)
            token = int(logits.argmax())
            ttft = time.perf_counter() - start
            if handle is not None:
                load = handle.wait()
                handle.release()
            first_logits = logits.float().cpu()
            tokens, per_step, stored = self._decode_and_store(prompt, token, max_new_tokens, kv_cache, stream, store)
        finally:
            if handle is not None:
                handle.release()
            if stream is not None:
                stream.close()
        return Generation(tokens, first_logits, ttft, time.perf_counter() - start,
                          hit_tokens=prefix.tokens if prefix is not None else 0, load=load, stored_blocks=stored,
                          stream_bytes_per_step=per_step, plan=kind, compute_tokens=k, decision=decision)

    def _lookup(self, tokens: list[int]) -> Match | SlicedMatch:
        """The cached prefix of ``tokens`` every rank has (a block one rank lacks is a miss for all)."""
        match = self.kv.lookup(tokens, self.tenant)
        return match.cut(self.tp.agree(match.blocks, self.device))

    def _compute_tokens(
        self, match: Match | SlicedMatch | None, prompt_tokens: int, strategy: Strategy, split_tokens: int | None
    ) -> tuple[int, RecomputePlan | None]:
        """k, the cached prefix's tokens to compute rather than load, and with "auto" the decision."""
        hit = match.tokens if match is not None else 0
        if strategy is Strategy.LOAD:
            return 0, None
        if strategy is Strategy.RECOMPUTE:
            return hit, None
        if strategy is Strategy.SPLIT:
            if split_tokens < 0 or split_tokens > hit:
                raise ValueError(f"split_tokens {split_tokens} is beyond the cached prefix of {hit} tokens "
                                 f"(0 <= split_tokens <= {hit})")
            return split_tokens, None
        decision = self._decide(match, prompt_tokens - hit)
        return decision.compute_tokens, decision

    def _forward(self, ids: list[int], kv_cache: KVStrataCache) -> torch.Tensor:
        """One forward over ``ids`` after what ``kv_cache`` holds; the last position's logits."""
        # Only the last position's logits are needed: the LM head over the whole prompt is
        # wasted work (several ms on a CPU for a few thousand tokens).
        out = self.model(input_ids=torch.tensor([ids], device=self.device), **{self._cache_arg: kv_cache},
                         use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    def _first_layer(self, handle: LoadHandle | SlicedLoad) -> tuple[LoadHandle | SlicedLoad | None,
                                                                      RestoredPrefix | None]:
        """Wait for the restore's first layer (on the CPU: for all of it; see the module text):
        (the handle, the restored span), the span None when nothing was loaded; on a failed
        restore (None, None), the handle released. Under TP the span is what every rank loaded."""
        try:
            if self.device.type == "cpu":
                handle.wait(_RESTORE_WAIT_S)
            handle.wait_layer(0, _RESTORE_WAIT_S)
            loaded = handle.blocks * self.cache.layout.block_tokens
        except Exception:  # noqa: BLE001 - a failed restore is recomputed, never served
            loaded = -1
        loaded = self.tp.agree(loaded, self.device)  # every rank calls it, failed or not
        if loaded < 0:
            handle.release()
            return None, None
        return handle, (RestoredPrefix(handle, loaded) if loaded else None)

    def _auto_inputs(self) -> tuple[HostCalibration, PrefillFit]:
        if self.cache is None:
            raise ValueError("strategy 'auto' needs a cache: there is nothing to load or recompute without one")
        calibration = self.calibration or self.cache.config.calibration
        if calibration is None:
            raise ValueError("strategy 'auto' needs a HostCalibration: pass calibration= to KVStrataLM or set the "
                             "cache's config.calibration (kvstrata calibrate)")
        prefill = self.prefill or calibration.prefill.get(self.cache.config.model_id)
        if prefill is None:
            raise ValueError(f"strategy 'auto' needs the model's prefill fit: pass prefill= to KVStrataLM "
                             f"(kvstrata.integrations.recompute.measure_prefill) or calibrate model "
                             f"{self.cache.config.model_id!r}")
        return calibration, prefill

    def _decide(self, match: Match | SlicedMatch | None, tail_tokens: int) -> RecomputePlan:
        calibration, prefill = self._auto_inputs()
        hit = match.tokens if match is not None else 0
        # What a load moves, block by block: a block of the rank's heads (head-sliced: a pack,
        # or its slices, taken here as one object of the pack's bytes) from its slowest medium.
        size = self.kv.layout.block_bytes if isinstance(self.kv, SlicedRank) else self.cache.layout.block_bytes
        media = match.media if match is not None else ()
        load = calibrated_load_time(calibration, media, size, self.cache.config.workers)
        contention = calibrated_contention(calibration, media, size, load, self.device.type == "cpu")
        rank = self.kv.layout  # the rank's KV of a block: all its slices
        return choose(hit, tail_tokens, rank.block_tokens, rank.block_bytes // rank.block_tokens, load, prefill,
                      contention)


@torch.inference_mode()
def plain_ttft(model: Any, prompt: list[int]) -> float:
    """Seconds to the first token of ``prompt`` with plain transformers: a fresh
    ``DynamicCache``, no kvstrata (the baseline a cold :meth:`KVStrataLM.generate` is held to)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    start = time.perf_counter()
    out = model(input_ids=torch.tensor([prompt], device=device), **{cache_arg(model): DynamicCache(config=model.config)},
                use_cache=True, logits_to_keep=1)
    int(out.logits[0, -1].argmax())
    return time.perf_counter() - start


def _strategy(value: Strategy | str) -> Strategy:
    try:
        return Strategy(value)
    except ValueError:
        names = ", ".join(repr(s.value) for s in Strategy)
        raise ValueError(f"unknown strategy {value!r}: expected one of {names}") from None
