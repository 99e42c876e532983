"""The workload's command-line edge, shared by ``kvstrata demo`` and ``kvstrata bench e2e``:
its options, parsing them (tiers by name), running it under a progress bar with a pool when
the remote tier is asked for, and its table."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvstrata import cli
from kvstrata.media import Medium, route_text
from kvstrata.pool.config import PoolConfig
from kvstrata.workload.report import TierReport, WorkloadReport
from kvstrata.workload.spec import ALONE_REPEATS, TIERS, Workload

if TYPE_CHECKING:  # the runner loads the cache and torch: imported where a workload runs
    from kvstrata.workload.runner import Beside

POOL_SEGMENT_BYTES = 512 << 20  # an embedded pool's, for the workload's few MiB of KV


def default_model_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvstrata" / "tiny-llama"


def add_model_args(p: argparse.ArgumentParser, default: str | None = None) -> None:
    """``--model-dir DIR`` or ``--like MODEL``; ``default``: what neither means (else the tiny model)."""
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model-dir", help="a local Hugging Face model directory (default: "
                                           f"{default or f'the tiny model in {default_model_dir()}'})")
    which.add_argument("--like", metavar="MODEL",
                       help="a random-weight model of this real model's shape: a preset (qwen2.5-0.5b, qwen3-0.6b, "
                            "llama-3.2-1b, qwen2.5-1.5b, ...) or a config.json; made once in "
                            f"{default_model_dir().parent}/MODEL-bfloat16 (kvstrata model make)")


def add_workload_args(p: argparse.ArgumentParser, conversations: int, turns: int) -> None:
    add_model_args(p)
    p.add_argument("--conversations", type=int, default=conversations, help=f"conversations (default: {conversations})")
    p.add_argument("--turns", type=int, default=turns, help=f"turns per conversation (default: {turns})")
    p.add_argument("--block-tokens", type=int, default=256, help="tokens per cached block (default: 256)")
    p.add_argument("--tiers", default=",".join(t.label for t in TIERS), help="tiers, comma separated (default: all four)")
    cli.add_pool_arg(p, "an embedded pool")
    p.add_argument("--no-pool", action="store_true", help="skip the remote tier")
    p.add_argument("--profile", metavar="FILE", help="predict restores with this `kvstrata calibrate` profile "
                   "(default: a quick calibration first)")
    cli.add_json_arg(p)


def parse_tiers(text: str) -> tuple[Medium, ...]:
    """``"host,disk"`` -> ``(HOST, DISK)``."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    by_label = {t.label: t for t in TIERS}
    unknown = [n for n in names if n not in by_label]
    if unknown or not names:
        raise cli.CliError(f"--tiers: unknown tier(s) {', '.join(unknown) or '(none given)'}; "
                           f"expected {', '.join(by_label)}")
    return tuple(by_label[n] for n in names)


def model_dir_of(args: argparse.Namespace) -> Path:
    """The model of ``args``: ``--model-dir``, ``--like``'s shaped model, or the tiny one (the last
    two built on first use)."""
    if args.model_dir:
        return cli.model_dir(args.model_dir)
    if getattr(args, "like", None):
        return shaped_model_dir(args.like)
    from kvstrata.integrations.tiny import make_tiny

    return make_tiny(default_model_dir())


def shaped_model_dir(like: str, dtype: str = "bfloat16") -> Path:
    """The random-weight model shaped as ``like`` (a preset or a config.json), made on first use
    beside the tiny model; a bad name is one line."""
    from rich.console import Console

    from kvstrata.integrations.shaped import ShapedSpec, make_shaped
    from kvstrata.kv.geometry import GeometryError
    from kvstrata.kv.presets import load_source

    try:
        name = load_source(like)[0]
        directory = default_model_dir().parent / f"{name}-{dtype}"
        if not directory.exists():
            Console(stderr=True).print(f"[dim]making the {name}-shaped model in {directory} (once)[/]")
        return make_shaped(directory, ShapedSpec(like, dtype)).directory
    except (FileExistsError, FileNotFoundError, GeometryError, ValueError) as e:
        raise cli.CliError(f"--like {like}: {e}") from None


@contextmanager
def _pool_context(args: argparse.Namespace, tiers: tuple[Medium, ...]) -> Iterator[tuple[PoolConfig | None, str | None]]:
    """Yields (the pool, None), or (None, why there is none); an embedded pool stops on exit."""
    if Medium.REMOTE not in tiers or args.no_pool:
        yield None, "--no-pool"
        return
    configured = cli.pool_config(args.pool)
    from kvstrata.pool import libs

    cannot = libs.problem() if configured is None else None  # not installed, or a system library missing
    if cannot:
        yield None, cannot
        return
    from kvstrata.pool.embedded import PoolError
    from kvstrata.pool.scoped import scoped_pool

    with ExitStack() as stack:
        try:
            pool, why = stack.enter_context(scoped_pool(configured, POOL_SEGMENT_BYTES)).config, None
        except (PoolError, OSError, ImportError, RuntimeError) as exc:
            pool, why = None, f"pool did not start: {' '.join(str(exc).split()) or type(exc).__name__}"
        yield pool, why


def workload_of(args: argparse.Namespace) -> Workload:
    return Workload(conversations=args.conversations, turns=args.turns, block_tokens=args.block_tokens)


