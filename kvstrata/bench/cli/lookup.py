"""``kvstrata bench lookup`` and ``kvstrata bench restart``: the lookup path's time against the
bare hash chain and as the index grows, and how soon a disk tier of many blocks serves a hit
after a restart. Tables and their labels are made here (``--json``: the report alone)."""

from __future__ import annotations

import argparse
import statistics
from typing import TYPE_CHECKING

from kvstrata import cli
from kvstrata.bench.cli.common import BenchParser, figure_table, run_and_report, spread_x, verdict_cells

if TYPE_CHECKING:
    from kvstrata.bench.lookup_report import LookupBenchReport
    from kvstrata.bench.restart import RestartBenchReport


def register(bench: BenchParser) -> None:
    """Add ``bench lookup`` and ``bench restart`` through ``bench`` (``kvstrata.bench.cli``'s sub-command maker)."""
    lookup = bench(
        "lookup", run_lookup, "hash+lookup time vs the bare xxh3 chain; lookup with 1M blocks indexed vs 1K",
        "Key and look up a 128K-token prompt (every block cached: the worst case) through "
        "PrefixIndex and through TieredCache.lookup, beside the bare chained xxh3-128 loop over the same "
        "ids, at 256 and 16 tokens a block; and the same lookup with 1M blocks indexed against 1K. "
        "Interleaved rounds; ratios are medians of per-round ratios, with their spread. Goals: <= 1.2x each.",
    )
    lookup.add_argument("--tokens", type=int, default=131_072, help="the prompt's tokens (default: 131072)")
    lookup.add_argument("--repeats", type=int, default=30, help="timed rounds, >= 3 (default: 30)")
    lookup.add_argument("--large-blocks", type=int, default=1_000_000,
                        help="blocks indexed in the scaling's large case (default: 1000000)")
    cli.add_json_arg(lookup)

    restart = bench(
        "restart", run_restart, "seconds from opening a cache on a disk tier of 100K blocks to its first hit",
        "Write a disk tier of many small blocks (100K by default, ~0.5 GB: the free space is checked), "
        "open and close a cache on it once, then time restarts: opening TieredCache on the directory, looking "
        "up a block and loading it from disk, its bytes checked. Page cache dropped for the files before each "
        "restart unless --warm. Goal: first hit <= 10 s at 100K blocks.",
    )
    restart.add_argument("--blocks", type=int, default=100_000, help="blocks on disk (default: 100000)")
    restart.add_argument("--repeats", type=int, default=3, help="timed restarts (default: 3)")
    restart.add_argument("--warm", action="store_true", help="keep the files in the page cache between restarts")
    restart.add_argument("--dir", metavar="DIR", help="where the tier's directory goes (default: the temp directory)")
    cli.add_json_arg(restart)


def run_restart(args: argparse.Namespace) -> int:
    from kvstrata.bench.restart import RestartBenchConfig, run_restart_bench

    config = RestartBenchConfig(blocks=args.blocks, repeats=args.repeats, cold=not args.warm, directory=args.dir)
    return run_and_report(args, lambda bar: run_restart_bench(config, bar), _print_restart,
                           {OSError: "no room for the blocks"})


def _print_restart(report: RestartBenchReport) -> None:
    from kvstrata.bench.goals import LookupFigure, goals_for

    t, c = report.times, report.config
    table = figure_table(
        f"kvstrata bench restart: a disk tier of {t.blocks:,} blocks ({t.file_bytes / 1e9:.2f} GB of files), "
        f"{c.repeats} restarts, page cache {'dropped' if t.cold else 'warm'}; seconds",
        (("figure (what is timed)", "left"), ("median", "right"), ("rounds", "right"), ("goal", "left"),
         ("pass", "left")))
    rows = [
        (LookupFigure.RESTART, "first hit after a restart", "open TieredCache, lookup, load one block", t.first_hit_s),
        (None, "  open", "TieredCache(config): the disk tier recovers", t.open_s),
        (None, "  close", "TieredCache.close (writes the disk manifest)", t.close_s),
    ]
    for figure, label, what, values in rows:
        goals = goals_for(figure, report.goals) if figure is not None else []
        table.add_row(f"{label}\n[dim]{what}[/]", f"{statistics.median(values):.3f}",
                      " ".join(f"{v:.3f}" for v in values), *verdict_cells(goals))
    out = cli.console()
    out.print(table)
    out.print(f"{t.recovered_blocks:,} blocks recovered; set-up (writing them) took {t.build_s:.1f} s. The goal "
              "judges the slowest restart.", highlight=False)


def run_lookup(args: argparse.Namespace) -> int:
    from kvstrata.bench.lookup_report import LookupBenchConfig, run_lookup_bench

    config = LookupBenchConfig(tokens=args.tokens, repeats=args.repeats, large_blocks=args.large_blocks)
    return run_and_report(args, lambda bar: run_lookup_bench(config, bar), _print_lookup)


def _print_lookup(report: LookupBenchReport) -> None:
    from kvstrata.bench.goals import CacheFigure, LookupFigure, goals_for

    c = report.config
    rows = []  # (figure judged, label, what is timed, ours, baseline, ratio and spread)
    for bs, t in report.lookups.items():
        loop = f"xxh3 loop {t.xxh3_loop_ms:.3f} ms"
        rows += [
            (CacheFigure.lookup(bs) if c.tokens == 131_072 else None, f"hash+lookup, block {bs}", "block_keys + PrefixIndex.match",
             f"{t.ours_ms:.3f} ms", loop, spread_x(t.ours_of_xxh3)),
            (None, f"  hash alone, block {bs}", "block_keys", f"{t.hash_only_ms:.3f} ms", loop,
             spread_x(t.hash_of_xxh3)),
            (None, f"  cache lookup, block {bs}", "TieredCache.lookup", f"{t.cache_ms:.3f} ms", loop,
             spread_x(t.cache_of_xxh3)),
            (None, f"  vs vLLM's hash, block {bs}", "hash+lookup / sha256(pickle)", f"{t.ours_ms:.3f} ms",
             f"sha256 {t.sha256_pickle_ms:.2f} ms", spread_x(t.ours_of_sha256)),
        ]
    s = report.scaling
    rows += [
        (LookupFigure.SCALING, f"lookup, {s.large:,} of {s.small:,} indexed",
         f"{s.blocks} blocks of {s.block_size}: hash + match", f"{s.lookup_large_ms:.3f} ms",
         f"{s.small:,} indexed {s.lookup_small_ms:.3f} ms", spread_x(s.lookup)),
        (None, "  match alone", "PrefixIndex.match", f"{s.match_large_ms:.3f} ms",
         f"{s.small:,} indexed {s.match_small_ms:.3f} ms", spread_x(s.match)),
    ]
    table = figure_table(
        f"kvstrata bench lookup: {c.tokens:,} random token ids, {c.repeats} interleaved rounds; time ratios",
        (("figure (what is timed)", "left"), ("ours", "right"), ("baseline", "right"),
         ("ratio (min-max)", "right"), ("goal", "left"), ("pass", "left")))
    for figure, label, what, ours, baseline, ratio in rows:
        goals = goals_for(figure, report.goals) if figure is not None else []
        table.add_row(f"{label}\n[dim]{what}[/]", ours, baseline, ratio, *verdict_cells(goals))
    out = cli.console()
    out.print(table)
    met = sum(g.passed for g in report.goals)
    out.print(f"goals met: {met} of {len(report.goals)}. Ratio = median over rounds of ours / baseline in the same "
              "round (min-max over rounds); the calls alternate one by one.", highlight=False)
