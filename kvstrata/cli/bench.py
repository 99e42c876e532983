"""``kvstrata bench``: benchmarks that print ours beside baselines measured in the same run.

``bench cache``: store and restore GB/s of each cache tier against plain copies, plain file
I/O and LMCache (when importable), and hash+lookup time. Progress goes to stderr; ``--json``
prints the report alone on stdout. Decimal GB/s (1 GB = 1e9 bytes).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from kvstrata import cli
from kvstrata.bench.timing import VerificationError

MIB = 1 << 20


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``bench cache``."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks: ours beside baselines measured in the same run",
        description="Measure kvstrata against plain copies, plain file I/O and other systems, "
        "in one run on the same bytes, and print the ratios.",
    )
    benches = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    benches.required = True
    cache = benches.add_parser(
        "cache",
        help="store/restore GB/s of each cache tier vs copies, file I/O and LMCache",
        description="Store and restore GB/s of the device, host and disk tiers of TieredCache on "
        "KV of a real model's geometry, beside a plain copy, plain file reads and writes "
        "(cold and warm) and LMCache when it is importable; plus hash+lookup time of 128K tokens. "
        "Every restore is verified bit-exact.",
    )
    cache.add_argument("--size-mib", type=int, default=512, help="KV moved by every step, MiB (default: 512)")
    cache.add_argument("--blocks", type=int, default=16, help="blocks the KV is cut into (default: 16)")
    cache.add_argument("--model", default="llama-3-8b", help="model preset or config for the KV geometry")
    cache.add_argument("--repeats", type=int, default=5, help="timed rounds after one warm-up, >= 3 (default: 5)")
    cache.add_argument("--workers", type=int, default=2, help="the cache's transfer threads (default: 2)")
    cache.add_argument("--dir", metavar="DIR", help="where scratch files go (default: the temp directory)")
    cache.add_argument("--no-lmcache", action="store_true", help="skip LMCache even if it imports")
    cache.add_argument("--json", action="store_true", help="print the report as JSON")
    cache.set_defaults(func=run_cache)


class _Bar:
    """A rich progress bar on stderr, for ``kvstrata.bench.timing.Progress``."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._task = progress.add_task("starting", total=None)

    def start(self, total_steps: int) -> None:
        self._progress.update(self._task, total=total_steps)

    def step(self, label: str) -> None:
        self._progress.update(self._task, advance=1, description=label)


