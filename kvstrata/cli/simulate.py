"""``kvstrata simulate``: replay a trace through one or more KV architectures and rank them."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvstrata import cli
from kvstrata.fleet.scorer import Policy
from kvstrata.cli.plan import checked_gpus, parse_fleet_tp, resolve_profile, sizing_text
from kvstrata.kv.presets import load_geometry
from kvstrata.media import Medium
from kvstrata.plan.sharing import KVSharing
from kvstrata.plan.sizing import InstanceSizing, WeightsDoNotFit, size_instances
from kvstrata.sim.config import Routing, SimConfig
from kvstrata.sim.instance import pack_servers
from kvstrata.sim.results import GOODPUT_SLO, TPOT_P99_SLO_S, TTFT_P90_SLO_S, Summary
from kvstrata.sim.run import offered_load, scale_time, simulate, trace_span_s
from kvstrata.sim.tiers import HARDWARE_NAME, WRITE_NAMES
from kvstrata.sim.traceio import read_trace
from kvstrata.slo import Slo

if TYPE_CHECKING:
    from kvstrata.page import HtmlPage


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="trace-driven simulation of KV architectures against SLOs")
    p.add_argument("--trace", required=True, help="JSON-lines trace (Mooncake format)")
    p.add_argument("--hardware", required=True, help="profile name or TOML file, with +upgrades (e.g. h200-cx7-gen5+cx8)")
    p.add_argument("--model", required=True, help="model preset or config.json")
    p.add_argument("--arch", required=True, help="architectures, comma separated (e.g. hbm,remote-gdr,hbm+pool+nvme)")
    p.add_argument("--instances", type=int, default=None, help="instances (default: as many as the GPUs hold)")
    p.add_argument("--gpus-per-instance", type=int, default=None,
                   help="GPUs per instance (default: the fewest that hold the weights with room for KV)")
    p.add_argument("--requests", type=int, default=None, help="take the first N requests")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (2 = half the rate)")
    p.add_argument("--write", choices=tuple(WRITE_NAMES), default="through", help="tier write policy")
    p.add_argument("--restore-slots", type=int, default=4, help="requests restoring at once per instance")
    p.add_argument("--fleet-tp", default=None, metavar="TP,...",
                   help="a fleet of mixed TP sizes on one shared pool, one size per instance (8,4,2,1 or 2x8,4x2), "
                        "instead of --instances/--gpus-per-instance")
    p.add_argument("--kv-sharing", choices=(*(m.value for m in KVSharing), "both"), default=None,
                   help="pool blocks TP-matched (per TP size, replicated heads per rank) or head-sliced (one copy "
                        "any TP loads), or both side by side (default with --fleet-tp: both; without: as before, "
                        "one copy, no pool report)")
    p.add_argument("--route", choices=tuple(r.value for r in Routing), default=Routing.SESSION.value,
                   help="session: hash_ids[0] mod instances (requests sharing a first block meet on one instance); "
                        "round-robin: arrival order")
    p.add_argument("--policy", default=None, metavar="POLICY",
                   help=f"route by a fleet policy, the router's own ({', '.join(x.value for x in Policy)}), or "
                        "'all' to run each on the same trace, a TTFT table per policy; instead of --route")
    p.add_argument("--pool-tokens", type=int, default=None, help="the pool's capacity in tokens (default: the profile's)")
    p.add_argument("--slo-ttft-ms", type=float, default=GOODPUT_SLO.ttft_s * 1e3,
                   help="goodput: a request meets the SLO with TTFT at most this (default %(default)g)")
    p.add_argument("--slo-tpot-ms", type=float, default=GOODPUT_SLO.tpot_s * 1e3,
                   help="... and TPOT at most this (default %(default)g; a one-token answer: TTFT alone)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--plot", metavar="DIR", help="write TTFT/TPOT CDF plots here (ttft_cdf.png, tpot_cdf.png)")
    cli.add_html_arg(p, "the ranking table and the CDF plots")
    p.set_defaults(func=run_simulate)


def run_simulate(args: argparse.Namespace) -> int:
    requests = read_trace(args.trace)
    if not requests:
        raise cli.CliError(f"trace {args.trace!r} has no requests (no non-blank line): nothing to simulate")
    if args.requests is not None:
        if args.requests < 1:
            raise cli.CliError(f"--requests must be at least 1, got {args.requests}")
        requests = requests[: args.requests]
    if args.time_scale != 1.0:
        try:
            requests = scale_time(requests, args.time_scale)
        except ValueError as e:
            raise cli.CliError(f"--time-scale: {e}") from None
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    if not archs:
        raise cli.CliError("--arch names no architecture")
    if args.restore_slots < 1:
        raise cli.CliError(f"--restore-slots must be at least 1, got {args.restore_slots}")
    geometry, profile = load_geometry(args.model), resolve_profile(args.hardware)
    sharings = _sharings(args)
    policies = _policies(args.policy)
    slo = cli.slo_ms(args.slo_ttft_ms, args.slo_tpot_ms)
    extra = {"tier_tokens": _pool_tokens(args), "routing": Routing(args.route), "restore_slots": args.restore_slots,
             "slo": slo}
    if args.fleet_tp is not None:
        sizing, fleet = None, _fleet(geometry, profile, args)
        config = SimConfig(geometry, profile, fleet_tp=fleet, **extra)
        setting = fleet_text(config)
    else:
        sizing = _sizing(geometry, profile, args)
        config = SimConfig(geometry, profile, sizing.gpus_per_instance, sizing.instances, **extra)
        setting = sizing_text(sizing)
    if policies:
        setting = setting.replace(f"; routing: {config.routing.value}", "")
        setting += f"; routed by {', '.join(p.value for p in policies)} (one run each)"
        if Policy.PREDICTED_TTFT in policies:
            setting += "; predicted-ttft routes to meet the goodput's SLO"
    load = offered_load(requests, config) if trace_span_s(requests) > 0 else None
    with Progress(console=Console(stderr=True), transient=True) as bar:
        tasks: dict[str, int] = {}

        def step(a: str, done: int, total: int) -> None:
            if a not in tasks:
                tasks[a] = bar.add_task(f"simulating {a}", total=total)
            bar.update(tasks[a], completed=done)

        summaries, outcomes = simulate(requests, config, archs, step, write=WRITE_NAMES[args.write], sharings=sharings,
                                       policies=policies, slo=slo)
    if args.json:
        doc = {"gpus_per_instance": config.gpus_per_instance, "instances": config.instance_count,
               "gpus_basis": sizing.basis.value if sizing else "fleet", "offered_load": load,
               "goodput_slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}}
        if sharings:
            doc |= {"fleet_tp": list(config.instance_tps), "routing": config.routing.value,
                    "kv_sharing": [m.value for m in sharings]}
        if policies:
            doc["policies"] = [p.value for p in policies]
        doc["architectures"] = [s.to_json(pool=bool(sharings)) for s in summaries]
        print(json.dumps(doc, indent=2))
    else:
        render(cli.console(), requests, summaries, load, setting, config.instance_count, slo)
        if sharings:
            render_pool(cli.console(), summaries)
        if policies:
            render_policies(cli.console(), summaries)
    if args.plot or args.html:
        _pictures(args, config, requests, summaries, outcomes, load, setting, bool(sharings), slo)
    return 0


def _sharings(args: argparse.Namespace) -> list[KVSharing]:
    """The sharing modes to run side by side; none (the pool as before, no pool report) unless asked
    for or a fleet is given."""
    if args.kv_sharing == "both" or (args.kv_sharing is None and args.fleet_tp is not None):
        return list(KVSharing)
    return [KVSharing(args.kv_sharing)] if args.kv_sharing else []


def goodput_text(s: Summary) -> str:
    """A run's goodput: the share of requests within the SLO, and those per simulated second."""
    return f"{s.goodput.share:.0%} ({s.goodput.per_s:.2f}/s)"


