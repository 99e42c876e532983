"""``kvstrata bench serve``: serving traffic through vLLM's own OpenAI server, with and without
kvstrata, driven by the ``openai`` package (an edge: processes, HTTP, files; the workload, the
servers' specs and the figures are built by the pure modules beside it).

What runs, in order (see :mod:`kvstrata.calibrate.serving.servers` for the servers):

1. Rounds. The baseline (vLLM, its prefix caching on) and kvstrata (vLLM + the connector) serve
   the round's conversations (:mod:`kvstrata.calibrate.serving.workload`) one after the other, the order
   rotating from round to round; each round draws fresh tokens for the same conversations, so
   no round finds another's KV. vLLM's KV memory is a few requests' worth: by a conversation's
   next turn its blocks have been evicted from vLLM, and only kvstrata can serve them.
2. Concurrency. On the kvstrata server, bursts of requests sharing one prefix, all sent at once:
   while only kvstrata holds the prefix, and while vLLM's own cache does
   (:mod:`kvstrata.bench.serve_burst`): each block loaded once, TTFT against vLLM's own hit.
3. Two servers, one pool. A second kvstrata server joins the first on the shared pool; each
   conversation's turns alternate between the two (no affinity), so a turn finds its history in
   the pool, put there by the other server.
4. Restart. The second server is stopped and started again (its disk directory kept) and the
   turns it served in the phase before are sent again: their KV comes from its disk tier (the
   blocks the other server put in the pool, from the pool).
5. P/D. A ``kv_producer`` server computes each prompt (one token), a ``kv_consumer`` server
   answers it with the KV read from the pool. Beside the decode server's TTFT: kvstrata's own
   restore time there and the prediction for this host (``HostCalibration.restore_s`` over the
   pool path: a ``kvstrata calibrate`` profile, else a quick calibration run here).
6. Reference. A server with prefix caching off and no connector computes every distinct prompt
   sent above from scratch; each completion is compared with its answer.

Without a pool (none configured and the pool engine not installed, or ``pool=False``) parts 2
and 5 are skipped, kvstrata has no pool tier, and the kvstrata server restarts and replays the
last round's turns. The no-reuse workload (:attr:`~kvstrata.calibrate.serving.workload.WorkloadKind.NO_REUSE`)
runs the rounds alone, each round's two servers sent prompts of their own: parts 2-5 exist to
reuse KV, and the reference checks the rounds' completions.
Every server and an embedded pool are stopped however the run ends: an exception, Ctrl-C or
SIGTERM (SIGINT is ignored while they stop, so a second Ctrl-C cannot leave them running).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from kvstrata.rounds import rotated
from kvstrata.bench.serve_burst import BurstPhase, BurstPlan, BurstRun, plan_bursts
from kvstrata.calibrate.serving.host import wait_quiet
from kvstrata.calibrate.serving.client import Endpoint, Handoff, Route, ask_each, drive
from kvstrata.calibrate.serving.servers import Instance, ServeBenchConfig, cpu_halves, server_specs, stats_path
from kvstrata.calibrate.serving.counters import ByteRates, Counters, counters_of
from kvstrata.calibrate.serving.workload import (
    TurnPlan,
    WorkloadKind,
    alternate,
    plan_conversations,
    replay_plans,
    round_plans,
    warm_prompts,
)
from kvstrata.calibrate.serving.measured import RequestRecord
from kvstrata.bench.serve_report import (
    PhaseRun,
    RestartRun,
    RoundRun,
    RunLog,
    ServeBenchReport,
    build_report,
)
from kvstrata.cache import CacheConfig
from kvstrata.integrations.vllm.server import ServerFailed, ServerSpec, VllmServer, start_together
from kvstrata.progress import NoProgress, Progress

if TYPE_CHECKING:
    from kvstrata.plan.host import HostCalibration
    from kvstrata.pool.config import PoolConfig
    from kvstrata.pool.scoped import PoolSource
    from kvstrata.sim.trace import Request

POOL_SEGMENT_BYTES = 512 << 20  # an embedded pool's: every connector server's remote_bytes fit
ROUND_SERVERS = (Instance.BASELINE, Instance.OURS)  # in this order in round_plans' [round][server]
SETTLE_S = 0.3  # after a phase's last answer, before its counters are read (the stats file is rewritten after a step)


def load_trace(config: ServeBenchConfig) -> tuple[list[Request], str]:
    """The trace's requests and what it is: the file's, or one generated with the workload's seed."""
    from kvstrata.calibrate.serving.workload import generated_trace
    from kvstrata.sim.traceio import read_trace

    w = config.workload
    if config.trace is not None:
        return read_trace(config.trace), str(config.trace)
    return generated_trace(w), f"generated (kvstrata trace generate --requests {w.conversations} --seed {w.seed} --kind {w.traffic.value})"


