"""``make_plan``: one model, one hardware profile, one request shape -> every path and scheme."""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.hardware.specs import HardwareProfile
from kvstrata.hardware.topology import NodeKind
from kvstrata.kv.geometry import KVGeometry
from kvstrata.plan.architectures import (
    DRAM_KV_FRACTION,
    HBM_USABLE_FRACTION,
    ArchitectureEstimate,
    Capacity,
    StepInputs,
    compare_architectures,
    hbm_step_seconds,
)
from kvstrata.plan.footprint import GroupBytes, first_layer_bytes, request_bytes, restore_bytes, stored_bytes
from kvstrata.plan.restore import RestoreEstimate, RestorePath, RestorePlanner, instance_gpus
from kvstrata.plan.sizing import InstanceSizing, size_instances

SEED_PATHS = (RestorePath.LOCAL_DRAM, RestorePath.REMOTE_GDR, RestorePath.REMOTE_TWO_HOP, RestorePath.NVME)


@dataclass(frozen=True)
class Plan:
    geometry: KVGeometry
    profile: HardwareProfile
    context_tokens: int
    cached_tokens: int
    gpus: tuple[str, ...]
    restore: tuple[RestoreEstimate, ...]
    architectures: tuple[ArchitectureEstimate, ...]
    capacity: Capacity
    sizing: InstanceSizing  # why these GPUs, and whether the weights fit on them
    restore_groups: GroupBytes  # each KV group's part of the restore, bytes per GPU

    @property
    def tp(self) -> int:
        return len(self.gpus)

    @property
    def restore_bytes(self) -> int:
        return self.restore[0].size_bytes

    def restore_for(self, path: RestorePath) -> RestoreEstimate:
        return next(r for r in self.restore if r.path is path)

    def to_json(self) -> dict:
        g = self.geometry
        return {
            "model": g.name,
            "hardware": self.profile.name,
            "context_tokens": self.context_tokens,
            "cached_tokens": self.cached_tokens,
            "gpus": list(self.gpus),
            "gpus_basis": self.sizing.basis.value,
            "weight_bytes": self.sizing.weight_bytes,
            "weights_uncounted": list(g.uncounted_params),  # the weight bytes are at least weight_bytes
            "dtype": g.dtype.name.lower(),
            "bytes_per_token": g.bytes_per_token,
            "bytes_per_token_per_gpu": g.bytes_per_token_per_gpu(self.tp),
            "restore_bytes": self.restore_bytes,
            "context_bytes": g.kv_bytes(self.context_tokens),
            "groups": [
                {
                    "kind": share.group.kind.value,
                    "label": share.group.label,
                    "layers": share.group.num_layers,
                    "span": share.group.span,
                    "restore_tokens": share.tokens,
                    "restore_bytes": share.size_bytes * self.tp,
                    "restore_bytes_per_gpu": share.size_bytes,
                }
                for share in self.restore_groups.shares
            ],
            "restore": [
                {
                    "path": r.path.value,
                    "bottleneck": r.bottleneck if r.available else None,
                    "bottlenecks": r.bottlenecks if r.available else None,
                    "gbps": r.gbps if r.available else None,
                    "seconds": r.seconds if r.available else None,
                    "unavailable": r.unavailable,
                    "stages": [
                        {"route": s.route, "seconds": s.seconds, "gbps": s.gbps, "bottleneck": s.bottleneck,
                         "bottlenecks": s.bottlenecks}
                        for s in r.stages
                    ],
                }
                for r in self.restore
            ],
            "capacity": {
                "hbm_tokens": self.capacity.hbm_tokens,
                "dram_tokens": self.capacity.dram_tokens,
                "pool_tokens": self.capacity.pool_tokens,
                "nvme_tokens": self.capacity.nvme_tokens,
                "weights_fit": self.capacity.weights_fit,
            },
            "architectures": [
                {
                    "key": a.arch.value,
                    "name": a.arch.title,
                    "why": a.arch.why,
                    "cost": a.arch.cost,
                    "capacity_tokens": a.capacity_tokens,
                    "concurrent_requests": a.concurrent_requests,
                    "first_wait_s": a.first_wait_s,
                    "first_wait_path": a.first_wait_path.value if a.first_wait_path else None,
                    "per_step_external_bytes": a.per_step_external_bytes,
                    "per_step_external_s": a.per_step_external_s,
                    "per_step_hbm_s": a.per_step_hbm_s,
                    "per_step_s": a.per_step_s,
                    "bound_by": a.bound_by,
                    "unavailable": a.unavailable,
                }
                for a in self.architectures
            ],
        }


def auto_gpus(geometry: KVGeometry, profile: HardwareProfile) -> int:
    """The default GPUs of one request: :func:`kvstrata.plan.sizing.size_instances`' choice,
    the fewest whose usable HBM holds the weights with ``KV_MARGIN_FRACTION`` left for KV."""
    return size_instances(geometry, profile, instances=1).gpus_per_instance