def _policies(name: str | None) -> list[Policy]:
    """``--policy``: none, one, or every policy for ``all``."""
    if name is None:
        return []
    return list(Policy) if name == "all" else [Policy.parse(name)]


def versus_round_robin(summaries: list[Summary]) -> list[tuple[Summary, float | None]]:
    """Each run with its TTFT p90 over round robin's on the same architecture and sharing mode
    (None where round robin did not run there), by architecture, then fastest first. Runs are
    matched by what ran (``spec``, ``sharing``, ``policy``), never by their labels."""
    setup = lambda s: (s.spec, s.sharing)  # noqa: E731
    rr = {setup(s): s.ttft_s["p90"] for s in summaries if s.policy is Policy.ROUND_ROBIN}
    rows = sorted(summaries, key=lambda s: (s.spec.label, s.sharing.value, s.ttft_s["p90"]))
    return [(s, s.ttft_s["p90"] / base if (base := rr.get(setup(s))) else None) for s in rows]


def render_policies(out: Console | HtmlPage, summaries: list[Summary]) -> None:
    """TTFT per architecture and routing policy (labelled ``arch / policy``), each against round
    robin's on the same architecture where it ran (:func:`versus_round_robin`)."""
    t = Table(title="TTFT per routing policy (the router's own policies, fed by the instances' caches)")
    for col in ("arch / policy", "TTFT p50 s", "TTFT p90 s", "p90 / round robin", "goodput", "hit rate", "SLO"):
        t.add_column(col, justify="left" if col == "arch / policy" else "right")
    for s, ratio in versus_round_robin(summaries):
        t.add_row(s.arch, f"{s.ttft_s['p50']:.3f}", f"{s.ttft_s['p90']:.3f}",
                  f"{ratio:.2f}x" if ratio is not None else "-", goodput_text(s),
                  " ".join(f"{HARDWARE_NAME[m]} {v:.0%}" for m, v in s.hit_rate.items()),
                  "[green]yes[/]" if s.meets_slo else "[red]no[/]")
    out.print(t)


