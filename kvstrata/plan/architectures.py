"""The seed's seven KV architectures: capacity, first wait and per-decode-step cost.

Each is judged for one request of ``context`` tokens on one instance of K GPUs:
  capacity: how many tokens (and requests of this context) the scheme's KV store holds,
    after the model's weights where it is HBM;
  first wait: time before decode can start, spent moving KV to the GPUs;
  per step: decode reads all of the request's kept KV every step (from HBM): every token of
    full-attention layers, the window of windowed ones, the state of recurrent ones
    (:mod:`kvstrata.plan.footprint`); a scheme that streams KV from DRAM moves it across PCIe
    every step as well. Prefix caching cuts the first wait only; it never reduces the per-step
    reads of history.

Stated assumptions: 90% of HBM is usable (vLLM's default ``gpu_memory_utilization``), 80% of
DRAM holds KV (the rest for the OS and staging buffers); a decode step of one request reads
the active weights' share of each GPU plus its KV shard.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from kvstrata.hardware.flows import GB
from kvstrata.plan.restore import RestoreEstimate, RestorePath

HBM_USABLE_FRACTION = 0.9
DRAM_KV_FRACTION = 0.8


class Architecture(enum.Enum):
    HBM_RESIDENT = "hbm"
    LOCAL_DRAM = "local-dram"
    REMOTE_GDR = "remote-gdr"
    REMOTE_STAGED = "remote-staged"
    PD_HANDOFF = "pd-handoff"
    DRAM_STREAMING = "dram-streaming"
    NVME = "nvme"

    @property
    def title(self) -> str:
        return _TEXT[self][0]

    @property
    def why(self) -> str:
        return _TEXT[self][1]

    @property
    def cost(self) -> str:
        return _TEXT[self][2]


_TEXT = {
    Architecture.HBM_RESIDENT: (
        "active KV stays in HBM",
        "every decode step reads local memory; best latency",
        "reserves HBM; limits contexts and concurrent requests",
    ),
    Architecture.LOCAL_DRAM: (
        "local DRAM holds KV, loaded into HBM on use",
        "larger cache from host memory; hits only cross local links",
        "load bound by PCIe and memory placement; not shareable across machines",
    ),
    Architecture.REMOTE_GDR: (
        "remote DRAM, written straight into HBM (GDR)",
        "many instances reuse the same KV; no target-side bounce",
        "request waits for the network; contends with other GPU traffic on the NIC",
    ),
    Architecture.REMOTE_STAGED: (
        "remote KV lands in local DRAM, then HBM",
        "prefetch from remote and keep a local reusable copy",
        "first use pays two hops; extra host-memory read and write",
    ),
    Architecture.PD_HANDOFF: (
        "prefill GPU hands KV to the decode GPU (P/D)",
        "schedule prefill and decode separately",
        "source GPU holds the KV until the transfer ends; cross-node handoff is network bound",
    ),
    Architecture.DRAM_STREAMING: (
        "read needed KV from DRAM before every step",
        "runs contexts larger than HBM can hold",
        "the same KV re-crosses PCIe every step; per-token time bound by external bandwidth",
    ),
    Architecture.NVME: (
        "colder KV on NVMe SSD",
        "cheap capacity for KV reused much later",
        "storage I/O wait; needs earlier prefetch and its own restore estimate",
    ),
}


@dataclass(frozen=True)
class Capacity:
    """Token capacities of each store, for one instance."""

    hbm_tokens: int
    dram_tokens: int
    pool_tokens: int | None
    nvme_tokens: int | None
    weights_fit: bool


@dataclass(frozen=True)
class ArchitectureEstimate:
    arch: Architecture
    capacity_tokens: int | None
    concurrent_requests: int | None
    first_wait_s: float | None
    first_wait_path: RestorePath | None
    per_step_external_bytes: int  # per GPU, per decode step
    per_step_external_s: float
    per_step_hbm_s: float
    unavailable: str | None = None

    @property
    def per_step_s(self) -> float:
        return max(self.per_step_external_s, self.per_step_hbm_s)

    @property
    def bound_by(self) -> str:
        return "PCIe (external)" if self.per_step_external_s > self.per_step_hbm_s else "HBM"


@dataclass(frozen=True)
class StepInputs:
    """What a decode step costs on this instance, shared by every architecture."""

    context_tokens: int
    kv_bytes_per_gpu: int  # the request's KV shard on one GPU: what it holds, what a step reads
    hbm_step_s: float  # weights' share + KV shard over HBM bandwidth
    stream_layers: float  # the shard over its first layer's part: a stream's first wait is 1/this of it


def compare_architectures(
    capacity: Capacity,
    step: StepInputs,
    restores: dict[RestorePath, RestoreEstimate],
    full_context: dict[RestorePath, RestoreEstimate],
) -> list[ArchitectureEstimate]:
    """Estimates for all seven, from the restore of the cached prefix (``restores``) and of
    the full context (``full_context``: P/D hands over all of it; streaming moves all each step)."""

    def per_request(tokens: int | None) -> int | None:
        return None if tokens is None else tokens // step.context_tokens

    def make(arch, tokens, path, est: RestoreEstimate | None, external_bytes=0, external_s=0.0, first=None):
        if est is not None and not est.available:
            return ArchitectureEstimate(arch, None, None, None, path, 0, 0.0, step.hbm_step_s, est.unavailable)
        wait = first if first is not None else (est.seconds if est is not None else 0.0)
        return ArchitectureEstimate(
            arch, tokens, per_request(tokens), wait, path, external_bytes, external_s, step.hbm_step_s
        )

    local = restores[RestorePath.LOCAL_DRAM]
    stream = full_context[RestorePath.LOCAL_DRAM]
    out = [
        make(Architecture.HBM_RESIDENT, capacity.hbm_tokens, None, None),
        make(Architecture.LOCAL_DRAM, capacity.dram_tokens, RestorePath.LOCAL_DRAM, local),
        make(Architecture.REMOTE_GDR, capacity.pool_tokens, RestorePath.REMOTE_GDR, restores[RestorePath.REMOTE_GDR]),
        make(
            Architecture.REMOTE_STAGED,
            capacity.pool_tokens,
            RestorePath.REMOTE_TWO_HOP,
            restores[RestorePath.REMOTE_TWO_HOP],
        ),
        make(
            Architecture.PD_HANDOFF, capacity.hbm_tokens, RestorePath.PD_HANDOFF, full_context[RestorePath.PD_HANDOFF]
        ),
        # Streaming keeps KV in DRAM; decode starts once the first layer's shard is in.
        make(
            Architecture.DRAM_STREAMING,
            capacity.dram_tokens,
            RestorePath.LOCAL_DRAM,
            stream,
            external_bytes=step.kv_bytes_per_gpu,
            external_s=stream.seconds,
            first=stream.seconds / step.stream_layers,
        ),
        make(Architecture.NVME, capacity.nvme_tokens, RestorePath.NVME, restores[RestorePath.NVME]),
    ]
    if not capacity.weights_fit:
        # No scheme serves a model whose weights overflow HBM: nothing is held. The reason is
        # the plan's one fact (``Capacity.weights_fit``), not each scheme's.
        out = [dataclasses.replace(e, capacity_tokens=0, concurrent_requests=0) for e in out]
    return out


def hbm_step_seconds(bytes_per_gpu: int, hbm_gbps: float) -> float:
    return bytes_per_gpu / (hbm_gbps * GB)
