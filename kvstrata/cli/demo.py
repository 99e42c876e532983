"""``kvstrata demo`` and ``kvstrata bench e2e``: a real model serving a multi-turn workload
through every tier, measured restore time beside the prediction for this host, and the
planner's view of the same workload on a built-in hardware profile."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvstrata import cli
from kvstrata.cli.plan import render, resolve_profile
from kvstrata.kv.presets import load_geometry
from kvstrata.media import route_text
from kvstrata.plan.planner import make_plan
from kvstrata.pool.config import PoolConfig


def default_model_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvstrata" / "tiny-llama"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="a tiny model serving a multi-turn workload through every tier, measured vs predicted",
        description="Make the tiny model if absent, start an embedded pool (if the pool engine is "
        "installed and none is configured), run a multi-turn workload through the device, host, disk "
        "and remote tiers, and print per tier the hit rate, measured restore time and the prediction "
        "for this host; then the planner's view of the same workload on a built-in profile.",
    )
    add_workload_args(p, conversations=4, turns=3)
    p.add_argument("--hardware", default="h200-cx7-gen5", help="profile for the planner's view (default: h200-cx7-gen5)")
    p.add_argument("--plan-model", default="llama-3-70b", help="model preset for the planner's view (default: llama-3-70b)")
    p.set_defaults(func=run_demo)


def add_workload_args(p: argparse.ArgumentParser, conversations: int, turns: int) -> None:
    p.add_argument("--model-dir", help=f"a local Hugging Face model directory (default: the tiny model in {default_model_dir()})")
    p.add_argument("--conversations", type=int, default=conversations, help=f"conversations (default: {conversations})")
    p.add_argument("--turns", type=int, default=turns, help=f"turns per conversation (default: {turns})")
    p.add_argument("--block-tokens", type=int, default=256, help="tokens per cached block (default: 256)")
    p.add_argument("--tiers", default="device,host,disk,remote", help="tiers, comma separated (default: all four)")
    cli.add_pool_arg(p, "an embedded pool")
    p.add_argument("--no-pool", action="store_true", help="skip the remote tier")
    p.add_argument("--profile", metavar="FILE", help="predict restores with this `kvstrata calibrate` profile "
                   "(default: a quick calibration first)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _workload(args: argparse.Namespace):
    from kvstrata.bench.e2e import TIERS, Workload

    tiers = tuple(t.strip() for t in args.tiers.split(",") if t.strip())
    unknown = [t for t in tiers if t not in TIERS]
    if unknown or not tiers:
        raise cli.CliError(f"--tiers: unknown tier(s) {', '.join(unknown) or '(none given)'}; expected {', '.join(TIERS)}")
    return Workload(conversations=args.conversations, turns=args.turns, block_tokens=args.block_tokens), tiers


def _model_dir(args: argparse.Namespace) -> Path:
    if args.model_dir:
        return cli.model_dir(args.model_dir)
    from kvstrata.integrations.tiny import make_tiny

    return make_tiny(default_model_dir())


@contextmanager
def _pool_context(args: argparse.Namespace, tiers: tuple[str, ...]) -> Iterator[tuple[PoolConfig | None, str | None]]:
    """Yields (the pool, None), or (None, why there is none); an embedded pool stops on exit."""
    if "remote" not in tiers or args.no_pool:
        yield None, "--no-pool"
        return
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # before Mooncake's library loads
    configured = cli.pool_config(args.pool)
    if configured is None and importlib.util.find_spec("mooncake") is None:
        yield None, "pool engine not installed (pip install 'kvstrata[remote]')"
        return
    from kvstrata.bench.remote import bench_pool
    from kvstrata.pool.embedded import PoolError

    with ExitStack() as stack:
        try:
            pool, _about = stack.enter_context(bench_pool(configured, 512 << 20))
            why = None
        except (PoolError, OSError, ImportError, RuntimeError) as exc:  # e.g. Debian's libibverbs1 missing
            pool, why = None, f"pool did not start: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        yield pool, why


def run_workload(args: argparse.Namespace) -> tuple[Any, list, Path]:
    from kvstrata.bench.e2e import run_e2e

    workload, tiers = _workload(args)
    model_dir = _model_dir(args)
    with _pool_context(args, tiers) as (pool, why), cli.progress(24) as bar:
        tasks = {t: bar.add_task(f"tier {t}", total=workload.conversations * workload.turns) for t in tiers}
        reports = run_e2e(model_dir, workload, tiers, pool, lambda t: bar.advance(tasks[t]), _calibration(args))
    for r in reports:
        if r.tier == "remote" and r.skipped and why:
            r.skipped = why
    return workload, reports, model_dir


def _calibration(args: argparse.Namespace):
    if not args.profile:
        return None
    from kvstrata.calibrate import load_calibration

    return load_calibration(args.profile)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def render_tiers(console: Console, reports: list, title: str) -> None:
    t = Table(title=title, title_justify="left")
    columns = ["tier", "hit rate", "restored MB", "restore ms: in prefill / alone", "predicted ms", "error (alone)"]
    for col in columns + ["GB/s", "TTFT cold / warm ms", "same tokens", "route"]:
        t.add_column(col)
    for r in reports:
        if r.skipped:
            t.add_row(r.tier, f"[yellow]skipped: {r.skipped}[/]", *[""] * (len(columns) + 2))
            continue
        j = r.to_json()
        measured = r.restore_alone_s if r.restored_bytes else 0.0

        def error(predicted: float | None) -> str:
            return f"{(predicted - measured) / measured:+.0%}" if predicted and measured > 0 else "-"

        t.add_row(
            r.tier,
            f"{r.hit_rate:.0%}",
            f"{r.restored_bytes / 1e6:.1f}",
            f"{_ms(r.restore_s)} / {_ms(measured)}",
            _ms(r.predicted_restore_s),
            error(r.predicted_restore_s),
            f"{r.restore_gbps:.2f}" if r.restored_bytes else "-",
            f"{_ms(j['ttft_cold_s'])} / {_ms(j['ttft_warm_s'])}",
            "[green]yes[/]" if r.tokens_identical else "[red]NO[/]",
            ", ".join(f"{route_text(k)} x{v}" for k, v in r.paths.items()) or "-",
        )
    console.print(t)
    for r in reports:
        if r.stream_bytes_per_step is not None:
            same = "[green]the same tokens[/]" if r.stream_tokens_identical else "[red]OTHER tokens[/]"
            console.print(
                f"per-step DRAM streaming (KV on the host, each layer fetched just before it runs): "
                f"{r.stream_bytes_per_step / 1e6:.2f} MB crossed host -> device per decode step, {same} as resident"
            )


def run_demo(args: argparse.Namespace) -> int:
    profile = resolve_profile(args.hardware)
    geometry = load_geometry(args.plan_model)
    workload, reports, model_dir = run_workload(args)
    out = cli.console()
    if args.json:
        print(json.dumps({"model_dir": str(model_dir), "tiers": {r.tier: r.to_json() for r in reports}}, indent=2))
        return 0 if all(r.tokens_identical for r in reports) else 1
    render_tiers(
        out,
        reports,
        f"kvstrata demo: {model_dir.name}, {workload.conversations} conversations x {workload.turns} turns, "
        f"blocks of {workload.block_tokens} tokens; restore time summed over turns; predicted by "
        + (f"the calibrated profile {args.profile}" if args.profile else "a quick calibration of this host, run first"),
    )
    served = [r for r in reports if not r.skipped and r.turns]
    if served:
        r = served[0]
        prompt = max(1, r.prompt_tokens // r.turns)
        hit = r.hit_tokens // r.turns
        out.print(
            f"\nThe planner's view of the same workload (mean prompt {prompt:,} tokens, {hit:,} reused) "
            f"for {geometry.name} on {profile.name}:"
        )
        render(out, make_plan(geometry, profile, prompt, hit))
    bad = [r.tier for r in reports if not r.tokens_identical]
    if bad:
        Console(stderr=True).print(f"[bold red]tokens differ from the cold run on: {', '.join(bad)}[/]")
        return 1
    return 0


def run_bench_e2e(args: argparse.Namespace) -> int:
    workload, reports, model_dir = run_workload(args)
    lmcache = None
    if not args.no_lmcache:
        lmcache = _lmcache_side(args, model_dir, workload, reports)
    report = {
        "model_dir": str(model_dir),
        "workload": workload.__dict__,
        "tiers": {r.tier: r.to_json() for r in reports},
        "lmcache": lmcache,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        out = cli.console()
        render_tiers(out, reports, f"kvstrata bench e2e: {model_dir.name}, {workload.conversations} x {workload.turns} turns")
        if lmcache and lmcache.get("tiers"):
            t = Table(title="LMCache 0.5.6 on the same prompts (its standalone engine, CPU adapter)", title_justify="left")
            for col in ("tier", "hit rate", "restore GB/s", "TTFT cold / warm ms", "same tokens", "ours GB/s", "ours / LMCache"):
                t.add_column(col)
            for tier, v in lmcache["tiers"].items():
                ours = next((r for r in reports if r.tier == tier), None)
                ours_gbps = ours.restore_gbps if ours else 0.0
                theirs = v.get("restore_gbps") or 0.0
                t.add_row(
                    tier,
                    f"{v.get('hit_rate', 0):.0%}",
                    f"{theirs:.2f}",
                    f"{_ms(v.get('ttft_cold_s'))} / {_ms(v.get('ttft_warm_s'))}",
                    "[green]yes[/]" if v.get("tokens_identical") else "[red]NO[/]",
                    f"{ours_gbps:.2f}",
                    f"{ours_gbps / theirs:.2f}x" if theirs else "-",
                )
            out.print(t)
        elif lmcache:
            out.print(f"LMCache: {lmcache.get('skipped')}")
    return 0 if all(r.tokens_identical for r in reports) else 1


def _lmcache_side(args, model_dir, workload, reports) -> dict | None:
    from kvstrata.bench import lmcache_e2e

    prompts = next((r.prompts for r in reports if getattr(r, "prompts", None)), None)
    if not prompts:
        return {"skipped": "no prompts ran"}
    python = args.lmcache_python or str(Path(__file__).resolve().parents[2] / ".venv-lmcache" / "bin" / "python")
    tiers = [t for t in ("host", "disk") if any(r.tier == t for r in reports)]
    result, reason = lmcache_e2e.run_in_side_venv(
        python, str(model_dir), prompts, tiers, max_new_tokens=workload.answer_tokens, chunk_tokens=workload.block_tokens,
        drop_page_cache=False,  # ours reads just-written files from the page cache too
    )
    return result if result is not None else {"skipped": reason}
