"""``kvstrata bench recompute`` and ``kvstrata bench e2e``: time to first token on a model.
``recompute``: load or recompute on the tiny model over capped disk rates; ``e2e``: the
workload of ``kvstrata demo`` on a transformers model, cold against warm per tier, with LMCache
beside it. Tables and their labels are made here (``--json``: the report alone)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from kvstrata import cli
from kvstrata.bench.cli.common import BenchParser, dir_arg, rounds_args, run_and_report, spread_x
from kvstrata.cli.workload import add_workload_args, ms, render_tiers, run_workload
from kvstrata.report import dumps

if TYPE_CHECKING:
    from kvstrata.bench.e2e import E2EBenchReport
    from kvstrata.bench.recompute import RecomputeBenchReport
    from kvstrata.rounds import Spread


def register(bench: BenchParser) -> None:
    """Add ``bench recompute`` and ``bench e2e`` through ``bench`` (``kvstrata.bench.cli``'s sub-command maker)."""
    recompute = bench(
        "recompute", run_recompute,
        "load or recompute: the auto plan's TTFT vs load-only and recompute-only, disk tier throttled",
        "On the tiny model, one long prompt whose prefix is cached on the disk tier only; the "
        "disk tier's reads capped at several rates (emulated slower storage). Per rate: TTFT of load-only, "
        "recompute-only and the auto plan (load, recompute, or compute the beginning while loading the rest), "
        "medians of repeats; the plan chosen and the ratio auto / min(load, recompute), goal <= 1.1. The auto "
        "decision's load times come from a probe of the capped disk tier, its prefill times from a measurement "
        "of the model on this host.",
    )
    recompute.add_argument("--rates", metavar="GBPS", type=float, nargs="+",
                           default=[0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 2.0],
                           help="disk read caps, decimal GB/s (default: 0.005 0.01 0.02 0.05 0.1 0.5 2)")
    recompute.add_argument("--cached-tokens", type=int, default=4096, help="the cached prefix, tokens (default: 4096)")
    recompute.add_argument("--tail-tokens", type=int, default=64, help="prompt tokens after it (default: 64)")
    recompute.add_argument("--block-tokens", type=int, default=64, help="tokens per block (default: 64)")
    rounds_args(recompute, repeats=9, per=" per rate")
    dir_arg(recompute)
    recompute.add_argument("--plot", metavar="FILE", help="also plot TTFT against the read cap (matplotlib) to FILE")
    cli.add_json_arg(recompute)

    e2e = bench(
        "e2e", run_bench_e2e, "a real model on a multi-turn workload: TTFT cold vs warm per tier, tokens identical",
        "Run a multi-turn workload (growing conversations, shared system prompts) on a "
        "transformers model through each tier: TTFT cold vs warm, hit rate, bytes restored, restore GB/s, "
        "and whether tokens equal the cold run's; LMCache beside it on the same prompts where it runs.",
    )
    add_workload_args(e2e, conversations=6, turns=4)
    e2e.add_argument("--no-lmcache", action="store_true", help="skip LMCache")
    e2e.add_argument("--lmcache-python", metavar="EXE", help="python of a venv with lmcache (default: .venv-lmcache)")


def run_recompute(args: argparse.Namespace) -> int:
    from kvstrata.bench.recompute import RecomputeBenchConfig, run_recompute_bench

    try:
        config = RecomputeBenchConfig(
            cached_tokens=args.cached_tokens, tail_tokens=args.tail_tokens, block_tokens=args.block_tokens,
            rates_gbps=tuple(args.rates), repeats=args.repeats, work_dir=args.dir,
        )
    except ValueError as exc:
        raise cli.CliError(str(exc)) from None

    def render(report: RecomputeBenchReport) -> None:
        _print_recompute(report)
        if args.plot:
            _plot_recompute(report, args.plot)

    return run_and_report(args, lambda bar: run_recompute_bench(config, bar), render)


def _print_recompute(report: RecomputeBenchReport) -> None:
    from kvstrata.plan.recompute import Strategy

    c, p = report.config, report.prefill.fit
    title = (
        f"kvstrata bench recompute: tiny model, {c.prompt_tokens:,}-token prompt, {c.cached_tokens:,} cached "
        f"on disk only ({c.cached_bytes / 1e6:.1f} MB), blocks of {c.block_tokens} tokens; "
        f"TTFT medians of {c.repeats}"
    )
    table = Table(title=title, title_justify="left")
    for name in ("disk cap GB/s", "probe GB/s", "load ms", "recompute ms", "auto ms", "plan", "k",
                 "predicted ms", "auto / min", "tokens", "pass"):
        table.add_column(name, justify="left" if name in ("plan", "tokens", "pass") else "right", no_wrap=True)
    for r in report.rates:
        t = r.ttft_s
        best = min(t[Strategy.LOAD], t[Strategy.RECOMPUTE])
        table.add_row(
            f"{r.gbps:g}", f"{r.probe.gbps:.3g}",
            *(f"[bold]{t[k] * 1e3:.1f}[/]" if t[k] == best else f"{t[k] * 1e3:.1f}"
              for k in (Strategy.LOAD, Strategy.RECOMPUTE)),
            f"{t[Strategy.AUTO] * 1e3:.1f}", r.plan.value, str(r.k), f"{r.predicted_s[Strategy.AUTO] * 1e3:.1f}",
            f"{r.ratio:.2f}x", "same" if r.tokens_match else "[bold red]DIFFER[/]",
            "[green]pass[/]" if r.passed else "[bold red]FAIL[/]",
        )
    out = cli.console()
    out.print(table)
    passed = sum(r.passed for r in report.rates)
    out.print(
        f"goal auto <= {c.goal_ratio:g} x min(load, recompute): met at {passed} of {len(report.rates)} rates. "
        f"Prefill fit (measured here, {report.prefill.measure_s:.1f} s): {p.latency_s * 1e3:.2f} ms + "
        f"{p.tokens_per_s:,.0f} tokens/s + attention {p.attn_s:.3g} s per token pair. "
        f"Load model: {c.load_model}. 'tokens': every run's first token vs the cold run's. "
        f"Wall {report.wall_s:.0f} s.",
        highlight=False,
    )


def _plot_recompute(report: RecomputeBenchReport, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        cli.console().print("[yellow]no matplotlib: --plot skipped[/]")
        return
    from kvstrata.plan.recompute import Strategy

    rates = [r.gbps for r in report.rates]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for plan, style in ((Strategy.LOAD, "o--"), (Strategy.RECOMPUTE, "s--"), (Strategy.AUTO, "D-")):
        ax.plot(rates, [r.ttft_s[plan] * 1e3 for r in report.rates], style, label=plan.value)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("disk read cap, GB/s")
    ax.set_ylabel("TTFT, ms (median)")
    ax.set_title("load or recompute: tiny model, prefix on disk only")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    cli.wrote("plot", path)


def run_bench_e2e(args: argparse.Namespace) -> int:
    from kvstrata.bench.e2e import E2EBenchReport, LMCacheBeside, version_note, versus
    from kvstrata.rounds import Skipped
    from kvstrata.cli.workload import model_dir_of, parse_tiers, workload_of

    if args.no_lmcache:
        run, lmcache = run_workload(args, beside=lambda tier, index, prompt: None), None
    else:
        python = args.lmcache_python or str(Path(__file__).resolve().parents[2] / ".venv-lmcache" / "bin" / "python")
        with LMCacheBeside(python, model_dir_of(args), workload_of(args), parse_tiers(args.tiers)) as side:
            run = run_workload(args, beside=side)
        lmcache = side.document()
    report = E2EBenchReport(run, versus(run, lmcache), lmcache, version_note(lmcache))
    if args.json:
        print(dumps(report))
        return 0 if run.tokens_identical else 1
    out = cli.console()
    workload = run.workload
    render_tiers(out, run, f"kvstrata bench e2e: {run.model_dir.name}, {workload.conversations} x {workload.turns} turns")
    _print_versus(out, report)
    if isinstance(lmcache, Skipped):
        out.print(f"LMCache: {lmcache.skipped}", highlight=False)
    elif isinstance(lmcache, dict) and lmcache.get("failed"):
        out.print(f"[yellow]LMCache {lmcache['failed']}[/]", highlight=False)
    if report.note:
        out.print(f"[yellow]{report.note}[/]", highlight=False)
    return 0 if run.tokens_identical else 1


def _print_versus(out: Console, report: E2EBenchReport) -> None:
    """Per tier: TTFT ours over plain transformers (cold) and over LMCache (warm), paired per
    turn, with LMCache's own figures beside ours."""
    from kvstrata.media import Medium

    lmcache = report.lmcache if isinstance(report.lmcache, dict) else None
    title = "TTFT paired per turn (ours over the baseline timed next to it: median (lowest-highest turn))"
    if lmcache:
        title += f"; LMCache {lmcache.get('lmcache', '')} (its standalone engine, CPU adapter)"
    t = Table(title=title, title_justify="left")
    for col in ("tier", "cold: ours / plain HF", "warm: ours / LMCache", "LMCache TTFT cold / warm ms",
                "LMCache hit rate", "LMCache same tokens", "restore GB/s ours / LMCache"):
        t.add_column(col)
    for tier, v in report.versus.items():
        theirs = v.lmcache or {}
        same = theirs.get("tokens_identical")
        t.add_row(
            tier.label,
            _paired(v.cold_over_plain),
            _paired(v.warm_over_lmcache),
            f"{ms(theirs.get('ttft_cold_s'))} / {ms(theirs.get('ttft_warm_s'))}" if theirs else "-",
            f"{theirs['hit_rate']:.0%}" if theirs else "-",
            "-" if same is None else "[green]yes[/]" if same else "[red]NO[/]",
            f"{report.run.tiers[tier].restore_gbps:.2f} / {theirs.get('restore_gbps') or 0.0:.2f}" if theirs else "-",
        )
    out.print(t)
    remote = report.versus.get(Medium.REMOTE)
    if remote is not None and remote.warm_over_host_and_pool is not None:
        out.print(f"remote warm TTFT over the host tier's plus the bytes at the pool's measured "
                  f"{report.run.pool_gbps:.2f} GB/s: {_paired(remote.warm_over_host_and_pool)}", highlight=False)


def _paired(r: Spread | None) -> str:
    return "-" if r is None else f"{spread_x(r)}, {r.rounds} turns"
