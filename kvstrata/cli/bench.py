"""``kvstrata bench``: benchmarks that print ours beside baselines measured in the same run.

``bench cache``: store and restore GB/s of each cache tier against plain copies, plain file
I/O and LMCache (when importable), and hash+lookup time. ``bench remote``: store and restore
GB/s through the remote tier (and the whole cache) against raw Mooncake calls, in TCP and
shared-memory modes, and time to first byte. ``bench sim``: wall seconds of the trace-driven
simulator per architecture on the Mooncake trace and on a 12,000-request tiling of it, beside a
plain replay of the same trace (``analyze``). ``bench recompute``: load or recompute on the tiny
model over capped disk rates. ``bench e2e``: the workload of ``kvstrata demo`` with LMCache
beside it. ``bench lookup`` and ``bench restart``: see ``kvstrata.cli.bench_lookup``. Progress goes to stderr; ``--json`` prints the report alone on stdout
(:func:`kvstrata.report.to_json`). Every table, and every label in it, is made here. Decimal
GB/s (1 GB = 1e9 bytes).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from rich.console import Console
from rich.table import Table

from kvstrata import cli
from kvstrata.cli.workload import add_workload_args, ms, render_tiers, run_workload
from kvstrata.report import dumps
from kvstrata.timing import VerificationError

if TYPE_CHECKING:
    from kvstrata.bench.cache_report import CacheBenchReport
    from kvstrata.bench.e2e import E2EBenchReport
    from kvstrata.bench.goals import Goal
    from kvstrata.bench.recompute import RecomputeBenchReport
    from kvstrata.bench.remote_report import RemoteBenchReport
    from kvstrata.bench.rounds import Compared, Spread
    from kvstrata.bench.sim import SimBenchReport

MIB = 1 << 20
R = TypeVar("R")
# ``register``'s sub-command maker, as the modules of other bench commands get it:
# (name, run, help, description) -> the sub-command's parser.
BenchParser = Callable[[str, Callable[[argparse.Namespace], int], str, str], argparse.ArgumentParser]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``bench cache``, ``remote``, ``sim``, ``e2e``, ``recompute``, ``lookup`` and ``restart``."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks: ours beside baselines measured in the same run",
        description="Measure kvstrata against plain copies, plain file I/O and other systems, "
        "in one run on the same bytes, and print the ratios.",
    )
    benches = parser.add_subparsers(dest="bench_command", metavar="BENCH", required=True)

    def bench(name: str, func: Callable[[argparse.Namespace], int], help: str, description: str) -> argparse.ArgumentParser:
        p = benches.add_parser(name, help=help, description=description)
        p.set_defaults(func=func)
        return p

    cache = bench(
        "cache", run_cache, "store/restore GB/s of each cache tier vs copies, file I/O and LMCache",
        "Store and restore GB/s of the device, host and disk tiers of TieredCache on "
        "KV of a real model's geometry, beside a plain copy, plain file reads and writes "
        "(cold and warm) and LMCache when it is importable; plus hash+lookup time of 128K tokens. "
        "Every restore is verified bit-exact.",
    )
    _kv_args(cache, size_mib=512, blocks=16, what="blocks the KV is cut into")
    _rounds_args(cache, repeats=5, per="", workers_help="the cache's transfer threads (default: 2)")
    _dir_arg(cache)
    cache.add_argument("--no-lmcache", action="store_true", help="skip LMCache even if it imports")
    cache.add_argument("--tp-readers", metavar="TPS", type=_tp_sizes,
                       help="also restore the KV as head-sliced blocks at each of these reader TP sizes "
                       "(comma-separated, e.g. 1,2,4,8) beside TP-matched blocks of the same bytes, from the host and "
                       "the disk tier; and hash+lookup of 128K tokens by TP=1 and the largest TP (goals: >=0.9x, <=1.5x)")
    cli.add_json_arg(cache)

    remote = bench(
        "remote", run_remote, "store/restore GB/s through the remote tier vs raw Mooncake calls, TCP and SHM",
        "Store and restore GB/s through the remote tier (RemoteTier on the transfer worker) "
        "beside raw Mooncake batch_put_from/batch_get_into of the same bytes, in cross-process TCP and "
        "same-host shared-memory modes; restores through the whole TieredCache of blocks that are only in "
        "the pool (pool -> device, pool -> host -> device); time to first byte (a one-block restore, a "
        "lookup that asks the pool). The pool is --pool FILE or $KVSTRATA_POOL, else an embedded one "
        "started for the run. Every restore is verified bit-exact.",
    )
    _kv_args(remote, size_mib=256, blocks=8, what="blocks (pool objects) it is cut into")
    _rounds_args(remote, repeats=5, per=" per mode", workers_help="transfer threads on our side (default: 2, the cache's)")
    remote.add_argument("--mode", choices=("tcp", "shm"), action="append",
                        help="measure only this mode (repeatable; default: tcp and shm)")
    cli.add_pool_arg(remote, "an embedded pool for the run")
    cli.add_json_arg(remote)

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
    _rounds_args(recompute, repeats=9, per=" per rate")
    _dir_arg(recompute)
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

    from kvstrata.cli import bench_lookup, bench_serve, bench_sglang  # here: they import this module's helpers

    bench_lookup.register(bench)
    bench_sglang.register(bench)
    bench_serve.register(bench)


def _kv_args(p: argparse.ArgumentParser, size_mib: int, blocks: int, what: str) -> None:
    """The bytes a benchmark moves: how many, in how many blocks, of which model's KV."""
    p.add_argument("--size-mib", type=int, default=size_mib, help=f"KV moved by every step, MiB (default: {size_mib})")
    p.add_argument("--blocks", type=int, default=blocks, help=f"{what} (default: {blocks})")
    p.add_argument("--model", default="llama-3-8b", help="model preset or config for the KV geometry")