def _pool_tokens(args: argparse.Namespace) -> tuple[tuple[Medium, int], ...]:
    if args.pool_tokens is None:
        return ()
    if args.pool_tokens < 0:
        raise cli.CliError(f"--pool-tokens must be at least 0, got {args.pool_tokens}")
    return ((Medium.REMOTE, args.pool_tokens),)


def _fleet(geometry, profile, args: argparse.Namespace) -> tuple[int, ...]:
    """``--fleet-tp``'s sizes, each one the node holds the weights on; errors name the flag."""
    for flag, value in (("--instances", args.instances), ("--gpus-per-instance", args.gpus_per_instance)):
        if value is not None:
            raise cli.CliError(f"--fleet-tp sets every instance's GPUs: drop {flag}")
    sizes = parse_fleet_tp(args.fleet_tp, geometry, profile)
    for tp in dict.fromkeys(sizes):
        try:
            size_instances(geometry, profile, tp, 1).check_fits()
        except WeightsDoNotFit as exc:
            raise cli.CliError(f"--fleet-tp {args.fleet_tp!r}: TP {tp}: {exc}") from None
    return sizes


def fleet_text(config: SimConfig) -> str:
    """The fleet's instances and servers, in one sentence."""
    tps = config.instance_tps
    servers = pack_servers(tps, len(config.profile.gpus))[-1][0] + 1
    return (f"a fleet of TP {','.join(map(str, tps))} ({sum(tps)} GPUs on {servers} server(s) of "
            f"{config.profile.name}, one shared pool); routing: {config.routing.value}")


def render_pool(out: Console | HtmlPage, summaries) -> None:
    """The shared pool per architecture and sharing mode: its own hit ratio, copies, bytes."""
    t = Table(title="The shared pool: its own hits (leading blocks present), copies per distinct block "
                    "(mean/max at the end, mean over arrivals), GB and distinct blocks at the end")
    for col in ("arch", "hit blocks", "hit tokens", "copies", "copies avg", "GB used", "blocks", "TTFT p50/p90 s"):
        t.add_column(col, justify="left" if col == "arch" else "right")
    for s in sorted((s for s in summaries if s.pool), key=lambda s: s.arch):
        p = s.pool
        t.add_row(s.arch, f"{p.block_hit_ratio:.1%}", f"{p.token_hit_ratio:.1%}",
                  f"{p.copies_mean:.2f}/{p.copies_max:.2f}", f"{p.copies_mean_time_avg:.2f}",
                  f"{p.used_bytes / 1e9:,.0f}/{p.capacity_bytes / 1e9:,.0f}", f"{p.distinct_blocks:,}",
                  f"{s.ttft_s['p50']:.2f}/{s.ttft_s['p90']:.2f}")
    out.print(t)


