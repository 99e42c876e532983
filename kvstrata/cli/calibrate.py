"""``kvstrata calibrate``: measure this host's paths and write a calibrated hardware profile;
``kvstrata validate``: restore through the tiered cache and compare with the prediction.

Progress goes to stderr; tables (or ``--json``) to stdout. Decimal GB/s (1 GB = 1e9 bytes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

from rich.table import Table

from kvstrata import cli
from kvstrata.calibrate import base_profile_text, load_calibration, profile_text
from kvstrata.pool.config import ENV, PoolConfig

MIB = 1 << 20


def register(subparsers: argparse._SubParsersAction) -> None:
    cal = subparsers.add_parser(
        "calibrate",
        help="measure this host's transfer paths and write a calibrated hardware profile",
        description="Measure effective bandwidth of the paths kvstrata moves KV on (memcpy 1 and N threads, "
        "host <-> device with CUDA, disk reads cold and warm, disk writes with fsync, xxh3, the pool when "
        "configured), fit latency + bytes/bandwidth per path, and write a hardware profile with a "
        "[calibration] table.",
    )
    cal.add_argument("--out", metavar="PROFILE.toml", help="write the calibrated profile here (default: print the table only)")
    _size_args(cal, quick="smaller and fewer sizes, fewer repeats",
               sizes="sizes to measure, MiB (default 4 16 64 256; --quick 4 16 64)", repeats="timed runs per size")
    cal.add_argument("--threads", type=int, default=2, help="the N of the N-thread paths: the cache's workers (default 2)")
    cli.add_pool_arg(cal, "pool paths skipped")
    cal.add_argument("--dir", metavar="DIR", help="scratch files here: the disk the disk tier uses (default: temp)")
    cal.add_argument("--base", default="workstation", help="the hardware profile to calibrate (name or .toml; default workstation)")
    cal.add_argument("--model-dir", metavar="DIR", action="append", default=[],
                     help="also fit this Hugging Face model's prefill rate (for load-or-recompute); repeatable")
    cal.add_argument("--engine", choices=("transformers", "vllm"), default="transformers",
                     help="what runs --model-dir: transformers (its prefill, for load-or-recompute) or vLLM (its prefill "
                          "and decode steps as a client of vllm serve sees them, bound to the CPUs bench serve gives a "
                          "server: the serving simulator's profile; default transformers)")
    cal.add_argument("--dtype", default="float32", help="the model's dtype under --engine vllm (default float32)")
    cal.add_argument("--combine", metavar="PROFILE.toml", nargs="+",
                     help="instead of measuring: combine these profiles written by kvstrata calibrate on this host "
                          "into one (each figure the median of theirs; the stalls pooled), written to --out on "
                          "--base: calibrations taken between the runs a profile is to predict stand for their sitting")
    cli.add_json_arg(cal, "the measurements")
    cal.set_defaults(func=run_calibrate)

    val = subparsers.add_parser(
        "validate",
        help="restore through the tiered cache and compare with the calibrated prediction",
        description="Restore KV of a real model layout from every tier (host, disk warm and cold, the pool "
        "when configured) at several sizes and compare LoadResult.seconds (median) with "
        "HostCalibration.restore_s, calibrated in the same sitting: each round probes the paths the restore "
        "moves bytes on, restores, and restores two tiny blocks (the tier's fixed cost), back to back. "
        "Goal: within 10%% at 64 MiB and more; misses are marked, exit code 0. With --serve: the serving "
        "simulator instead, on bench serve --json reports and a --profile from calibrate --engine vllm.",
    )
    val.add_argument("--profile", metavar="FILE",
                     help="also show the predictions of this profile written by `kvstrata calibrate` (the rows' "
                     "own predictions come from probes interleaved with the restores, in the same sitting)")
    _size_args(val, quick="sizes 16 and 64 MiB, fewer repeats", sizes="KV per restore, MiB (default 16 64 256)",
               repeats="timed rounds per row", default_repeats=9)
    val.add_argument("--workers", type=int, default=2, help="the cache's transfer threads (default 2)")
    val.add_argument("--model", default="llama-3-8b", help="model preset for the KV layout (default llama-3-8b)")
    val.add_argument("--block-tokens", type=int, default=64, help="tokens per block (default 64)")
    cli.add_pool_arg(val, "no remote row")
    val.add_argument("--dir", metavar="DIR", help="where the disk tier's files go (default: temp)")
    val.add_argument("--serve", metavar="BENCH.json", nargs="+",
                     help="instead: simulate each bench serve --json report's run on --profile (a profile from "
                          "kvstrata calibrate --model-dir DIR --engine vllm) and put the simulation beside what was "
                          "measured, per configuration: TTFT/TPOT percentiles, throughput, hit rates per tier")
    val.add_argument("--plot", metavar="PATH", help="with --serve: write measured and simulated CDFs (PNG) here")
    cli.add_json_arg(val, "the rows")
    val.set_defaults(func=run_validate)


def _size_args(p: argparse.ArgumentParser, quick: str, sizes: str, repeats: str, default_repeats: int = 5) -> None:
    """``--quick``, ``--sizes-mib`` and ``--repeats`` (``default_repeats``, 3 with ``--quick``)."""
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--sizes-mib", type=float, nargs="+", help=sizes)
    p.add_argument("--repeats", type=int, help=f"{repeats} after a warm-up (default {default_repeats}; --quick 3)")


def _pool(arg: str | None) -> tuple[PoolConfig | None, str]:
    """The pool and where it came from, for the report."""
    pool = cli.pool_config(arg)
    if arg:
        return pool, f"--pool {arg}"
    return pool, (f"${ENV}" if pool is not None else f"no pool: --pool FILE nor ${ENV} given")


def _sizes(values: list[float] | None, default: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(v * MIB) for v in values) if values else default


def _calibrate(quick: bool, threads: int, directory: str | None, pool: PoolConfig | None,
               sizes_mib: list[float] | None = None, repeats: int | None = None):
    from kvstrata.calibrate.measure import DEFAULT_SIZES, QUICK_SIZES, CalibrateConfig, calibrate

    config = CalibrateConfig(
        sizes=_sizes(sizes_mib, QUICK_SIZES if quick else DEFAULT_SIZES),
        repeats=repeats or (3 if quick else 5),
        threads=threads,
        directory=directory,
        pool=pool,
    )
    with cli.progress() as progress:
        return calibrate(config, cli.StepBar(progress))


def _with_prefill(calibration, model_dirs: list[str]):
    """The calibration plus each model's prefill fit, keyed by the model directory's name (the
    model id a cache of that model is configured with, e.g. by ``kvstrata demo``)."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from kvstrata.integrations.recompute import measure_prefill

    prefill = dict(calibration.prefill)
    for model_dir in model_dirs:
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        prefill[Path(model_dir).resolve().name] = measure_prefill(model)
    return dataclasses.replace(calibration, prefill=prefill)