def _rounds_args(p: argparse.ArgumentParser, repeats: int, per: str, workers_help: str | None = None) -> None:
    """``--repeats`` (see :mod:`kvstrata.bench.rounds`), and ``--workers`` when it has a help text."""
    p.add_argument("--repeats", type=int, default=repeats,
                   help=f"timed rounds{per} after one warm-up, >= 3 (default: {repeats})")
    if workers_help is not None:
        p.add_argument("--workers", type=int, default=2, help=workers_help)


def _tp_sizes(text: str) -> tuple[int, ...]:
    """``1,2,4,8`` as TP sizes: distinct integers >= 1."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"expected distinct TP sizes >= 1, comma-separated (e.g. 1,2,4,8), got {text!r}")
    return sizes


def _dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", metavar="DIR", help="where scratch files go (default: the temp directory)")


def _run_and_report(
    args: argparse.Namespace,
    run: Callable[[cli.StepBar], R],
    render: Callable[[R], None],
    failures: dict[type[BaseException], str] | None = None,
) -> int:
    """Run a benchmark under a progress bar on stderr, then print its JSON or its table.

    ``failures`` maps exception types to a one-line label; each becomes exit code 1.
    """
    labels = {VerificationError: "verification failed", **(failures or {})}
    try:
        with cli.progress(32) as progress:
            report = run(cli.StepBar(progress))
    except tuple(labels) as exc:
        label = next(text for kind, text in labels.items() if isinstance(exc, kind))
        Console(stderr=True).print(f"[bold red]{label}:[/] {exc}", highlight=False)
        return 1
    if args.json:
        print(dumps(report))
    else:
        render(report)
    return 0


def _gbps(value: float) -> str:
    return f"{value:.2f}"


def _x(value: float) -> str:
    return f"{value:.2f}x"


def spread_x(spread: Spread) -> str:
    """A paired ratio with its spread: ``1.05x (0.98-1.20)``."""
    return f"{spread.median:.2f}x ({spread.min:.2f}-{spread.max:.2f})"


def _xs(value: float, low: float, high: float) -> str:
    """A paired ratio with its spread over rounds, on two lines."""
    return f"{value:.2f}x\n[dim]{low:.2f}..{high:.2f}[/]"


def _xc(figure: Compared) -> str:
    return _xs(figure.ratio, figure.ratio_min, figure.ratio_max)


def _ms2(value: float) -> str:
    return f"{value:.2f} ms"


def _verdicts(goals: list[Goal]) -> tuple[str, str]:
    """A table cell of goals and one of their verdicts, a line each."""
    return ("\n".join(g.goal for g in goals),
            "\n".join("[green]pass[/]" if g.passed else "[bold red]FAIL[/]" for g in goals))


def _figure_table(title: str, columns: tuple[tuple[str, str], ...]) -> Table:
    table = Table(title=title, title_justify="left")
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=name != "figure (what is timed)")  # type: ignore[arg-type]
    return table


# --- bench cache --------------------------------------------------------------------------------


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
        tp_readers=args.tp_readers or (),
    )
    if config.tp_readers:  # a TP size the model's heads do not split over fails now, not after the other rounds
        from kvstrata.bench.tpread import check_readers

        check_readers(config.model, config.tp_readers)
    return _run_and_report(args, lambda bar: run_cache_bench(config, bar), _print_cache)


def _print_cache(report: CacheBenchReport) -> None:
    from kvstrata.bench.cache_report import LMCacheFigure, LMCacheMeasured
    from kvstrata.bench.goals import CacheFigure, goals_for

    c, tiers, lmc = report.config, report.tiers, report.lmcache
    host, disk, dev = tiers.host, tiers.disk, tiers.device
    cold, warm = disk.cold, disk.warm

    def lm(theirs: Callable[[LMCacheMeasured], LMCacheFigure]) -> tuple[str, str]:
        if not isinstance(lmc, LMCacheMeasured):
            return "-", "-"
        fig = theirs(lmc)
        return _gbps(fig.rate.median), _x(fig.ours_over_lmcache)

    none = ("-", "-")
    # (figure judged, label, what is timed, ours, baseline, ratio, LMCache and ours / LMCache)
    rows: list[tuple[CacheFigure | None, str, str, str, str, str, tuple[str, str]]] = [
        (None, "device store", "store() into device tier", _gbps(dev.store.ours),
         f"copy d->d {_gbps(dev.store.baseline)}", _xc(dev.store), none),
        (None, "device hit", f"load() of {c.config.blocks} device blocks", f"{dev.hit_ms:.3f} ms", "-", "-", none),
        (CacheFigure.HOST_STORE, "host store", "device tier -> host", _gbps(host.store.ours),
         f"copy d->h {_gbps(host.store.baseline)}", _xc(host.store), lm(lambda m: m.host.store)),
        (CacheFigure.HOST_RESTORE, "host restore", "load(): host -> device", _gbps(host.restore.ours),
         f"copy h->d {_gbps(host.restore.baseline)}", _xc(host.restore), lm(lambda m: m.host.retrieve)),
        (CacheFigure.DISK_STORE, "disk store", "host -> disk (buffered)", _gbps(disk.store.ours),
         f"write {_gbps(disk.store.baseline)}", _xc(disk.store), lm(lambda m: m.disk.store)),
        (CacheFigure.DISK_COLD, "disk restore, cold", "load(): disk->host->device", _gbps(cold.restore.ours),
         f"cold read {_gbps(cold.restore.baseline)}", _xc(cold.restore), lm(lambda m: m.disk.retrieve_cold)),
        (CacheFigure.DISK_WARM, "disk restore, warm", "load(): disk->host->device", _gbps(warm.restore.ours),
         f"copy h->d {_gbps(warm.restore.baseline)}", _xc(warm.restore), lm(lambda m: m.disk.retrieve_warm)),
        (None, "", "", "", f"warm read {_gbps(warm.raw_read_gbps)}", _x(warm.raw_read_ratio), ("", "")),
        (None, "disk tier read, cold", "DiskTier: disk -> host", _gbps(cold.tier_read_gbps),
         f"cold read {_gbps(cold.restore.baseline)}", _x(cold.tier_read_ratio), none),
        (None, "disk tier read, warm", "DiskTier: disk -> host", _gbps(warm.tier_read_gbps),
         f"warm read {_gbps(warm.raw_read_gbps)}", _x(warm.tier_read_ratio), none),
    ]
    for bs, times in report.lookup_128k.items():
        rows.append((
            CacheFigure.lookup(bs), f"hash+lookup 128K, block {bs}", "keys + match; time ratio", f"{times.ours_ms:.3f} ms",
            f"xxh3 loop {times.xxh3_loop_ms:.3f} ms", spread_x(times.ours_of_xxh3), none,
        ))

    title = (
        f"kvstrata bench cache: {c.config.size_bytes / MIB:g} MiB of {c.config.model} KV as {c.config.blocks} blocks of "
        f"{c.kv.block_tokens} tokens ({c.kv.block_bytes / MIB:g} MiB), device {c.kv.device}, "
        f"median of {c.config.repeats} rounds; GB/s unless marked"
    )
    table = _figure_table(title, (("figure (what is timed)", "left"), ("ours", "right"), ("baseline", "right"),
                                  ("ratio", "right"), ("LMCache", "right"), ("ours/LMC", "right"),
                                  ("goal", "left"), ("pass", "left")))
    for figure, label, what, ours, baseline, ratio, (lm_value, lm_ratio) in rows:
        goals = goals_for(figure, report.goals) if figure is not None else []
        table.add_row(f"{label}\n[dim]{what}[/]" if what else label, ours, baseline, ratio, lm_value, lm_ratio,
                      *_verdicts(goals))
    out = cli.console()
    out.print(table)
    met = sum(g.passed for g in report.goals)
    copies = ", ".join(f"{name.removeprefix('copy.')} {_gbps(fig.median)}" for name, fig in report.baselines.items()
                       if name.startswith("copy."))
    out.print(f"goals met: {met} of {len(report.goals)}. Plain copies, GB/s: {copies}.", highlight=False)
    if isinstance(lmc, LMCacheMeasured):
        out.print(f"LMCache {lmc.version}: {lmc.setup}.", highlight=False)
    else:
        out.print(f"LMCache: not measured ({lmc.reason}).", highlight=False)
    verified = report.verified
    out.print(
        f"verified bit-exact: {verified.ours_bytes / 1e9:.2f} GB restored by ours, "
        f"{verified.lmcache_bytes / 1e9:.2f} GB by LMCache. GB = 1e9 bytes; ratio = median over rounds "
        "of ours / baseline within a round (lowest-highest round in brackets).",
        highlight=False,
    )
    if report.tp_readers is not None:
        _print_tp_readers(report)


def _print_tp_readers(report: CacheBenchReport) -> None:
    from kvstrata.bench.goals import SLICED_OF_MATCHED, sliced_lookup_figure, sliced_restore_figure

    tp, c = report.tp_readers, report.config
    assert tp is not None

    def verdicts(figure: str) -> tuple[str, str]:
        return _verdicts([g for g in report.goals if g.figure == figure])

    mib = 1 << 20
    title = (
        f"head-sliced vs TP-matched restores: {c.config.size_bytes / MIB:g} MiB of {c.config.model} KV "
        f"({tp.kv_heads} KV heads, {tp.slices} slices a block), {tp.blocks} blocks of {tp.block_tokens} tokens, "
        f"device {c.kv.device}; each of TP ranks: load() + copy into its KV; median of {c.config.repeats} rounds, "
        f"GB/s of all ranks' bytes; goal: head-sliced >={SLICED_OF_MATCHED}x TP-matched"
    )
    table = _figure_table(title, (("tier, reader TP", "left"), ("objects/rank", "right"),
                                  ("TP-matched", "right"), ("head-sliced", "right"), ("ratio", "right"),
                                  ("load alone", "right"), ("slices", "right"), ("pass", "left")))
    for row in tp.restores:
        objects = (f"{row.matched_objects} x {row.matched_object_bytes / mib:g} MiB\n"
                   f"{row.sliced_objects} x {row.sliced_object_bytes / mib:g} MiB\n"
                   f"{row.slices_objects} x {row.slices_object_bytes / mib:g} MiB")
        table.add_row(f"{row.source.value}, TP={row.tp}", objects,
                      _gbps(row.rate.baseline), _gbps(row.rate.ours), _xc(row.rate), _xc(row.load), _xc(row.slices),
                      verdicts(sliced_restore_figure(row.source.value, row.tp))[1])
    out = cli.console()
    out.print(table)
    lookups = _figure_table(
        "hash+lookup of 128K tokens by an instance, every block in the host tier, as the pool's lookup makes it: "
        "each rank its block keys, its slice keys and its match, the ranks at once (the slowest rank's time); "
        "ms, medians",
        (("block, TP=t", "left"), ("matched TP=1", "right"), ("sliced TP=1", "right"), ("sliced TP=t", "right"),
         ("its ranks' CPU", "right"), ("TP=t / TP=1", "right"), ("goal", "left"), ("pass", "left")))
    where = []
    for bs, lk in tp.lookups.items():
        lookups.add_row(f"block {bs}, TP={lk.tp}", f"{lk.matched_tp1_ms:.2f}", f"{lk.sliced_tp1_ms:.2f}",
                        f"{lk.sliced_tp_ms:.2f}", f"{lk.sliced_tp_ranks_ms:.2f}", spread_x(lk.tp_of_tp1),
                        *verdicts(sliced_lookup_figure(bs, lk.tp)))
        where.append(f"block {bs}: sliced TP=1 {spread_x(lk.sliced_of_matched)} matched TP=1; of it the block keys "
                     f"{lk.hash_ms:.2f} ms, the slice keys {lk.slice_keys_tp1_ms:.2f} ms (TP={lk.tp}: "
                     f"{lk.slice_keys_tp_ms:.2f} ms, all ranks), the matches the rest")
    out.print(lookups)
    out.print("Where the sliced lookup's time goes: " + "; ".join(where) + ".", highlight=False)
    met = sum(g.passed for g in tp.goals)
    out.print(
        f"head-sliced goals met: {met} of {len(tp.goals)}. verified bit-exact: {tp.verified_bytes / 1e9:.2f} GB restored "
        f"(every layout). objects/rank: TP-matched blocks, head-sliced packs (a rank's slices of a block), one "
        f"object per slice; 'slices': their restore's ratio to TP-matched (not a goal: what a rank reads from the "
        f"shared pool). {tp.note}.",
        highlight=False, markup=False,
    )


# --- bench remote -------------------------------------------------------------------------------


def run_remote(args: argparse.Namespace) -> int:
    from kvstrata.bench.remote import RemoteBenchConfig, run_remote_bench
    from kvstrata.pool.client import PoolUnavailable
    from kvstrata.pool.config import RemoteMode
    from kvstrata.pool.embedded import PoolError

    modes = tuple(dict.fromkeys(RemoteMode(m) for m in args.mode)) if args.mode else tuple(RemoteMode)
    config = RemoteBenchConfig(
        size_bytes=args.size_mib * MIB,
        blocks=args.blocks,
        model=args.model,
        repeats=args.repeats,
        workers=args.workers,
        modes=modes,
    )
    config.layout()  # a size that is no whole number of tokens per block fails here, before any pool starts
    pool = cli.pool_config(args.pool)
    unavailable = {PoolUnavailable: "pool unavailable", PoolError: "pool unavailable"}
    return _run_and_report(args, lambda bar: run_remote_bench(config, pool, bar), _print_remote, unavailable)


def _print_remote(report: RemoteBenchReport) -> None:
    from kvstrata.bench.goals import RemoteFigure, goals_for
    from kvstrata.bench.rounds import Skipped
    from kvstrata.media import FetchPath
    from kvstrata.pool.scoped import PoolOrigin

    c = report.config
    blocks = c.config.blocks
    block = f"{c.kv.block_bytes / MIB:g} MiB"
    rows: list[tuple[RemoteFigure | None, str, str, str, str, str]] = []  # judged, label, what, ours, raw, ratio
    skipped = []
    for mode, m in report.modes.items():
        if isinstance(m, Skipped):
            skipped.append(f"{mode.value}: not measured ({m.skipped})")
            continue
        direct, staged = m.cache[FetchPath.DIRECT], m.cache[FetchPath.STAGED]
        name = mode.value
        rows += [
            (RemoteFigure.of(mode, store=False), f"{name} restore", "RemoteTier.read_many_into, pipelined",
             _gbps(m.restore.ours), f"batch_get_into {_gbps(m.restore.baseline)}", _xc(m.restore)),
            (RemoteFigure.of(mode, store=True), f"{name} store", "RemoteTier.write_many, pipelined",
             _gbps(m.store.ours), f"batch_put_from {_gbps(m.store.baseline)}", _xc(m.store)),
            (None, f"{name} cache restore, direct", "load(): pool -> device", _gbps(direct.restore_gbps),
             f"batch_get_into {_gbps(direct.raw_gbps)}", _xs(direct.ratio, direct.ratio_min, direct.ratio_max)),
            (None, f"{name} cache restore, staged", "load(): pool -> host -> device", _gbps(staged.restore_gbps),
             f"batch_get_into {_gbps(staged.raw_gbps)}", _xs(staged.ratio, staged.ratio_min, staged.ratio_max)),
            (None, f"{name} first byte", f"restore of one {block} block; time ratio", _ms2(m.ttfb.ours),
             f"batch_get_into {_ms2(m.ttfb.baseline)}", _xc(m.ttfb)),
            (RemoteFigure(f"{name} lookup"), f"{name} lookup asking the pool", f"lookup(): exists + adopt, {blocks} blocks; time ratio",
             _ms2(m.lookup.ours), f"batch_is_exist {_ms2(m.lookup.baseline)}", _xc(m.lookup)),
            (RemoteFigure(f"{name} sealed restore"), f"{name} restore, sealed" if m.seal.sealed else
             f"{name} restore (pool has no secret: unsealed)", "MAC checked; raw column: unsealed",
             _gbps(m.seal.restore.ours), f"unsealed {_gbps(m.seal.restore.baseline)}", _xc(m.seal.restore)),
            (None, f"{name} store, sealed", "MAC made; raw column: unsealed", _gbps(m.seal.store.ours),
             f"unsealed {_gbps(m.seal.store.baseline)}", _xc(m.seal.store)),
            (None, f"{name} restore, encrypted", "AES-GCM; raw column: unsealed", _gbps(m.seal.encrypted_restore.ours),
             f"unsealed {_gbps(m.seal.encrypted_restore.baseline)}", _xc(m.seal.encrypted_restore)),
        ]
    pool = c.pool
    title = (
        f"kvstrata bench remote: {c.config.size_bytes / MIB:g} MiB of {c.config.model} KV as {blocks} blocks of "
        f"{c.kv.block_tokens} tokens ({block}), device {c.kv.device}, {pool.source.value} pool, "
        f"median of {c.config.repeats} rounds; GB/s unless marked"
    )
    table = _figure_table(title, (("figure (what is timed)", "left"), ("ours", "right"), ("raw Mooncake", "right"),
                                  ("ratio", "right"), ("goal", "left"), ("pass", "left")))
    for figure, label, what, ours, raw, ratio in rows:
        goals = goals_for(figure, report.goals) if figure is not None else []
        table.add_row(f"{label}\n[dim]{what}[/]", ours, raw, ratio, *_verdicts(goals))
    out = cli.console()
    out.print(table)
    met = sum(g.passed for g in report.goals)
    where = f"master {pool.config.master}, daemon {pool.config.daemon or 'none on this host'}"
    if pool.source is PoolOrigin.EMBEDDED:
        where += f" (pid {pool.daemon_pid}, {pool.segment_bytes / MIB:g} MiB segment)"
    out.print(f"goals met: {met} of {len(report.goals)}. Pool: {where}; this process joins with a 0-byte "
              "segment, so every byte crosses into the daemon's process.", highlight=False)
    crossed = [
        f"{mode.value} {m.loopback_bytes['ours.restore'] / MIB:.1f} (ours) / {m.loopback_bytes['raw.restore'] / MIB:.1f} (raw)"
        for mode, m in report.measured().items() if "ours.restore" in m.loopback_bytes
    ]
    if crossed:
        out.print(f"MiB over loopback sockets during one {c.config.size_bytes / MIB:g} MiB restore (warm-up): "
                  f"{'; '.join(crossed)}.", highlight=False)
    for line in skipped:
        out.print(line, highlight=False)
    out.print(
        f"verified bit-exact: {report.verified.bytes / 1e9:.2f} GB restored (ours, raw and the cache's). "
        "GB = 1e9 bytes; ratio = median over rounds of ours / raw within a round (rates; time ratios: ours' "
        "time / raw's, < 1 is faster).",
        highlight=False,
    )


# --- bench sim ----------------------------------------------------------------------------------


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
    return _run_and_report(args, lambda bar: run_sim_bench(requests, path, config, bar), _print_sim)


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


# --- bench recompute ----------------------------------------------------------------------------


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

    return _run_and_report(args, lambda bar: run_recompute_bench(config, bar), render)


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


# --- bench e2e ----------------------------------------------------------------------------------


def run_bench_e2e(args: argparse.Namespace) -> int:
    from kvstrata.bench.e2e import E2EBenchReport, LMCacheBeside, version_note, versus
    from kvstrata.bench.rounds import Skipped
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

