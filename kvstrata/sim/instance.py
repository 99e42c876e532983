"""The simulator's instances: where each sits on the profile's servers, what its tiers and its
running batch may hold, and the flows a restore into it takes.

A fleet (:attr:`SimConfig.fleet_tp`) runs instances of different TP sizes on one shared pool,
its blocks keyed and sized by :class:`kvstrata.plan.sharing.KVSharing` (see
:mod:`kvstrata.sim.pool`). Instances are packed onto servers of the profile in the order
listed, each on consecutive GPUs of one server, a new server when the next does not fit the one
being filled; each server is a copy of the profile, its links and memories its own, and the
pool (every resource with a pool end) the one all share.

A stored block keeps every per-token group's KV of its tokens and a state snapshot at its end
(a hit may end at any block): :func:`kvstrata.plan.footprint.stored_bytes`; a dense model's
block is its tokens' bytes. HBM counts per GPU, the off-GPU stores one logical copy.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from kvstrata.fleet.pace import TokenPace
from kvstrata.hardware.flows import GB, Flow, Resource, flow_along, max_min_share
from kvstrata.hardware.specs import HardwareProfile
from kvstrata.hardware.topology import NodeKind
from kvstrata.media import Medium
from kvstrata.plan.architectures import DRAM_KV_FRACTION, HBM_USABLE_FRACTION
from kvstrata.plan.footprint import stored_bytes
from kvstrata.plan.restore import RestorePath, RestorePlanner, local_dram
from kvstrata.plan.sharing import KVSharing, pool_bytes
from kvstrata.sim.batchkv import BatchKV
from kvstrata.sim.config import SimConfig
from kvstrata.sim.lru import BlockLRU
from kvstrata.sim.model import TimeModel
from kvstrata.sim.pool import SharedPool
from kvstrata.sim.tiers import ArchSpec
from kvstrata.sim.trace import BLOCK_TOKENS


def pack_servers(tps: Sequence[int], node_gpus: int) -> list[tuple[int, int]]:
    """(server, first GPU) of each instance: packed in order onto servers of ``node_gpus`` GPUs,
    a new server when the next instance does not fit the rest of the current one."""
    out, server, used = [], 0, 0
    for tp in tps:
        if used + tp > node_gpus:
            server, used = server + 1, 0
        out.append((server, used))
        used += tp
    return out


def on_server(flows: list[Flow], server: int) -> list[Flow]:
    """``flows`` on copy ``server`` of the profile's node: each resource re-keyed as that server's,
    but those with a pool end (the pool's memory and NICs, which every server shares)."""
    if server == 0:
        return flows

    def own(r: Resource) -> Resource:
        if "pool." in r.key:
            return r
        return Resource(f"s{server}/{r.key}", f"server {server}: {r.label}", r.gbps)

    return [replace(f, uses=tuple((own(r), w) for r, w in f.uses)) for f in flows]


@dataclass
class Instance:
    """One instance: its GPUs and server, its tiers and limits, and its scheduling state (which the
    engine changes as it runs)."""

    index: int
    server: int  # which copy of the profile's node (see on_server)
    gpus: list[str]
    planner: RestorePlanner
    model: TimeModel
    caches: dict[Medium, BlockLRU]
    batch: BatchKV  # what the running batch holds, per KV group
    kv_limit_bytes: int  # what the running batch may hold: per GPU in HBM, the logical copy when streaming
    kv_limit_tp: int  # the ``tp`` the limit's bytes are counted at
    stream_bytes_per_s: float  # per GPU, DRAM -> HBM with all K GPUs streaming at once
    stream_flows: list[Flow]
    ready: deque = field(default_factory=deque)  # records waiting to prefill
    restore_queue: deque = field(default_factory=deque)  # (record, jobs) waiting for a slot
    restoring: int = 0
    decode_ready: deque = field(default_factory=deque)  # pd: handed off, waiting to join
    queued_tokens: int = 0  # prefill tokens of requests routed here and not yet prefilled
    busy: bool = False
    prefill_busy: bool = False  # pd: the prefill group
    running: list = field(default_factory=list)  # heap of (finish_step, seq, record, batch id)
    pace: TokenPace = field(default_factory=TokenPace)  # its decode's time per token, as a router sees it


def _total_bytes(profile: HardwareProfile, kind: NodeKind) -> int:
    """The capacity of the profile's nodes of ``kind``, the peer server's left out."""
    return sum(x.capacity_bytes for x in profile.topology.of_kind(kind) if not x.name.startswith("peer."))


def _blocks(config: SimConfig, tier: Medium, capacity_bytes: int, block_bytes: int) -> int:
    """Blocks of ``block_bytes`` in ``capacity_bytes``, or as many as the config's override for ``tier``."""
    overrides = dict(config.tier_tokens)
    return overrides[tier] // BLOCK_TOKENS if tier in overrides else capacity_bytes // block_bytes


def shared_pool(config: SimConfig) -> SharedPool:
    """The pool every instance shares: the profile's pool DRAM, in blocks of one logical copy."""
    block = stored_bytes(config.geometry, BLOCK_TOKENS)
    pool_dram = int(_total_bytes(config.profile, NodeKind.REMOTE_DRAM) * DRAM_KV_FRACTION)
    return SharedPool(_blocks(config, Medium.REMOTE, pool_dram, block) * block, block)


def build_instances(config: SimConfig, arch: ArchSpec, pool: SharedPool) -> list[Instance]:
    """The config's instances, packed onto the profile's servers (:func:`pack_servers`), each with
    its tiers of ``arch`` (the pool a view of ``pool``) and its running batch's limit."""
    g, p, tps = config.geometry, config.profile, config.instance_tps
    placed = pack_servers(tps, len(p.gpus))
    per_server = Counter(server for server, _ in placed)  # instances on a server share its DRAM and drives
    topo = p.topology
    block = stored_bytes(g, BLOCK_TOKENS)
    instances: list[Instance] = []
    for i, (k, (server, first)) in enumerate(zip(tps, placed)):
        gpus = [x.name for x in p.gpus[first : first + k]]
        model = TimeModel.build(g, p, gpus)
        # Every weight stays resident (a MoE's idle experts too), a 1/K share per GPU.
        hbm_free = max(0, int(min(topo.node(x).capacity_bytes for x in gpus) * HBM_USABLE_FRACTION
                              - g.weight_bytes() / k))
        host_bytes = int(_total_bytes(p, NodeKind.DRAM) * DRAM_KV_FRACTION / per_server[server])
        default = {
            Medium.DEVICE: _blocks(config, Medium.DEVICE, hbm_free, stored_bytes(g, BLOCK_TOKENS, tp=k)),
            Medium.HOST: _blocks(config, Medium.HOST, host_bytes, block),
            Medium.DISK: _blocks(config, Medium.DISK, int(_total_bytes(p, NodeKind.FLASH) / per_server[server]),
                                 block),
        }
        # TP-matched: an instance hits only its TP size's blocks, which cost every rank's copy.
        view = pool.view(k if config.sharing is KVSharing.MATCHED else None,
                         pool_bytes(g, BLOCK_TOKENS, k, config.sharing))
        caches = {tier: view if tier is Medium.REMOTE else BlockLRU(default[tier]) for tier in arch.tiers}
        planner = RestorePlanner(p, gpus)
        stream = on_server([flow_along(topo, topo.route(local_dram(p, x), x, size_bytes=1), 1) for x in gpus], server)
        stream_rate = min(s.gbps for s in max_min_share(stream)) * GB
        # The running batch lives in HBM (per GPU), or in DRAM when streaming (one logical copy).
        limit, limit_tp = (host_bytes, 1) if arch.streaming else (hbm_free, k)
        instances.append(
            Instance(i, server, gpus, planner, model, caches, BatchKV(g), limit, limit_tp, stream_rate, stream)
        )
    return instances


def restore_stages(inst: Instance, profile: HardwareProfile, path: RestorePath,
                   shard_bytes: int) -> list[Callable[[], list[Flow]]]:
    """The planner's flows for ``shard_bytes`` of KV per GPU along ``path``, stage by stage, on the
    instance's server (see :func:`on_server`)."""
    stages = _path_stages(inst, profile, path, shard_bytes)
    if inst.server == 0:
        return stages
    return [lambda stage=stage: on_server(stage(), inst.server) for stage in stages]


def _path_stages(inst: Instance, p: HardwareProfile, path: RestorePath,
                 shard_bytes: int) -> list[Callable[[], list[Flow]]]:
    """The planner's flows for ``shard_bytes`` of KV per GPU along ``path``, stage by stage."""
    shard = [shard_bytes] * len(inst.gpus)
    pl = inst.planner
    dram = lambda g: local_dram(p, g)  # noqa: E731
    local = lambda: pl.local_flows(shard, dram)  # noqa: E731
    if path is RestorePath.LOCAL_DRAM:
        return [local]
    if path is RestorePath.REMOTE_GDR:
        return [lambda: pl.network_flows(lambda g: "pool.dram", lambda g: g, shard, pool_side=True)]
    if path is RestorePath.REMOTE_TWO_HOP:
        return [lambda: pl.network_flows(lambda g: "pool.dram", dram, shard, pool_side=True), local]
    if path is RestorePath.PD_HANDOFF:
        return [lambda: pl.network_flows(lambda g: f"peer.{g}", lambda g: g, shard, pool_side=False)]
    topo = p.topology

    def from_drive() -> list[Flow]:
        return [
            flow_along(topo, topo.route(pl.drive_for(g), dram(g), size_bytes=s), s)
            for g, s in zip(inst.gpus, shard)
        ]

    return [from_drive, local]
