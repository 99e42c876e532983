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

A fleet (:attr:`SimConfig.fleet_tp`) runs instances of different TP sizes on one shared pool;
how instances sit on the profile's servers, and what each may hold, is :mod:`kvstrata.sim.instance`.

Restores queue per instance: at most ``restore_slots`` requests restore at once (as a load
queue in a serving engine does); the rest wait in arrival order. Without the bound an
overloaded instance would start every queued request's restore at arrival, all sharing the
links, so that none finishes early.

Hardware counted: ``instances x gpus_per_instance`` GPUs, except ``pd-handoff``, whose prefill
groups are the peer server's GPUs, as many again (the seed's fifth scheme adds prefill
machines); :attr:`SimOutcome.gpus` says how many a run used, so throughput per GPU compares.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence

from kvstrata.media import Medium
from kvstrata.plan.footprint import held_bytes, request_bytes, restore_bytes
from kvstrata.plan.restore import RestorePath
from kvstrata.policies.write import WritePolicy
from kvstrata.sim.config import Routing, SimConfig
from kvstrata.sim.fleet import FleetRouting, instance_cost
from kvstrata.sim.instance import Instance, build_instances, restore_stages, shared_pool
from kvstrata.sim.network import Network
from kvstrata.sim.outcome import RequestRecord, SimOutcome
from kvstrata.sim.tiers import ArchSpec
from kvstrata.sim.trace import BLOCK_TOKENS, Request, sort_by_time


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
        self.pool = shared_pool(config)
        self.instances = build_instances(config, arch, self.pool)
        self._stream_bytes: dict[str, float] = {}
        self._tier_writes: dict[Medium, int] = dict.fromkeys(arch.tiers, 0)
        self._gpus = sum(config.instance_tps) * (2 if arch.pd_handoff else 1)
        self._fleet = None if config.policy is None else FleetRouting(
            config.policy, [instance_cost(config.geometry, i.model, i.planner, arch) for i in self.instances],
            config.slo)


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
            self.config.policy,
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
            paces = [i.pace.seconds_per_token(self.now) if i.running else None for i in self.instances]
            inst = self.instances[self._fleet.choose(r, [i.queued_tokens for i in self.instances], paces)]
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

    def _restore_jobs(self, inst: Instance, hits: dict[Medium, int], end: int) -> list[tuple[RestorePath, int]]:
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

    def _write(self, inst: Instance, ids: Sequence[int]) -> None:
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

    def _touch(self, inst: Instance, tier: Medium, ids: Sequence[int], fresh: list[int]) -> list[int]:
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

    def _start_restores(self, inst: Instance) -> None:
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
                self.net.start(self.now, restore_stages(inst, self.config.profile, path, shard_bytes), one_done)

    def _restore_slot_freed(self, inst: Instance, rec: RequestRecord) -> None:
        inst.restoring -= 1
        self._start_restores(inst)
        self._restored(inst, rec)

    def _restored(self, inst: Instance, rec: RequestRecord) -> None:
        rec.restore_s = self.now - rec.arrival_s
        inst.ready.append(rec)
        self._kick(inst)

    # --- prefill and decode ---------------------------------------------------------------

    def _fits(self, inst: Instance, rec: RequestRecord) -> bool:
        if len(inst.running) >= self.config.max_batch:
            return False
        # Its KV at its last token (a window caps a windowed group), on top of what the batch holds now.
        need = request_bytes(self.config.geometry, rec.request.input_length + rec.request.output_length, inst.kv_limit_tp)
        return not inst.running or inst.batch.bytes(inst.kv_limit_tp) + need <= inst.kv_limit_bytes

    def _kick(self, inst: Instance) -> None:
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

    def _prefill_s(self, inst: Instance, rec: RequestRecord) -> float:
        cached = sum(rec.hit_tokens.values())
        return inst.model.prefill_s(rec.request.input_length - cached, cached)

    def _prefilled(self, inst: Instance, rec: RequestRecord) -> None:
        inst.queued_tokens -= rec.request.input_length - sum(rec.hit_tokens.values())
        if self.arch.pd_handoff:
            inst.prefill_busy = False
            shard = request_bytes(self.config.geometry, rec.request.input_length, len(inst.gpus))
            stages = restore_stages(inst, self.config.profile, RestorePath.PD_HANDOFF, shard)
            self.net.start(self.now, stages, lambda t: self._push(t, lambda: self._handed_off(inst, rec)))
            self._kick(inst)
            return
        inst.busy = False
        self._first_token(inst, rec)
        self._kick(inst)

    def _handed_off(self, inst: Instance, rec: RequestRecord) -> None:
        self._first_token(inst, rec, join_queue=inst.decode_ready)
        self._kick(inst)

    def _first_token(self, inst: Instance, rec: RequestRecord, join_queue: deque | None = None) -> None:
        rec.first_token_s = self.now
        if rec.request.output_length <= 1:
            self._finish(rec)
        elif join_queue is not None:
            join_queue.append(rec)
        else:
            self._join(inst, rec)

    def _join(self, inst: Instance, rec: RequestRecord) -> None:
        # It finishes after output_length - 1 more steps; its context grows one token a step.
        finish_step = inst.batch.steps + rec.request.output_length - 1
        if not inst.running:  # the pace's next gap counts from here
            inst.pace.start(self.now)
        rid = inst.batch.join(rec.request.input_length + 1)
        heapq.heappush(inst.running, (finish_step, next(self._seq), rec, rid))

    def _step_s(self, inst: Instance) -> float:
        held = inst.batch.held()
        step = inst.model.decode_step_s(len(inst.running), held)
        if self.arch.streaming:
            kv_per_gpu = held_bytes(self.config.geometry, held, len(inst.gpus))
            step = max(step, kv_per_gpu / inst.stream_bytes_per_s)
            for f in inst.stream_flows:  # every step re-crosses PCIe: count it on the links
                for r, w in f.uses:
                    self._stream_bytes[r.key] = self._stream_bytes.get(r.key, 0.0) + w * kv_per_gpu
        return step

    def _stepped(self, inst: Instance) -> None:
        inst.busy = False
        last = inst.pace.last_s  # set when the batch began (_join)
        inst.pace.add(self.now, self.now - last if last is not None else 0.0, len(inst.running))  # each one's token
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
