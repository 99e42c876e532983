"""``kvstrata bench cache`` and ``kvstrata bench remote``: store and restore GB/s through each
cache tier and through the remote tier, beside the plain copies, file I/O, LMCache and raw
Mooncake calls of the same bytes in the same run. Tables and their labels are made here
(``--json``: the report alone)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstrata import cli
from kvstrata.bench.cli.common import (
    MIB,
    BenchParser,
    dir_arg,
    figure_table,
    gbps_cell,
    rounds_args,
    run_and_report,
    spread_x,
    verdict_cells,
)

if TYPE_CHECKING:
    from kvstrata.bench.cache_report import CacheBenchReport
    from kvstrata.bench.remote_report import RemoteBenchReport
    from kvstrata.rounds import Compared


def register(bench: BenchParser) -> None:
    """Add ``bench cache`` and ``bench remote`` through ``bench`` (``kvstrata.bench.cli``'s sub-command maker)."""
    cache = bench(
        "cache", run_cache, "store/restore GB/s of each cache tier vs copies, file I/O and LMCache",
        "Store and restore GB/s of the device, host and disk tiers of TieredCache on "
        "KV of a real model's geometry, beside a plain copy, plain file reads and writes "
        "(cold and warm) and LMCache when it is importable; plus hash+lookup time of 128K tokens. "
        "Every restore is verified bit-exact.",
    )
    _kv_args(cache, size_mib=512, blocks=16, what="blocks the KV is cut into")
    rounds_args(cache, repeats=5, per="", workers_help="the cache's transfer threads (default: 2)")
    dir_arg(cache)
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
    rounds_args(remote, repeats=5, per=" per mode", workers_help="transfer threads on our side (default: 2, the cache's)")
    remote.add_argument("--mode", choices=("tcp", "shm"), action="append",
                        help="measure only this mode (repeatable; default: tcp and shm)")
    cli.add_pool_arg(remote, "an embedded pool for the run")
    cli.add_json_arg(remote)


def _kv_args(p: argparse.ArgumentParser, size_mib: int, blocks: int, what: str) -> None:
    """The bytes a benchmark moves: how many, in how many blocks, of which model's KV."""
    p.add_argument("--size-mib", type=int, default=size_mib, help=f"KV moved by every step, MiB (default: {size_mib})")
    p.add_argument("--blocks", type=int, default=blocks, help=f"{what} (default: {blocks})")
    p.add_argument("--model", default="llama-3-8b", help="model preset or config for the KV geometry")


def _tp_sizes(text: str) -> tuple[int, ...]:
    """``1,2,4,8`` as TP sizes: distinct integers >= 1."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"expected distinct TP sizes >= 1, comma-separated (e.g. 1,2,4,8), got {text!r}")
    return sizes


def _x(value: float) -> str:
    return f"{value:.2f}x"


def _xs(value: float, low: float, high: float) -> str:
    """A paired ratio with its spread over rounds, on two lines."""
    return f"{value:.2f}x\n[dim]{low:.2f}..{high:.2f}[/]"


def _xc(figure: Compared) -> str:
    return _xs(figure.ratio, figure.ratio_min, figure.ratio_max)


def _ms2(value: float) -> str:
    return f"{value:.2f} ms"


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
    return run_and_report(args, lambda bar: run_cache_bench(config, bar), _print_cache)


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
        return gbps_cell(fig.rate.median), _x(fig.ours_over_lmcache)

    none = ("-", "-")
    # (figure judged, label, what is timed, ours, baseline, ratio, LMCache and ours / LMCache)
    rows: list[tuple[CacheFigure | None, str, str, str, str, str, tuple[str, str]]] = [
        (None, "device store", "store() into device tier", gbps_cell(dev.store.ours),
         f"copy d->d {gbps_cell(dev.store.baseline)}", _xc(dev.store), none),
        (None, "device hit", f"load() of {c.config.blocks} device blocks", f"{dev.hit_ms:.3f} ms", "-", "-", none),
        (CacheFigure.HOST_STORE, "host store", "device tier -> host", gbps_cell(host.store.ours),
         f"copy d->h {gbps_cell(host.store.baseline)}", _xc(host.store), lm(lambda m: m.host.store)),
        (CacheFigure.HOST_RESTORE, "host restore", "load(): host -> device", gbps_cell(host.restore.ours),
         f"copy h->d {gbps_cell(host.restore.baseline)}", _xc(host.restore), lm(lambda m: m.host.retrieve)),
        (CacheFigure.DISK_STORE, "disk store", "host -> disk (buffered)", gbps_cell(disk.store.ours),
         f"write {gbps_cell(disk.store.baseline)}", _xc(disk.store), lm(lambda m: m.disk.store)),
        (CacheFigure.DISK_COLD, "disk restore, cold", "load(): disk->host->device", gbps_cell(cold.restore.ours),
         f"cold read {gbps_cell(cold.restore.baseline)}", _xc(cold.restore), lm(lambda m: m.disk.retrieve_cold)),
        (CacheFigure.DISK_WARM, "disk restore, warm", "load(): disk->host->device", gbps_cell(warm.restore.ours),
         f"copy h->d {gbps_cell(warm.restore.baseline)}", _xc(warm.restore), lm(lambda m: m.disk.retrieve_warm)),
        (None, "", "", "", f"warm read {gbps_cell(warm.raw_read_gbps)}", _x(warm.raw_read_ratio), ("", "")),
        (None, "disk tier read, cold", "DiskTier: disk -> host", gbps_cell(cold.tier_read_gbps),
         f"cold read {gbps_cell(cold.restore.baseline)}", _x(cold.tier_read_ratio), none),
        (None, "disk tier read, warm", "DiskTier: disk -> host", gbps_cell(warm.tier_read_gbps),
         f"warm read {gbps_cell(warm.raw_read_gbps)}", _x(warm.tier_read_ratio), none),
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
    table = figure_table(title, (("figure (what is timed)", "left"), ("ours", "right"), ("baseline", "right"),
                                  ("ratio", "right"), ("LMCache", "right"), ("ours/LMC", "right"),
                                  ("goal", "left"), ("pass", "left")))
    for figure, label, what, ours, baseline, ratio, (lm_value, lm_ratio) in rows:
        goals = goals_for(figure, report.goals) if figure is not None else []
        table.add_row(f"{label}\n[dim]{what}[/]" if what else label, ours, baseline, ratio, lm_value, lm_ratio,
                      *verdict_cells(goals))
    out = cli.console()
    out.print(table)
    met = sum(g.passed for g in report.goals)
    copies = ", ".join(f"{name.removeprefix('copy.')} {gbps_cell(fig.median)}" for name, fig in report.baselines.items()
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
        return verdict_cells([g for g in report.goals if g.figure == figure])

    mib = 1 << 20
    title = (
        f"head-sliced vs TP-matched restores: {c.config.size_bytes / MIB:g} MiB of {c.config.model} KV "
        f"({tp.kv_heads} KV heads, {tp.slices} slices a block), {tp.blocks} blocks of {tp.block_tokens} tokens, "
        f"device {c.kv.device}; each of TP ranks: load() + copy into its KV; median of {c.config.repeats} rounds, "
        f"GB/s of all ranks' bytes; goal: head-sliced >={SLICED_OF_MATCHED}x TP-matched"
    )
    table = figure_table(title, (("tier, reader TP", "left"), ("objects/rank", "right"),
                                  ("TP-matched", "right"), ("head-sliced", "right"), ("ratio", "right"),
                                  ("load alone", "right"), ("slices", "right"), ("pass", "left")))
    for row in tp.restores:
        objects = (f"{row.matched_objects} x {row.matched_object_bytes / mib:g} MiB\n"
                   f"{row.sliced_objects} x {row.sliced_object_bytes / mib:g} MiB\n"
                   f"{row.slices_objects} x {row.slices_object_bytes / mib:g} MiB")
        table.add_row(f"{row.source.value}, TP={row.tp}", objects,
                      gbps_cell(row.rate.baseline), gbps_cell(row.rate.ours), _xc(row.rate), _xc(row.load), _xc(row.slices),
                      verdicts(sliced_restore_figure(row.source.value, row.tp))[1])
    out = cli.console()
    out.print(table)
    lookups = figure_table(
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
    return run_and_report(args, lambda bar: run_remote_bench(config, pool, bar), _print_remote, unavailable)


def _print_remote(report: RemoteBenchReport) -> None:
    from kvstrata.bench.goals import RemoteFigure, goals_for
    from kvstrata.rounds import Skipped
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
             gbps_cell(m.restore.ours), f"batch_get_into {gbps_cell(m.restore.baseline)}", _xc(m.restore)),
            (RemoteFigure.of(mode, store=True), f"{name} store", "RemoteTier.write_many, pipelined",
             gbps_cell(m.store.ours), f"batch_put_from {gbps_cell(m.store.baseline)}", _xc(m.store)),
            (None, f"{name} cache restore, direct", "load(): pool -> device", gbps_cell(direct.restore_gbps),
             f"batch_get_into {gbps_cell(direct.raw_gbps)}", _xs(direct.ratio, direct.ratio_min, direct.ratio_max)),
            (None, f"{name} cache restore, staged", "load(): pool -> host -> device", gbps_cell(staged.restore_gbps),
             f"batch_get_into {gbps_cell(staged.raw_gbps)}", _xs(staged.ratio, staged.ratio_min, staged.ratio_max)),
            (None, f"{name} first byte", f"restore of one {block} block; time ratio", _ms2(m.ttfb.ours),
             f"batch_get_into {_ms2(m.ttfb.baseline)}", _xc(m.ttfb)),
            (RemoteFigure(f"{name} lookup"), f"{name} lookup asking the pool", f"lookup(): exists + adopt, {blocks} blocks; time ratio",
             _ms2(m.lookup.ours), f"batch_is_exist {_ms2(m.lookup.baseline)}", _xc(m.lookup)),
            (RemoteFigure(f"{name} sealed restore"), f"{name} restore, sealed" if m.seal.sealed else
             f"{name} restore (pool has no secret: unsealed)", "MAC checked; raw column: unsealed",
             gbps_cell(m.seal.restore.ours), f"unsealed {gbps_cell(m.seal.restore.baseline)}", _xc(m.seal.restore)),
            (None, f"{name} store, sealed", "MAC made; raw column: unsealed", gbps_cell(m.seal.store.ours),
             f"unsealed {gbps_cell(m.seal.store.baseline)}", _xc(m.seal.store)),
            (None, f"{name} restore, encrypted", "AES-GCM; raw column: unsealed", gbps_cell(m.seal.encrypted_restore.ours),
             f"unsealed {gbps_cell(m.seal.encrypted_restore.baseline)}", _xc(m.seal.encrypted_restore)),
        ]
    pool = c.pool
    title = (
        f"kvstrata bench remote: {c.config.size_bytes / MIB:g} MiB of {c.config.model} KV as {blocks} blocks of "
        f"{c.kv.block_tokens} tokens ({block}), device {c.kv.device}, {pool.source.value} pool, "
        f"median of {c.config.repeats} rounds; GB/s unless marked"
    )
    table = figure_table(title, (("figure (what is timed)", "left"), ("ours", "right"), ("raw Mooncake", "right"),
                                  ("ratio", "right"), ("goal", "left"), ("pass", "left")))
    for figure, label, what, ours, raw, ratio in rows:
        goals = goals_for(figure, report.goals) if figure is not None else []
        table.add_row(f"{label}\n[dim]{what}[/]", ours, raw, ratio, *verdict_cells(goals))
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