def run_calibrate(args: argparse.Namespace) -> int:
    base = base_profile_text(args.base)  # a bad --base fails before minutes of measuring
    if args.combine:
        return _combine(args, base)
    pool, pool_source = _pool(args.pool)
    for model_dir in args.model_dir:
        cli.model_dir(model_dir)  # a bad one fails before minutes of measuring
    run = _calibrate(args.quick, args.threads, args.dir, pool, args.sizes_mib, args.repeats)
    if args.model_dir and args.engine == "vllm":
        from kvstrata.cli.calibrate_steps import with_vllm_steps  # measured through bench serve's servers and client

        run.calibration = with_vllm_steps(run.calibration, args.model_dir, args.dtype, pool)
    elif args.model_dir:
        run.calibration = _with_prefill(run.calibration, args.model_dir)
    if args.out:
        _write(Path(args.out), run.calibration, base)
    if args.json:
        print(json.dumps({
            "host": run.calibration.host, "device": run.calibration.device, "threads": run.calibration.threads,
            "seconds": run.seconds, "pool": pool_source, "skipped": {k.value: why for k, why in run.skipped.items()},
            "measurements": [{"path": m.path.value, "bytes": m.size_bytes, "median_s": m.median_s, "spread": m.spread,
                              "gbps": m.gbps, "runs_s": list(m.runs_s)} for m in run.measurements],
            # a fixed cost's bandwidth is infinite: null (JSON has no infinity)
            "fits": {k.value: {"latency_s": p.latency_s, "gbps": p.gbps if math.isfinite(p.gbps) else None, "spread": p.spread}
                     for k, p in run.calibration.paths.items()},  # keyed by the profile's stable keys
            "efficiency": run.calibration.efficiency, "out": args.out,
            **_model_fits(run.calibration),
        }, indent=2))
        return 0
    console = cli.console()
    table = Table(title=f"{run.calibration.host}: measured paths ({run.calibration.device}, N = {run.calibration.threads})")
    for col in ("path", "size", "median", "GB/s", "spread"):
        table.add_column(col, justify="left" if col == "path" else "right")
    for m in run.measurements:
        table.add_row(m.path.label, f"{m.size_bytes / MIB:g} MiB", _ms(m.median_s), f"{m.gbps:.2f}", f"±{m.spread:.0%}")
    console.print(table)
    fits = Table(title="fits: seconds = latency + bytes / bandwidth")
    for col in ("path", "latency", "GB/s", "worst spread"):
        fits.add_column(col, justify="left" if col == "path" else "right")
    for name, p in run.calibration.paths.items():
        fits.add_row(name.label, f"{p.latency_s * 1e6:.0f} us", f"{p.gbps:.2f}", f"±{p.spread:.0%}")
    console.print(fits)
    for name, why in run.skipped.items():
        console.print(f"skipped {name}: {why}", highlight=False)
    _print_fits(console, run.calibration)
    for k, v in run.calibration.efficiency.items():
        console.print(f"efficiency.{k} = {v:.3f} (measured)", highlight=False)
    where = f"wrote {args.out} (base {args.base})" if args.out else "no --out: profile not written"
    console.print(f"{where}; {run.seconds:.1f} s", highlight=False)
    return 0


