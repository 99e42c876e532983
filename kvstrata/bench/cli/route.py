"""``kvstrata bench route``: one trace through ``kvstrata route`` over 2-3 ``vllm serve`` with the
connector on one pool, under each routing policy in turn (:mod:`kvstrata.bench.route`).
Arguments are checked here, before any server starts; the table and its labels are made here
(``--json``: the report alone; ``--plot``: TTFT CDFs per policy). The cells are ``bench serve``'s."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from kvstrata import cli
from kvstrata.bench.cli.common import BenchParser, run_and_report, spread_x
from kvstrata.bench.cli.serve import hits_text, ms_text, pct_text, pool_choice, same_text
from kvstrata.cli.workload import add_model_args
from kvstrata.fleet.scorer import TPOT_HEADROOM, Policy

if TYPE_CHECKING:
    from kvstrata.bench.route_plan import RouteBenchConfig
    from kvstrata.bench.route_report import RouteBenchReport

MiB = 1 << 20
# (flag, type, default, help): the workload's and the servers' sizes, as bench serve takes them
_SIZES = (
    ("--servers", int, 2, "vllm serve servers with the connector on one pool, 2 or 3"),
    ("--conversations", int, 7, "conversations at once; a multiple of --servers lets round robin, taking requests "
                                "in arrival order (turn by turn), keep every conversation on one server"),
    ("--turns", int, 3, "turns per conversation"),
    ("--rounds", int, 2, "rounds, each running every policy once (the order rotating)"),
    ("--rate", float, 4.0, "requests per second the schedule sends"),
    ("--max-tokens", int, 16, "answer tokens per turn"),
    ("--user-tokens", int, 48, "new user tokens per later turn"),
    ("--max-model-len", int, 512, "vLLM's max_model_len"),
    ("--block-size", int, 32, "vLLM's block size in tokens, one 512-token trace block each"),
    ("--kv-blocks", int, 32, "vLLM's KV memory in blocks, per server: a few requests' worth"),
    ("--max-num-seqs", int, 8, "vLLM's max_num_seqs"),
    ("--host-mib", int, 64, "kvstrata's host DRAM tier per server, MiB"),
    ("--disk-mib", int, 256, "kvstrata's disk tier per server, MiB"),
    ("--remote-mib", int, 128, "the pool each server tracks, MiB"),
    ("--seed", int, 0, "the prompts' (and a generated trace's) seed"),
    ("--slo-ttft-ms", float, 100.0, "a request meets the SLO with TTFT at most this"),
    ("--slo-tpot-ms", float, 50.0, "... and TPOT at most this"),
)

# the rest: (flag, argparse's keywords)
_OPTIONS = (
    ("--trace", {"metavar": "FILE", "help": "Mooncake-format JSON-lines trace (default: one generated with --seed, "
                                            "as kvstrata trace generate makes it)"}),
    ("--dtype", {"choices": ("float32", "bfloat16", "float16"), "default": "float32",
                 "help": "the servers' dtype (default: float32: completions compared exactly)"}),
    ("--server-cpus", {"metavar": "LIST", "help": "bind the first server's compute to these CPUs (default: halves of "
                                                  "the host's, dealt to the servers in turn)"}),
    ("--no-pool", {"action": "store_true", "help": "no pool: each server's tiers are its own"}),
    ("--profile", {"metavar": "FILE", "help": "price the servers for predicted-ttft with this kvstrata calibrate "
                                              "profile (default: a quick calibration, the prefill measured)"}),
    ("--dir", {"metavar": "DIR", "help": "keep disk tiers, stats and server logs here (default: a temporary "
                                         "directory, removed)"}),
    ("--plot", {"metavar": "PATH", "help": "also write the TTFT CDF per policy (PNG) to PATH"}),
)

HELP = "kvstrata route's policies over vllm serve servers on one pool: TTFT, hits, goodput"
DESCRIPTION = (
    "Start 2-3 vllm serve servers with the KVStrata connector on one pool (vLLM's KV a few requests' worth, its KV "
    "events on), and send one trace's multi-turn conversations (bench serve's workload) through kvstrata route's "
    "front under each routing policy in turn: round robin, prefix overlap with Dynamo's and llm-d's fixed tier "
    "weights, and kvstrata's predicted TTFT. Each pass has fresh tokens for the same conversations, the order "
    "rotating per round. Per policy: TTFT p50/p90, TPOT p50, hits per tier, requests per server, goodput at the SLO, "
    "and ratios to round robin (median of per-round ratios). Every completion is compared with a cold server's. "
    "Makes the tiny model if --model-dir is not given.")
OTHERS = [x.value for x in Policy if x is not Policy.ROUND_ROBIN]


def register(bench: BenchParser) -> None:
    """Add ``bench route`` through ``bench`` (``kvstrata.bench.cli``'s sub-command maker)."""
    p = bench("route", run_route, HELP, DESCRIPTION)
    add_model_args(p)
    for flag, kind, default, text in _SIZES:
        p.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default:g})")
    p.add_argument("--policies", default=",".join(OTHERS), metavar="LIST",
                   help=f"the policies compared with round robin, comma-separated (default: all: {', '.join(OTHERS)})")
    for flag, how in _OPTIONS:
        p.add_argument(flag, **how)
    cli.add_pool_arg(p, "an embedded pool for the run")
    cli.add_json_arg(p)


