"""The simulator's time model: prefill and decode-step seconds on one instance of K GPUs.

Stated formulas (pure arithmetic, no hardware access):

* Prefill of ``n`` new tokens after ``c`` cached tokens (the prefix hit):
  ``FLOPs = 2 * active_params * n + 4 * hidden * sum over attention groups of layers * A``,
  where ``hidden = attention_heads * head_dim`` and ``A`` the tokens the new ones attend to,
  summed (QK^T and PV): ``n * (c + n / 2)`` for full attention (each new token attends on
  average to ``c + n / 2``), capped at the window for a windowed group
  (:func:`kvstrata.plan.footprint.attended_tokens`). Recurrent (state) layers' work is in
  ``active_params``. Seconds = FLOPs / (K x bf16 dense TFLOPS x ``COMPUTE_EFFICIENCY``).
* A decode step of a batch of ``b`` requests: attention reads every kept token, so per GPU it
  reads the active weights' share plus what the batch holds (each group's kept tokens, each
  request's state; :class:`kvstrata.sim.batchkv.BatchKV`), over the GPU's HBM bandwidth; or
  it is compute bound, ``(2 * active_params * b + 4 * hidden * sum of layers * kept tokens) /
  (K x TFLOPS x efficiency)``, whichever is longer. A dense model holding ``S`` tokens reads
  ``active_params * weight_bytes / K + S * bytes_per_token_per_gpu``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.hardware.catalog import gpu_model
from kvstrata.hardware.flows import GB
from kvstrata.hardware.specs import HardwareProfile
from kvstrata.kv.geometry import KVGeometry
from kvstrata.plan.footprint import attended_tokens, held_bytes

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
        geometry: the model, whose groups size what is held and read.
        active_params: parameters used per token.
        attn_widths: per group, ``layers * hidden``, the attention FLOPs coefficient per token
            pair / 4 (0 for a state group).
    """

    tp: int
    flops_per_s: float
    hbm_bytes_per_s: float
    weight_bytes_per_gpu: int
    geometry: KVGeometry
    active_params: int
    attn_widths: tuple[int, ...]

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
            geometry=geometry,
            active_params=geometry.active_params,
            attn_widths=tuple(g.num_layers * hidden if g.kind.per_token else 0 for g in geometry.groups),
        )

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill ``new_tokens`` after ``cached_tokens`` already in HBM."""
        n = new_tokens
        attention = sum(
            4 * width * attended_tokens(cached_tokens, n, group.span)
            for group, width in zip(self.geometry.groups, self.attn_widths) if width
        )
        return (2 * self.active_params * n + attention) / self.flops_per_s

    def decode_step_bytes_per_gpu(self, held: tuple[int, ...]) -> int:
        """Bytes one GPU reads in a step of a batch holding ``held`` (per group, as
        :meth:`kvstrata.sim.batchkv.BatchKV.held` gives it)."""
        return self.weight_bytes_per_gpu + held_bytes(self.geometry, held, self.tp)

    def decode_step_s(self, batch: int, held: tuple[int, ...]) -> float:
        """Seconds of one decode step of ``batch`` requests holding ``held``: the larger of HBM
        reading and compute."""
        if batch <= 0:
            return 0.0
        memory_s = self.decode_step_bytes_per_gpu(held) / self.hbm_bytes_per_s
        attention = sum(4 * width * kept for width, kept in zip(self.attn_widths, held))
        flops = 2 * self.active_params * batch + attention
        return max(memory_s, flops / self.flops_per_s)
