"""``kvstrata bench serve``: serving traffic through ``vllm serve`` with and without kvstrata
(:mod:`kvstrata.bench.serve`). Arguments are checked here, before any server starts; the table
and its labels are made here (``--json``: the report alone; ``--plot``: TTFT CDFs)."""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from kvstrata import cli
from kvstrata.bench.cli.common import BenchParser, run_and_report, spread_x
from kvstrata.calibrate.serving.counters import HitsSource
from kvstrata.calibrate.serving.workload import WorkloadKind
from kvstrata.sim.synthetic import TraceKind
from kvstrata.cli.workload import add_model_args

if TYPE_CHECKING:
    from kvstrata.bench.serve_report import ServeBenchReport
    from kvstrata.calibrate.serving.measured import Measured

MiB = 1 << 20


def register(bench: BenchParser) -> None:
    """Add ``bench serve`` through ``bench`` (``kvstrata.bench.cli``'s sub-command maker)."""
    p = bench(
        "serve", run_serve, "vllm serve with and without kvstrata: TTFT, throughput, hits per tier, P/D, same tokens",
        "Start vLLM's own OpenAI server (vllm serve) on 127.0.0.1 without and with the KVStrata connector, "
        "vLLM's prefix caching on in both and its KV memory a few requests' worth, and drive it with the openai "
        "package: many multi-turn conversations from a Mooncake-format trace (generated with a seed by default), "
        "streamed completions, arrivals at --rate, each turn extending the last. Interleaved rounds; per "
        "configuration TTFT p50/p90/p99, TPOT, throughput, vLLM's prefix hit rate and kvstrata's per tier. Then "
        "two servers on one pool (turns alternating), a restart (hits from the disk tier), and prefill/decode "
        "servers handing the KV over in the pool, beside the prediction for this host. Every completion is "
        "compared with a cold server's (prefix caching off). The model: --model-dir, or --like MODEL's random-weight "
        f"model of a real model's shape (default: {DEFAULT_LIKE}, made once); the workload's sizes follow it "
        "(a real shape: prompts of 1-2K tokens; the tiny model: 100-500). "
        "--workload no-reuse: the same shapes and pace with every prompt new (no block shared in the run), the "
        "rounds alone: what the connector costs a server it never serves a hit to.",
    )
    add_model_args(p, f"--like {DEFAULT_LIKE}")
    p.add_argument("--workload", choices=[k.value for k in WorkloadKind], default=WorkloadKind.CONVERSATIONS.value,
                   help="conversations (each turn extends the last) or no-reuse (the same shapes and pace, every "
                        "prompt new; the rounds alone) (default: conversations)")
    p.add_argument("--traffic", choices=[k.value for k in TraceKind], default=TraceKind.MIX.value,
                   help="the generated trace's traffic: chat sessions, requests behind a few shared system prompts, "
                        "agents looping over one long prefix of tools and documents (RAG-like), or their mix "
                        "(default: mix; kvstrata trace generate --kind)")
    p.add_argument("--trace", metavar="FILE", help="Mooncake-format JSON-lines trace (default: one generated "
                                                   "with --seed, as kvstrata trace generate makes it)")
    p.add_argument("--conversations", type=int, help=_sized("conversations at once", "conversations"))
    p.add_argument("--turns", type=int, default=3, help="turns per conversation (default: 3)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of vLLM alone and with kvstrata (default: 2)")
    p.add_argument("--rate", type=float, help=_sized("requests per second the schedule sends", "rate"))
    p.add_argument("--max-tokens", type=int, default=16, help="answer tokens per turn (default: 16)")
    p.add_argument("--user-tokens", type=int, help=_sized("new user tokens per later turn", "user_tokens"))
    p.add_argument("--max-model-len", type=int, help=_sized("vLLM's max_model_len", "max_model_len"))
    p.add_argument("--block-size", type=int, help=_sized("vLLM's block size in tokens, one 512-token trace block each",
                                                         "block_size"))
    p.add_argument("--kv-blocks", type=int, help=_sized("vLLM's KV memory in blocks", "kv_blocks"))
    p.add_argument("--max-num-seqs", type=int, default=8, help="vLLM's max_num_seqs (default: 8)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help=_sized("the servers' dtype (float32 on the tiny model, whose random logits tie often: "
                               "'same as cold' then allows no near-tie; in bf16 a completion that leaves the "
                               "reference's only where its top two were within rounding is counted apart)", "dtype"))
    p.add_argument("--host-mib", type=int, help=_sized("kvstrata's host DRAM tier, MiB", "host_mib"))
    p.add_argument("--disk-mib", type=int, default=256, help="kvstrata's disk tier, MiB (default: 256)")
    p.add_argument("--disk-read-gbps", type=float, metavar="GBPS",
                   help="cap the disk tiers' reads at this many GB/s (a slow drive the connector is not told of: "
                        "it measures its loads and recomputes what a slow tier cannot bring back faster)")
    p.add_argument("--connector-extra", metavar="JSON", help="more kv_connector_extra_config for the kvstrata servers, "
                                                             "e.g. '{\"sync_save\": true}'")
    p.add_argument("--server-cpus", metavar="LIST",
                   help="bind vLLM alone's and kvstrata's server compute to these CPUs (a vLLM CPU list, e.g. "
                        "'0-3'; default: half the host's, the client and the pool keeping the rest)")
    p.add_argument("--remote-mib", type=int, default=128, help="the pool each server tracks, MiB (default: 128)")
    p.add_argument("--seed", type=int, default=0, help="the prompts' (and a generated trace's) seed (default: 0)")
    cli.add_pool_arg(p, "an embedded pool for the run")
    p.add_argument("--no-pool", action="store_true", help="no pool: skip the two-server and P/D parts")
    p.add_argument("--profile", metavar="FILE", help="predict the P/D restore with this kvstrata calibrate profile "
                                                     "(default: a quick calibration of this host)")
    p.add_argument("--dir", metavar="DIR", help="keep disk tiers, stats and server logs here (default: a "
                                                "temporary directory, removed)")
    p.add_argument("--plot", metavar="PATH", help="also write TTFT CDFs with and without kvstrata (PNG) to PATH")
    cli.add_json_arg(p)


