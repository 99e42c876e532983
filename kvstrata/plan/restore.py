"""Restore time of a cached prefix along each of the seed's paths, into the GPUs of one instance.

A request on K GPUs (tensor parallel) restores K shards at once, one into each GPU; the
shards share links max-min fairly, so a shared switch uplink or a NIC serving two GPUs shows
up in the aggregate. The restore's time is the slowest shard's; its bottleneck is that
shard's bottleneck link.

Paths (the seed's three, and NVMe):
  local DRAM -> HBM: each GPU reads its NUMA-local socket's DRAM over PCIe (a CUDA copy).
  remote DRAM -> HBM (GDR): pool DRAM -> pool NIC -> fabric -> local NIC -> PCIe -> HBM.
  remote -> local DRAM -> HBM: RDMA into local DRAM, then a CUDA copy (two hops, in sequence).
  NVMe -> DRAM -> HBM: the drive on the GPU's socket into DRAM, then a CUDA copy.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from kvstrata.hardware.catalog import nic_model
from kvstrata.hardware.flows import GB, Flow, flow_along, max_min_share, run_concurrently
from kvstrata.hardware.specs import HardwareProfile
from kvstrata.hardware.topology import NodeKind, Path


class RestorePath(enum.Enum):
    LOCAL_DRAM = "local DRAM -> HBM (CUDA copy)"
    REMOTE_GDR = "remote DRAM -> HBM (GPUDirect RDMA)"
    REMOTE_TWO_HOP = "remote DRAM -> local DRAM -> HBM (two hops)"
    NVME = "NVMe -> DRAM -> HBM"
    PD_HANDOFF = "prefill GPU -> decode GPU (P/D handoff)"

    @property
    def short(self) -> str:
        return _SHORT[self]


_SHORT = {
    RestorePath.LOCAL_DRAM: "DRAM -> HBM",
    RestorePath.REMOTE_GDR: "remote -> HBM (GDR)",
    RestorePath.REMOTE_TWO_HOP: "remote -> DRAM -> HBM",
    RestorePath.NVME: "NVMe -> DRAM -> HBM",
    RestorePath.PD_HANDOFF: "P/D handoff",
}


@dataclass(frozen=True)
class Stage:
    """One hop of a restore, all GPUs' shards moving concurrently."""

    route: str  # the first shard's route, for display
    seconds: float
    gbps: float  # aggregate over all shards
    bottleneck: str  # the slowest shard's
    bottlenecks: int = 1  # distinct resources bounding the shards side by side: gbps sums them


@dataclass(frozen=True)
class RestoreEstimate:
    path: RestorePath
    size_bytes: int
    stages: tuple[Stage, ...]
    unavailable: str | None = None  # why this hardware has no such path

    @property
    def available(self) -> bool:
        return self.unavailable is None

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.stages)

    @property
    def gbps(self) -> float:
        """Bytes restored per second, end to end (stages in sequence)."""
        return self.size_bytes / self.seconds / GB if self.seconds > 0 else 0.0

    @property
    def bottleneck(self) -> str:
        return max(self.stages, key=lambda s: s.seconds).bottleneck if self.stages else "-"

    @property
    def bottlenecks(self) -> int:
        """Resources bounding the slowest stage side by side (e.g. one NIC port per GPU): its
        rate is their aggregate, each carrying about 1/n of it."""
        return max(self.stages, key=lambda s: s.seconds).bottlenecks if self.stages else 0


def instance_gpus(profile: HardwareProfile, count: int) -> list[str]:
    if not 1 <= count <= len(profile.gpus):
        raise ValueError(f"gpus must be between 1 and {len(profile.gpus)} for profile {profile.name!r}, got {count}")
    return [g.name for g in profile.gpus[:count]]


def local_dram(profile: HardwareProfile, gpu: str) -> str:
    return f"{profile.socket_of(profile.gpu(gpu).attach)}.dram"


