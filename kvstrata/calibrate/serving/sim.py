"""``bench serve`` simulated (pure): the same servers, phases and client, on simulated engines.

What a run of :mod:`kvstrata.bench.serve` does, in the same order, each server a
:class:`~kvstrata.sim.serving.engine.ServerSim` with the same KV memory, scheduler limits and
kvstrata tiers (:mod:`kvstrata.calibrate.serving.servers`):

1. the rounds: vLLM alone and vLLM with kvstrata, one after the other, the order rotating;
2. two kvstrata servers on one pool, each conversation's turns alternating between them;
3. the restart: the second server (the kvstrata server without a pool) started again with its
   disk tier and the pool kept, the turns it served sent again;
4. P/D: a producer computes each prompt (one token), a consumer answers it from the pool.

Every server warms up with the same two prompts the bench sends it (a server that warms with
another's prompts finds them where that one stored them). The conversations are the bench's
own (:func:`~kvstrata.calibrate.serving.workload.plan_conversations`, a variant per phase); the answers
are token ids of their own, one set per request, since what the model says changes no timing.
Each phase begins once the workers have stopped spinning, as the bench waits for a quiet host.
The client is the bench's: a turn goes at its slot or when its previous answer is back,
whichever is later; a request reaches its server's engine ``request_in_s`` after it is sent (and
now and then a stall later, the measured share of them: :mod:`~kvstrata.sim.serving.cpus`),
and each token the client ``response_out_s`` after it is sampled
(:mod:`~kvstrata.sim.serving.timing`). Each configuration's figures are computed by the bench's
own :func:`~kvstrata.calibrate.serving.measured.measure`, on simulated records and counters.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstrata.rounds import rotated
from kvstrata.calibrate.serving.servers import CPU_HALF, Instance
from kvstrata.calibrate.serving.counters import Counters
from kvstrata.calibrate.serving.workload import (
    ConversationPlan,
    ServeWorkload,
    alternate,
    arrival_s,
    plan_conversations,
    replay_plans,
    warm_prompts,
)
from kvstrata.calibrate.serving.measured import Measured, RequestRecord, measure, total
from kvstrata.media import Medium
from kvstrata.sim.serving.cpus import HostCpus
from kvstrata.sim.serving.engine import Clock, EngineLimits, ServerSim, SimRequest
from kvstrata.sim.serving.store import ServerStore, TierLRU
from kvstrata.sim.serving.timing import ServingTimes
from kvstrata.sim.trace import Request

WARM_PROMPTS = 2  # as bench serve's fleet sends each server it starts
WARM_WITH = {Instance.SECOND: Instance.OURS, Instance.DECODE: Instance.PREFILL}


@dataclass(frozen=True)
class ServeSetup:
    """What the bench ran, as the simulation needs it.

    Attributes:
        workload: the conversations' shape and pace.
        trace: the trace the conversations open with.
        vocab: the model's vocabulary (the bench draws prompt ids below it).
        rounds: interleaved rounds.
        limits: every server's scheduler settings and KV memory.
        block_bytes: one block's KV.
        device_bytes, host_bytes, disk_bytes, remote_bytes: kvstrata's tiers.
        pool: the pool's phases ran.
        times: the host's time model.
    """

    workload: ServeWorkload
    trace: tuple[Request, ...]
    vocab: int
    rounds: int
    limits: EngineLimits
    block_bytes: int
    device_bytes: int
    host_bytes: int
    disk_bytes: int
    remote_bytes: int
    pool: bool
    times: ServingTimes

    def blocks(self, nbytes: int) -> int:
        return nbytes // self.block_bytes


@dataclass(frozen=True)
class SimulatedServe:
    """Each configuration's simulated figures, keyed as the bench's report names them."""

    configurations: dict[str, Measured]
    preemptions: dict[Instance, int]


def simulate_serve(setup: ServeSetup) -> SimulatedServe:
    """Run the bench's phases (see the module text) on simulated servers."""
    return _Bench(setup).run()