def run_serve_bench(config: ServeBenchConfig, pool: PoolConfig | None = None,
                    calibration: HostCalibration | None = None, progress: Progress | None = None,
                    why_no_pool: str | None = None) -> ServeBenchReport:
    """Run ``bench serve`` (see the module text).

    Args:
        config: what to run.
        pool: the pool to use (None: an embedded one, when ``config.pool``).
        calibration: this host's profile for the P/D prediction (None: a quick calibration).
        progress: where progress goes.
        why_no_pool: why ``config.pool`` is off, for the report.

    Raises:
        ValueError, FileNotFoundError: a bad trace, or a trace shorter than the conversations
            (before anything starts).
        ServerFailed: a server did not start (its log's tail in the message).
        RequestFailed: a request failed.
    """
    progress = progress or NoProgress()
    began = time.perf_counter()
    trace, trace_text = load_trace(config)
    w = config.workload
    rounds_plans = round_plans(trace, w, config.vocab, config.rounds, len(ROUND_SERVERS))  # checks the trace first
    reuse = w.kind is WorkloadKind.CONVERSATIONS  # no-reuse: the rounds alone (see the module text)
    later = [plan_conversations(trace, w, config.vocab, config.rounds + i) for i in range(2)] if reuse else []
    with ExitStack() as stack:
        stack.enter_context(signals_end_the_run())
        work = work_dir(config, stack)
        rates = byte_rates(work)  # before any server: the host as quiet as the run finds it
        source = pool_source(config, pool, stack)
        pool_file = write_pool_file(source, work)
        fleet = stack.enter_context(Fleet(
            server_specs(config, work, pool_file, f"bench-serve-{uuid.uuid4().hex[:8]}", server_env(),
                         cpu_halves(sorted(os.sched_getaffinity(0)), config.server_cpus)),
            config, work, progress))
        stack.callback(ignore_sigint)  # unwinds first: nothing interrupts the stops below
        run = Phases(config, fleet, progress)
        rounds = run.rounds(rounds_plans)
        bursts = run.bursts(plan_bursts(w, config.vocab, config.rounds, config.vllm_kv_tokens)) if reuse else ()
        shared: PhaseRun | None = None
        restart: RestartRun | None = None
        pd: PhaseRun | None = None
        if reuse:
            shared = run.shared(later[0]) if source is not None else None
            if shared is not None:
                restart = run.restart(Instance.SECOND, shared.records)
            else:
                restart = run.restart(Instance.OURS, rounds[-1].runs[Instance.OURS].records)
            pd = run.prefill_decode(later[1]) if source is not None else None
        ran = RunLog(tuple(rounds), shared, restart, pd, bursts)
        if pd is not None and calibration is None:
            progress.start(1)
            progress.step("calibrating this host's restore paths (a few seconds)")
            calibration, basis = _quick_calibration(config, work, source.config), "a quick calibration of this host"
        else:
            basis = "the calibrated profile given" if calibration is not None else "none"
        reference = run.reference(ran.runs())
    return build_report(config, trace_text, rounds_plans[0][0], ran, reference, source,
                        (calibration, basis, CacheConfig.workers),
                        why_no_pool, dict(fleet.start_s), dict(fleet.metrics_text), time.perf_counter() - began,
                        rates)