DEFAULT_LIKE = "qwen2.5-0.5b"  # the smallest shape people serve; its prefill here is ~1000x its KV's host restore


@dataclass(frozen=True)
class Sizing:
    """bench serve's defaults for a kind of model: the flags left out take these.

    A real model's shape (``--like``, a model directory of one): prompts of 1-2K tokens, as chat
    and agents send, in 128-token blocks; vLLM's KV 17 blocks (about one conversation's), so a
    conversation's next turn finds its history evicted by the others' turns; a request every ~3 s,
    under what one of this host's cores prefills (a 1.5K-token opener of Qwen2.5-0.5B's shape:
    about 4 s in bf16), so queues come from bursts, not from an overloaded server; bf16, as served.
    The tiny model (``kvstrata model make-tiny``): the same shapes at a 32-token block, float32
    (its random logits tie often, see ``--dtype``).
    """

    conversations: int
    rate: float
    user_tokens: int
    max_model_len: int
    block_size: int
    kv_blocks: int
    dtype: str
    host_mib: int


SHAPED = Sizing(conversations=6, rate=0.3, user_tokens=64, max_model_len=2048, block_size=128, kv_blocks=17,
                dtype="bfloat16", host_mib=512)
TINY = Sizing(conversations=8, rate=4.0, user_tokens=48, max_model_len=512, block_size=32, kv_blocks=32,
              dtype="float32", host_mib=64)


def _sized(text: str, name: str) -> str:
    return f"{text} (default: {getattr(SHAPED, name)} for a real model's shape, {getattr(TINY, name)} for the tiny model)"


def sizing_of(args: argparse.Namespace) -> Sizing:
    """The defaults for ``args``' model, known without building it: the tiny model's for a
    directory ``kvstrata model make-tiny`` wrote, else a real shape's."""
    if args.model_dir is None:
        return SHAPED  # --like, or the default DEFAULT_LIKE
    from kvstrata.integrations.tiny import TINY_MARKER

    marker = Path(args.model_dir) / TINY_MARKER
    try:
        made = json.loads(marker.read_text()) if marker.is_file() else None
    except (OSError, ValueError):
        made = None
    return TINY if isinstance(made, dict) and "like" not in made else SHAPED


