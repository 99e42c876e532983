"""``kvstrata plan``: restore time per path and the seven architectures, for a model on hardware."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from kvstrata import cli
from kvstrata.hardware.profile import HardwareProfile, load_profile
from kvstrata.hardware.whatif import apply_upgrades
from kvstrata.kv.geometry import KVGeometry
from kvstrata.kv.presets import load_geometry
from kvstrata.plan.planner import Plan, make_plan, pool_capacity_bytes, ratios
from kvstrata.plan.restore import RestoreEstimate
from kvstrata.plan.sharing import FleetSharing, KVSharing, fleet_sharing
from kvstrata.plan.sizing import KV_MARGIN_FRACTION, Basis, InstanceSizing, WeightsDoNotFit, check_tp

if TYPE_CHECKING:
    from kvstrata.page import HtmlPage

DEFAULT_MODEL = "llama-3-70b"
DEFAULT_HARDWARE = "h200-cx7-gen5"
DEFAULT_CONTEXT = 32768


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="restore time per path and the seven KV architectures")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"preset or config.json path (default {DEFAULT_MODEL})")
    p.add_argument("--hardware", default=DEFAULT_HARDWARE, help=f"profile name or .toml (default {DEFAULT_HARDWARE})")
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT, help="context tokens of the request")
    p.add_argument("--cached", type=int, default=None, help="cached prefix tokens to restore (default: all)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs the request spans (default: fewest that fit)")
    p.add_argument("--dtype", default=None, help="KV dtype (default: the model config's)")
    p.add_argument("--vs", default=None, help="other profile, or upgrades like +cx8, +gen6, +socket-direct")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw restore time vs context per path")
    cli.add_html_arg(p, "the tables and the restore-time plot")
    p.add_argument("--fleet-tp", default=None, metavar="TP,...",
                   help="a fleet sharing one pool, one TP size per instance (8,4,2,1 or 2x8,4x2): "
                        "a prefix's pool bytes and copies TP-matched vs head-sliced")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def parse_fleet_tp(text: str, geometry: KVGeometry, profile: HardwareProfile, flag: str = "--fleet-tp") -> tuple[int, ...]:
    """One TP size per instance from ``8,4,2,1`` or ``COUNTxTP`` items (``2x8,4x2``), each a
    degree the node and the model's KV heads allow; a bad one is a one-line error naming ``flag``."""
    sizes: list[int] = []
    for item in text.split(","):
        count, times, tp = item.strip().lower().rpartition("x")
        if not tp.isdigit() or (times and not count.isdigit()):
            raise cli.CliError(f"{flag} {text!r}: {item.strip()!r} is not a TP size (expected sizes like 8,4,2,1 "
                               "or COUNTxTP items like 2x8,4x2)")
        n = int(count) if times else 1
        if int(tp) < 1 or n < 1:
            raise cli.CliError(f"{flag} {text!r}: {item.strip()!r}: a TP size and a count must be at least 1")
        try:
            check_tp(geometry, int(tp), len(profile.gpus))
        except ValueError as exc:
            raise cli.CliError(f"{flag} {text!r}: TP {tp}: {exc}") from None
        sizes += [int(tp)] * n
    return tuple(sizes)


def resolve_profile(text: str, base: HardwareProfile | None = None, flag: str = "--hardware") -> HardwareProfile:
    """``name``, ``file.toml``, ``name+cx8`` or (with a base) ``+cx8``."""
    name, plus, upgrades = text.partition("+")
    if not name:
        if base is None:
            raise ValueError(f"{flag} {text!r}: upgrades alone need a base profile (try NAME{text})")
        return apply_upgrades(base, text)
    profile = load_profile(name)
    return apply_upgrades(profile, plus + upgrades) if plus else profile


