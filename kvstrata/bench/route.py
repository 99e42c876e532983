"""``kvstrata bench route``: one trace through ``kvstrata route``'s front over 2-3 ``vllm serve``
with the connector on one pool, under each routing policy in turn (an edge: processes, HTTP,
threads; the plan is :mod:`kvstrata.bench.route_plan`'s, the figures :mod:`kvstrata.bench.route_report`'s).

What runs, in order:

1. Restores priced. kvstrata's scorer (``predicted-ttft``) is given the servers' costs as
   ``kvstrata route --calibration`` gives them (:meth:`ServerCost.from_calibration
   <kvstrata.fleet.cost.ServerCost.from_calibration>`): a profile's restore lines, else a quick
   calibration of this host's paths before any server starts, and the profile's prefill for the
   model, else one measured through the first server (cold prompts of two lengths:
   :func:`~kvstrata.bench.route_plan.per_token_s`).
2. Servers. ``servers`` connector servers (``bench serve``'s kvstrata server, each with its own
   disk directory and stats file, its compute bound to a half of the CPUs in turn), all on one
   pool, each publishing vLLM's KV events (``--kv-events-config``, ZMQ on loopback), which carry
   kvstrata's host, disk and pool tiers too. vLLM's KV memory is a few requests' worth, as in
   ``bench serve``: a conversation's later turn finds its history in the vLLM cache or the
   kvstrata tiers of the server that took its last turn, or in the pool.
3. Passes. Each round, every policy's pass (:func:`~kvstrata.bench.route_plan.plan_passes`): a
   router of its own (``kvstrata route``'s aiohttp app, :func:`kvstrata.fleet.front.make_app`,
   served on a loopback port from a thread of the bench's process), its index fed by the
   servers' events from the pass's start, and the conversations sent through it by ``bench
   serve``'s client. Each server's counters are read before and after.
4. Reference. The servers stop; a server with prefix caching off and no connector answers every
   prompt sent, and each completion is compared with its answer.

SGLang's router (the ``sglang-router`` wheel's cache-aware policy) is not started, and the report
says why: tried by hand, its 0.3.2 installs from pip and fronts ``vllm serve`` here with text
prompts (streamed or not), but refuses a completion whose prompt is token ids, which is what this
workload sends (its answers are compared token for token with a cold server's).
Every server, router and an embedded pool are stopped however the run ends (``bench serve``'s
signal handling).
"""

from __future__ import annotations

import asyncio
import enum
import importlib.util
import json
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvstrata.bench.route_plan import Pass, RouteBenchConfig, per_token_s, plan_passes
from kvstrata.bench.route_report import PassRun, RouteBenchReport, build_report
from kvstrata.bench.serve import (SETTLE_S, Fleet, ignore_sigint, pool_source, write_pool_file, Phases, server_env,
                                  signals_end_the_run, work_dir, load_trace)
from kvstrata.bench.serve_report import PhaseRun
from kvstrata.cache import CacheConfig
from kvstrata.calibrate.serving.client import Endpoint, ask_each, drive
from kvstrata.calibrate.serving.host import wait_quiet
from kvstrata.calibrate.serving.servers import Instance, cpu_halves, server_specs, stats_path
from kvstrata.calibrate.serving.workload import ConversationPlan, draw, plan_conversations
from kvstrata.integrations.vllm.server import ServerSpec, free_port
from kvstrata.progress import NoProgress, Progress
from kvstrata.rounds import Skipped

if TYPE_CHECKING:
    from kvstrata.fleet.cost import ServerCost
    from kvstrata.fleet.front import FrontConfig
    from kvstrata.plan.host import HostCalibration
    from kvstrata.pool.config import PoolConfig

FRONT_START_S = 60.0  # the router's start: its first /health round, vLLM's hashing imported
PREFILL_SAMPLES = 3  # cold prompts per length for the measured prefill


class Member(enum.Enum):
    """A process the bench's client knows by name (its value: the reports' and the logs')."""

    SERVER_1 = "server-1"
    SERVER_2 = "server-2"
    SERVER_3 = "server-3"
    ROUTER = "router"  # where every pass's requests go: which server answered is the router's to count


SERVERS = (Member.SERVER_1, Member.SERVER_2, Member.SERVER_3)


