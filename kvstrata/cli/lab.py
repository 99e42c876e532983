"""``kvstrata lab``: a cluster on this machine (namespaces, veth links shaped by tc) restoring KV
through the real cache, beside the planner's prediction; ``kvstrata lab clean`` removes what a
killed lab left behind."""

from __future__ import annotations

import argparse
import signal
import statistics
import time

from rich.table import Table

from kvstrata import cli
from kvstrata.media import FetchPath

MIB = 1 << 20


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvstrata.lab.run import LabConfig, Phase

    d = LabConfig()
    lab = subparsers.add_parser(
        "lab",
        help="emulated hosts and shaped NIC links on this machine: restores measured vs the planner (root)",
        description="Builds hosts as network namespaces joined by veth links shaped with tc (tbf), runs a real "
                    "pool on one and the cache on others, and restores KV through the cache at each link rate, "
                    "beside the planner's prediction and the bottleneck it names. Three clusters: one shaped link "
                    "(restores direct and staged), two shaped ports on two rails (one restore spread over both, "
                    "against one port), and two hosts behind one shaped uplink (each host's share). Needs root.",
    )
    lab.add_argument("--rates", type=float, nargs="+", default=list(d.rates_gbit), metavar="GBIT",
                     help=f"the one-link phase's rates, Gbit/s (default {' '.join(f'{r:g}' for r in d.rates_gbit)})")
    lab.add_argument("--sizes-mib", type=float, nargs="+", metavar="MIB",
                     help=f"restore sizes (default {' '.join(f'{s // MIB}' for s in d.sizes)})")
    lab.add_argument("--repeats", type=int, default=d.repeats, help=f"timed rounds after a warm-up (default {d.repeats})")
    lab.add_argument("--phases", nargs="+", choices=[p.value for p in Phase], default=[p.value for p in Phase],
                     help="which clusters to run (default all)")
    lab.add_argument("--ports-rate", type=float, default=d.ports_rate_gbit, metavar="GBIT",
                     help=f"each port's rate in the two-port phase (default {d.ports_rate_gbit:g})")
    lab.add_argument("--uplink-rate", type=float, default=d.uplink_rate_gbit, metavar="GBIT",
                     help=f"the shared uplink's rate (default {d.uplink_rate_gbit:g})")
    lab.add_argument("--model", default=d.model, help=f"model preset for the KV layout (default {d.model})")
    lab.add_argument("--quick", action="store_true",
                     help="one shaped link at 2.5 Gbit/s and one far above the host's paths, 16 and 64 MiB, 1 round")
    lab.add_argument("--plot", metavar="PATH", help="also write measured vs predicted GB/s per rate (PNG) to PATH")
    cli.add_json_arg(lab)
    lab.set_defaults(func=run_lab_command)
    sub = lab.add_subparsers(dest="lab_command")
    clean = sub.add_parser("clean", help="remove the namespaces of labs whose process is gone")
    clean.set_defaults(func=run_clean)


def _config(args: argparse.Namespace):
    from kvstrata.lab.run import LabConfig, Phase

    if args.quick:
        return LabConfig(rates_gbit=(2.5, 40.0), sizes=(16 * MIB, 64 * MIB), repeats=1, phases=(Phase.LINK,),
                         model=args.model)
    sizes = tuple(int(s * MIB) for s in args.sizes_mib) if args.sizes_mib else LabConfig.sizes
    return LabConfig(rates_gbit=tuple(args.rates), sizes=sizes, repeats=args.repeats,
                     phases=tuple(Phase(p) for p in dict.fromkeys(args.phases)),
                     ports_rate_gbit=args.ports_rate, uplink_rate_gbit=args.uplink_rate, model=args.model)


