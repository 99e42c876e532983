"""``bench serve``'s results: each phase as it ran, the paired ratios of the rounds, and the
report (pure: built from records and counters; JSON through :func:`kvstrata.report.dumps`, the
plot through :mod:`kvstrata.plots.cdf`). What the client saw per request and each
configuration's figures (TTFT, TPOT, throughput, hit rates, identical completions) are
:mod:`kvstrata.calibrate.serving.measured`'s, which the serving simulator computes the same way.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvstrata.rounds import Skipped, Spread
from kvstrata.calibrate.serving.servers import Instance
from kvstrata.calibrate.serving.counters import ByteRates, ConnectorCpu, Counters
from kvstrata.calibrate.serving.measured import Measured, RequestRecord, measure, percentile, total
from kvstrata.calibrate.serving.workload import WorkloadKind
from kvstrata.media import Medium
from kvstrata.report import OMIT_NONE

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from kvstrata.bench.serve_burst import BurstRun, Concurrency
    from kvstrata.calibrate.serving.servers import ServeBenchConfig
    from kvstrata.calibrate.serving.workload import TurnPlan
    from kvstrata.plan.host import HostCalibration
    from kvstrata.pool.scoped import PoolSource


@dataclass(frozen=True)
class PhaseRun:
    """One phase as it ran: the answers (a P/D phase's decode answers), a P/D phase's prefill
    calls, and each server's counters over the phase."""

    records: tuple[RequestRecord, ...]
    counters: Mapping[Instance, Counters]
    prefills: tuple[RequestRecord, ...] = ()


# --- the report's parts ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ServeRound:
    """One interleaved round: both configurations on the round's conversations, in ``order``."""

    index: int
    order: tuple[Instance, ...]
    baseline: Measured
    kvstrata: Measured


@dataclass(frozen=True)
class Versus:
    """kvstrata over the baseline, per round then the median with its spread (times: < 1 is faster)."""

    ttft_p50: Spread
    ttft_p90: Spread
    tpot_p50: Spread
    output_tokens_per_s: Spread
    server_cpu_per_request: Spread  # CPU seconds of the server's processes per request


def versus(rounds: Sequence[ServeRound]) -> Versus:
    def ratio(of: str) -> Spread:
        return Spread.of([_ratio(getattr(r.kvstrata, of), getattr(r.baseline, of)) for r in rounds])

    return Versus(ratio("ttft_p50_s"), ratio("ttft_p90_s"), ratio("tpot_p50_s"), ratio("output_tokens_per_s"),
                  ratio("server_cpu_per_request_s"))


def _ratio(a: float | None, b: float | None) -> float:
    """``a / b``; NaN where either is missing (a TPOT of one-token answers) or ``b`` is not > 0."""
    return a / b if a is not None and b is not None and b > 0 else math.nan


@dataclass(frozen=True)
class SharedPool:
    """Two kvstrata servers on one pool, turns alternating between them: each server's figures
    over the turns it served (its hits per tier), and both together."""

    servers: dict[Instance, Measured]
    together: Measured


@dataclass(frozen=True)
class Restart:
    """A server restarted (its disk tier kept) and the turns it had served sent again."""

    server: Instance
    restart_s: float  # stop, start and /health answering
    replay: Measured
    metrics_text_before: str  # its /metrics as it stopped


@dataclass(frozen=True)
class PrefillDecode:
    """Prefill on a ``kv_producer``, then decode on a ``kv_consumer``, the KV handed over in the pool.

    Attributes:
        decode: the decode server's requests: its TTFT is the handoff (the KV read from the
            pool, the prompt's last token computed, the first token out).
        prefill: the prefill server's requests (one token each).
        client_ttft_p50_s: median over turns of the prefill's latency plus the decode's TTFT:
            the first token as the client of the pair sees it.
        restore_measured_s: kvstrata's own time per load on the decode server (its stats).
        restore_predicted_s: the mean over the decode loads of the prediction for this host:
            the restore of the load's bytes over the pool path (``HostCalibration.restore_s``).
        restore_bytes: the mean bytes a decode request could load (its full blocks).
        prediction: where the prediction's figures come from.
    """

    decode: Measured
    prefill: Measured
    client_ttft_p50_s: float
    restore_measured_s: float | None
    restore_predicted_s: float | None
    restore_bytes: float
    prediction: str


def prefill_decode(run: PhaseRun, block_tokens: int, block_bytes: int, workers: int,
                   calibration: HostCalibration | None, prediction: str) -> PrefillDecode:
    """The P/D phase's figures, with the calibration's restore prediction (None: no prediction)."""
    from kvstrata.calibrate.serving.workload import hit_blocks

    decode = measure(run.records, run.counters[Instance.DECODE], block_tokens)
    prefill = measure(run.prefills, run.counters[Instance.PREFILL], block_tokens)
    first = {(r.conversation, r.turn): r.latency_s for r in run.prefills}
    client = [first[(r.conversation, r.turn)] + r.ttft_s for r in run.records if (r.conversation, r.turn) in first]
    blocks = [hit_blocks(r.prompt_tokens, block_tokens) for r in run.records]
    predicted = None
    if calibration is not None and blocks:
        try:
            predicted = statistics.mean(calibration.restore_s(Medium.REMOTE, b * block_bytes, b, workers=workers)
                                        for b in blocks)
        except KeyError:  # the pool path was not calibrated
            predicted, prediction = None, f"{prediction} (no pool path in it)"
    return PrefillDecode(decode, prefill, percentile(client, 50), decode.load_seconds_per_load, predicted,
                         statistics.mean(b * block_bytes for b in blocks) if blocks else 0.0, prediction)


@dataclass(frozen=True)
class ServeBenchReport:
    """``bench serve``'s report (see :mod:`kvstrata.bench.serve`).

    Attributes:
        config: what ran, sizes included.
        trace: the trace file, or what generated it.
        opener_tokens: each conversation's opening prompt, tokens.
        baseline, kvstrata: each configuration over every round.
        rounds: each round's figures.
        versus: kvstrata over the baseline, paired per round.
        shared_pool, restart, prefill_decode: the later parts (or why they did not run: no pool,
            or the no-reuse workload, which runs the rounds alone).
        concurrency: bursts of requests sharing a prefix only kvstrata holds, against the same
            when vLLM's cache holds it (:mod:`kvstrata.bench.serve_burst`; the no-reuse workload: skipped).
        pool: where the pool came from (None: no pool).
        reference_prompts: prompts the reference server computed.
        identical: no completion checked differs from the reference's (near-ties apart).
        server_start_s: each server's seconds to answer /health.
        metrics_text: each server's /metrics as it stopped.
        wall_s: the whole run.
        byte_rates: this host's copy and checksum rates, measured before the servers started
            (what the connector's bytes cost, against its CPU; None: not measured).
        connector_cpu_beyond_bytes_per_request_s: the connector's CPU per request over the
            rounds beyond what its bytes take at ``byte_rates`` (None: either is unknown).
    """

    config: ServeBenchConfig
    trace: str
    opener_tokens: tuple[int, ...]
    baseline: Measured
    kvstrata: Measured
    rounds: tuple[ServeRound, ...]
    versus: Versus
    shared_pool: SharedPool | Skipped
    restart: Restart | Skipped
    prefill_decode: PrefillDecode | Skipped
    concurrency: Concurrency | Skipped
    pool: PoolSource | None
    reference_prompts: int
    identical: bool
    server_start_s: dict[Instance, float]
    metrics_text: dict[Instance, str]
    wall_s: float
    byte_rates: ByteRates | None = field(default=None, metadata=OMIT_NONE)
    connector_cpu_beyond_bytes_per_request_s: float | None = field(default=None, metadata=OMIT_NONE)
    prefill_vs_restore: PrefillVsRestore | None = field(default=None, metadata=OMIT_NONE)


@dataclass(frozen=True)
class RoundRun:
    """One round as it ran: the order the configurations ran in, and each one's run."""

    order: tuple[Instance, ...]
    runs: Mapping[Instance, PhaseRun]


@dataclass(frozen=True)
class RestartRun:
    """A restart as it ran: the server, its replay, the seconds to /health, its /metrics before."""

    server: Instance
    run: PhaseRun
    restart_s: float
    metrics_text_before: str


@dataclass(frozen=True)
class RunLog:
    """Every phase as it ran, before the reference's check (None: the phase did not run)."""

    rounds: tuple[RoundRun, ...]
    shared: PhaseRun | None
    restart: RestartRun | None
    prefill_decode: PhaseRun | None
    bursts: tuple[BurstRun, ...] = ()

    def runs(self) -> list[PhaseRun]:
        optional = (self.shared, self.restart.run if self.restart is not None else None, self.prefill_decode)
        return ([run for r in self.rounds for run in r.runs.values()] + [run for run in optional if run is not None]
                + [run for b in self.bursts for run in b.runs()])


@dataclass(frozen=True)
class PrefillVsRestore:
    """What recomputing a prompt token costs this model on this host, against bringing its KV
    back from the host tier: the ratio that bounds what any KV cache can gain here.

    Attributes:
        prefill_s_per_token: vLLM alone's quickest first turn (the least queued) over its tokens.
        restore_s_per_token: a copy and an xxh3 checksum of a token's KV bytes at this host's
            one-thread rates (what a host-tier load does to them).
        ratio: the first over the second.
    """

    prefill_s_per_token: float
    restore_s_per_token: float
    ratio: float


def prefill_vs_restore(baseline: Measured, rates: ByteRates | None, bytes_per_token: float) -> PrefillVsRestore | None:
    """From the rounds and the run's byte rates (None: no first turn, or no rates)."""
    firsts = [r.ttft_s / r.prompt_tokens for r in baseline.requests if r.turn == 0 and r.prompt_tokens]
    if not firsts or rates is None:
        return None
    prefill = min(firsts)
    restore = bytes_per_token / (rates.copy_gbps * 1e9) + bytes_per_token / (rates.checksum_gbps * 1e9)
    return PrefillVsRestore(prefill, restore, prefill / restore)


def build_report(config: ServeBenchConfig, trace: str, first_plans: Sequence[TurnPlan], ran: RunLog,
                 reference: Mapping[tuple[int, ...], RequestRecord], pool: PoolSource | None,
                 prediction: tuple[HostCalibration | None, str, int], why_no_pool: str | None,
                 start_s: dict[Instance, float], metrics_text: dict[Instance, str], wall_s: float,
                 byte_rates: ByteRates | None = None) -> ServeBenchReport:
    """The report of ``ran``, every completion checked against ``reference`` (its answer per
    prompt); ``prediction``: the calibration for the P/D restore, what it is, the cache's workers."""
    bt = config.workload.block_tokens
    if config.workload.kind is WorkloadKind.NO_REUSE:
        why_not = "--workload no-reuse"  # the rounds alone: the later parts exist to reuse KV
    else:
        why_not = why_no_pool or "no pool"

    def final(run: PhaseRun) -> PhaseRun:
        tie = TIE_NATS[config.dtype]
        return replace(run, records=checked(run.records, reference, tie), prefills=checked(run.prefills, reference, tie))

    checked_rounds = [{i: final(run) for i, run in r.runs.items()} for r in ran.rounds]
    rounds = tuple(ServeRound(n, r.order, *(measure(runs[i].records, runs[i].counters[i], bt)
                                            for i in (Instance.BASELINE, Instance.OURS)))
                   for n, (r, runs) in enumerate(zip(ran.rounds, checked_rounds)))

    def over_rounds(instance: Instance) -> Measured:
        runs = [by[instance] for by in checked_rounds]
        walls = [r.baseline.wall_s if instance is Instance.BASELINE else r.kvstrata.wall_s for r in rounds]
        return measure([rec for run in runs for rec in run.records], total(run.counters[instance] for run in runs),
                       bt, wall_s=sum(walls))

    shared: SharedPool | Skipped = Skipped(why_not)
    if ran.shared is not None:
        s = final(ran.shared)
        shared = SharedPool({i: measure([r for r in s.records if r.server is i], s.counters[i], bt)
                             for i in (Instance.OURS, Instance.SECOND)}, measure(s.records, total(s.counters.values()), bt))
    restart: Restart | Skipped = Skipped(why_not)
    if ran.restart is not None:
        replay = final(ran.restart.run)
        restart = Restart(ran.restart.server, ran.restart.restart_s,
                          measure(replay.records, replay.counters[ran.restart.server], bt),
                          ran.restart.metrics_text_before)
    pd: PrefillDecode | Skipped = Skipped(why_not)
    if ran.prefill_decode is not None:
        calibration, basis, workers = prediction
        pd = prefill_decode(final(ran.prefill_decode), bt, config.block_bytes, workers, calibration, basis)
    bursts: Concurrency | Skipped = Skipped("--workload no-reuse")
    if ran.bursts:
        from kvstrata.bench.serve_burst import concurrency

        bursts = concurrency([replace(b, from_kvstrata=final(b.from_kvstrata), from_vllm=final(b.from_vllm),
                                      others=tuple(final(o) for o in b.others)) for b in ran.bursts],
                             Instance.OURS, bt)
    baseline, ours = over_rounds(Instance.BASELINE), over_rounds(Instance.OURS)
    every = [baseline, ours]
    if not isinstance(bursts, Skipped):
        every += [bursts.from_kvstrata, bursts.from_vllm, bursts.setup]
    if isinstance(restart, Restart):
        every.append(restart.replay)
    if isinstance(shared, SharedPool):
        every.append(shared.together)
    if isinstance(pd, PrefillDecode):
        every += [pd.decode, pd.prefill]
    return ServeBenchReport(config, trace, tuple(len(p.opener) for p in first_plans), baseline, ours, rounds,
                            versus(rounds), shared, restart, pd, bursts, pool, len(reference),
                            all(m.identical is True for m in every), start_s, metrics_text, wall_s, byte_rates,
                            _beyond_bytes(ours.connector_cpu_per_request, byte_rates),
                            prefill_vs_restore(baseline, byte_rates, config.block_bytes / config.workload.block_tokens))


def _beyond_bytes(cpu: ConnectorCpu | None, rates: ByteRates | None) -> float | None:
    return None if cpu is None or rates is None else cpu.beyond_bytes_s(rates)


TIE_NATS = {"float32": 0.0, "bfloat16": 0.25, "float16": 0.05}  # a lead below this can flip with rounding (measured.py)


def checked(records: Sequence[RequestRecord], reference: Mapping[tuple[int, ...], RequestRecord],
            tie_nats: float = 0.0) -> tuple[RequestRecord, ...]:
    """``records`` with ``identical`` (the answer equals the reference's for its prompt; a
    prefill's one token: the reference answer's first) and ``near_tie`` set: where it first left
    the reference's answer, the reference's choice led its runner-up by less than ``tie_nats``."""
    out = []
    for r in records:
        expected = reference.get(r.prompt)
        if expected is None:
            out.append(replace(r, identical=None))
            continue
        ids = expected.output_ids[: len(r.output_ids)]
        first = next((i for i, (a, b) in enumerate(zip(ids, r.output_ids)) if a != b), None)
        tie = first is not None and first < len(expected.leads) and expected.leads[first] < tie_nats
        out.append(replace(r, identical=ids == r.output_ids, near_tie=tie))
    return tuple(out)


def ttft_figure(report: ServeBenchReport) -> Figure:
    """TTFT CDFs with and without kvstrata (every round's requests), in milliseconds."""
    from kvstrata.plots.cdf import Latency, cdf_figure

    w = report.config.workload
    subject = (f"{report.config.model_dir.name}: {w.conversations} conversations x {w.turns} turns at "
               f"{w.rate_per_s:g} req/s, {report.config.rounds} round(s); vLLM KV {report.config.kv_blocks} blocks "
               f"x {w.block_tokens} tokens")
    samples = {"vLLM, prefix caching": report.baseline.ttft_s, "vLLM + kvstrata": report.kvstrata.ttft_s}
    fig = cdf_figure(samples, Latency("TTFT", "time to first token", "ms", 1e3, "ttft_s"), subject, None)
    fig.axes[0].set_title(f"TTFT CDF with and without kvstrata\n{subject}", fontsize=10)  # not per architecture
    return fig