def run_route_bench(config: RouteBenchConfig, pool: PoolConfig | None = None,
                    calibration: HostCalibration | None = None, progress: Progress | None = None) -> RouteBenchReport:
    """Run ``bench route`` (see the module text).

    Args:
        config: what to run (``config.serve.pool`` off: no pool tier, the servers share nothing).
        pool: the pool to use (None: an embedded one).
        calibration: this host's profile (None: a quick calibration of its restore paths).
        progress: where progress goes.

    Raises:
        ValueError, FileNotFoundError: a bad trace, or one shorter than the conversations.
        ServerFailed: a server did not start. RequestFailed: a request failed.
    """
    progress = progress or NoProgress()
    began = time.perf_counter()
    s, w = config.serve, config.serve.workload
    trace, trace_text = load_trace(s)
    passes = [p for in_round in plan_passes(config.policies, s.rounds) for p in in_round]
    conversations = {p.variant: plan_conversations(trace, w, s.vocab, p.variant) for p in passes}  # checks the trace
    members = SERVERS[: config.servers]
    with ExitStack() as stack:
        stack.enter_context(signals_end_the_run())
        work = work_dir(s, stack)
        source = pool_source(s, pool, stack)
        basis = "the profile given"
        if calibration is None:
            from kvstrata.workload.runner import quick_calibration

            progress.start(1)
            progress.step("calibrating this host's restore paths (a few seconds)")
            calibration = quick_calibration(s.block_bytes, work, source.config if source is not None else None)
            basis = "a quick calibration of this host's restore paths"
        specs, events = member_specs(config, work, write_pool_file(source, work))
        fleet = stack.enter_context(Fleet(specs, s, work, progress))
        stack.callback(ignore_sigint)  # unwinds first: nothing interrupts the stops below
        fleet.start(*members)
        cost, cost_text = _server_cost(fleet, members[0], config, calibration, basis, progress)
        urls = {fleet.servers[m].url: m for m in members}
        runs = [_pass(fleet, urls, events, p, conversations[p.variant], cost, config, progress) for p in passes]
        fleet.stop(*members)
        reference = Phases(s, fleet, progress).reference([PhaseRun(r.records, {}) for r in runs])
    return build_report(config, trace_text, [m.value for m in members], runs, reference, sglang_router(), cost_text,
                        source, {m.value: fleet.start_s[m] for m in members}, time.perf_counter() - began)


def member_specs(config: RouteBenchConfig, work: Path, pool_file: Path | None
                 ) -> tuple[dict[object, ServerSpec], dict[Member, str]]:
    """The servers' specs (``bench serve``'s kvstrata server, each with a disk directory, a stats
    file, a CPU half and a KV event endpoint of its own) and the cold reference's; and each
    server's event endpoint."""
    halves = cpu_halves(sorted(os.sched_getaffinity(0)), config.serve.server_cpus)
    specs = server_specs(config.serve, work, pool_file, f"bench-route-{uuid.uuid4().hex[:8]}", server_env(), halves)
    base = specs[Instance.OURS]
    out: dict[object, ServerSpec] = {Instance.REFERENCE: specs[Instance.REFERENCE]}
    events = {}
    for i, member in enumerate(SERVERS[: config.servers]):
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        events[member] = endpoint
        connector = {**(base.connector or {}), "disk_dir": str(work / f"disk-{member.name.lower()}"),
                     "stats_path": str(stats_path(work, member))}
        bind = {} if halves is None else {"VLLM_CPU_OMP_THREADS_BIND": halves[i % 2]}
        kv_events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint})
        out[member] = replace(base, connector=connector, env={**base.env, **bind},
                              extra_args=(*base.extra_args, "--kv-events-config", kv_events))
    return out, events


SGLANG_TOKEN_IDS = ("its completions take text prompts only (0.3.2 refuses token ids: 'prompt: data did not match any "
                    "variant of untagged enum StringOrArray'), and this workload's prompts are token ids")


def sglang_router() -> Skipped:
    """Why SGLang's router is not among the policies."""
    if importlib.util.find_spec("sglang_router") is None:
        return Skipped(f"sglang-router is not installed here; its cache-aware policy was not run: {SGLANG_TOKEN_IDS}")
    return Skipped(f"sglang-router is installed, but its cache-aware policy was not run: {SGLANG_TOKEN_IDS}")