def nic_for(profile: HardwareProfile, gpu: str) -> str:
    """The NIC a GPU receives through: the k-th NIC beside it for the k-th GPU beside it."""
    attach = profile.gpu(gpu).attach
    peers = [g.name for g in profile.gpus if g.attach == attach]
    nics = [n.name for n in profile.nics if attach in n.attach]
    if not nics:  # none on its switch: any NIC on its socket, else the first
        socket = profile.socket_of(attach)
        nics = [n.name for n in profile.nics if any(profile.socket_of(a) == socket for a in n.attach)]
        nics = nics or [n.name for n in profile.nics]
    return nics[peers.index(gpu) % len(nics)]


def _stage(flows: list[Flow]) -> Stage:
    done = run_concurrently(flows)
    slowest = max(done, key=lambda c: c.finish_s)
    total = sum(f.size_bytes for f in flows)
    transfer_s = max(c.finish_s - c.flow.latency_s for c in done)
    moving = {c.bottleneck.key for c in done if c.flow.size_bytes} or {slowest.bottleneck.key}
    return Stage(
        route=flows[0].path.describe() if flows[0].path else flows[0].name,
        seconds=slowest.finish_s,
        gbps=total / transfer_s / GB if transfer_s > 0 else 0.0,  # nothing moved: 0, never inf
        bottleneck=slowest.bottleneck.label,
        bottlenecks=len(moving),
    )


def _finish_together(size: int, rates: list[float], latencies: list[float]) -> list[int]:
    """Split ``size`` bytes over parallel sub-flows (bytes/s, seconds) so all finish at the
    same time T: part_i = rate_i x (T - latency_i); a sub-flow too slow to start before T
    gets nothing. Parts are whole bytes summing to ``size``."""
    if size == 0:
        return [0] * len(rates)
    active = list(range(len(rates)))
    while True:
        rate = sum(rates[i] for i in active)
        finish = (size + sum(rates[i] * latencies[i] for i in active)) / rate
        late = [i for i in active if latencies[i] >= finish]
        if not late:
            break
        active = [i for i in active if i not in late]
    parts = [0] * len(rates)
    for i in active:
        parts[i] = int(rates[i] * (finish - latencies[i]))
    parts[active[0]] += size - sum(parts)
    return parts


def _distinct(paths: list[Path]) -> list[Path]:
    """The same route reached through two waypoint lists counts once."""
    seen, out = set(), []
    for path in paths:
        key = tuple((h.src, h.dst) for h in path.hops)
        if key not in seen:
            seen.add(key)
            out.append(path)
    return out


