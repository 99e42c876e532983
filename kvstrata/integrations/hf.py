"""A transformers model on kvstrata: prefix reuse from any tier, layer by layer, and DRAM streaming.

:class:`KVStrataLM` wraps a causal LM (``transformers`` 5.x) and a :class:`~kvstrata.cache.TieredCache`.
For a prompt it looks up the longest cached prefix (never the last token: one token must be
computed to give the next token's logits), starts an asynchronous load of it, and runs the
model on the rest only. The model's cache is a :class:`KVStrataCache`, a transformers ``Cache``
of :class:`RestoringLayer` s: layer *i*'s first ``update`` waits for layer *i* of the restored
blocks only, so layer *i* computes while later layers are still arriving. When generation ends,
the full blocks of everything computed (prompt and answer) are stored, so the next turn of a
conversation finds its history.

Load or recompute: ``generate(strategy=...)`` brings the cached prefix in by loading it (the
default), recomputing it, or splitting it: the model computes the prompt's beginning ``[0, k)``
from scratch while the cache loads blocks ``[k, hit)``, the loaded KV is appended after the
computed KV in each layer, then the rest of the prompt is computed (Cake's split; the decision,
``"auto"``, is :func:`kvstrata.plan.recompute.choose` on this host's calibration).

Streaming (the seed's sixth scheme, per-step DRAM streaming): with ``streaming=True`` the
sequence's KV lives in host memory (pinned on CUDA) and only two layers' KV are on the device at
a time: each layer's KV crosses host -> device just before the layer runs, while the next
layer's copy is already under way (a CUDA stream, or a worker thread on a CPU-only host). Every
decode step therefore moves the whole KV once across the host link; :class:`Generation` reports
those bytes. Tokens equal the resident run's: the same values meet the same arithmetic.

One sequence at a time (batch 1): this integration proves bytes and timing, a serving engine
batches (see :mod:`kvstrata.integrations.vllm`).
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvstrata.cache import LoadHandle, LoadResult, TieredCache
from kvstrata.index.prefix import Match
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.media import Medium
from kvstrata.plan.host import DISK_READ_COLD, HostCalibration, PrefillFit
from kvstrata.plan.recompute import LoadTime, PlanKind, RecomputePlan, Strategy, choose
from kvstrata.tensors import kv_dtype

# The model's dtype is the cache's KV dtype (FP8 KV is an engine's choice, not a model's).
_MODEL_DTYPES = (DType.BF16, DType.FP16, DType.FP32)


def model_layout(config: Any, block_tokens: int, dtype: torch.dtype) -> KVLayout:
    """The kvstrata block layout of a Hugging Face decoder config (MHA/GQA; batch 1, no TP)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return KVLayout(config.num_hidden_layers, block_tokens, kv_heads, head_dim, kv_dtype(dtype, _MODEL_DTYPES))