class Phases:
    """The phases, each returning its raw runs (checked against the reference at the end)."""

    def __init__(self, config: ServeBenchConfig, fleet: Fleet, progress: Progress) -> None:
        self.config, self.fleet, self.progress = config, fleet, progress
        self.w = config.workload

    def phase(self, plans: Sequence[TurnPlan], route: Route, servers: Sequence[Instance], label: str,
              rate_per_s: float | None = None) -> PhaseRun:
        """One phase, on a quiet host: a vLLM worker busy-polls its queue for a while after its
        last step (about 1 s), and a phase begun while the last one's server still spun on the
        CPUs this one's is bound to had its first requests take 0.2-0.7 s to a first token.
        ``rate_per_s``: the pace (None: the workload's; ``math.inf``: every request at once)."""
        wait_quiet()
        before = self.fleet.counters(servers)
        rate = self.w.rate_per_s if rate_per_s is None else rate_per_s
        driven = drive(plans, route, self.w.max_tokens, rate, self.progress, label)
        time.sleep(SETTLE_S)
        after = self.fleet.counters(servers)
        return PhaseRun(driven.records, {s: after[s].minus(before[s]) for s in servers}, driven.prefills)

    def rounds(self, plans: Sequence[Sequence[Sequence[TurnPlan]]]) -> list[RoundRun]:
        """Each round's ``[server]`` plans (``ROUND_SERVERS``' order), the servers in turn."""
        self.fleet.start(*ROUND_SERVERS)
        out = []
        for r, by_server in enumerate(plans):
            order = tuple(rotated([Instance.OURS, Instance.BASELINE], r))
            by = {}
            for instance in order:
                endpoint, sent = self.fleet.endpoint(instance), by_server[ROUND_SERVERS.index(instance)]
                by[instance] = self.phase(sent, lambda c, t, e=endpoint: e, [instance],
                                          f"round {r + 1}/{len(plans)}, {instance.value}")
            out.append(RoundRun(order, by))
        self.fleet.stop(Instance.BASELINE)
        return out

    def bursts(self, plans: Sequence[BurstPlan]) -> tuple[BurstRun, ...]:
        """Each round's bursts on the kvstrata server (:mod:`kvstrata.bench.serve_burst`)."""
        endpoint = self.fleet.endpoint(Instance.OURS)
        out = []
        for plan in plans:
            def send(prompts: Sequence[Sequence[int]], what: str) -> PhaseRun:
                return self.phase(replay_plans(prompts), lambda c, t: endpoint, [Instance.OURS],
                                  f"concurrency {plan.index + 1}/{len(plans)}: {what}", rate_per_s=math.inf)

            seed = send([plan.seed], "the shared prefix, computed")
            ran = {phase: send(plan.prompts(phase), phase.value) for phase in plan.order}
            out.append(BurstRun(plan, ran[BurstPhase.FROM_KVSTRATA], ran[BurstPhase.FROM_VLLM],
                                (seed, ran[BurstPhase.FILL])))
        return tuple(out)

    def shared(self, plans: Sequence[TurnPlan]) -> PhaseRun:
        self.fleet.start(Instance.SECOND)
        pair = (self.fleet.endpoint(Instance.OURS), self.fleet.endpoint(Instance.SECOND))
        run = self.phase(plans, lambda c, t: pair[alternate(c, t)], [Instance.OURS, Instance.SECOND],
                         "two servers, one pool")
        self.fleet.stop(Instance.OURS)
        return run

    def restart(self, instance: Instance, served: Sequence[RequestRecord]) -> RestartRun:
        """Restart ``instance``, then send again the prompts it served (of ``served``), in the same order."""
        mine = [r for r in served if r.server is instance]
        seconds, before = self.fleet.restart(instance)
        endpoint = self.fleet.endpoint(instance)
        run = self.phase(replay_plans([r.prompt for r in mine]), lambda c, t: endpoint, [instance],
                         f"{instance.value}, restarted: the same turns again")
        self.fleet.stop(instance)
        return RestartRun(instance, run, seconds, before)

    def prefill_decode(self, plans: Sequence[TurnPlan]) -> PhaseRun:
        self.fleet.start(Instance.PREFILL, Instance.DECODE)
        handoff = Handoff(self.fleet.endpoint(Instance.PREFILL), self.fleet.endpoint(Instance.DECODE))
        run = self.phase(plans, lambda c, t: handoff, [Instance.PREFILL, Instance.DECODE], "P/D via the pool")
        self.fleet.stop(Instance.PREFILL, Instance.DECODE)
        return run

    def reference(self, runs: Sequence[PhaseRun]) -> dict[tuple[int, ...], RequestRecord]:
        """Every distinct prompt sent, answered from scratch, with each choice's lead over its
        runner-up (the near-ties of :mod:`kvstrata.bench.serve_report`)."""
        prompts = list(dict.fromkeys(r.prompt for run in runs for r in (*run.records, *run.prefills)))
        self.fleet.start(Instance.REFERENCE)
        answers = ask_each(self.fleet.endpoint(Instance.REFERENCE), prompts, self.w.max_tokens,
                           self.config.max_num_seqs, self.progress, "reference (prefix caching off)", leads=True)
        self.fleet.stop(Instance.REFERENCE)
        return dict(zip(prompts, answers, strict=True))


