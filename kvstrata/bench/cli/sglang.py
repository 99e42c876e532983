"""``kvstrata bench sglang``: kvstrata as SGLang's HiCache L3 storage beside SGLang's own file
backend and a raw Mooncake client (``kvstrata.bench.sglang``). Its table and labels are made here
(``--json``: the report alone)."""

from __future__ import annotations

import argparse
import importlib.util
from typing import TYPE_CHECKING

from kvstrata import cli
from kvstrata.bench.cli.common import BenchParser, figure_table, gbps_cell, run_and_report, spread_x

if TYPE_CHECKING:
    from kvstrata.bench.sglang import SGLangBenchReport


def register(bench: BenchParser) -> None:
    """Add ``bench sglang`` through ``bench`` (``kvstrata.bench.cli``'s sub-command maker)."""
    p = bench(
        "sglang", run_sglang, "kvstrata as SGLang's HiCache storage vs HiCacheFile (disk) and raw Mooncake (pool)",
        "Back up and prefetch SGLang host-pool pages through kvstrata's HiCache backend (zero-copy interface) "
        "beside SGLang's own HiCacheFile on the disk (set, get warm, get cold) and beside a raw Mooncake client "
        "and SGLang's own Mooncake backend on the pool (set, get), driven by "
        "SGLang's own controller methods, in interleaved rounds; every "
        "prefetch verified byte for byte. Goals: >= 1.5x HiCacheFile, >= 0.9x raw Mooncake. Needs SGLang "
        "(bash .ci/sglang-venv makes a venv with it on a CPU host).",
    )
    p.add_argument("--model", default="llama-3-8b", help="model preset or config.json for the page shape "
                                                         "(default: llama-3-8b)")
    p.add_argument("--page-tokens", type=int, default=16, help="SGLang's page size in tokens (default: 16)")
    p.add_argument("--pages", type=int, default=128, help="pages a round moves (default: 128, one SGLang batch)")
    p.add_argument("--layout", default="page_first", help="SGLang's host pool layout: page_first (its default), "
                                                          "layer_first or page_first_direct")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds after one warm-up, >= 3 (default: 5)")
    p.add_argument("--workers", type=int, default=2, help="kvstrata's transfer threads (default: 2)")
    p.add_argument("--dir", default=None, help="where the disk backends' files go (default: the temp directory)")
    p.add_argument("--no-pool", action="store_true", help="the disk rows only")
    p.add_argument("--pool", default=None, help="a pool config file (default: $KVSTRATA_POOL, else an embedded "
                                                "pool for the run)")
    cli.add_json_arg(p)


def run_sglang(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("sglang") is None:
        raise cli.CliError("bench sglang needs SGLang, which is not installed here (on a CPU host: "
                           "bash .ci/sglang-venv, then .venv-sglang/bin/kvstrata bench sglang)")
    from kvstrata.bench.sglang import SGLangBenchConfig, host_shape, run_sglang_bench
    from kvstrata.pool.client import PoolUnavailable
    from kvstrata.pool.embedded import PoolError

    config = SGLangBenchConfig(args.model, args.page_tokens, args.pages, args.layout, args.repeats,
                               args.workers, args.dir, not args.no_pool)
    host_shape(config)  # a model of no one per-token group fails here, before any pool starts
    pool = cli.pool_config(args.pool) if config.pool else None
    unavailable = {PoolUnavailable: "pool unavailable", PoolError: "pool unavailable"}
    return run_and_report(args, lambda bar: run_sglang_bench(config, pool, bar), _print_sglang, unavailable)


def _print_sglang(report: SGLangBenchReport) -> None:
    from kvstrata.bench.sglang import Side

    c = report.config
    table = figure_table(
        f"kvstrata as SGLang's HiCache storage: {report.shape}, {report.page_bytes / (1 << 20):g} MiB a page; "
        f"median of {c.repeats} rounds; kvstrata on the zero-copy interface, HiCacheFile on its generic one, "
        "both through SGLang's controller; raw Mooncake: one batch_put_from / batch_get_into",
        (("figure", "left"), ("ours GB/s", "right"), ("pages/s", "right"), ("baseline", "left"),
         ("GB/s", "right"), ("pages/s ", "right"), ("ours/baseline", "right"), ("goal", "left"),
         ("pass", "left")))
    for row in report.rows:
        table.add_row(row.figure, gbps_cell(row.ours_gbps), f"{row.ours_pages_per_s:.0f}",
                      row.baseline.value, gbps_cell(row.theirs_gbps), f"{row.theirs_pages_per_s:.0f}",
                      spread_x(row.ratio), "—" if row.goal is None else f">={row.goal}x",
                      "—" if row.goal is None else "[green]pass[/]" if row.passed else "[bold red]FAIL[/]")
    out = cli.console()
    out.print(table)
    lines = [f"goals met: {report.goals_met} of {report.goals}. verified byte for byte: "
             f"{report.verified_bytes / 1e9:.2f} GB prefetched."]
    if report.pool_skipped:
        lines.append(f"pool rows: {report.pool_skipped}.")
    elif report.pool is not None:
        lines.append(f"pool: {report.pool.source.value} ({report.pool.config.master}).")
    if not any(r.side is Side.POOL for r in report.rows) and not report.pool_skipped:
        lines.append("pool rows: none.")
    out.print(" ".join(lines), highlight=False, markup=False)