class RestoredPrefix:
    """``tokens`` tokens' KV (the prompt's first, or in a split those after the computed
    beginning), arriving layer by layer from a :class:`LoadHandle`."""

    def __init__(self, handle: LoadHandle, tokens: int, timeout_s: float = 120.0) -> None:
        self.handle = handle
        self.tokens = tokens
        self.timeout_s = timeout_s

    def layer(self, i: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s K and V as ``[1, kv_heads, tokens, head_dim]`` on ``device`` (waits for it)."""
        self.handle.wait_layer(i, self.timeout_s)
        kv = torch.cat([self.handle.block(b)[i] for b in range(self.handle.blocks)], dim=1)  # [2, tokens, H, D]
        kv = kv.to(device, non_blocking=True).permute(0, 2, 1, 3).unsqueeze(1)  # [2, 1, H, tokens, D]
        return kv[0], kv[1]


class RestoringLayer(DynamicLayer):
    """A DynamicLayer whose next update first appends this layer of a restored span: the
    prompt's cached prefix (before anything was computed), or, in a split, the loaded blocks
    after the computed beginning. ``prefix`` is the span still to append (None once appended)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.prefix: RestoredPrefix | None = None

    def get_seq_length(self) -> int:
        return super().get_seq_length() + (self.prefix.tokens if self.prefix is not None else 0)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.prefix is not None:
            keys, values = self.prefix.layer(self.index, key_states.device)  # [1, H, tokens, D]
            keys, values = keys.to(key_states.dtype), values.to(value_states.dtype)
            if self.is_initialized:
                self.keys = torch.cat([self.keys, keys], dim=-2)
                self.values = torch.cat([self.values, values], dim=-2)
            else:
                self.lazy_initialization(key_states, value_states)
                self.keys, self.values = keys, values
            self.prefix = None
        return super().update(key_states, value_states, *args, **kwargs)


class StreamingLayer(RestoringLayer):
    """KV kept in host memory; each update copies this layer's KV to the device (prefetched
    while the layer before ran) and starts the next layer's copy."""

    def __init__(self, index: int, stream: StreamedKV) -> None:
        super().__init__(index)
        self.stream = stream
        self.length = 0  # tokens in the host copy

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else super().get_seq_length()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        s = self.stream
        if not self.is_initialized:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.is_initialized = True
            if self.prefix is not None:
                k, v = self.prefix.layer(self.index, s.host)
                s.append(self.index, 0, k, v)
                self.length = self.prefix.tokens
            s.fetched.pop(self.index, None)
        past = s.take(self.index, self.length, key_states.device)  # this layer's past KV on the device
        s.append(self.index, self.length, key_states, value_states)
        self.length += key_states.shape[-2]
        s.prefetch((self.index + 1) % s.layers, key_states.device)
        if past is None:
            return key_states, value_states
        return torch.cat([past[0], key_states], dim=-2), torch.cat([past[1], value_states], dim=-2)


class StreamedKV:
    """Host buffers of every layer's KV, grown by doubling, and the device copies in flight."""

    def __init__(self, layers: int, host: torch.device, pin: bool) -> None:
        self.layers = layers
        self.host = host
        self.pin = pin
        self.buffers: list[torch.Tensor | None] = [None] * layers  # [2, 1, H, capacity, D]
        self.lengths = [0] * layers
        self.fetched: dict[int, Any] = {}  # layer -> (Future | (event, tensor), length)
        self.bytes_moved = 0
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvstrata-stream")
        self._cuda_stream = None

    def append(self, layer: int, at: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        n = keys.shape[-2]
        buf = self.buffers[layer]
        if buf is None or buf.shape[3] < at + n:
            cap = max(at + n, 2 * (buf.shape[3] if buf is not None else 256))
            shape = (2, keys.shape[0], keys.shape[1], cap, keys.shape[3])
            new = torch.empty(shape, dtype=keys.dtype, device=self.host, pin_memory=self.pin)
            if buf is not None:
                new[:, :, :, :at].copy_(buf[:, :, :, :at])
            self.buffers[layer] = buf = new
        buf[0, :, :, at : at + n].copy_(keys)
        buf[1, :, :, at : at + n].copy_(values)
        self.lengths[layer] = at + n

    def _copy(self, layer: int, length: int, device: torch.device) -> torch.Tensor:
        src = self.buffers[layer][:, :, :, :length]
        return src.to(device, non_blocking=True) if device.type == "cuda" else src.clone()

    def prefetch(self, layer: int, device: torch.device) -> None:
        length = self.lengths[layer]
        if self.buffers[layer] is None or layer in self.fetched:
            return
        if device.type == "cuda":
            if self._cuda_stream is None:
                self._cuda_stream = torch.cuda.Stream(device)
            self._cuda_stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._cuda_stream):
                tensor = self._copy(layer, length, device)
                event = torch.cuda.Event()
                event.record(self._cuda_stream)
            self.fetched[layer] = ((event, tensor), length)
        else:
            self.fetched[layer] = (self._thread.submit(self._copy, layer, length, device), length)

    def take(self, layer: int, length: int, device: torch.device) -> torch.Tensor | None:
        """This layer's first ``length`` tokens on the device: the prefetched copy, or a copy now."""
        if length == 0:
            return None
        self.bytes_moved += 2 * self.buffers[layer][0, :, :, :length].nbytes  # what this step needs
        got = self.fetched.pop(layer, None)
        if got is not None and got[1] == length:
            pending = got[0]
            if isinstance(pending, Future):
                return pending.result()
            event, tensor = pending
            torch.cuda.current_stream(device).wait_event(event)
            return tensor
        if got is not None and isinstance(got[0], Future):
            got[0].result()  # a stale copy still counts: it crossed
        return self._copy(layer, length, device)

    def close(self) -> None:
        self._thread.shutdown(wait=True)


class KVStrataCache(Cache):
    """A transformers Cache of :class:`RestoringLayer` (or :class:`StreamingLayer`) per layer."""

    def __init__(self, num_layers: int, stream: StreamedKV | None = None):
        if stream is None:
            layers = [RestoringLayer(i) for i in range(num_layers)]
        else:
            layers = [StreamingLayer(i, stream) for i in range(num_layers)]
        super().__init__(layers=layers)
        self.stream = stream

    def append_restored(self, prefix: RestoredPrefix) -> None:
        """Append ``prefix`` after what each layer holds, at that layer's next update."""
        for layer in self.layers:
            layer.prefix = prefix

    def kv(self) -> torch.Tensor:
        """All cached KV as ``[layers, 2, tokens, kv_heads, head_dim]`` (batch 1), for storing."""
        if self.stream is not None:
            s = self.stream
            n = min(s.lengths)
            per_layer = [s.buffers[i][:, 0, :, :n] for i in range(s.layers)]  # [2, H, n, D]
        else:
            per_layer = [torch.stack([layer.keys[0], layer.values[0]]) for layer in self.layers]
        return torch.stack(per_layer).permute(0, 1, 3, 2, 4).contiguous()


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

    The TieredCache's layout must be :func:`model_layout` of the model (checked), so blocks
    stored by one model never load into another (the namespace carries model id and layout).

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
    ) -> None:
        self.model = model
        self.cache = cache
        self.tenant = tenant
        self.calibration = calibration
        self.prefill = prefill
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.num_layers = model.config.num_hidden_layers
        if cache is not None:
            want = model_layout(model.config, cache.layout.block_tokens, self.dtype)
            if cache.layout != want:
                raise ValueError(f"cache layout {cache.layout.describe()} does not fit the model's {want.describe()}")

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
            logits = self.model(input_ids=ids, past_key_values=kv_cache, use_cache=True).logits[0, -1]
            token = int(logits.argmax())
            tokens.append(token)
        steps = max_new_tokens - 1
        per_step = (stream.bytes_moved - moved_before) / steps if stream is not None and steps else 0.0
        stored = 0
        if store and self.cache is not None:
            computed = list(prompt) + tokens[:-1]  # the last token's KV is never computed
            stored = self.cache.store(computed, kv_cache.kv(), self.tenant).result().new_blocks
        return tokens, per_step, stored

    def _generate_planned(
        self, prompt: list[int], max_new_tokens: int, reuse: bool, store: bool, streaming: bool,
        strategy: Strategy, split_tokens: int | None,
    ) -> Generation:
        """Every strategy (see :meth:`generate`); load is the split at k = 0."""
        start = time.perf_counter()
        block = self.cache.layout.block_tokens if self.cache is not None else 1
        match = self.cache.lookup(prompt[:-1], self.tenant) if reuse and self.cache is not None else None
        hit = match.tokens if match is not None else 0
        decision = None
        if strategy is Strategy.LOAD:
            k = 0
        elif strategy is Strategy.RECOMPUTE:
            k = hit
        elif strategy is Strategy.SPLIT:
            if split_tokens < 0 or split_tokens > hit:
                raise ValueError(f"split_tokens {split_tokens} is beyond the cached prefix of {hit} tokens "
                                 f"(0 <= split_tokens <= {hit})")
            k = split_tokens
        else:
            decision = self._decide(match, len(prompt) - hit)
            k = decision.compute_tokens
        kind = PlanKind.LOAD if k == 0 else PlanKind.RECOMPUTE if k == hit else PlanKind.SPLIT
        stream = StreamedKV(self.num_layers, torch.device("cpu"), self.device.type == "cuda") if streaming else None
        kv_cache = KVStrataCache(self.num_layers, stream)
        prefix, handle, load = None, None, None
        try:
            if kind is PlanKind.RECOMPUTE or hit == 0:
                done = 0  # tokens whose KV is in kv_cache
            else:
                # Start loading [k, hit), then compute [0, k) while it loads (nothing when k = 0).
                j = k // block
                handle = self.cache.load(Match(match.keys[j:], match.media[j:], block, match.total_blocks))
                if k:
                    self.model(input_ids=torch.tensor([prompt[:k]], device=self.device), past_key_values=kv_cache,
                               use_cache=True, logits_to_keep=1)
                try:
                    handle.wait_layer(0, 120.0)
                    loaded = handle.blocks * block
                except Exception:  # noqa: BLE001 - a failed restore is recomputed, never served
                    handle.release()
                    handle, loaded = None, 0
                if loaded:
                    prefix = RestoredPrefix(handle, loaded)
                    kv_cache.append_restored(prefix)  # after [0, k)
                done = k + loaded
            ids = torch.tensor([prompt[done:]], device=self.device)
            # Only the last position's logits are needed: the LM head over the whole prompt is
            # wasted work (several ms on a CPU for a few thousand tokens).
            out = self.model(input_ids=ids, past_key_values=kv_cache, use_cache=True, logits_to_keep=1)
            logits = out.logits[0, -1]
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
        loaded_tokens = prefix.tokens if prefix is not None else 0
        return Generation(tokens, first_logits, ttft, time.perf_counter() - start, loaded_tokens, load, stored,
                          per_step, kind, k, decision)

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

    def _decide(self, match: Match | None, tail_tokens: int) -> RecomputePlan:
        calibration, prefill = self._auto_inputs()
        layout = self.cache.layout
        hit = match.tokens if match is not None else 0
        media = match.media if match is not None else ()
        load = calibrated_load_time(calibration, media, layout.block_bytes, self.cache.config.workers)
        contention = calibrated_contention(calibration, media, layout.block_bytes, load, self.device)
        return choose(hit, tail_tokens, layout.block_tokens, layout.block_bytes // layout.block_tokens, load, prefill,
                      contention)