def _server_cost(fleet: Fleet, member: Member, config: RouteBenchConfig, calibration: HostCalibration, basis: str,
                 progress: Progress) -> tuple[ServerCost, str]:
    """Every server's cost model for kvstrata's scorer, and what it rests on."""
    from kvstrata.fleet.cost import ServerCost
    from kvstrata.plan.fits import PrefillFit

    s, w = config.serve, config.serve.workload
    model_id = s.model_dir.resolve().name
    prefill = calibration.prefill.get(model_id)
    if prefill is not None:
        how = f"its prefill ({prefill.tokens_per_s:.0f} tokens/s) from the profile"
    else:
        endpoint = fleet.endpoint(member)
        lengths = (2 * w.block_tokens + 1, w.longest_prompt_tokens)
        samples = []
        for n in lengths:
            prompts = [draw(w.seed, s.vocab, -2, f"prefill/{n}/{i}", n) for i in range(PREFILL_SAMPLES)]
            answers = ask_each(endpoint, prompts, 1, 1, progress, f"prefill of {n} tokens, cold")
            samples.append([(n, a.ttft_s) for a in answers])
        per_token = per_token_s(*samples)
        prefill = PrefillFit(0.0, 1.0 / per_token)
        calibration = replace(calibration, prefill={**calibration.prefill, model_id: prefill})
        how = (f"its prefill ({per_token * 1e6:.0f} us/token) measured through {member.value}: cold prompts of "
               f"{lengths[0]} and {lengths[1]} tokens")
    cost = ServerCost.from_calibration(calibration, model_id, w.block_tokens, s.block_bytes, CacheConfig.workers)
    tiers = ", ".join(m.label for m in cost.restore) or "none"
    return cost, f"restores ({tiers}) from {basis}; {how}"


def _pass(fleet: Fleet, urls: Mapping[str, Member], events: Mapping[Member, str], plan: Pass,
          conversations: Sequence[ConversationPlan], cost: ServerCost, config: RouteBenchConfig,
          progress: Progress) -> PassRun:
    """One policy's pass through a router of its own, on a quiet host (``bench serve``'s phases')."""
    from kvstrata.fleet.front import FrontConfig, Upstream

    s, w = config.serve, config.serve.workload
    members = list(urls.values())
    front = FrontConfig(tuple(Upstream(url, events[m]) for url, m in urls.items()), plan.policy, w.block_tokens,
                        server_cost=cost, slo=config.slo)
    with _Front(front) as router:
        wait_quiet()  # its half-second windows also let the router's event subscriptions join
        before = fleet.counters(members)
        endpoint = Endpoint(Member.ROUTER, router.base_url, fleet.specs[members[0]].model)  # type: ignore[arg-type]
        driven = drive(conversations, lambda c, t: endpoint, w.max_tokens, w.rate_per_s, progress,
                       f"round {plan.round + 1}/{s.rounds}, {plan.policy.value}")
        time.sleep(SETTLE_S)
        after = fleet.counters(members)
        answered = router.answered()
    records = driven.records
    wall = max(r.done_s for r in records) - min(r.sent_s for r in records) if records else 0.0
    return PassRun(plan, records, {m.value: after[m].minus(before[m]) for m in members},
                   {urls[u].value: n for u, n in answered.items() if u in urls}, wall)


class _Front:
    """``kvstrata route``'s app for one pass, on a loopback port, its event loop on a thread of its
    own (a context manager: started on entry, its watchers and sockets closed on exit)."""

    def __init__(self, config: FrontConfig) -> None:
        from kvstrata.fleet.front import make_app

        self.app = make_app(config)
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bench-route-front", daemon=True)
        self._runner = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> _Front:
        from aiohttp import web

        self._thread.start()
        try:
            self._runner = web.AppRunner(self.app, access_log=None)
            self._call(self._start(web))
        except BaseException:
            self.__exit__()
            raise
        return self

    async def _start(self, web) -> None:
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def __exit__(self, *exc: object) -> None:
        try:
            if self._runner is not None:
                self._call(self._runner.cleanup())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(FRONT_START_S)
            self._loop.close()

    def _call(self, coroutine) -> object:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(FRONT_START_S)

    def answered(self) -> dict[str, int]:
        """Requests answered 200, per server URL (the router's ``kvstrata_route_requests_total``)."""
        from kvstrata.fleet.front import METRICS

        out: dict[str, int] = {}
        for family in self.app[METRICS].requests.collect():
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("code") == "200":
                    server = sample.labels["server"]
                    out[server] = out.get(server, 0) + int(sample.value)
        return out