def sized(args: argparse.Namespace) -> Sizing:
    """Fill ``args``' sized flags left out (and the model: ``DEFAULT_LIKE``); the sizing used."""
    if args.model_dir is None and args.like is None:
        args.like = DEFAULT_LIKE
    sizing = sizing_of(args)
    for f in fields(Sizing):
        if getattr(args, f.name) is None:
            setattr(args, f.name, getattr(sizing, f.name))
    return sizing


def _connector_extra(text: str | None) -> dict[str, object]:
    """``--connector-extra``'s JSON object, checked as the connector checks its extra config."""
    if text is None:
        return {}
    import json

    try:
        extra = json.loads(text)
    except json.JSONDecodeError as error:
        raise cli.CliError(f"--connector-extra is not JSON: {error}") from None
    if not isinstance(extra, dict):
        raise cli.CliError(f"--connector-extra must be a JSON object, got {text!r}")
    from kvstrata.integrations.vllm.settings import ConnectorSettings

    try:
        ConnectorSettings.from_extra(extra)
    except ValueError as error:
        raise cli.CliError(f"--connector-extra: {error}") from None
    return extra


def run_serve(args: argparse.Namespace) -> int:
    from kvstrata.calibrate.serving.workload import ServeWorkload

    # what needs no model and no vLLM first: a bad flag is one line at once
    sized(args)
    workload = ServeWorkload(args.conversations, args.turns, args.max_tokens, args.user_tokens, args.block_size,
                             args.max_model_len, args.rate, args.seed, WorkloadKind(args.workload),
                             TraceKind(args.traffic))
    if args.trace is not None and not os.path.isfile(args.trace):
        raise cli.CliError(f"--trace {args.trace}: no such file")
    if args.disk_read_gbps is not None and not args.disk_read_gbps > 0:
        raise cli.CliError(f"--disk-read-gbps must be > 0, got {args.disk_read_gbps}")
    for flag in ("host_mib", "disk_mib", "remote_mib"):
        if getattr(args, flag) < 1:
            raise cli.CliError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.server_cpus is not None:
        from kvstrata.calibrate.serving.servers import server_cpu_set

        try:
            server_cpu_set(args.server_cpus)
        except ValueError as error:
            raise cli.CliError(f"--server-cpus {error}") from None
    calibration = None
    if args.profile:
        from kvstrata.calibrate import load_calibration

        calibration = load_calibration(args.profile)
    pool, use_pool, why = pool_choice(args)
    from kvstrata.bench.serve import run_serve_bench
    from kvstrata.calibrate.serving.host import model_facts
    from kvstrata.calibrate.serving.client import RequestFailed
    from kvstrata.calibrate.serving.servers import ServeBenchConfig
    from kvstrata.cli.workload import model_dir_of
    from kvstrata.integrations.vllm.server import ServerFailed
    from kvstrata.pool.client import PoolUnavailable
    from kvstrata.pool.embedded import PoolError

    model_dir = model_dir_of(args)
    facts = model_facts(model_dir, args.dtype)
    config = ServeBenchConfig(
        workload, model_dir, facts.vocab, facts.bytes_per_token * args.block_size,
        trace=Path(args.trace) if args.trace else None, rounds=args.rounds, kv_blocks=args.kv_blocks,
        max_num_seqs=args.max_num_seqs, dtype=args.dtype, host_bytes=args.host_mib * MiB, disk_bytes=args.disk_mib * MiB,
        remote_bytes=args.remote_mib * MiB, pool=use_pool, disk_read_gbps=args.disk_read_gbps,
        connector_extra=tuple(_connector_extra(args.connector_extra).items()),
        directory=Path(args.dir) if args.dir else None, server_cpus=args.server_cpus,
    )
    if args.trace is not None:  # a bad line, or fewer requests than conversations: one line, before any server
        from kvstrata.bench.serve import load_trace
        from kvstrata.calibrate.serving.workload import round_plans

        round_plans(load_trace(config)[0], workload, facts.vocab, config.rounds)
    reports: list[ServeBenchReport] = []

    def run(bar: cli.StepBar) -> ServeBenchReport:
        report = run_serve_bench(config, pool, calibration, bar, why)
        reports.append(report)
        if args.plot:
            _plot(report, args.plot, args.json)
        return report

    failures = {ServerFailed: "vllm serve failed", RequestFailed: "request failed",
                PoolUnavailable: "pool unavailable", PoolError: "pool unavailable"}
    try:
        code = run_and_report(args, run, _print_serve, failures)
    except KeyboardInterrupt:
        Console(stderr=True).print("[yellow]interrupted: every server (and an embedded pool) stopped[/]")
        return 130
    if code == 0 and reports and not reports[0].identical:
        Console(stderr=True).print("[bold red]completions differ from the cold reference's (see the table)[/]")
        return 1
    return code