class Fleet:
    """The servers of a run: started, warmed up, stopped (their last /metrics kept); a context
    manager that stops every one still running on exit."""

    WARM_PROMPTS = 2
    # a server warms up with the prompts another put in the pool before it: its first loads from
    # the pool (connecting to the pool's daemon, first transfers) are then not in the measured turns
    WARM_WITH = {Instance.SECOND: Instance.OURS, Instance.DECODE: Instance.PREFILL}

    def __init__(self, specs: dict[Instance, ServerSpec], config: ServeBenchConfig, work: Path,
                 progress: Progress) -> None:
        self.specs, self.workload, self.vocab = specs, config.workload, config.vocab
        self.work, self.progress = work, progress
        self.servers: dict[Instance, VllmServer] = {}
        self.start_s: dict[Instance, float] = {}
        self.metrics_text: dict[Instance, str] = {}
        self._timeout_s = config.start_timeout_s

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(*self.servers)

    def start(self, *instances: Instance) -> None:
        """Start ``instances`` together (each one's start beside the others'), then warm each up."""
        self.progress.start(len(instances) + 1)
        self.progress.step(f"starting {', '.join(i.value for i in instances)} (vllm serve, ~20-60 s)")
        servers = [VllmServer(self.specs[i], self.work / f"{i.name.lower()}.log", start_timeout_s=self._timeout_s)
                   for i in instances]
        self.servers.update(zip(instances, servers))
        start_together(servers)
        for instance, server in zip(instances, servers):
            self.start_s.setdefault(instance, server.started_s or 0.0)
            self.progress.step(f"warming {instance.value} up")
            self._warm_up(instance)

    def restart(self, instance: Instance) -> tuple[float, str]:
        """Stop ``instance`` and start it again, its disk tier kept: the seconds from the stop to
        /health answering, and its /metrics as it stopped."""
        self.progress.start(1)
        self.progress.step(f"restarting {instance.value} (its disk tier kept)")
        begin = time.perf_counter()
        self.stop(instance)
        before = self.metrics_text.pop(instance, "")
        stats_path(self.work, instance).unlink(missing_ok=True)  # the new process counts from zero
        server = self.servers[instance] = VllmServer(self.specs[instance], self.work / f"{instance.name.lower()}.log",
                                                     start_timeout_s=self._timeout_s)
        server.start()
        seconds = time.perf_counter() - begin
        self._warm_up(instance)
        return seconds, before

    def stop(self, *instances: Instance) -> None:
        for instance in instances:
            server = self.servers.pop(instance, None)
            if server is None:
                continue
            try:
                if server.running:
                    self.metrics_text[instance] = server.metrics_text()
            except OSError:
                pass  # a server that died keeps no metrics; it is still stopped below
            finally:
                server.stop()

    def endpoint(self, instance: Instance) -> Endpoint:
        return Endpoint(instance, self.servers[instance].base_url, self.specs[instance].model)

    def counters(self, instances: Sequence[Instance]) -> dict[Instance, Counters]:
        out = {}
        for instance in instances:
            server = self.servers[instance]
            if not server.running:
                raise ServerFailed(f"vllm serve ({instance.value}) exited during the run:\n{server.log_tail()}")
            path = stats_path(self.work, instance)
            stats = json.loads(path.read_text()) if path.is_file() else None
            out[instance] = counters_of(server.metrics_text(), stats, server.cpu_seconds())
        return out

    def _warm_up(self, instance: Instance) -> None:
        """A few requests first: a fresh server's first requests pay one-time costs. Then wait
        for the host's CPUs to go quiet: a server answering /health still has start-up work
        in hand, which the next phase's first requests would otherwise share the CPUs with."""
        tag = self.WARM_WITH.get(instance, instance).name
        ask_each(self.endpoint(instance), warm_prompts(self.workload, self.vocab, self.WARM_PROMPTS, tag), 2, 1)
        wait_quiet()