class RestorePlanner:
    """Restore estimates for one profile and one set of GPUs."""

    def __init__(self, profile: HardwareProfile, gpus: list[str]) -> None:
        self.profile = profile
        self.topology = profile.topology
        self.gpus = gpus
        # (ends per GPU, pool_side) -> per GPU its sub-routes as unit flows, and each one's
        # rate when all run: both depend on the topology only, which is frozen, never on sizes.
        self._network: dict[tuple, tuple[list[list[Flow]], list[float]]] = {}

    def network_flows(self, src_of, dst_of, shard_bytes: list[int], pool_side: bool) -> list[Flow]:
        """Flows of one network stage: each GPU's shard across its NIC.

        Each shard is spread over every port of the GPU's NIC and every host link of that NIC
        (Socket Direct), bytes split in proportion to what each sub-flow gets when all run.

        Args:
            src_of: GPU name -> the node its shard leaves from (e.g. ``"pool.dram"``).
            dst_of: GPU name -> the node its shard lands on (the GPU, or its local DRAM).
            shard_bytes: bytes per GPU, in the order of ``self.gpus``.
            pool_side: the far end is the pool's NICs (else a peer node's NIC of the same name).

        Returns:
            One flow per used sub-route, GPU by GPU.
        """
        ends = tuple((src_of(g), dst_of(g)) for g in self.gpus)
        if (ends, pool_side) not in self._network:
            self._network[ends, pool_side] = self._unit_flows(ends, pool_side)
        shards, shares = self._network[ends, pool_side]
        rates = iter(shares)
        flows = []
        for units, size in zip(shards, shard_bytes):
            parts = _finish_together(size, [next(rates) for _ in units], [u.latency_s for u in units])
            kept = [(unit, part) for unit, part in zip(units, parts) if part] or [(units[0], 0)]
            # A flow's resources do not depend on its size: the unit flow resized is flow_along's.
            flows.extend(dataclasses.replace(unit, size_bytes=part) for unit, part in kept)
        return flows

    def _unit_flows(self, ends: tuple[tuple[str, str], ...], pool_side: bool) -> tuple[list[list[Flow]], list[float]]:
        shards: list[list[Path]] = []
        for i, (gpu, (src, dst)) in enumerate(zip(self.gpus, ends)):
            nic = nic_for(self.profile, gpu)
            spec = next(n for n in self.profile.nics if n.name == nic)
            routes = []
            for port in range(len(nic_model(spec.model).port_gbit)):
                far = f"pool.nic{i % self.profile.pool.nics}.p{port}" if pool_side else f"peer.{nic}.p{port}"
                for attach in spec.attach:
                    waypoints = (far, f"{nic}.p{port}", nic, attach)
                    routes.append(self.topology.route(src, dst, via=waypoints))
            shards.append(_distinct(routes))
        units = [[flow_along(self.topology, path, 1) for path in paths] for paths in shards]
        shares = [s.gbps * GB for s in max_min_share([u for per_gpu in units for u in per_gpu])]
        return units, shares

    def local_flows(self, shard_bytes: list[int], src_of) -> list[Flow]:
        """Flows of one local stage: each GPU's shard from a node of its host into the GPU.

        Args:
            shard_bytes: bytes per GPU, in the order of ``self.gpus``.
            src_of: GPU name -> the node its shard leaves from (e.g. its socket's DRAM).

        Returns:
            One flow per GPU, along the topology's route for that size.
        """
        return [
            flow_along(self.topology, self.topology.route(src_of(g), g, size_bytes=size), size)
            for g, size in zip(self.gpus, shard_bytes)
        ]

    def restore(self, path: RestorePath, shard_bytes: list[int]) -> RestoreEstimate:
        total = sum(shard_bytes)
        p, dram = self.profile, lambda g: local_dram(self.profile, g)
        if path is RestorePath.LOCAL_DRAM:
            return RestoreEstimate(path, total, (_stage(self.local_flows(shard_bytes, dram)),))
        if path in (RestorePath.REMOTE_GDR, RestorePath.REMOTE_TWO_HOP):
            if p.pool is None or not p.nics:
                return RestoreEstimate(path, total, (), "no remote DRAM pool or no NIC in this profile")
            if path is RestorePath.REMOTE_GDR:
                flows = self.network_flows(lambda g: "pool.dram", lambda g: g, shard_bytes, pool_side=True)
                return RestoreEstimate(path, total, (_stage(flows),))
            first = _stage(self.network_flows(lambda g: "pool.dram", dram, shard_bytes, pool_side=True))
            return RestoreEstimate(path, total, (first, _stage(self.local_flows(shard_bytes, dram))))
        if path is RestorePath.NVME:
            if not p.nvmes:
                return RestoreEstimate(path, total, (), "no NVMe drive in this profile")
            first = _stage(
                [
                    flow_along(self.topology, self.topology.route(self.drive_for(g), dram(g), size_bytes=size), size)
                    for g, size in zip(self.gpus, shard_bytes)
                ]
            )
            return RestoreEstimate(path, total, (first, _stage(self.local_flows(shard_bytes, dram))))
        if path is RestorePath.PD_HANDOFF:
            if not p.nics:
                return RestoreEstimate(path, total, (), "no NIC in this profile: no cross-node handoff")
            flows = self.network_flows(lambda g: f"peer.{g}", lambda g: g, shard_bytes, pool_side=False)
            return RestoreEstimate(path, total, (_stage(flows),))
        raise ValueError(f"unknown restore path {path!r}")

    def drive_for(self, gpu: str) -> str:
        """The NVMe drive a GPU restores from.

        Args:
            gpu: the GPU's name.

        Returns:
            The first drive on the GPU's socket, else the profile's first drive; drives are
            shared when there are fewer than GPUs.
        """
        socket = self.profile.socket_of(self.profile.gpu(gpu).attach)
        drives = [n.name for n in self.topology.of_kind(NodeKind.FLASH) if n.socket == socket]
        return (drives or [n.name for n in self.topology.of_kind(NodeKind.FLASH)])[0]
