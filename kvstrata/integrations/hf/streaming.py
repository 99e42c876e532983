"""Per-step DRAM streaming (the sixth of the planner's seven architectures): the sequence's KV lives in host memory.

With ``streaming=True`` (:meth:`~kvstrata.integrations.hf.generate.KVStrataLM.generate`) the
sequence's KV lives in host memory (pinned on CUDA) and only two layers' KV are on the device at
a time: each layer's KV crosses host -> device just before the layer runs, while the next
layer's copy is already under way (a CUDA stream, or a worker thread on a CPU-only host). Every
decode step therefore moves the whole KV once across the host link;
:class:`~kvstrata.integrations.hf.generate.Generation` reports those bytes. Tokens equal the
resident run's: the same values meet the same arithmetic.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvstrata.integrations.hf.cache import RestoringLayer
from kvstrata.transfer.placement import io_thread_started


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
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvstrata-stream", initializer=io_thread_started)
        self._cuda_stream = None

    def layer(self, index: int) -> StreamingLayer:
        """The cache layer ``index`` that streams through these buffers."""
        return StreamingLayer(index, self)

    def host_kv(self) -> list[torch.Tensor]:
        """Every layer's KV in host memory, ``[2, kv_heads, tokens, head_dim]`` each (batch 1),
        up to the shortest layer's length."""
        n = min(self.lengths)
        return [self.buffers[i][:, 0, :, :n] for i in range(self.layers)]

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