# --- the edges' helpers -----------------------------------------------------------------------------


RATE_BYTES = 32 << 20  # a few cache blocks' worth, far past the CPU caches
RATE_RUNS = 5


def byte_rates(work: Path) -> ByteRates:
    """This host's one-thread copy and xxh3 rates: the median of a few runs over RATE_BYTES,
    as ``kvstrata calibrate`` times them (what the connector's bytes cost, against its CPU)."""
    import statistics

    import torch

    from kvstrata.calibrate.probes import Prober, blocks_layout
    from kvstrata.plan.calpaths import CalPath

    prober = Prober(work / "rates", 1, torch.device("cpu"), blocks_layout(1 << 20))
    try:
        copy, checksum = prober.step(CalPath.MEMCPY_1T, RATE_BYTES), prober.step(CalPath.CHECKSUM, RATE_BYTES)
        copy(), checksum()  # warm
        copy_s = statistics.median(copy() for _ in range(RATE_RUNS))
        checksum_s = statistics.median(checksum() for _ in range(RATE_RUNS))
    finally:
        prober.close()
    return ByteRates(RATE_BYTES / copy_s / 1e9, RATE_BYTES / checksum_s / 1e9)


def work_dir(config: ServeBenchConfig, stack: ExitStack) -> Path:
    if config.directory is not None:
        config.directory.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="serve-", dir=config.directory))  # a run of its own: disk tiers are locked
        return work
    work = Path(tempfile.mkdtemp(prefix="kvstrata-serve-"))
    stack.callback(shutil.rmtree, work, ignore_errors=True)
    return work


def pool_source(config: ServeBenchConfig, pool: PoolConfig | None, stack: ExitStack) -> PoolSource | None:
    if not config.pool:
        return None
    from kvstrata.pool.scoped import scoped_pool

    return stack.enter_context(scoped_pool(pool, POOL_SEGMENT_BYTES))


def write_pool_file(source: PoolSource | None, work: Path) -> Path | None:
    """A file the servers' connectors read the pool from (the pool's own, else written here)."""
    if source is None:
        return None
    if source.config.config_file is not None:
        return source.config.config_file
    path = work / "pool.toml"
    lines = [f"{k} = {json.dumps(v)}" for k, v in source.config.to_json().items() if v is not None]
    path.write_text("[pool]\n" + "\n".join(lines) + "\n")
    return path


def server_env() -> dict[str, str]:
    """The servers import this kvstrata (the connector's module), whichever the venv installed."""
    import kvstrata

    root = str(Path(kvstrata.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}


def _quick_calibration(config: ServeBenchConfig, work: Path, pool: PoolConfig) -> HostCalibration:
    from kvstrata.workload.runner import quick_calibration

    return quick_calibration(config.block_bytes, work, pool)


@contextmanager
def signals_end_the_run() -> Iterator[None]:
    """SIGTERM and SIGHUP end the run as Ctrl-C does (the stack unwinds, the servers stop);
    SIGINT's handler is put back after (``ignore_sigint`` sets it aside while they stop)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def end(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    kept = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, end)
    try:
        yield
    finally:
        for s, handler in kept.items():
            signal.signal(s, handler)


def ignore_sigint() -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