def _capacity(geometry: KVGeometry, profile: HardwareProfile, gpus: list[str], context_tokens: int) -> Capacity:
    """Each store's capacity in tokens of requests of ``context_tokens`` tokens.

    HBM holds running requests, each :func:`~kvstrata.plan.footprint.request_bytes` per GPU;
    an off-GPU store keeps one logical copy of each request's prefix,
    :func:`~kvstrata.plan.footprint.stored_bytes` with one end. Tokens are whole bytes times the
    context over a request's bytes, so whole requests are ``tokens // context_tokens``; a dense
    model's tokens are bytes over bytes per token.
    """
    topo = profile.topology
    tp = len(gpus)
    per_gpu_free = min(topo.node(g).capacity_bytes for g in gpus) * HBM_USABLE_FRACTION - geometry.weight_bytes() / tp
    hbm_tokens = max(0, int(per_gpu_free)) * context_tokens // request_bytes(geometry, context_tokens, tp)
    stored = stored_bytes(geometry, context_tokens)

    def tokens(kind: NodeKind, fraction: float) -> int | None:
        nodes = [n for n in topo.of_kind(kind) if not n.name.startswith("peer.")]
        if not nodes:
            return None
        return int(sum(n.capacity_bytes for n in nodes) * fraction) * context_tokens // stored

    return Capacity(
        hbm_tokens=hbm_tokens,
        dram_tokens=tokens(NodeKind.DRAM, DRAM_KV_FRACTION) or 0,
        pool_tokens=tokens(NodeKind.REMOTE_DRAM, DRAM_KV_FRACTION),
        nvme_tokens=tokens(NodeKind.FLASH, 1.0),
        weights_fit=per_gpu_free > 0,
    )


def pool_capacity_bytes(profile: HardwareProfile) -> int | None:
    """The pool's KV capacity (``DRAM_KV_FRACTION`` of its DRAM, as :func:`_capacity` counts it);
    None where the hardware has no pool."""
    nodes = [n for n in profile.topology.of_kind(NodeKind.REMOTE_DRAM) if not n.name.startswith("peer.")]
    return int(sum(n.capacity_bytes for n in nodes) * DRAM_KV_FRACTION) if nodes else None


def make_plan(
    geometry: KVGeometry,
    profile: HardwareProfile,
    context_tokens: int,
    cached_tokens: int | None = None,
    gpus: int | None = None,
) -> Plan:
    """Restore estimates for the cached prefix on every path, and the seven architectures.

    Args:
        geometry: the model's KV geometry.
        profile: the hardware.
        context_tokens: the request's context length (prompt plus history).
        cached_tokens: the cached prefix to restore; defaults to the whole context.
        gpus: GPUs the request spans (tensor parallel); defaults to ``auto_gpus``.
    """
    if not isinstance(context_tokens, int) or context_tokens <= 0:
        raise ValueError(f"context must be a positive number of tokens, got {context_tokens!r}")
    cached = context_tokens if cached_tokens is None else cached_tokens
    if not isinstance(cached, int) or not 0 <= cached <= context_tokens:
        raise ValueError(f"cached must be between 0 and context ({context_tokens}) tokens, got {cached!r}")
    if not profile.gpus:
        raise ValueError(f"profile {profile.name!r} has no GPU to plan for")
    sizing = size_instances(geometry, profile, gpus, instances=1)  # checks a count asked for
    names = instance_gpus(profile, sizing.gpus_per_instance)
    tp = len(names)
    planner = RestorePlanner(profile, names)
    groups = restore_bytes(geometry, cached, tp)  # the windows before the prefix end, one state snapshot
    restores = {p: planner.restore(p, [groups.size_bytes] * tp) for p in SEED_PATHS}
    kv_shard = request_bytes(geometry, context_tokens, tp)  # what the request holds and each step reads
    full = {p: planner.restore(p, [kv_shard] * tp) for p in (RestorePath.LOCAL_DRAM, RestorePath.PD_HANDOFF)}
    hbm_gbps = min(profile.topology.node(g).bandwidth.effective_gbps for g in names)
    weights_share = geometry.active_params * geometry.effective_weight_dtype.size_bytes // tp
    step = StepInputs(
        context_tokens, kv_shard, hbm_step_seconds(weights_share + kv_shard, hbm_gbps),
        kv_shard / first_layer_bytes(geometry, context_tokens, tp),
    )
    capacity = _capacity(geometry, profile, names, context_tokens)
    archs = compare_architectures(capacity, step, restores, full)
    return Plan(geometry, profile, context_tokens, cached, tuple(names), tuple(restores.values()), tuple(archs),
                capacity, sizing, groups)


def ratios(a: Plan, b: Plan) -> dict:
    """b relative to a: restore speed-ups (a.seconds / b.seconds) and first-wait speed-ups."""

    def ratio(x: float | None, y: float | None) -> float | None:
        return x / y if x and y else None

    return {
        "restore_speedup": {
            ra.path.value: ratio(ra.seconds if ra.available else None, rb.seconds if rb.available else None)
            for ra, rb in zip(a.restore, b.restore)
        },
        "first_wait_speedup": {
            ea.arch.value: ratio(ea.first_wait_s, eb.first_wait_s) for ea, eb in zip(a.architectures, b.architectures)
        },
        "per_step_speedup": {
            ea.arch.value: ratio(ea.per_step_s, eb.per_step_s) for ea, eb in zip(a.architectures, b.architectures)
        },
    }
