"""``kvstrata bench sim``: wall seconds of the trace-driven simulator per architecture on the
Mooncake trace and on a 12,000-request tiling of it, beside a plain replay of the same trace
(``analyze``). The table and its labels are made here (``--json``: the report alone)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from rich.table import Table

from kvstrata import cli
from kvstrata.bench.cli.common import BenchParser, run_and_report

if TYPE_CHECKING:
    from kvstrata.bench.sim import SimBenchReport


def register(bench: BenchParser) -> None:
    """Add ``bench sim`` through ``bench`` (``kvstrata.bench.cli``'s sub-command maker)."""
    sim = bench(
        "sim", run_sim, "wall seconds of the simulator per architecture vs a plain replay of the trace",
        "Time kvstrata's trace-driven simulator, one run per architecture (the seven and "
        "hbm+pool+nvme) on h200-cx7-gen5 with llama-3-70b, on the Mooncake trace and on a larger trace "
        "tiled from it (later copies shifted in time and given fresh block ids: new sessions); beside "
        "the time of a plain replay of the same trace (kvstrata.sim.analyze), as a ratio. Goal: each "
        "simulation <= 5 s on one core.",
    )
    sim.add_argument("--trace", metavar="FILE", help="JSON-lines trace (Mooncake format; default: "
                     "<repo>/../shared/data/traces/mooncake_synthetic_trace.jsonl)")
    sim.add_argument("--requests-large", type=int, default=12_000,
                     help="requests of the tiled trace (default: 12000)")
    cli.add_json_arg(sim)


def run_sim(args: argparse.Namespace) -> int:
    from kvstrata.bench.sim import DEFAULT_TRACE, SimBenchConfig, run_sim_bench
    from kvstrata.sim.traceio import read_trace

    path = args.trace or str(DEFAULT_TRACE)
    if not os.path.isfile(path):
        where = "" if args.trace else " (the default: the Mooncake trace in the shared data folder)"
        raise cli.CliError(f"trace {path!r} not found{where}; pass --trace FILE")
    if args.requests_large < 1:
        raise cli.CliError(f"--requests-large must be at least 1, got {args.requests_large}")
    config = SimBenchConfig(requests_large=args.requests_large)
    requests = read_trace(path)
    return run_and_report(args, lambda bar: run_sim_bench(requests, path, config, bar), _print_sim)


def _print_sim(report: SimBenchReport) -> None:
    c = report.config
    core = f"pinned to CPU {c.pinned_cpu}" if c.pinned_cpu is not None else "not pinned"
    title = (
        f"kvstrata bench sim: {c.model} on {c.hardware}, {c.instances} instances of "
        f"{c.gpus_per_instance} GPU(s); one run per architecture, {core}"
    )
    table = Table(title=title, title_justify="left")
    for name, justify in (("trace", "left"), ("arch", "left"), ("wall s", "right"), ("CPU s", "right"),
                          ("requests/s", "right"), ("vs analyze", "right"), ("goal", "left"), ("pass", "left")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for trace in report.traces:
        base = trace.baseline
        table.add_row(f"{trace.name} ({trace.requests:,})", "[dim]analyze (baseline)[/]", f"{base.wall_s:.4f}", "-",
                      f"{base.requests_per_s:,.0f}", "1.00x", "", "")
        for row in trace.architectures:
            table.add_row(
                "", row.arch, f"{row.wall_s:.2f}", f"{row.cpu_s:.2f}", f"{row.requests_per_s:,.0f}",
                f"{row.overhead_x:,.0f}x", f"<={c.goal_wall_s:g} s",
                "[green]pass[/]" if row.within_goal else "[bold red]FAIL[/]",
            )
        table.add_section()
    out = cli.console()
    out.print(table)
    met = sum(g.passed for g in report.goals)
    tiling = report.traces[1].tiling
    out.print(
        f"goals met: {met} of {len(report.goals)}. Trace: {c.trace}. The tiled trace: {tiling.copies} "
        f"copies (the last may be partial), each {tiling.span_ms / 1e3:,.1f} s later than the one before and "
        f"its block ids shifted by {tiling.id_stride:,} (new sessions). Baseline: median of "
        f"{c.baseline_repeats} runs of kvstrata.sim.analyze (unlimited cache) on the same requests; "
        "'vs analyze' = the simulation's wall time over it.",
        highlight=False,
    )
