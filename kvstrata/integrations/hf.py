"""A transformers model on kvstrata: prefix reuse from any tier, layer by layer, and DRAM streaming.

:class:`KVStrataLM` wraps a causal LM (``transformers`` 5.x) and a :class:`~kvstrata.cache.TieredCache`.
For a prompt it looks up the longest cached prefix (never the last token: one token must be
computed to give the next token's logits), starts an asynchronous load of it, and runs the
model on the rest only. The model's cache is a :class:`KVStrataCache`, a transformers ``Cache``
of :class:`RestoringLayer` s: layer *i*'s first ``update`` waits for layer *i* of the restored
blocks only, so layer *i* computes while later layers are still arriving. When generation ends,
the full blocks of everything computed (prompt and answer) are stored, so the next turn of a
conversation finds its history.

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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvstrata.cache import LoadHandle, LoadResult, TieredCache
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout

_DTYPES = {torch.bfloat16: DType.BF16, torch.float16: DType.FP16, torch.float32: DType.FP32}


def model_layout(config: Any, block_tokens: int, dtype: torch.dtype) -> KVLayout:
    """The kvstrata block layout of a Hugging Face decoder config (MHA/GQA; batch 1, no TP)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if dtype not in _DTYPES:
        raise ValueError(f"KV dtype {dtype} is not supported: use bfloat16, float16 or float32")
    return KVLayout(config.num_hidden_layers, block_tokens, kv_heads, head_dim, _DTYPES[dtype])


class RestoredPrefix:
    """The first ``tokens`` tokens' KV, arriving layer by layer from a :class:`LoadHandle`."""

    def __init__(self, handle: LoadHandle, tokens: int, timeout_s: float = 120.0) -> None:
        self.handle = handle
        self.tokens = tokens
        self.timeout_s = timeout_s
        self.layers_before_done = 0  # layers whose compute began while later layers were still loading

    def layer(self, i: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s K and V as ``[1, kv_heads, tokens, head_dim]`` on ``device`` (waits for it)."""
        self.handle.wait_layer(i, self.timeout_s)
        self.layers_before_done += not self.handle.done()
        kv = torch.cat([self.handle.block(b)[i] for b in range(self.handle.blocks)], dim=1)  # [2, tokens, H, D]
        kv = kv.to(device, non_blocking=True).permute(0, 2, 1, 3).unsqueeze(1)  # [2, 1, H, tokens, D]
        return kv[0], kv[1]


class RestoringLayer(DynamicLayer):
    """A DynamicLayer whose first update prepends this layer of a restored prefix."""

    def __init__(self, index: int, prefix: RestoredPrefix | None = None) -> None:
        super().__init__()
        self.index = index
        self.prefix = prefix

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return self.prefix.tokens if self.prefix is not None else 0
        return super().get_seq_length()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized and self.prefix is not None:
            self.lazy_initialization(key_states, value_states)
            keys, values = self.prefix.layer(self.index, key_states.device)
            self.keys, self.values = keys.to(key_states.dtype), values.to(value_states.dtype)
        return super().update(key_states, value_states, *args, **kwargs)


class StreamingLayer(RestoringLayer):
    """KV kept in host memory; each update copies this layer's KV to the device (prefetched
    while the layer before ran) and starts the next layer's copy."""

    def __init__(self, index: int, stream: StreamedKV, prefix: RestoredPrefix | None = None) -> None:
        super().__init__(index, prefix)
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

    def __init__(self, num_layers: int, prefix: RestoredPrefix | None = None, stream: StreamedKV | None = None):
        if stream is None:
            layers = [RestoringLayer(i, prefix) for i in range(num_layers)]
        else:
            layers = [StreamingLayer(i, stream, prefix) for i in range(num_layers)]
        super().__init__(layers=layers)
        self.stream = stream

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
    """

    tokens: list[int]
    first_logits: torch.Tensor
    ttft_s: float
    seconds: float
    hit_tokens: int = 0
    load: LoadResult | None = None
    stored_blocks: int = 0
    stream_bytes_per_step: float = 0.0
    extra: dict = field(default_factory=dict)


class KVStrataLM:
    """Greedy generation with a transformers causal LM whose prefix KV comes from kvstrata.

    The TieredCache's layout must be :func:`model_layout` of the model (checked), so blocks
    stored by one model never load into another (the namespace carries model id and layout).
    """

    def __init__(self, model: Any, cache: TieredCache | None, tenant: str = "") -> None:
        self.model = model
        self.cache = cache
        self.tenant = tenant
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
    ) -> Generation:
        if not prompt:
            raise ValueError("prompt is empty: at least one token is needed")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        start = time.perf_counter()
        prefix, handle = None, None
        if reuse and self.cache is not None:
            match = self.cache.lookup(prompt[:-1], self.tenant)  # the last token is always computed
            if match.blocks:
                handle = self.cache.load(match)
                try:
                    # How many blocks the load holds is settled once layer 0 is in; later layers
                    # keep arriving while the model computes.
                    handle.wait_layer(0, 120.0)
                    loaded = handle.blocks * self.cache.layout.block_tokens
                except Exception:  # noqa: BLE001 - a failed restore is recomputed, never served
                    handle.release()
                    handle, loaded = None, 0
                if loaded:
                    prefix = RestoredPrefix(handle, loaded)
        stream = None
        if streaming:
            pin = self.device.type == "cuda"
            stream = StreamedKV(self.num_layers, torch.device("cpu"), pin)
        kv_cache = KVStrataCache(self.num_layers, prefix, stream)
        try:
            hit = prefix.tokens if prefix is not None else 0
            ids = torch.tensor([prompt[hit:]], device=self.device)
            logits = self.model(input_ids=ids, past_key_values=kv_cache, use_cache=True).logits[0, -1]
            token = int(logits.argmax())
            ttft = time.perf_counter() - start
            load = handle.wait() if handle is not None else None
            if handle is not None:
                handle.release()
            first_logits = logits.float().cpu()
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
        finally:
            if handle is not None:
                handle.release()
            if stream is not None:
                stream.close()
        extra = {"layers_before_load_done": prefix.layers_before_done} if prefix is not None else {}
        return Generation(tokens, first_logits, ttft, time.perf_counter() - start, hit, load, stored, per_step, extra)