def run_lab_command(args: argparse.Namespace) -> int:
    from kvstrata.lab.netns import unavailable
    from kvstrata.lab.run import run_lab
    from kvstrata.report import dumps

    config = _config(args)
    why = unavailable()
    if why:
        raise cli.CliError(f"lab: {why}")
    # SIGTERM unwinds like Ctrl-C, so the namespaces and the pool go with the lab.
    signal.signal(signal.SIGTERM, _interrupt)
    started = time.perf_counter()
    with cli.progress() as progress:
        report = run_lab(config, cli.StepBar(progress))
    seconds = time.perf_counter() - started
    if args.plot:
        from kvstrata.plots import png_bytes, save_png
        from kvstrata.plots.lab import lab_figure

        save_png(png_bytes(lab_figure(report)), args.plot)
        cli.wrote("measured vs predicted", args.plot, args.json)
    if args.json:
        print(dumps(report))
        return 0
    _print(report, seconds)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_clean(args: argparse.Namespace) -> int:
    from kvstrata.lab.netns import clean_stale

    gone = clean_stale()
    cli.console().print(f"removed {len(gone)} namespace(s) of labs no longer running" + (": " + ", ".join(gone) if gone else ""))
    return 0


def _print(report, seconds: float) -> None:
    from kvstrata.lab.report import GOAL

    out = cli.console()
    paths = report.paths
    out.print(f"this host's paths, measured unshaped in the same rounds: restore from the pool "
              f"{paths.transport.gbps:.2f} GB/s + {paths.transport.latency_s * 1e3:.1f} ms; host -> device copy "
              f"{paths.copy.gbps:.2f} GB/s", highlight=False)
    if report.link:
        table = Table(title=f"one link: restores through the cache, predicted vs measured ({report.config.repeats} rounds, "
                            f"{report.config.model})")
        for col in ("link", "path", "size", "predicted", "measured", "GB/s", "error", "bound predicted", "bound seen",
                    "bottleneck"):
            table.add_column(col, justify="left" if col in ("link", "path", "bottleneck") else "right")
        for r in report.link:
            mark = "" if not r.in_goal else ("[green]" if abs(r.error) <= GOAL else "[bold red]")
            agree = "" if r.predicted_bound is r.observed_bound or r.rate_gbit is None else "[bold red]"
            table.add_row("unshaped" if r.rate_gbit is None else f"{r.rate_gbit:g} Gbit/s",
                          "remote -> device" if r.path is FetchPath.DIRECT else "remote -> host -> device",
                          f"{r.nbytes / MIB:g} MiB", _ms(r.predicted_s), _ms(r.measured_s), f"{r.measured_gbps:.3f}",
                          f"{mark}{r.error:+.1%}", r.predicted_bound.value, f"{agree}{r.observed_bound.value}",
                          r.bottleneck)
        out.print(table)
    if report.ports:
        table = Table(title="two ports: one restore spread over a pool daemon behind each, against one port")
        for col in ("rate/port", "size", "one port", "two ports", "speedup", "planner"):
            table.add_column(col, justify="right")
        for r in report.ports:
            table.add_row(f"{r.rate_gbit:g} Gbit/s", f"{r.nbytes / MIB:g} MiB", _ms(statistics.median(r.one_port_runs_s)),
                          _ms(statistics.median(r.two_ports_runs_s)), f"{r.speedup:.2f}x", f"{r.predicted_speedup:.2f}x")
        out.print(table)
    if report.uplink:
        table = Table(title="shared uplink: two hosts restoring at once behind one shaped link")
        for col in ("host", "uplink", "size", "alone", "at once", "share", "planner's share"):
            table.add_column(col, justify="right")
        for r in report.uplink:
            table.add_row(r.host, f"{r.rate_gbit:g} Gbit/s", f"{r.nbytes / MIB:g} MiB", _ms(statistics.median(r.alone_runs_s)),
                          _ms(statistics.median(r.together_runs_s)), f"{r.share:.2f}", f"{r.predicted_share:.2f}")
        out.print(table)
    for goal in report.goals:
        mark = "[green]met[/]" if goal.met else "[bold red]MISSED[/]"
        out.print(f"{mark} {goal.what}: {goal.detail}", highlight=False)
    out.print(f"{seconds:.0f} s; every namespace, link and qdisc removed", highlight=False)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