class _Bench:
    def __init__(self, setup: ServeSetup) -> None:
        self.setup, self.w = setup, setup.workload
        self.clock = Clock()
        self.servers: dict[Instance, ServerSim] = {}
        self.pool = TierLRU(setup.blocks(setup.remote_bytes)) if setup.pool else None
        self.disks: dict[Instance, TierLRU] = {}
        self._answer_ids = itertools.count(1)
        decode = setup.times.decode
        self.cpus = HostCpus(decode.together, decode.spin_s, decode.beside_spin, setup.times.stalls)

    def run(self) -> SimulatedServe:
        s, w = self.setup, self.w
        plans = [plan_conversations(s.trace, w, s.vocab, variant) for variant in range(s.rounds + 2)]
        out: dict[str, Measured] = {}
        self.start(Instance.BASELINE, Instance.OURS)
        by: dict[Instance, list[tuple[tuple[RequestRecord, ...], Counters, float]]] = {
            Instance.BASELINE: [], Instance.OURS: []}
        for r in range(s.rounds):
            for instance in rotated([Instance.OURS, Instance.BASELINE], r):
                records, counters, wall = self.phase(plans[r], lambda c, t, i=instance: i, [instance])
                by[instance].append((records, counters[instance], wall))
        self.stop(Instance.BASELINE)
        for instance, name in ((Instance.BASELINE, "baseline"), (Instance.OURS, "kvstrata")):
            runs = by[instance]
            out[name] = measure([rec for records, _, _ in runs for rec in records],
                                total(c for _, c, _ in runs), w.block_tokens, wall_s=sum(x for _, _, x in runs))
        last_ours = by[Instance.OURS][-1][0]
        if s.pool:
            self.start(Instance.SECOND)
            pair = (Instance.OURS, Instance.SECOND)
            records, counters, _ = self.phase(plans[s.rounds], lambda c, t: pair[alternate(c, t)], list(pair))
            out["shared_pool"] = measure(records, total(counters.values()), w.block_tokens)
            for instance in pair:
                out[f"shared_pool.{instance.value}"] = measure([r for r in records if r.server is instance],
                                                               counters[instance], w.block_tokens)
            restart, served = Instance.SECOND, records
            self.stop(Instance.OURS)
        else:
            restart, served = Instance.OURS, last_ours
        prompts = [r.prompt for r in served if r.server is restart]
        self.restart(restart)
        records, counters, _ = self.phase(replay_plans(prompts), lambda c, t: restart, [restart])
        out["restart"] = measure(records, counters[restart], w.block_tokens)
        self.stop(restart)
        if s.pool:
            self.start(Instance.PREFILL, Instance.DECODE)
            records, counters, _ = self.phase(plans[s.rounds + 1], lambda c, t: (Instance.PREFILL, Instance.DECODE),
                                              [Instance.PREFILL, Instance.DECODE])
            decode = [r for r in records if r.server is Instance.DECODE]
            prefill = [r for r in records if r.server is Instance.PREFILL]
            out["prefill_decode.decode"] = measure(decode, counters[Instance.DECODE], w.block_tokens)
            out["prefill_decode.prefill"] = measure(prefill, counters[Instance.PREFILL], w.block_tokens)
        return SimulatedServe(out, {i: srv.preemptions for i, srv in self.servers.items()})

    # --- servers ------------------------------------------------------------------------------

    def _store(self, instance: Instance) -> ServerStore | None:
        s = self.setup
        if instance in (Instance.BASELINE, Instance.REFERENCE):
            return None
        tiers = {Medium.DEVICE: TierLRU(s.blocks(s.device_bytes)), Medium.HOST: TierLRU(s.blocks(s.host_bytes))}
        if instance in (Instance.OURS, Instance.SECOND):
            tiers[Medium.DISK] = self.disks.setdefault(instance, TierLRU(s.blocks(s.disk_bytes)))
        if self.pool is not None:
            tiers[Medium.REMOTE] = self.pool
        return ServerStore(tiers)

    def start(self, *instances: Instance) -> None:
        for instance in instances:
            server = ServerSim(self.clock, self.setup.limits, self.setup.times, self._store(instance),
                               loads=instance is not Instance.PREFILL, saves=instance is not Instance.DECODE,
                               cpus=self.cpus)
            self.cpus.bind(id(server), CPU_HALF.get(instance, instance))
            self.servers[instance] = server
            self._warm_up(instance)

    def stop(self, *instances: Instance) -> None:
        """As the bench stops ``instances``: their workers hold no CPU from now (their counters stay readable)."""
        for instance in instances:
            self.cpus.leave(id(self.servers[instance]))

    def restart(self, instance: Instance) -> None:
        self.stop(instance)
        self.servers[instance].restarted(self._store(instance))
        self._warm_up(instance)

    def _warm_up(self, instance: Instance) -> None:
        tag = WARM_WITH.get(instance, instance).name
        server = self.servers[instance]
        for prompt in warm_prompts(self.w, self.setup.vocab, WARM_PROMPTS, tag):  # one at a time
            request = SimRequest(tuple(prompt), self._answer(2), self.clock.now_s, lambda r: None)
            self.clock.at(self.clock.now_s + self.setup.times.request_in_s, lambda r=request: server.submit(r))
            self.clock.run()

    def _out_s(self, instance: Instance) -> float:
        """A token's way out from ``instance`` to the client, from now (slower while another
        server steps: the host's CPUs are shared)."""
        return self.setup.times.response_out_s * self.cpus.stretch(id(self.servers[instance]), self.clock.now_s)

    def _answer(self, n: int) -> tuple[int, ...]:
        """Token ids no prompt has (negative): what a request generates."""
        return tuple(-next(self._answer_ids) for _ in range(n))

    # --- the client ---------------------------------------------------------------------------

    def phase(self, plans: Sequence[ConversationPlan], route: Callable[[int, int], Instance | tuple[Instance, Instance]],
              servers: Sequence[Instance]) -> tuple[tuple[RequestRecord, ...], dict[Instance, Counters], float]:
        """One phase: every conversation of ``plans`` through ``route``; its records (a P/D turn's
        prefill call too, by its server), each server's counters over it, and its wall time."""
        before = {i: counters_of(self.servers[i]) for i in servers}
        start = self.clock.now_s + self.cpus.spin_s  # the bench waits for a quiet host: no worker spinning
        records: list[RequestRecord] = []
        rate, turns = self.w.rate_per_s, len(plans)
        times = self.setup.times

        def send(position: int, plan: ConversationPlan, turn: int, answers: list[tuple[int, ...]]) -> None:
            prompt = plan.prompt(turn, answers)
            target = route(plan.index, turn)

            def ask(instance: Instance, max_tokens: int, then: Callable[[SimRequest], None]) -> None:
                sent = self.clock.now_s

                def done(r: SimRequest) -> None:  # the last token read by the client
                    records.append(RequestRecord(plan.index, turn, instance, len(prompt), r.answer,
                                                 r.first_token_s + r.first_out_s - sent, r.tpot_s,
                                                 self.clock.now_s - sent, sent - start, prompt=prompt))
                    then(r)

                server = self.servers[instance]
                request = SimRequest(prompt, self._answer(max_tokens), sent,
                                     lambda r: self.clock.at(self.clock.now_s + self._out_s(instance), lambda: done(r)),
                                     first=lambda r: setattr(r, "first_out_s", self._out_s(instance)))
                way_in = times.request_in_s * self.cpus.stretch(id(server), sent) + self.cpus.stall_s(id(server), sent)
                self.clock.at(sent + way_in, lambda: server.submit(request))

            def answered(r: SimRequest) -> None:
                if turn + 1 < plan.turns:
                    slot = start + arrival_s(position, turn + 1, turns, rate)
                    self.clock.at(slot, lambda: send(position, plan, turn + 1, [*answers, r.answer]))

            if isinstance(target, tuple):
                ask(target[0], 1, lambda r: ask(target[1], self.w.max_tokens, answered))
            else:
                ask(target, self.w.max_tokens, answered)

        for position, plan in enumerate(plans):
            self.clock.at(start + arrival_s(position, 0, turns, rate), lambda p=position, c=plan: send(p, c, 0, []))
        self.clock.run()
        wall = max((r.done_s for r in records), default=0.0) - min((r.sent_s for r in records), default=0.0)
        return (tuple(sorted(records, key=lambda r: r.sent_s)),
                {i: counters_of(self.servers[i]).minus(before[i]) for i in servers}, wall)


def counters_of(server: ServerSim) -> Counters:
    """A simulated server's counters as ``bench serve`` reads a real one's (cumulative; kvstrata's
    hits as its /metrics exports them)."""
    exported = {m: n for m, n in server.hit_blocks.items() if n} if server.store is not None else None
    return Counters(dict(exported or {}), exported, server.store is not None, server.load_requests, server.load_s, 0,
                    float(server.prefix_queries_tokens), float(server.prefix_hits_tokens))