def _combine(args: argparse.Namespace, base: str) -> int:
    from kvstrata.plan.sittings import combine

    if not args.out:
        raise cli.CliError("--combine writes a profile: give --out PROFILE.toml")
    calibrations = [load_calibration(p) for p in args.combine]  # a bad one: its error, one line
    combined = combine(calibrations)
    _write(Path(args.out), combined, base)
    if args.json:
        print(json.dumps({"combined": args.combine, "out": args.out, **_model_fits(combined)}, indent=2))
        return 0
    console = cli.console()
    _print_fits(console, combined)
    console.print(f"wrote {args.out} (base {args.base}): the median of {len(calibrations)} calibrations", highlight=False)
    return 0


def _write(out: Path, calibration, base: str) -> None:
    """The calibrated profile to ``out``, loaded back: the planner must load it, so fail here,
    not at ``kvstrata plan``."""
    from kvstrata.hardware.profile import load_profile

    out.write_text(profile_text(calibration, base))
    load_profile(out)


def _model_fits(calibration) -> dict:
    """A calibration's per-model fits, for ``--json``."""
    return {name: {m: dataclasses.asdict(f) for m, f in getattr(calibration, name).items()}
            for name in ("prefill", "decode", "connector", "stalls")}


def _print_fits(console, calibration) -> None:
    """A calibration's model fits, one line each."""
    for model, f in calibration.prefill.items():
        console.print(f"prefill {model}: {f.latency_s * 1e3:.2f} ms + tokens / {f.tokens_per_s:,.0f} per s "
                      f"+ {f.attn_s:.3g} s x tokens x context", highlight=False)
    for model, d in calibration.decode.items():
        console.print(f"decode step {model}: {d.latency_s * 1e3:.2f} ms + {d.per_request_s * 1e6:.0f} us x requests "
                      f"+ {d.per_token_s * 1e9:.0f} ns x tokens held; {d.together:.2f}x beside another server "
                      f"stepping, {d.beside_spin:.2f}x beside its worker spinning, which it does "
                      f"{d.spin_s * 1e3:.0f} ms after its last step", highlight=False)
    for model, k in calibration.connector.items():
        console.print(f"connector {model}: {k.request_s * 1e3:.1f} ms per request, {k.load_s * 1e3:.1f} ms per load "
                      f"beyond its restore, {k.remote_load_s * 1e3:.1f} ms more from the pool as served", highlight=False)
    for model, st in calibration.stalls.items():
        console.print(f"stalls {model}: {st.alone:.0%} of requests alone ({_stall_sizes(st.alone_s)}), {st.beside:.0%} "
                      f"beside another server ({_stall_sizes(st.beside_s)})", highlight=False)