def calibrated_load_time(
    calibration: HostCalibration, media: tuple[Medium, ...], block_bytes: int, workers: int
) -> LoadTime:
    """``L(blocks)``: predicted seconds to load the last ``blocks`` of blocks on ``media`` (one
    medium per block, in order), by :meth:`HostCalibration.restore_s` per source tier, the
    tiers' times added (a conservative sum: the cache fetches them in one plan). Blocks already
    on the device cost nothing. Disk reads use the cold-read path when it was calibrated (a
    prediction for storage, not for the page cache), else the page-cache path."""
    cold = DISK_READ_COLD in calibration.paths

    def load_s(blocks: int) -> float:
        return sum(
            calibration.restore_s(medium.label, n * block_bytes, n, workers, cold=cold)
            for medium, n in _to_restore(media, blocks).items()
        )

    return load_s


def calibrated_contention(
    calibration: HostCalibration, media: tuple[Medium, ...], block_bytes: int, load: LoadTime,
    device: torch.device,
) -> LoadTime | None:
    """``X(blocks)`` of :func:`kvstrata.plan.recompute.choose`: None when the model runs on a
    GPU; on the CPU, the load's processor time, taken whole (conservative): per source tier its
    one-thread cost from the calibration (disk: the page-cache read path, i.e. copying and
    checksumming, not the storage's wait), or the whole predicted load where a path is missing."""
    if device.type != "cpu":
        return None

    def cpu_s(blocks: int) -> float:
        try:
            return sum(
                calibration.restore_s(medium.label, n * block_bytes, n, workers=1, cold=False)
                for medium, n in _to_restore(media, blocks).items()
            )
        except KeyError:  # a path not calibrated: the whole load counts
            return load(blocks)

    return cpu_s


def _to_restore(media: tuple[Medium, ...], blocks: int) -> Counter[Medium]:
    """Blocks per source tier among the last ``blocks`` of ``media``; those on the device move nothing."""
    counts = Counter(media[len(media) - blocks:] if blocks else ())
    counts.pop(Medium.DEVICE, None)
    return counts


def _strategy(value: Strategy | str) -> Strategy:
    try:
        return Strategy(value)
    except ValueError:
        names = ", ".join(repr(s.value) for s in Strategy)
        raise ValueError(f"unknown strategy {value!r}: expected one of {names}") from None