def _policies(text: str) -> tuple[Policy, ...]:
    try:
        return tuple(Policy.parse(name.strip()) for name in text.split(",") if name.strip())
    except ValueError as error:
        raise cli.CliError(f"--policies: {error}") from None


def _config(args: argparse.Namespace, use_pool: bool) -> RouteBenchConfig:
    """The run's configuration, every flag checked (a bad one: one line, before any server)."""
    from kvstrata.bench.route_plan import RouteBenchConfig
    from kvstrata.calibrate.serving.host import model_facts
    from kvstrata.calibrate.serving.servers import ServeBenchConfig
    from kvstrata.calibrate.serving.workload import ServeWorkload
    from kvstrata.cli.workload import model_dir_of

    if args.trace is not None and not os.path.isfile(args.trace):
        raise cli.CliError(f"--trace {args.trace}: no such file")
    shape = ServeWorkload(args.conversations, args.turns, args.max_tokens, args.user_tokens, args.block_size,
                          args.max_model_len, args.rate, args.seed)
    slo, policies = cli.slo_ms(args.slo_ttft_ms, args.slo_tpot_ms), _policies(args.policies)
    model = model_dir_of(args)
    facts = model_facts(model, args.dtype)
    tiers = {f"{t}_bytes": getattr(args, f"{t}_mib") * MiB for t in ("host", "disk", "remote")}
    sizes = {name: getattr(args, name) for name in ("rounds", "kv_blocks", "max_num_seqs", "dtype", "server_cpus")}
    where = {"trace": Path(args.trace) if args.trace else None, "directory": Path(args.dir) if args.dir else None}
    serve = ServeBenchConfig(shape, model, facts.vocab, facts.bytes_per_token * args.block_size, pool=use_pool,
                             **tiers, **sizes, **where)
    return RouteBenchConfig(serve, args.servers, policies, slo)


def _failures() -> dict[type[BaseException], str]:
    from kvstrata.calibrate.serving.client import RequestFailed
    from kvstrata.integrations.vllm.server import ServerFailed
    from kvstrata.pool.client import PoolUnavailable
    from kvstrata.pool.embedded import PoolError

    return {ServerFailed: "vllm serve failed", RequestFailed: "request failed", PoolUnavailable: "pool unavailable",
            PoolError: "pool unavailable"}