def pool_choice(args: argparse.Namespace) -> tuple[object, bool, str | None]:
    """(the configured pool or None, whether to run the pool's parts, why not)."""
    if args.no_pool:
        return None, False, "--no-pool"
    configured = cli.pool_config(args.pool)
    if configured is None:
        from kvstrata.pool import libs

        cannot = libs.problem()
        if cannot:
            return None, False, f"no pool: {cannot}"
    return configured, True, None


def _plot(report: ServeBenchReport, path: str, json_output: bool) -> None:
    from kvstrata.bench.serve_report import ttft_figure
    from kvstrata.plots import png_bytes, save_png

    save_png(png_bytes(ttft_figure(report)), path)
    cli.wrote("TTFT CDFs", path, json_output)


def _near_ties(report: ServeBenchReport) -> str:
    """What the near-ties were, where there were any (:mod:`kvstrata.bench.serve_report`)."""
    from kvstrata.bench.serve_report import TIE_NATS

    ties = report.baseline.near_ties, report.kvstrata.near_ties
    if not any(ties):
        return ""
    return (f", or leaves it only where the reference's greedy choice led its runner-up by under "
            f"{TIE_NATS[report.config.dtype]} nats ({report.config.dtype} rounding: vLLM alone {ties[0]}, with kvstrata "
            f"{ties[1]} over the rounds)")


def ms_text(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}" if seconds >= 0.1 else f"{seconds * 1e3:.1f}"


def pct_text(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.0%}"


def hits_text(m: Measured) -> str:
    if not m.hits:
        return "-"
    return " ".join(f"{tier.label} {h.rate:.0%}" for tier, h in m.hits.items())


def same_text(m: Measured) -> str:
    if m.identical is None:
        return "-"
    ties = f" ({m.near_ties} near-tie{'s' if m.near_ties > 1 else ''})" if m.near_ties else ""
    return f"[green]yes{ties}[/]" if m.identical else f"[bold red]NO ({m.differing})[/]{ties}"


_HITS_SOURCE = {
    HitsSource.METRICS: "kvstrata_connector_lookup_hit_blocks_total{tier} on /metrics: the blocks beyond vLLM's own "
                        "prefix hit that kvstrata held as vLLM admitted the request, by the fastest tier holding them",
    HitsSource.STATS_FILE: "the connector's stats file: the blocks it loaded into vLLM, by the tier each came from",
    HitsSource.NONE: "none (no connector)",
}


def _cpu_line(report: ServeBenchReport) -> list[str]:
    """The connector's CPU time per request, where its server exports it (else no line), and
    what of it is beyond its bytes' cost, where the run measured this host's rates."""
    m, rates = report.kvstrata, report.byte_rates
    cpu = m.connector_cpu_per_request
    if cpu is None:
        return []
    line = (f"connector CPU per request: {cpu.total_s * 1e3:.2f} ms (scheduler {cpu.scheduler_s * 1e3:.2f}, worker "
            f"{cpu.worker_s * 1e3:.2f}): kvstrata_connector_cpu_seconds_total on the kvstrata server's /metrics over "
            f"the rounds, over its {len(m.requests)} requests.")
    if rates is not None:
        line += (f" Beyond its bytes: {cpu.beyond_bytes_s(rates) * 1e3:.2f} ms ({cpu.copied_bytes / 1e6:.2f} MB "
                 f"copied, {cpu.checksummed_bytes / 1e6:.2f} MB of it hashed, {cpu.bytes_s(rates) * 1e3:.2f} ms at "
                 f"this host's {rates.copy_gbps:.1f} GB/s copy and {rates.checksum_gbps:.1f} GB/s xxh3, one thread).")
    return [line]