def run(args: argparse.Namespace) -> int:
    geometry = load_geometry(args.model, args.dtype)
    profile = resolve_profile(args.hardware)
    if args.context <= 0:
        raise cli.CliError(f"--context must be a positive number of tokens, got {args.context}")
    if args.cached is not None and not 0 <= args.cached <= args.context:
        raise cli.CliError(f"--cached must be between 0 and --context ({args.context:,}) tokens, got {args.cached}")
    checked_gpus(geometry, profile, args.gpus, "--gpus")
    fleet = None
    if args.fleet_tp is not None:
        sizes = parse_fleet_tp(args.fleet_tp, geometry, profile)
        fleet = fleet_sharing(geometry, sizes, args.context, pool_capacity_bytes(profile))
    plan = make_plan(geometry, profile, args.context, args.cached, args.gpus)
    other = None
    if args.vs:
        other_profile = resolve_profile(args.vs, profile, "--vs")
        # Same GPU count where the other profile has that many; else its own default.
        other_gpus = args.gpus if args.gpus is not None else (plan.tp if plan.tp <= len(other_profile.gpus) else None)
        checked_gpus(geometry, other_profile, other_gpus, f"--vs {args.vs} with --gpus")
        other = make_plan(geometry, other_profile, args.context, args.cached, other_gpus)
    if args.json:
        doc = plan.to_json()
        if other:
            doc["vs"] = other.to_json() | {"ratios": ratios(plan, other)}
        if fleet:
            doc["fleet"] = fleet.to_json()
        print(json.dumps(doc, indent=2, allow_nan=False))
    else:
        render_all(cli.console(), plan, other)
        if fleet:
            render_fleet(cli.console(), fleet)
    if args.plot or args.html:
        _pictures(args, geometry, plan, other)
    return 0


def render_all(console: Console | HtmlPage, plan: Plan, other: Plan | None) -> None:
    """The plan's tables, then the other profile's and the speed-ups when there is one."""
    render(console, plan)
    if other:
        render(console, other)
        render_ratios(console, plan, other)


def _pictures(args: argparse.Namespace, geometry, plan: Plan, other: Plan | None) -> None:
    """``--plot`` and ``--html``: the restore-time figure, and the page of tables and figure."""
    from kvstrata.page import HtmlPage
    from kvstrata.plots import png_bytes, save_png
    from kvstrata.plots.restore import restore_figure

    profiles = [plan.profile] + ([other.profile] if other else [])
    fig = restore_figure(geometry, profiles, plan.tp, max(args.context, 1024))
    png = png_bytes(fig)
    if args.plot:
        cli.wrote("plot", save_png(png, args.plot), args.json)
    if args.html:
        hardware = " vs ".join(p.name for p in profiles)
        page = HtmlPage(f"kvstrata plan: {geometry.name} on {hardware}, {plan.context_tokens:,}-token context")
        render_all(page, plan, other)
        page.image(png, fig.axes[0].get_title().replace("\n", " "))
        cli.wrote("report", page.write(args.html), args.json)


def checked_gpus(geometry: KVGeometry, profile: HardwareProfile, gpus: int | None, flag: str) -> None:
    """Refuse, naming ``flag``, a GPU count the node or the model's KV heads do not allow."""
    if gpus is None:
        return
    try:
        check_tp(geometry, gpus, len(profile.gpus))
    except ValueError as exc:
        raise cli.CliError(f"{flag} {gpus}: {exc}") from None


def sizing_text(s: InstanceSizing) -> str:
    """Why an instance has its GPUs, in one sentence."""
    k, gb = s.gpus_per_instance, 1e9
    share = (
        f"{s.model}'s {s.weight_bytes / gb:,.1f} GB of {s.weight_dtype} weights take {s.weight_bytes_per_gpu / gb:,.1f} GB "
        f"of each {s.gpu_model}'s {s.usable_hbm_bytes_per_gpu / gb:,.1f} GB usable HBM, "
        f"leaving {max(s.kv_room_bytes_per_gpu, 0) / gb:,.1f} GB for KV"
    )
    if s.uncounted:
        share += f" (a lower bound: assumed none in {', '.join(s.uncounted)}, which the config gives no fields to count)"
    if s.basis is Basis.REQUESTED:
        return f"{k} GPU(s) per instance, as asked: {share}"
    if s.basis is Basis.KV_MARGIN:
        return f"{k} GPU(s) per instance, the fewest leaving at least {KV_MARGIN_FRACTION:.0%} of usable HBM for KV: {share}"
    if s.basis is Basis.WEIGHTS_ONLY:
        return (
            f"{k} GPU(s) per instance, the fewest that hold the weights (none of the node's groups leaves "
            f"{KV_MARGIN_FRACTION:.0%} for KV): {share}"
        )
    return f"{k} GPU(s) per instance, the most the node offers"