def run_route(args: argparse.Namespace) -> int:
    pool, use_pool, _ = pool_choice(args)
    config = _config(args, use_pool)
    calibration = None
    if args.profile:
        from kvstrata.calibrate import load_calibration

        calibration = load_calibration(args.profile)
    from kvstrata.bench.route import run_route_bench

    reports: list[RouteBenchReport] = []

    def run(bar: cli.StepBar) -> RouteBenchReport:
        reports.append(run_route_bench(config, pool, calibration, bar))
        if args.plot:
            from kvstrata.bench.route_report import ttft_figure
            from kvstrata.plots import png_bytes, save_png

            save_png(png_bytes(ttft_figure(reports[0])), args.plot)
            cli.wrote("TTFT CDF per policy", args.plot, args.json)
        return reports[0]

    errors = Console(stderr=True)
    try:
        code = run_and_report(args, run, _print_route, _failures())
    except KeyboardInterrupt:
        errors.print("[yellow]interrupted: every server (and an embedded pool) stopped[/]")
        return 130
    if code or reports[0].identical:
        return code
    errors.print("[bold red]completions differ from the cold reference's (see the table)[/]")
    return 1


def _print_route(report: RouteBenchReport) -> None:
    c, w = report.config, report.config.serve.workload
    s = c.serve
    pool = f", pool {s.remote_bytes / MiB:g} MiB shared" if report.pool is not None else ", no pool"
    title = (f"kvstrata bench route: {s.model_dir.name} ({s.dtype}), {c.servers} servers, {w.conversations} "
             f"conversations x {w.turns} turns at {w.rate_per_s:g} req/s, {s.rounds} round(s); per server vLLM KV "
             f"{s.kv_blocks} blocks x {w.block_tokens} tokens, kvstrata host {s.host_bytes / MiB:g} MiB, disk "
             f"{s.disk_bytes / MiB:g} MiB{pool}. Times in ms")
    table = Table(title=title, title_justify="left")
    columns = ("policy", "n", "TTFT p50", "p90", "TPOT", "vLLM hit", "kvstrata hit by tier", "per server",
               "goodput", "p50 / RR", "p90 / RR", "goodput / RR", "same")
    for name in columns:
        table.add_column(name, justify="left" if name in ("policy", "kvstrata hit by tier", "same") else "right")
    for r in report.results:
        m, v = r.measured, r.versus_round_robin
        table.add_row(r.policy.value, str(len(m.requests)), ms_text(m.ttft_p50_s), ms_text(m.ttft_p90_s), ms_text(m.tpot_p50_s),
                      pct_text(m.vllm_prefix_hit_rate), hits_text(m), "/".join(map(str, r.requests_per_server.values())),
                      f"{r.goodput.share:.0%}", spread_x(v.ttft_p50), spread_x(v.ttft_p90),
                      spread_x(v.goodput_share), same_text(m))
    out = cli.console()
    out.print(table)
    lines = [
        f"Goodput: the share of requests with TTFT <= {c.slo.ttft_s * 1e3:g} ms and TPOT <= {c.slo.tpot_s * 1e3:g} ms "
        f"(per policy, requests/s meeting both: "
        + ", ".join(f"{r.policy.value} {r.goodput.per_s:.2f}" for r in report.results) + "). / RR: the median over "
        f"{s.rounds} round(s) of the ratio to round robin within a round (lowest-highest round); times < 1x: faster.",
        f"Per server: requests the router had {', '.join(report.servers)} answer. Hits: vLLM's own prefix cache, "
        "and kvstrata's beyond it by tier, over the prompt tokens (the servers' counters summed).",
        "Order per round: " + "; ".join(", ".join(p.value for p in o) for o in report.orders)
        + f". predicted-ttft priced by {report.cost}, and routing to meet the goodput's SLO (a server past {TPOT_HEADROOM:g}x its "
        f"TPOT target in pace, or predicted past its TTFT target, is passed over while another is not). "
        f"SGLang's router: {report.sglang.skipped}.",
        f"Workload: trace {report.trace}; each pass the same conversations with tokens of its own.",
    ]
    same = (f"every one equals the reference's ({report.reference_prompts} distinct prompts)" if report.identical
            else "[bold red]some differ from the reference's[/]")
    starts = ", ".join(f"{name} {sec:.0f}" for name, sec in report.start_s.items())
    lines += [f"Completions: {same} (vllm serve, prefix caching off, no connector).",
              f"Server starts, s: {starts}. Wall {report.wall_s:.0f} s."]
    for line in lines:
        out.print(line, highlight=False)