def run_workload(args: argparse.Namespace, beside: Beside | None = None) -> WorkloadReport:
    """The workload of ``args`` through its tiers, under a progress bar on stderr (``beside``:
    another system's turns, interleaved with ours; see :func:`kvstrata.workload.runner.run_tier`)."""
    from kvstrata.workload.runner import run_e2e

    tiers = parse_tiers(args.tiers)
    workload = workload_of(args)
    model_dir = model_dir_of(args)
    calibration = None
    if args.profile:
        from kvstrata.calibrate import load_calibration

        calibration = load_calibration(args.profile)
    with _pool_context(args, tiers) as (pool, why), cli.progress(24) as bar:
        tasks = {t: bar.add_task(f"tier {t.label}", total=workload.turns_total) for t in tiers}
        report = run_e2e(model_dir, workload, tiers, pool, lambda t: bar.advance(tasks[t]), calibration, beside)
    remote = report.tiers.get(Medium.REMOTE)
    if remote is not None and remote.skipped and why:  # say why there was no pool
        report = dataclasses.replace(report, tiers={**report.tiers, Medium.REMOTE: dataclasses.replace(remote, skipped=why)})
    return report


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def render_tiers(console: Console, report: WorkloadReport, title: str) -> None:
    """Two tables, each within 80 columns: the restores beside their prediction, then what a
    user sees (TTFT, the tokens, the routes the blocks took). Cells never wrap; long text
    (why a tier was skipped) goes under the tables."""
    console.print(title, highlight=False)  # above, not as the table's title: that wraps to the table's width
    restores = Table()
    for header in ("tier", "hit\nrate", "restored\nMB", "restore\nms", "alone\nms",
                   "predicted\nms", "error\n(alone)", "GB/s"):
        restores.add_column(header, justify="left" if header == "tier" else "right", no_wrap=True)
    answers = Table(title="What a request saw, per tier: TTFT medians over turns", title_justify="left")
    for header in ("tier", "TTFT cold\nms", "TTFT warm\nms", "same\ntokens", "route (blocks)"):
        answers.add_column(header, justify="right" if header.startswith("TTFT") else "left", no_wrap=True)
    for tier, r in report.tiers.items():
        if r.skipped:  # why, under the tables: a cell would cut it
            restores.add_row(tier.label, "-", "[yellow]skipped[/]", "[yellow](see below)[/]", *["-"] * 4)
            answers.add_row(tier.label, "-", "-", "-", "[yellow]skipped[/]")
            continue
        measured = r.restore_alone_s if r.restored_bytes else 0.0
        error = prediction_error(r)
        restores.add_row(
            tier.label,
            f"{r.hit_rate:.0%}",
            f"{r.restored_bytes / 1e6:.1f}",
            ms(r.restore_s),
            ms(measured),
            ms(r.predicted_restore_s),
            "-" if error is None else f"{error:+.0%}",
            f"{r.restore_gbps:.2f}" if r.restored_bytes else "-",
        )
        answers.add_row(
            tier.label,
            ms(r.ttft_cold_s),
            ms(r.ttft_warm_s),
            "[green]yes[/]" if r.tokens_identical else "[red]NO[/]",
            "\n".join(f"{route_text(k)} x{v}" for k, v in r.paths.items()) or "-",
        )
    console.print(restores)
    console.print(f"[dim]{RESTORE_LEGEND}[/]", highlight=False)
    console.print(answers)
    for tier, r in report.tiers.items():
        if r.skipped:
            console.print(f"[yellow]{tier.label} skipped:[/] {escape(r.skipped)}", highlight=False)
    note = error_note(report)
    if note:
        console.print(note, highlight=False)
    for r in report.tiers.values():
        if r.stream_bytes_per_step is not None:
            same = "[green]the same tokens[/]" if r.stream_tokens_identical else "[red]OTHER tokens[/]"
            console.print(
                f"per-step DRAM streaming (KV on the host, each layer fetched just before it runs): "
                f"{r.stream_bytes_per_step / 1e6:.2f} MB crossed host -> device per decode step, {same} as resident"
            )


RESTORE_LEGEND = ("restore ms: the warm runs' loads, while the model computed beside them; alone ms: the "
                  f"same restores with nothing else running (median of {ALONE_REPEATS}), what the prediction describes")
OFF_BY = 0.5  # a prediction further off than this is explained under the table
SMALL_LOAD_MB = 8.0  # below it a load's fixed costs outweigh its bytes (0.5 MB: ~0.1 ms of copying, ~0.4 ms in all)


def prediction_error(r: TierReport) -> float | None:
    """(predicted - measured alone) / measured alone; None where either is missing."""
    measured = r.restore_alone_s if r.restored_bytes else 0.0
    return (r.predicted_restore_s - measured) / measured if r.predicted_restore_s and measured > 0 else None


def error_note(report: WorkloadReport) -> str | None:
    """Why a prediction is far off, said once (None: every one within OFF_BY)."""

    off = [r for r in report.tiers.values() if not r.skipped and abs(prediction_error(r) or 0.0) > OFF_BY]
    if not off:
        return None
    loads = sum(r.loads for r in off)
    mb = sum(r.restored_bytes for r in off) / max(1, loads) / 1e6
    blocks = sum(b for r in off for _, b in r.load_sizes) / max(1, loads)
    busy = ""
    if report.load_average is not None and report.cpus and report.load_average > 0.5 * report.cpus:
        busy = (f"; this host was busy as the run began (load average {report.load_average:.1f} on "
                f"{report.cpus} CPUs), so these timings are noisy: measure on an idle host")
    size = f"Each load here moved {mb:.2f} MB ({blocks:.1f} blocks)"
    if mb <= SMALL_LOAD_MB:
        size += (": at that size fixed per-call costs (handing copies to worker threads, kvstrata's "
                 "dispatch, opening block files), not bandwidth, take most of the time, and they vary "
                 "from run to run with what else shares the CPUs")
    return (
        f"error (alone): predicted vs the same restores run alone (median of {ALONE_REPEATS} after a warm-up); "
        f"{', '.join(r.tier.label for r in off)} off by more than {OFF_BY:.0%}. {size}{busy}."
    )