_NEW = {  # what the workload line adds for each kind
    WorkloadKind.CONVERSATIONS: "",
    WorkloadKind.NO_REUSE: " in length, but every prompt is new (a tag in its first block: no block shared in the "
                           "run, so kvstrata can only store)",
}


def _print_serve(report: ServeBenchReport) -> None:
    from kvstrata.rounds import Skipped

    c, w = report.config, report.config.workload
    tiers = f"device {c.device_bytes / MiB:g} MiB, host {c.host_bytes / MiB:g} MiB, disk {c.disk_bytes / MiB:g} MiB"
    if report.pool is not None:
        tiers += f", pool {c.remote_bytes / MiB:g} MiB"
    fresh = " (no reuse: every prompt new)" if w.kind is WorkloadKind.NO_REUSE else ""
    title = (f"kvstrata bench serve: {c.model_dir.name} ({c.dtype}), {w.conversations} conversations x {w.turns} "
             f"turns{fresh} at {w.rate_per_s:g} req/s, {c.rounds} interleaved round(s); vLLM KV {c.kv_blocks} blocks x "
             f"{w.block_tokens} tokens ({c.vllm_kv_tokens:,} tokens); kvstrata {tiers}. Times in ms")
    table = Table(title=title, title_justify="left")
    for name, justify in (("configuration", "left"), ("n", "right"), ("TTFT p50", "right"), ("p90", "right"),
                          ("p99", "right"), ("TPOT", "right"), ("req/s", "right"), ("tok/s", "right"),
                          ("vLLM hit", "right"), ("kvstrata hit by tier", "left"), ("same", "left")):
        table.add_column(name, justify=justify, no_wrap=name != "kvstrata hit by tier")  # type: ignore[arg-type]

    def row(label: str, m: Measured) -> None:
        table.add_row(label, str(len(m.requests)), ms_text(m.ttft_p50_s), ms_text(m.ttft_p90_s), ms_text(m.ttft_p99_s),
                      ms_text(m.tpot_p50_s), f"{m.requests_per_s:.1f}", f"{m.output_tokens_per_s:.0f}",
                      pct_text(m.vllm_prefix_hit_rate), hits_text(m), same_text(m))

    def skipped(label: str, why: str) -> None:
        table.add_row(label, "", "[yellow]skipped[/]", *[""] * 7, f"[yellow]{why}[/]")

    row("vLLM alone", report.baseline)
    row("vLLM + kvstrata", report.kvstrata)
    table.add_section()
    if isinstance(report.shared_pool, Skipped):
        skipped("2 servers, 1 pool", report.shared_pool.skipped)
    else:
        for instance, m in report.shared_pool.servers.items():
            row(f"2 servers: {instance.value}", m)
    if isinstance(report.restart, Skipped):
        skipped("restart", report.restart.skipped)
    else:
        row(f"{report.restart.server.value}, restarted", report.restart.replay)
    burst = report.concurrency
    if isinstance(burst, Skipped):
        skipped("concurrency", burst.skipped)
    else:
        row(f"{burst.requests} at once, prefix in kvstrata", burst.from_kvstrata)
        row(f"{burst.requests} at once, prefix in vLLM", burst.from_vllm)
    pd = report.prefill_decode
    if isinstance(pd, Skipped):
        skipped("P/D", pd.skipped)
    else:
        row("P/D: decode", pd.decode)
        row("P/D: prefill", pd.prefill)
    out = cli.console()
    out.print(table)
    v = report.versus
    lines = [
        f"kvstrata / vLLM, the median over {v.ttft_p50.rounds} round(s) of the ratio within a round (lowest-highest "
        f"round): TTFT p50 {spread_x(v.ttft_p50)}, p90 {spread_x(v.ttft_p90)}, TPOT p50 {spread_x(v.tpot_p50)} "
        f"(< 1x: faster); output tok/s {spread_x(v.output_tokens_per_s)}"
        + ("" if math.isnan(v.server_cpu_per_request.median) else
           f"; the server's CPU seconds per request (API server, engine core, workers, from /proc) "
           f"{spread_x(v.server_cpu_per_request)}") + ".",
        *_cpu_line(report),
        "Rows: vLLM alone and with kvstrata over every round; two kvstrata servers on one pool, turns alternating "
        "(each server's turns); the second restarted, the same turns sent again; prefill (kv_producer, 1 token) and "
        "decode (kv_consumer) servers, the KV handed over in the pool. TPOT and hits: p50 and rates over the prompt "
        "tokens; same: every completion equals a cold server's (prefix caching off, no connector).",
        f"Workload: trace {report.trace}; its 512-token blocks become {w.block_tokens} tokens (lengths x "
        f"{w.block_tokens}/512), openers cut at {w.opener_max_tokens} tokens (this run's: "
        f"{min(report.opener_tokens)}-{max(report.opener_tokens)}); each later turn adds the {w.max_tokens}-token "
        f"answer and {w.user_tokens} user tokens{_NEW[w.kind]}. Completions API, stream=True, prompts as token ids, "
        f"greedy, max_tokens {w.max_tokens}, ignore_eos.",
    ]
    if not isinstance(report.restart, Skipped):
        lines.append(f"Restart: {report.restart.server.value} stopped and started again in "
                     f"{report.restart.restart_s:.0f} s, its disk tier kept; {len(report.restart.replay.requests)} "
                     "turns it had served sent again.")
    if not isinstance(burst, Skipped):
        once = "each block once" if burst.loaded_once else "[bold red]some more than once[/]"
        lines.append(
            f"Concurrency: {burst.requests} requests at once sharing a {burst.prefix_blocks}-block prefix, in "
            f"{burst.ttft_p90.rounds} round(s); the burst whose prefix only kvstrata held over the one whose prefix vLLM's "
            f"cache held: TTFT p90 {spread_x(burst.ttft_p90)}, p50 {spread_x(burst.ttft_p50)}. Blocks loaded from "
            f"kvstrata: {burst.loaded_blocks} in {burst.load_requests} load(s) ({once}).")
    if not isinstance(pd, Skipped):
        predicted = "-" if pd.restore_predicted_s is None else f"{pd.restore_predicted_s * 1e3:.1f} ms"
        lines.append(
            f"P/D handoff (the decode server's TTFT, the prompt's KV in the pool): p50 {ms_text(pd.decode.ttft_p50_s)} ms, against "
            f"{ms_text(pd.prefill.ttft_p50_s)} ms for the prefill server computing it; the pair's first token as its client "
            f"sees it (prefill latency + decode TTFT): p50 {ms_text(pd.client_ttft_p50_s)} ms. kvstrata's restore on the "
            f"decode server: {ms_text(pd.restore_measured_s)} ms a load ({pd.restore_bytes / 1e3:.0f} KB on average); "
            f"predicted for this host ({pd.prediction}): {predicted}.")
    connected = [report.kvstrata] + ([] if isinstance(report.restart, Skipped) else [report.restart.replay])
    lines.append("kvstrata hits: " + "; ".join(sorted({_HITS_SOURCE[m.hits_source] for m in connected})))
    if report.identical:
        lines.append(f"Completions: every one equals the reference's (vllm serve, prefix caching off, no connector; "
                     f"{report.reference_prompts} distinct prompts){_near_ties(report)}.")
    else:
        lines.append("[bold red]Completions: some differ from the reference's (prefix caching off, no connector).[/]")
    starts = ", ".join(f"{i.value} {s:.0f}" for i, s in report.server_start_s.items())
    if (pr := report.prefill_vs_restore) is not None:
        lines.append(f"This model on this host: a prompt token's prefill {pr.prefill_s_per_token * 1e3:.2f} ms (vLLM "
                     f"alone's quickest first turn) against {pr.restore_s_per_token * 1e6:.1f} us to bring its KV back "
                     f"from the host tier (a copy and an xxh3 of its bytes at this host's one-thread rates): recomputing "
                     f"costs {pr.ratio:,.0f}x restoring.")
    lines.append(f"Server starts, s: {starts}. Wall {report.wall_s:.0f} s.")
    for line in lines:
        out.print(line, highlight=False)
