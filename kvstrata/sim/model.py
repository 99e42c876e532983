"""The simulator's time model: prefill and decode-step seconds on one instance of K GPUs.

Stated formulas (pure arithmetic, no hardware access):

* Prefill of ``n`` new tokens after ``c`` cached tokens (the prefix hit):
  ``FLOPs = 2 * active_params * n + 4 * layers * hidden * n * (c + n / 2)``, where
  ``hidden = attention_heads * head_dim``; the second term is QK^T and PV over the causal
  context (each new token attends on average to ``c + n / 2`` tokens). Seconds =
  FLOPs / (K x bf16 dense TFLOPS x ``COMPUTE_EFFICIENCY``).
* A decode step of a batch of ``b`` requests holding ``S`` context tokens in all: dense
  attention reads every cached token, so per GPU it reads the active weights' share plus the
  batch's KV shard, ``active_params * weight_bytes / K + S * kv_bytes_per_token_per_gpu``, over
  the GPU's HBM bandwidth; or it is compute bound, ``(2 * active_params * b + 4 * layers *
  hidden * S) / (K x TFLOPS x efficiency)``, whichever is longer.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.hardware.catalog import gpu_model
from kvstrata.hardware.flows import GB
from kvstrata.hardware.profile import HardwareProfile
from kvstrata.kv.geometry import KVGeometry

COMPUTE_EFFICIENCY = 0.5  # achieved fraction of bf16 dense peak (model FLOPs utilisation)
TFLOP = 1e12


@dataclass(frozen=True)
class TimeModel:
    """Seconds of prefill and decode on one instance.

    Attributes:
        tp: GPUs of the instance (tensor parallel).
        flops_per_s: achieved FLOP/s of the whole instance.
        hbm_bytes_per_s: effective HBM bandwidth of one GPU (the slowest of the instance).
        weight_bytes_per_gpu: active weights each GPU reads per decode step.
        kv_bytes_per_token_per_gpu: KV shard of one token on one GPU.
        active_params: parameters used per token.
        attn_width: ``layers * hidden``, the attention FLOPs coefficient per token pair / 4.
    """

    tp: int
    flops_per_s: float
    hbm_bytes_per_s: float
    weight_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int
    active_params: int
    attn_width: int

    @classmethod
    def build(cls, geometry: KVGeometry, profile: HardwareProfile, gpus: list[str]) -> TimeModel:
        tp = len(gpus)
        tflops = min(gpu_model(profile.gpu(g).model).bf16_dense_tflops for g in gpus)
        hbm_gbps = min(profile.topology.node(g).bandwidth.effective_gbps for g in gpus)
        hidden = geometry.num_attention_heads * geometry.head_dim
        return cls(
            tp=tp,
            flops_per_s=tp * tflops * TFLOP * COMPUTE_EFFICIENCY,
            hbm_bytes_per_s=hbm_gbps * GB,
            weight_bytes_per_gpu=geometry.active_params * geometry.effective_weight_dtype.size_bytes // tp,
            kv_bytes_per_token_per_gpu=geometry.bytes_per_token_per_gpu(tp),
            active_params=geometry.active_params,
            attn_width=geometry.num_layers * hidden,
        )

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill ``new_tokens`` after ``cached_tokens`` already in HBM."""
        n = new_tokens
        flops = 2 * self.active_params * n + 4 * self.attn_width * n * (cached_tokens + n / 2)
        return flops / self.flops_per_s

    def decode_step_bytes_per_gpu(self, context_tokens: int) -> int:
        """Bytes one GPU reads in a step of a batch holding ``context_tokens`` in all."""
        return self.weight_bytes_per_gpu + context_tokens * self.kv_bytes_per_token_per_gpu

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """Seconds of one decode step: the larger of HBM reading and compute."""
        if batch <= 0:
            return 0.0
        memory_s = self.decode_step_bytes_per_gpu(context_tokens) / self.hbm_bytes_per_s
        flops = 2 * self.active_params * batch + 4 * self.attn_width * context_tokens
        return max(memory_s, flops / self.flops_per_s)