def weights_misfit(s: InstanceSizing) -> str | None:
    """The one line saying the weights do not fit, or None when they do."""
    try:
        s.check_fits()
    except WeightsDoNotFit as exc:
        return str(exc)
    return None


def _s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:,.2f} ms" if seconds < 1 else f"{seconds:,.2f} s"


def _ms(seconds: float | None) -> str:
    """Milliseconds to four figures or so, at most six characters below 100 s (table cells)."""
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    return f"{ms:,.2f}" if ms < 100 else f"{ms:,.1f}" if ms < 1000 else f"{ms:,.0f}"


def _n(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def side_by_side(r: RestoreEstimate) -> str | None:
    """For a restore whose slowest stage runs over several links like its bottleneck (one per
    GPU's NIC, say), a line saying so, and that its GB/s is their sum; else None."""
    if not r.available or r.bottlenecks <= 1:
        return None
    stage = max(r.stages, key=lambda s: s.seconds)
    n = r.bottlenecks
    which = "its slowest stage, " if len(r.stages) > 1 else ""
    return f"{r.path.short}: {which}{stage.gbps:,.1f} GB/s over {n} links like {r.bottleneck}, ~{stage.gbps / n:,.1f} each"


def render(console: Console, plan: Plan) -> None:
    g = plan.geometry
    held = f" ({g.kv_bytes(plan.context_tokens) / 1e9:,.2f} GB held at this context)" if g.hybrid else ""
    console.print(
        f"[bold]{g.name}[/] ({g.attention.name}, {g.dtype.name.lower()}) on [bold]{plan.profile.name}[/]: "
        f"{plan.context_tokens:,}-token context, {plan.cached_tokens:,} cached, {plan.tp} GPU(s) "
        f"({', '.join(plan.gpus)}); {g.bytes_per_token:,} KV bytes/token{held}, "
        f"{g.bytes_per_token_per_gpu(plan.tp):,} per GPU; restore {plan.restore_bytes / 1e9:,.2f} GB"
    )
    misfit = weights_misfit(plan.sizing)
    if misfit:
        console.print(
            f"[bold yellow]note:[/] {misfit}. Every architecture's capacity is 0 here; the restore times "
            "still hold",
            highlight=False,
        )
    else:
        console.print(f"[dim]{sizing_text(plan.sizing)}[/]", highlight=False)
    t = Table(title="KV restore per path, one way (decimal GB/s of all the GPUs' shards)")
    # Within 80 columns: times in ms in the headers, every cell on one line but the bottleneck's
    # (it wraps between words: a link's name, then its ends).
    for col in ("path", "time\nms", "GB/s", "bottleneck", "stages\nms @ GB/s"):
        t.add_column(col, justify="right" if col in ("time\nms", "GB/s") else "left", no_wrap=col != "bottleneck")
    for r in plan.restore:
        if not r.available:
            t.add_row(r.path.short, "-", "-", f"[dim]n/a: {r.unavailable}[/]", "")
            continue
        stages = "\n".join(f"{_ms(s.seconds)} @ {s.gbps:,.1f}" for s in r.stages) if len(r.stages) > 1 else ""
        mark = "*" if side_by_side(r) else ""
        t.add_row(r.path.short, _ms(r.seconds), f"{r.gbps:,.1f}{mark}", r.bottleneck, stages)
    console.print(t)
    for r in plan.restore:
        if note := side_by_side(r):
            console.print(f"[dim]* {note}[/]", highlight=False)
    if g.hybrid:
        render_groups(console, plan)
    render_architectures(console, plan)


def render_architectures(console: Console | HtmlPage, plan: Plan) -> None:
    """The seven architectures, one short line each within 80 columns: times in ms in the
    headers, why one is not available under the table (a cell would cut it)."""
    a = Table(title="The seven architectures: capacity, first wait, decode step (one request)")
    for col in ("architecture", "capacity\ntokens", "requests", "first\nwait ms", "step\nms", "ext.\nGB/GPU",
                "bound\nby"):
        a.add_column(col, justify="left" if col in ("architecture", "bound\nby") else "right", no_wrap=True)
    for e in plan.architectures:
        if e.unavailable and e.capacity_tokens is None:
            a.add_row(e.arch.value, "-", "-", "-", "-", "-", "[dim]n/a[/]")
            continue
        ext = f"{e.per_step_external_bytes / 1e9:,.2f}" if e.per_step_external_bytes else "0"
        bound = e.bound_by.removesuffix(" (external)")  # the step's external bytes over PCIe
        a.add_row(e.arch.value, _n(e.capacity_tokens), _n(e.concurrent_requests), _ms(e.first_wait_s), _ms(e.per_step_s),
                  ext, bound + ("*" if e.unavailable else ""))
    console.print(a)
    for e in plan.architectures:
        if e.unavailable:
            mark = "n/a" if e.capacity_tokens is None else "*"
            console.print(f"[dim]{mark} {e.arch.value}: {e.unavailable}[/]", highlight=False)
    console.print(
        "[dim]" + "; ".join(f"{e.arch.value}: {e.arch.title}" for e in plan.architectures) + "[/]", highlight=False
    )


def render_fleet(console: Console | HtmlPage, fleet: FleetSharing) -> None:
    """Per TP size, one prefix's pool bytes TP-matched vs head-sliced; then a prefix every size has
    seen: its copies and how many such prefixes the pool holds in each mode."""
    gb = 1e9
    t = Table(title=f"A {fleet.context_tokens:,}-token prefix in the shared pool, per TP size of the fleet")
    for col in ("TP", "instances", "TP-matched", "head-sliced", "copies matched"):
        t.add_column(col, justify="right")
    for size in fleet.sizes:
        t.add_row(str(size.tp), str(size.instances), f"{size.matched_bytes / gb:,.3f} GB",
                  f"{size.sliced_bytes / gb:,.3f} GB", f"{size.replication:.3g}")
    console.print(t)
    held = {m: fleet.prefixes(m) for m in KVSharing}
    if fleet.pool_capacity_bytes is None:
        where = "the hardware has no pool"
    else:
        where = (f"the pool's {fleet.pool_capacity_bytes / gb:,.0f} GB holds {_n(held[KVSharing.MATCHED])} "
                 f"TP-matched, {_n(held[KVSharing.SLICED])} head-sliced")
    console.print(
        f"a prefix every TP size has seen: {fleet.matched_copies:.3g} copies ({fleet.matched_bytes / gb:,.3f} GB) "
        f"TP-matched, 1 ({fleet.sliced_bytes / gb:,.3f} GB) head-sliced; {where}",
        highlight=False,
    )


def render_groups(console: Console | HtmlPage, plan: Plan) -> None:
    """What each KV group adds to the restore: every cached token of full layers, the window
    before the prefix end of windowed ones, one snapshot of a recurrent state."""
    t = Table(title="The restore by KV group (all the GPUs' shards)")
    for col in ("group", "layers", "tokens moved", "bytes", "share"):
        t.add_column(col, justify="left" if col == "group" else "right", no_wrap=True)
    total = plan.restore_groups.size_bytes
    for share in plan.restore_groups.shares:
        group = share.group
        name = group.kind.value + (f" {group.span:,} tok" if group.span else "")
        moved = "1 state" if not group.kind.per_token and share.size_bytes else _n(share.tokens)
        part = f"{share.size_bytes / total:.0%}" if total else "-"
        t.add_row(name, str(group.num_layers), moved, f"{share.size_bytes * plan.tp / 1e9:,.3f} GB", part)
    console.print(t)


def render_ratios(console: Console, a: Plan, b: Plan) -> None:
    r = ratios(a, b)
    t = Table(title=f"{b.profile.name} vs {a.profile.name}: speed-up (>1 = faster)")
    t.add_column("path / architecture")
    t.add_column(a.profile.name, justify="right")
    t.add_column(b.profile.name, justify="right")
    t.add_column("speed-up", justify="right")
    for ra, rb in zip(a.restore, b.restore):
        x = r["restore_speedup"][ra.path.value]
        t.add_row(
            ra.path.short,
            f"{_s(ra.seconds)} ({ra.bottleneck})" if ra.available else "-",
            f"{_s(rb.seconds)} ({rb.bottleneck})" if rb.available else "-",
            f"{x:.2f}x" if x else "-",
        )
    console.print(t)