def render(out: Console | HtmlPage, requests, summaries, load: float | None, sizing: str, instances: int,
           slo: Slo = GOODPUT_SLO) -> None:
    """The GPUs chosen, the ranking table and the offered-load line, to a console or an HTML page."""
    t = Table(title=f"{len(requests):,} requests; SLO: TTFT p90 <= {TTFT_P90_SLO_S:g} s, TPOT p99 <= {TPOT_P99_SLO_S * 1e3:g} ms; "
                    f"goodput: requests with TTFT <= {slo.ttft_s * 1e3:g} ms and TPOT <= {slo.tpot_s * 1e3:g} ms")
    for col in ("rank", "arch", "GPUs", "TTFT p50/p90/p99 s", "TPOT p50/p90/p99 ms", "tok/s", "tok/s/GPU", "hit rate",
                "goodput", "SLO"):
        t.add_column(col)
    for i, s in enumerate(summaries, 1):
        t.add_row(
            str(i),
            s.arch,
            str(s.gpus),
            "/".join(f"{v:.2f}" for v in s.ttft_s.values()),
            "/".join("-" if math.isnan(v) else f"{v * 1e3:.1f}" for v in s.tpot_s.values()),  # -: no request past 1 token
            f"{s.throughput_tok_s:,.0f}",
            f"{s.throughput_per_gpu:,.1f}",
            " ".join(f"{HARDWARE_NAME[m]} {v:.0%}" for m, v in s.hit_rate.items()),
            goodput_text(s),
            "[green]yes[/]" if s.meets_slo else "[red]no[/]",
        )
    out.print(f"{instances} instance(s); {sizing}", highlight=False)
    out.print(t)
    if load is None:
        out.print(f"all {len(requests):,} requests arrive at once: no arrival rate, so no offered load to state")
        return
    note = "[red]overloaded: queues grow, TTFT reflects queueing[/]" if load > 1 else "within capacity"
    out.print(
        f"offered prefill load without reuse: {load:.2f}x the instances' compute ({note}); "
        "--time-scale stretches arrivals"
    )


def _sizing(geometry, profile, args: argparse.Namespace) -> InstanceSizing:
    """The instances' GPUs: the flags' values, checked, else the default; errors name the flags."""
    if args.instances is not None and args.instances < 1:
        raise cli.CliError(f"--instances must be at least 1, got {args.instances}")
    checked_gpus(geometry, profile, args.gpus_per_instance, "--gpus-per-instance")
    try:
        sizing = size_instances(geometry, profile, args.gpus_per_instance, args.instances)
    except ValueError as exc:
        flags = " with ".join(f for f, v in (("--instances", args.instances),
                                             ("--gpus-per-instance", args.gpus_per_instance)) if v is not None)
        raise cli.CliError(f"{flags}: {exc}") from None
    try:
        sizing.check_fits()  # one line naming the model, its weights and the GPUs
    except WeightsDoNotFit as exc:
        if args.gpus_per_instance is None and args.instances is not None:
            raise cli.CliError(f"--instances {args.instances} leaves {sizing.gpus_per_instance} GPU(s) each: {exc}") from None
        raise
    return sizing


def _pictures(args: argparse.Namespace, config: SimConfig, requests, summaries, outcomes, load: float | None,
              sizing: str, pool_table: bool, slo: Slo) -> None:
    """``--plot DIR`` and ``--html FILE``: the TTFT and TPOT CDFs, and the page of table and CDFs
    (and the shared pool's table where sharing modes were compared, as on the terminal)."""
    from kvstrata.page import HtmlPage
    from kvstrata.plots import png_bytes, save_png
    from kvstrata.plots.cdf import simulation_figures

    shape = (f"TP {','.join(map(str, config.fleet_tp))}" if config.fleet_tp
             else f"{config.instance_count} instance(s) x {config.gpus_per_instance} GPU(s)")
    setting = f"{config.geometry.name} on {config.profile.name}, {shape}"
    figures = simulation_figures(outcomes, f"{Path(args.trace).name}: {setting}, {len(requests):,} requests")
    pngs = {name: png_bytes(fig) for name, fig in figures.items()}
    if args.plot:
        for name, png in pngs.items():
            cli.wrote("plot", save_png(png, Path(args.plot) / f"{name}.png"), args.json)
    if args.html:
        page = HtmlPage(f"kvstrata simulate: {Path(args.trace).name}, {setting}")
        render(page, requests, summaries, load, sizing, config.instance_count, slo)
        if pool_table:
            render_pool(page, summaries)
        for name, fig in figures.items():
            page.image(pngs[name], fig.axes[0].get_title().replace("\n", ": ", 1))
        cli.wrote("report", page.write(args.html), args.json)