def _stall_sizes(sizes: tuple[float, ...]) -> str:
    return f"{min(sizes) * 1e3:.0f}-{max(sizes) * 1e3:.0f} ms late" if sizes else "none late"


def run_validate(args: argparse.Namespace) -> int:
    if args.serve:
        from kvstrata.cli.validate_serve import run_validate_serve

        return run_validate_serve(args)
    if args.plot:
        raise cli.CliError("--plot goes with --serve")
    from kvstrata.calibrate.validate import DEFAULT_SIZES, GOAL, GOAL_MIN_BYTES, QUICK_SIZES, ValidateConfig, validate

    pool, pool_source = _pool(args.pool)
    started = time.perf_counter()
    profile = load_calibration(args.profile) if args.profile else None
    config = ValidateConfig(
        sizes=_sizes(args.sizes_mib, QUICK_SIZES if args.quick else DEFAULT_SIZES),
        repeats=args.repeats or (3 if args.quick else ValidateConfig.repeats),
        workers=args.workers,
        model=args.model,
        block_tokens=args.block_tokens,
        directory=args.dir,
        pool=pool,
    )
    with cli.progress() as progress:
        run = validate(config, cli.StepBar(progress), profile)
    seconds = time.perf_counter() - started
    rows = run.rows
    if args.json:
        print(json.dumps({"profile": args.profile, "pool": pool_source, "goal": GOAL, "goal_min_bytes": GOAL_MIN_BYTES,
                          "workers": config.workers, "repeats": config.repeats, "seconds": seconds,
                          "within_goal": run.within_goal,
                          "fits": {k.value: {"latency_s": p.latency_s, "gbps": p.gbps if math.isfinite(p.gbps) else None,
                                       "spread": p.spread} for k, p in run.calibration.paths.items()},
                          "paths": [r.to_json() for r in rows]}, indent=2))
        return 0
    console = cli.console()
    table = Table(title=f"restore: predicted (calibrated in this sitting, interleaved) vs measured, "
                        f"{config.workers} workers, {config.model}, {config.repeats} rounds")
    cols = ["path", "size", "blocks", "predicted", "measured", "spread", "error", "paired error", f"within {GOAL:.0%}"]
    if profile is not None:
        cols.insert(-1, "profile error")
    for col in cols:
        table.add_column(col, justify="left" if col == "path" else "right")
    for r in rows:
        verdict = {True: "[green]yes[/]", False: "[bold red]MISS[/]", None: "[dim]n/a[/]"}[r.meets_goal]
        cells = [r.path, f"{r.bytes / MIB:g} MiB", str(r.blocks), _ms(r.predicted_s), _ms(r.measured_s),
                 f"±{r.spread:.0%}", f"{r.error:+.1%}", f"{r.paired_error:+.1%} ±{r.paired_spread:.0%}", verdict]
        if profile is not None:
            cells.insert(-1, "n/a" if r.profile_error is None else f"{r.profile_error:+.1%}")
        table.add_row(*cells)
    console.print(table)
    fits = Table(title="this sitting's fits: restore = tier's fixed cost + bytes / each path's GB/s")
    for col in ("path", "latency", "GB/s", "worst spread"):
        fits.add_column(col, justify="left" if col == "path" else "right")
    for name, p in run.calibration.paths.items():
        fits.add_row(name.label, f"{p.latency_s * 1e6:.0f} us", f"{p.gbps:.2f}" if math.isfinite(p.gbps) else "-",
                     f"±{p.spread:.0%}")
    console.print(fits)
    graded = run.graded
    console.print(f"{sum(1 for r in graded if r.meets_goal)} of {len(graded)} rows of >= {GOAL_MIN_BYTES / MIB:g} MiB "
                  f"within {GOAL:.0%}; pool: {pool_source}; {seconds:.1f} s", highlight=False)
    return 0


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"
