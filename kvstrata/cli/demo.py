"""``kvstrata demo``: a real model serving a multi-turn workload through every tier
(:mod:`kvstrata.workload`), measured restore time beside the prediction for this host, and the
planner's view of the same workload on a built-in hardware profile."""

from __future__ import annotations

import argparse

from rich.console import Console

from kvstrata import cli
from kvstrata.cli.plan import render, resolve_profile
from kvstrata.cli.workload import add_workload_args, render_tiers, run_workload
from kvstrata.kv.presets import load_geometry
from kvstrata.plan.planner import make_plan
from kvstrata.report import dumps


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


def run_demo(args: argparse.Namespace) -> int:
    profile = resolve_profile(args.hardware)
    geometry = load_geometry(args.plan_model)
    report = run_workload(args)
    if args.json:
        print(dumps(report))
        return 0 if report.tokens_identical else 1
    out = cli.console()
    workload = report.workload
    render_tiers(
        out,
        report,
        f"kvstrata demo: {report.model_dir.name}, {workload.conversations} conversations x {workload.turns} turns, "
        f"blocks of {workload.block_tokens} tokens; restore time summed over turns; predicted by "
        + (f"the calibrated profile {args.profile}" if args.profile else "a quick calibration of this host, run first"),
    )
    served = [r for r in report.tiers.values() if not r.skipped and r.turns]
    if served:
        r = served[0]
        prompt = max(1, r.prompt_tokens // r.turns)
        hit = r.hit_tokens // r.turns
        out.print(
            f"\nThe planner's view of the same workload (mean prompt {prompt:,} tokens, {hit:,} reused) "
            f"for {geometry.name} on {profile.name}:"
        )
        render(out, make_plan(geometry, profile, prompt, hit))
    bad = [tier.label for tier, r in report.tiers.items() if not r.tokens_identical]
    if bad:
        Console(stderr=True).print(f"[bold red]tokens differ from the cold run on: {', '.join(bad)}[/]")
        return 1
    return 0