def run_cache(args: argparse.Namespace) -> int:
    from kvstrata.bench.cache import CacheBenchConfig, run_cache_bench

    config = CacheBenchConfig(
        size_bytes=args.size_mib * MIB,
        blocks=args.blocks,
        model=args.model,
        repeats=args.repeats,
        workers=args.workers,
        directory=args.dir,
        lmcache=not args.no_lmcache,
    )
    err = Console(stderr=True)
    columns = (TextColumn("{task.description:<32}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, console=err, transient=True) as progress:
            report = run_cache_bench(config, _Bar(progress))
    except VerificationError as exc:
        err.print(f"[bold red]verification failed:[/] {exc}", highlight=False)
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_cache(report)
    return 0


# --- the table ------------------------------------------------------------------------------------


def _gbps(value: float) -> str:
    return f"{value:.2f}"


def _x(value: float) -> str:
    return f"{value:.2f}x"


def _print_cache(report: dict[str, Any]) -> None:
    c = report["config"]
    tiers, lmc = report["tiers"], report["lmcache"]
    host, disk, dev = tiers["host"], tiers["disk"], tiers["device"]
    cold, warm = disk["cold"], disk["warm"]
    base = report["baselines"]
    goals: dict[str, list[dict]] = {}
    for goal in report["goals"]:
        goals.setdefault(goal["figure"], []).append(goal)

    def lm(group: str, name: str) -> tuple[str, str]:
        if not lmc["available"]:
            return "-", "-"
        fig = lmc[group][name]
        return _gbps(fig["gbps"]), _x(fig["ours_over_lmcache"])

    rows = [
        ("device store", "store() into device tier", _gbps(dev["store_gbps"]),
         f"copy d->d {_gbps(dev['baseline_gbps'])}", _x(dev["ratio"]), ("-", "-")),
        ("device hit", f"load() of {c['blocks']} device blocks", f"{dev['hit_ms']:.3f} ms", "-", "-", ("-", "-")),
        ("host store", "device tier -> host", _gbps(host["store_gbps"]),
         f"copy d->h {_gbps(host['store_baseline_gbps'])}", _x(host["store_ratio"]), lm("host", "store")),
        ("host restore", "load(): host -> device", _gbps(host["restore_gbps"]),
         f"copy h->d {_gbps(host['baseline_gbps'])}", _x(host["restore_ratio"]), lm("host", "retrieve")),
        ("disk store", "host -> disk (buffered)", _gbps(disk["store_gbps"]),
         f"write {_gbps(disk['store_baseline_gbps'])}", _x(disk["store_ratio"]), lm("disk", "store")),
        ("disk restore, cold", "load(): disk->host->device", _gbps(cold["restore_gbps"]),
         f"cold read {_gbps(cold['baseline_gbps'])}", _x(cold["ratio"]), lm("disk", "retrieve_cold")),
        ("disk restore, warm", "load(): disk->host->device", _gbps(warm["restore_gbps"]),
         f"copy h->d {_gbps(warm['baseline_gbps'])}", _x(warm["ratio"]), lm("disk", "retrieve_warm")),
        ("", "", "", f"warm read {_gbps(warm['raw_read_gbps'])}", _x(warm["raw_read_ratio"]), ("", "")),
        ("disk tier read, cold", "DiskTier: disk -> host", _gbps(cold["tier_read_gbps"]),
         f"cold read {_gbps(cold['baseline_gbps'])}", _x(cold["tier_read_ratio"]), ("-", "-")),
        ("disk tier read, warm", "DiskTier: disk -> host", _gbps(warm["tier_read_gbps"]),
         f"warm read {_gbps(warm['raw_read_gbps'])}", _x(warm["tier_read_ratio"]), ("-", "-")),
    ]
    for bs, detail in report["lookup_128k"].items():
        rows.append((
            f"hash+lookup 128K, block {bs}", "keys + match; time ratio", f"{detail['ours_ms']:.3f} ms",
            f"vLLM sha256 {detail['sha256_pickle_ms']:.2f} ms",
            f"{detail['ours_ms'] / detail['sha256_pickle_ms']:.2f}x",
            ("-", "-"),
        ))

    title = (
        f"kvstrata bench cache: {c['size_bytes'] / MIB:g} MiB of {c['model']} KV as {c['blocks']} blocks of "
        f"{c['block_tokens']} tokens ({c['block_bytes'] / MIB:g} MiB), device {c['device']}, "
        f"median of {c['repeats']} rounds; GB/s unless marked"
    )
    table = Table(title=title, title_justify="left")
    for name, justify in (("figure (what is timed)", "left"), ("ours", "right"), ("baseline", "right"),
                          ("ratio", "right"), ("LMCache", "right"), ("ours/LMC", "right"),
                          ("goal", "left"), ("pass", "left")):
        table.add_column(name, justify=justify, no_wrap=name != "figure (what is timed)")
    for figure, what, ours, baseline, ratio, (lm_value, lm_ratio) in rows:
        mine = goals.get(figure, [])
        table.add_row(
            f"{figure}\n[dim]{what}[/]" if what else figure, ours, baseline, ratio, lm_value, lm_ratio,
            "\n".join(g["goal"] for g in mine),
            "\n".join("[green]pass[/]" if g["passed"] else "[bold red]FAIL[/]" for g in mine),
        )
    out = cli.console()
    out.print(table)
    met = sum(g["passed"] for g in report["goals"])
    copies = ", ".join(f"{name.removeprefix('copy.')} {_gbps(fig['gbps'])}" for name, fig in base.items()
                       if name.startswith("copy."))
    out.print(f"goals met: {met} of {len(report['goals'])}. Plain copies, GB/s: {copies}.", highlight=False)
    if not lmc["available"]:
        out.print(f"LMCache: not measured ({lmc['reason']}).", highlight=False)
    else:
        out.print(f"LMCache {lmc['version']}: {lmc['setup']}.", highlight=False)
    verified = report["verified"]
    out.print(
        f"verified bit-exact: {verified['ours_bytes'] / 1e9:.2f} GB restored by ours, "
        f"{verified['lmcache_bytes'] / 1e9:.2f} GB by LMCache. GB = 1e9 bytes; ratio = median over rounds "
        "of ours / baseline within a round.",
        highlight=False,
    )
