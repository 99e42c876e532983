"""The event loop: arrivals, restores, prefill, continuous-batching decode, P/D handoff.

Events sit in one ``heapq`` keyed by (time, sequence), so a run is O(E log E) in its events.

Scheduling policy (stated, simple, per instance): prefill first. When an instance's GPUs are
free it prefills the oldest request whose restore has finished, if the batch's KV plus that
prompt fits the instance's KV capacity; otherwise it runs one decode step for every running
request (all of them together: continuous batching). New requests thus join the batch between
steps. Under ``pd-handoff`` each instance is a pair: a prefill group (the profile's ``peer``
GPUs) and the decode group, which only decodes; the prompt's KV crosses the network between
them, and the first token counts from its arrival at the decode group.

Requests go to instance ``hash_ids[0] % instances`` (session affinity: a session's first
block never changes), or round robin when a request has no ids; :attr:`Routing.ROUND_ROBIN`
sends every request to the next instance in turn (so requests sharing a prefix reach several
instances). A fleet policy (:attr:`SimConfig.policy`, the router's own, :mod:`kvstrata.sim.fleet`)
instead chooses from what each instance's caches hold, its queued prefill and its costs. Cache
look-ups and inserts happen at arrival, in arrival order, so hits do not
depend on timing.

A fleet (:attr:`SimConfig.fleet_tp`) runs instances of different TP sizes on one shared pool,
its blocks keyed and sized by :class:`kvstrata.plan.sharing.KVSharing` (see
:mod:`kvstrata.sim.pool`). Instances are packed onto servers of the profile in the order
listed, each on consecutive GPUs of one server, a new server when the next does not fit the one
being filled; each server is a copy of the profile, its links and memories its own, and the
pool (every resource with a pool end) the one all share.

Restores queue per instance: at most ``restore_slots`` requests restore at once (as a load
queue in a serving engine does); the rest wait in arrival order. Without the bound an
overloaded instance would start every queued request's restore at arrival, all sharing the
links, so that none finishes early.

Hardware counted: ``instances x gpus_per_instance`` GPUs, except ``pd-handoff``, whose prefill
groups are the peer server's GPUs, as many again (the seed's fifth scheme adds prefill
machines); :attr:`SimOutcome.gpus` says how many a run used, so throughput per GPU compares.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from kvstrata.fleet.scorer import Policy
from kvstrata.hardware.flows import GB, Flow, Resource, flow_along, max_min_share
from kvstrata.hardware.profile import HardwareProfile
from kvstrata.hardware.topology import NodeKind
from kvstrata.kv.geometry import KVGeometry
from kvstrata.media import Medium
from kvstrata.plan.architectures import DRAM_KV_FRACTION, HBM_USABLE_FRACTION
from kvstrata.plan.footprint import held_bytes, request_bytes, restore_bytes, stored_bytes
from kvstrata.plan.restore import RestorePath, RestorePlanner, local_dram
from kvstrata.plan.sharing import KVSharing, pool_bytes
from kvstrata.plan.sizing import size_instances
from kvstrata.policies.write import WritePolicy
from kvstrata.sim.batchkv import BatchKV
from kvstrata.sim.fleet import FleetRouting, instance_cost
from kvstrata.sim.lru import BlockLRU
from kvstrata.sim.model import TimeModel
from kvstrata.sim.network import Network
from kvstrata.sim.pool import PoolStats, SharedPool
from kvstrata.sim.tiers import ArchSpec
from kvstrata.sim.trace import BLOCK_TOKENS, Request, sort_by_time


class Routing(enum.Enum):
    """Which instance a request goes to (see the module text)."""

    SESSION = "session"  # hash_ids[0] % instances
    ROUND_ROBIN = "round-robin"  # arrival index % instances


@dataclass(frozen=True)
class SimConfig:
    """One simulation's setting.

    Attributes:
        geometry: the model.
        profile: the hardware; instance ``i`` uses GPUs ``i*K .. i*K+K-1`` of it.
        gpus_per_instance: K (tensor parallel); default (None) the fewest GPUs that hold the
            weights with room for KV (:func:`kvstrata.plan.sizing.size_instances`).
        instances: how many; default all the profile's GPUs allow.
        tier_tokens: capacity overrides per tier in tokens (per instance; the pool is shared).
        max_batch: most requests decoding together on one instance.
        restore_slots: most requests restoring at once on one instance.
        record_events: keep every event's time (for tests).
        fleet_tp: one TP size per instance of a mixed fleet (then ``gpus_per_instance`` and
            ``instances`` stay None); empty: ``instances`` of ``gpus_per_instance`` GPUs.
        sharing: how pool blocks are keyed and sized; head-sliced (one copy per block id, which
            any instance hits) is what the pool modelled before fleets.
        routing: which instance each request goes to.
        policy: a fleet routing policy (:mod:`kvstrata.sim.fleet`); when set, it routes, not ``routing``.
    """

    geometry: KVGeometry
    profile: HardwareProfile
    gpus_per_instance: int | None = None
    instances: int | None = None
    tier_tokens: tuple[tuple[Medium, int], ...] = ()
    max_batch: int = 256
    restore_slots: int = 4
    record_events: bool = False
    fleet_tp: tuple[int, ...] = ()
    sharing: KVSharing = KVSharing.SLICED
    routing: Routing = Routing.SESSION
    policy: Policy | None = None

    def __post_init__(self) -> None:
        # A model whose weights overflow its GPUs' HBM is refused, never simulated.
        if self.fleet_tp:
            if self.gpus_per_instance is not None or self.instances is not None:
                raise ValueError("a fleet sets each instance's GPUs: give fleet_tp or gpus_per_instance/instances")
            for tp in dict.fromkeys(self.fleet_tp):
                size_instances(self.geometry, self.profile, tp, 1).check_fits()
        else:
            sizing = size_instances(self.geometry, self.profile, self.gpus_per_instance, self.instances)
            sizing.check_fits()
            object.__setattr__(self, "gpus_per_instance", sizing.gpus_per_instance)  # resolved defaults
            object.__setattr__(self, "instances", sizing.instances)
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")
        if self.restore_slots < 1:
            raise ValueError(f"restore_slots must be at least 1, got {self.restore_slots}")

    @property
    def instance_count(self) -> int:
        return len(self.fleet_tp) or self.instances

    @property
    def instance_tps(self) -> tuple[int, ...]:
        """Each instance's TP size (GPUs), in instance order."""
        return self.fleet_tp or (self.gpus_per_instance,) * self.instances


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
class RequestRecord:
    """What happened to one request (times in seconds from the trace start)."""

    request: Request
    instance: int
    arrival_s: float
    hit_tokens: dict[Medium, int]
    restore_s: float = 0.0  # arrival to restored, queueing for a restore slot included
    restore_started_s: float | None = None  # when its restore took a slot; None: nothing to restore
    first_token_s: float | None = None
    finish_s: float | None = None
    completions: int = 0  # must end at exactly 1

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None for one token or fewer."""
        n = self.request.output_length
        return (self.finish_s - self.first_token_s) / (n - 1) if n > 1 else None


@dataclass
class SimOutcome:
    """Raw results of one run; :mod:`kvstrata.sim.results` summarises them."""

    arch: ArchSpec
    records: list[RequestRecord]
    makespan_s: float
    link_bytes: dict[str, float]  # resource key -> bytes moved
    link_sent_bytes: dict[str, float]
    link_gbps: dict[str, float]
    link_labels: dict[str, str]
    gpus: int = 0
    tier_writes: dict[Medium, int] = field(default_factory=dict)  # blocks written into each tier
    event_times: list[float] = field(default_factory=list)
    pool: PoolStats | None = None  # what the shared pool held and served; None: no pool tier
    sharing: KVSharing = KVSharing.SLICED


@dataclass
class _Instance:
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


class Simulation:
    """Replays ``requests`` through one architecture. Call :meth:`run` once."""

    def __init__(
        self,
        requests: Sequence[Request],
        config: SimConfig,
        arch: ArchSpec,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.requests = sort_by_time(requests)
        self.config = config
        self.arch = arch
        self.progress = progress
        self.net = Network()
        self._heap: list = []
        self._seq = itertools.count()
        self.now = 0.0
        self.records: list[RequestRecord] = []
        self.event_times: list[float] = []
        self._done = 0
        self._wake_version = -1  # the network version a pending wake-up was scheduled for
        g, p, tps = config.geometry, config.profile, config.instance_tps
        overrides = dict(config.tier_tokens)
        placed = pack_servers(tps, len(p.gpus))
        per_server = Counter(server for server, _ in placed)  # instances on a server share its DRAM and drives
        topo = p.topology

        def total(kind: NodeKind) -> int:
            return sum(x.capacity_bytes for x in topo.of_kind(kind) if not x.name.startswith("peer."))

        # A stored block keeps every per-token group's KV of its tokens and a state snapshot at
        # its end (a hit may end at any block): footprint.stored_bytes; a dense model's block is
        # its tokens' bytes. HBM counts per GPU, the off-GPU stores one logical copy.
        block = stored_bytes(g, BLOCK_TOKENS)

        def blocks(tier: Medium, capacity_bytes: int, block_bytes: int = block) -> int:
            return overrides[tier] // BLOCK_TOKENS if tier in overrides else capacity_bytes // block_bytes

        pool_blocks = blocks(Medium.REMOTE, int(total(NodeKind.REMOTE_DRAM) * DRAM_KV_FRACTION))
        self.pool = SharedPool(pool_blocks * block, block)
        self.instances: list[_Instance] = []
        for i, (k, (server, first)) in enumerate(zip(tps, placed)):
            gpus = [x.name for x in p.gpus[first : first + k]]
            model = TimeModel.build(g, p, gpus)
            # Every weight stays resident (a MoE's idle experts too), a 1/K share per GPU.
            hbm_free = max(0, int(min(topo.node(x).capacity_bytes for x in gpus) * HBM_USABLE_FRACTION
                                  - g.weight_bytes() / k))
            host_bytes = int(total(NodeKind.DRAM) * DRAM_KV_FRACTION / per_server[server])
            default = {
                Medium.DEVICE: blocks(Medium.DEVICE, hbm_free, stored_bytes(g, BLOCK_TOKENS, tp=k)),
                Medium.HOST: blocks(Medium.HOST, host_bytes),
                Medium.DISK: blocks(Medium.DISK, int(total(NodeKind.FLASH) / per_server[server])),
            }
            # TP-matched: an instance hits only its TP size's blocks, which cost every rank's copy.
            pool = self.pool.view(k if config.sharing is KVSharing.MATCHED else None,
                                  pool_bytes(g, BLOCK_TOKENS, k, config.sharing))
            caches = {tier: pool if tier is Medium.REMOTE else BlockLRU(default[tier]) for tier in arch.tiers}
            planner = RestorePlanner(p, gpus)
            stream = on_server([flow_along(topo, topo.route(local_dram(p, x), x, size_bytes=1), 1) for x in gpus], server)
            stream_rate = min(s.gbps for s in max_min_share(stream)) * GB
            # The running batch lives in HBM (per GPU), or in DRAM when streaming (one logical copy).
            limit, limit_tp = (host_bytes, 1) if arch.streaming else (hbm_free, k)
            self.instances.append(
                _Instance(i, server, gpus, planner, model, caches, BatchKV(g), limit, limit_tp, stream_rate, stream)
            )
        self._stream_bytes: dict[str, float] = {}
        self._tier_writes: dict[Medium, int] = dict.fromkeys(arch.tiers, 0)
        self._gpus = sum(tps) * (2 if arch.pd_handoff else 1)
        self._fleet = None if config.policy is None else FleetRouting(
            config.policy, [instance_cost(g, i.model, i.planner, arch) for i in self.instances])

    # --- the loop -----------------------------------------------------------------------------

    def _push(self, t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), action))

    def run(self) -> SimOutcome:
        for index, r in enumerate(self.requests):
            self._push(r.timestamp_ms / 1000, lambda r=r, index=index: self._arrive(r, index))
        while True:
            net_t = self.net.next_event_s()
            if net_t is not None and self.net.version != self._wake_version:
                self._wake_version = self.net.version
                self._push(max(net_t, self.now), lambda v=self._wake_version: self._net_wake(v))
            if not self._heap:
                break
            t, _, action = heapq.heappop(self._heap)
            if t < self.now:
                raise AssertionError(f"event at {t} after {self.now}")
            self.now = t
            if self.config.record_events:
                self.event_times.append(t)
            action()
        if self.net.active:
            raise AssertionError("transfers left unfinished")
        makespan = max((r.finish_s for r in self.records), default=0.0) - min(
            (r.arrival_s for r in self.records), default=0.0
        )
        moved = dict(self.net.moved_bytes)
        sent = dict(self.net.sent_bytes)
        for key, b in self._stream_bytes.items():
            moved[key] = moved.get(key, 0.0) + b
            sent[key] = sent.get(key, 0.0) + b
        resources = dict(self.net.resources)
        for inst in self.instances:
            for f in inst.stream_flows:
                for r, _ in f.uses:
                    resources[r.key] = r
        return SimOutcome(
            self.arch,
            self.records,
            makespan,
            moved,
            sent,
            {k: r.gbps for k, r in resources.items()},
            {k: r.label for k, r in resources.items()},
            self._gpus,
            dict(self._tier_writes),
            self.event_times,
            self.pool.stats() if Medium.REMOTE in self.arch.tiers else None,
            self.config.sharing,
        )

    def _net_wake(self, version: int) -> None:
        if version == self.net.version:
            self._wake_version = -1  # consumed: the loop schedules the next wake-up
            self.net.advance(self.now)

    # --- arrival and restore ------------------------------------------------------------------

    def _arrive(self, r: Request, index: int) -> None:
        n = len(self.instances)
        session = r.hash_ids and self.config.routing is Routing.SESSION
        if self._fleet is not None:
            inst = self.instances[self._fleet.choose(r, [i.queued_tokens for i in self.instances])]
        else:
            inst = self.instances[(r.hash_ids[0] if session else index) % n]
        covered, hits = 0, {}
        for tier in self.arch.tiers:
            run = inst.caches[tier].leading_run(r.hash_ids)
            tokens = min(run * BLOCK_TOKENS, r.input_length)
            hits[tier] = max(0, tokens - covered)
            covered = max(covered, tokens)
            if tier is Medium.REMOTE:
                self.pool.looked_up(len(r.hash_ids), run, r.input_length, tokens)
        self._write(inst, r.hash_ids)
        self.pool.sample()
        rec = RequestRecord(r, inst.index, self.now, hits)
        inst.queued_tokens += r.input_length - covered
        self.records.append(rec)
        jobs = self._restore_jobs(inst, hits, covered)
        if not jobs:
            self._restored(inst, rec)
            return
        inst.restore_queue.append((rec, jobs))
        self._start_restores(inst)

    def _restore_jobs(self, inst: _Instance, hits: dict[Medium, int], end: int) -> list[tuple[RestorePath, int]]:
        """(path, bytes per GPU) of each tier's segment of a hit ending at ``end`` tokens, tiers in
        search order: :func:`kvstrata.plan.footprint.restore_bytes`, so a windowed group moves only
        what of its window lies in the segment, a state group its snapshot with the last one."""
        jobs, start = [], 0
        for tier, tokens in hits.items():
            path = self.arch.restore_path(tier)
            if tokens and path:
                size = restore_bytes(self.config.geometry, end, len(inst.gpus), (start, start + tokens)).size_bytes
                if size:
                    jobs.append((path, size))
            start += tokens
        return jobs

    def _write(self, inst: _Instance, ids: Sequence[int]) -> None:
        """Insert a request's blocks per the write policy (see :mod:`kvstrata.sim.tiers`)."""
        tiers, writes = self.arch.tiers, self._tier_writes
        if self.arch.write is WritePolicy.WRITE_THROUGH:
            for tier in tiers:
                cache = inst.caches[tier]
                fresh = [b for b in ids if b not in cache]
                writes[tier] += len(fresh)
                self._touch(inst, tier, ids, fresh)
            return
        # Write-back, the one other policy an ArchSpec admits.
        for tier in tiers[1:]:
            inst.caches[tier].refresh(ids)
        first = inst.caches[tiers[0]]
        fresh = [b for b in ids if b not in first]
        writes[tiers[0]] += len(fresh)
        demoted = self._touch(inst, tiers[0], ids, fresh)
        for tier in tiers[1:]:
            if not demoted:
                break
            cache = inst.caches[tier]
            fresh = [b for b in demoted if b not in cache]
            writes[tier] += len(fresh)
            demoted = self._touch(inst, tier, fresh, fresh)

    def _touch(self, inst: _Instance, tier: Medium, ids: Sequence[int], fresh: list[int]) -> list[int]:
        """``inst.caches[tier].touch(ids)`` (``fresh``: those of ``ids`` it did not hold), its
        evicted ids returned; a routing policy's index told what the tier now holds and dropped
        (a block evicted and inserted again by the same touch: neither)."""
        cache = inst.caches[tier]
        evicted = cache.touch(ids)
        if self._fleet is not None:
            new = set(fresh)
            stored = [b for b in fresh if b in cache]
            removed = [b for b in evicted if b not in cache and b not in new]
            self._fleet.changed(inst.index, tier, stored, removed, self.now)
        return evicted

    def _start_restores(self, inst: _Instance) -> None:
        while inst.restore_queue and inst.restoring < self.config.restore_slots:
            rec, jobs = inst.restore_queue.popleft()
            inst.restoring += 1
            rec.restore_started_s = self.now
            pending = [len(jobs)]

            def one_done(t: float, rec=rec, pending=pending) -> None:
                pending[0] -= 1
                if pending[0] == 0:
                    self._push(t, lambda: self._restore_slot_freed(inst, rec))

            for path, shard_bytes in jobs:
                self.net.start(self.now, self._stages(inst, path, shard_bytes), one_done)

    def _restore_slot_freed(self, inst: _Instance, rec: RequestRecord) -> None:
        inst.restoring -= 1
        self._start_restores(inst)
        self._restored(inst, rec)

    def _path_stages(self, inst: _Instance, path: RestorePath, shard_bytes: int) -> list[Callable[[], list[Flow]]]:
        """The planner's flows for ``shard_bytes`` of KV per GPU along ``path``, stage by stage."""
        shard = [shard_bytes] * len(inst.gpus)
        pl, p = inst.planner, self.config.profile
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

    def _stages(self, inst: _Instance, path: RestorePath, shard_bytes: int) -> list[Callable[[], list[Flow]]]:
        """:meth:`_path_stages` on the instance's server (see :func:`on_server`)."""
        stages = self._path_stages(inst, path, shard_bytes)
        if inst.server == 0:
            return stages
        return [lambda stage=stage: on_server(stage(), inst.server) for stage in stages]

    def _restored(self, inst: _Instance, rec: RequestRecord) -> None:
        rec.restore_s = self.now - rec.arrival_s
        inst.ready.append(rec)
        self._kick(inst)

    # --- prefill and decode ---------------------------------------------------------------

    def _fits(self, inst: _Instance, rec: RequestRecord) -> bool:
        if len(inst.running) >= self.config.max_batch:
            return False
        # Its KV at its last token (a window caps a windowed group), on top of what the batch holds now.
        need = request_bytes(self.config.geometry, rec.request.input_length + rec.request.output_length, inst.kv_limit_tp)
        return not inst.running or inst.batch.bytes(inst.kv_limit_tp) + need <= inst.kv_limit_bytes

    def _kick(self, inst: _Instance) -> None:
        if self.arch.pd_handoff and not inst.prefill_busy and inst.ready:
            inst.prefill_busy = True
            rec = inst.ready.popleft()
            self._push(self.now + self._prefill_s(inst, rec), lambda: self._prefilled(inst, rec))
        if inst.busy:
            return
        if self.arch.pd_handoff:
            while inst.decode_ready and self._fits(inst, inst.decode_ready[0]):
                self._join(inst, inst.decode_ready.popleft())
        elif inst.ready and self._fits(inst, inst.ready[0]):
            inst.busy = True
            rec = inst.ready.popleft()
            self._push(self.now + self._prefill_s(inst, rec), lambda: self._prefilled(inst, rec))
            return
        if inst.running:
            inst.busy = True
            self._push(self.now + self._step_s(inst), lambda: self._stepped(inst))

    def _prefill_s(self, inst: _Instance, rec: RequestRecord) -> float:
        cached = sum(rec.hit_tokens.values())
        return inst.model.prefill_s(rec.request.input_length - cached, cached)

    def _prefilled(self, inst: _Instance, rec: RequestRecord) -> None:
        inst.queued_tokens -= rec.request.input_length - sum(rec.hit_tokens.values())
        if self.arch.pd_handoff:
            inst.prefill_busy = False
            shard = request_bytes(self.config.geometry, rec.request.input_length, len(inst.gpus))
            stages = self._stages(inst, RestorePath.PD_HANDOFF, shard)
            self.net.start(self.now, stages, lambda t: self._push(t, lambda: self._handed_off(inst, rec)))
            self._kick(inst)
            return
        inst.busy = False
        self._first_token(inst, rec)
        self._kick(inst)

    def _handed_off(self, inst: _Instance, rec: RequestRecord) -> None:
        self._first_token(inst, rec, join_queue=inst.decode_ready)
        self._kick(inst)

    def _first_token(self, inst: _Instance, rec: RequestRecord, join_queue: deque | None = None) -> None:
        rec.first_token_s = self.now
        if rec.request.output_length <= 1:
            self._finish(rec)
        elif join_queue is not None:
            join_queue.append(rec)
        else:
            self._join(inst, rec)

    def _join(self, inst: _Instance, rec: RequestRecord) -> None:
        # It finishes after output_length - 1 more steps; its context grows one token a step.
        finish_step = inst.batch.steps + rec.request.output_length - 1
        rid = inst.batch.join(rec.request.input_length + 1)
        heapq.heappush(inst.running, (finish_step, next(self._seq), rec, rid))

    def _step_s(self, inst: _Instance) -> float:
        held = inst.batch.held()
        step = inst.model.decode_step_s(len(inst.running), held)
        if self.arch.streaming:
            kv_per_gpu = held_bytes(self.config.geometry, held, len(inst.gpus))
            step = max(step, kv_per_gpu / inst.stream_bytes_per_s)
            for f in inst.stream_flows:  # every step re-crosses PCIe: count it on the links
                for r, w in f.uses:
                    self._stream_bytes[r.key] = self._stream_bytes.get(r.key, 0.0) + w * kv_per_gpu
        return step

    def _stepped(self, inst: _Instance) -> None:
        inst.busy = False
        inst.batch.step()
        while inst.running and inst.running[0][0] <= inst.batch.steps:
            _, _, rec, rid = heapq.heappop(inst.running)
            r = rec.request
            inst.batch.leave(rid, r.input_length + r.output_length)
            self._finish(rec)
        self._kick(inst)

    def _finish(self, rec: RequestRecord) -> None:
        rec.finish_s = self.now
        rec.completions += 1
        self._done += 1
        if self.progress is not None:
            self.progress(self._done, len(self.requests))
