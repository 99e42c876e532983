"""The ``kvstrata`` command line: the edge where strings, files and env vars are parsed.

Each sub-command lives in its own module exposing ``register(subparsers)``; the module sets
``func`` on its parser, which takes the parsed ``argparse.Namespace`` and returns an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from kvstrata.extras import missing_extra
from kvstrata.pool.config import ENV as POOL_ENV
from kvstrata.pool.config import PoolConfig, load_pool_config, pool_from_env
from kvstrata.slo import Slo

# The modules that each register one or more sub-commands, in help order. ``kvstrata bench`` is
# the benchmarks' own module, imported by its name here: the one place the product names its
# benchmarks, which import the product and never the other way (tests/test_architecture.py).
_COMMAND_MODULES = (
    "kvstrata.cli.plan", "kvstrata.cli.demo", "kvstrata.cli.hardware", "kvstrata.cli.kv", "kvstrata.cli.model",
    "kvstrata.cli.pool", "kvstrata.bench.cli", "kvstrata.cli.trace", "kvstrata.cli.simulate", "kvstrata.cli.route",
    "kvstrata.cli.calibrate", "kvstrata.cli.doctor", "kvstrata.cli.lab",
)


def console() -> Console:
    """A console for tables: the terminal's width (or $COLUMNS), else 120 columns when piped."""
    out = Console()
    return out if out.is_terminal or "COLUMNS" in os.environ else Console(width=120)


class CliError(Exception):
    """A user error worth one clear line on stderr and exit code 2, never a traceback."""


class StepBar:
    """A rich progress bar (one task) for ``kvstrata.progress.Progress``: ``start(total)``
    then ``step(label)`` per step; a second ``start`` begins again from zero."""

    def __init__(self, progress) -> None:
        self._progress = progress
        self._task = progress.add_task("starting", total=None)

    def start(self, total_steps: int) -> None:
        self._progress.update(self._task, total=total_steps, completed=0)

    def step(self, label: str) -> None:
        self._progress.update(self._task, advance=1, description=label)


class StepProgress(Progress):
    """A Progress drawn as its steps advance (at most ten times a second), not from a thread of
    its own: the benchmarks time work in this process, and a terminal's redraws (a few ms of
    Python each, holding the interpreter's lock) would be timed with it."""

    MIN_REDRAW_S = 0.1

    def __init__(self, *columns: Any, **kwargs: Any) -> None:
        super().__init__(*columns, auto_refresh=False, **kwargs)
        self._drawn_at = 0.0

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._redraw()

    def update(self, task_id: TaskID, **kwargs: Any) -> None:
        super().update(task_id, **kwargs)
        self._redraw()

    def _redraw(self) -> None:
        now = time.monotonic()
        if now - self._drawn_at >= self.MIN_REDRAW_S:
            self._drawn_at = now
            self.refresh()


def progress(label_width: int | None = None) -> Progress:
    """A transient progress bar on stderr (stdout stays for the table or ``--json``): the step's
    label, padded to ``label_width`` when given, a bar, steps done of all, time elapsed; drawn
    as steps advance (:class:`StepProgress`)."""
    label = "{task.description}" if label_width is None else f"{{task.description:<{label_width}}}"
    return StepProgress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=True)


def add_pool_arg(parser: argparse.ArgumentParser, otherwise: str) -> None:
    """``--pool FILE``; ``otherwise`` says what a command does when neither it nor the env var is given."""
    parser.add_argument("--pool", metavar="FILE",
                        help=f"a pool config (TOML or pool.json); default: ${POOL_ENV}, else {otherwise}")


def add_json_arg(parser: argparse.ArgumentParser, what: str = "the report") -> None:
    """``--json``: print ``what`` as JSON on stdout instead of tables."""
    parser.add_argument("--json", action="store_true", help=f"print {what} as JSON")


def add_html_arg(parser: argparse.ArgumentParser, what: str) -> None:
    """``--html FILE``: also write a one-page HTML report of ``what`` (see :mod:`kvstrata.page`)."""
    parser.add_argument("--html", metavar="FILE.html", default=None,
                        help=f"also write a one-page HTML report ({what}) to FILE.html")


def wrote(what: str, path: str | os.PathLike, json_output: bool = False) -> None:
    """Say that ``what`` was written to ``path``: on stdout, or on stderr when stdout carries JSON."""
    Console(stderr=json_output).print(f"{what} written to [bold]{path}[/]", highlight=False, soft_wrap=True)


def pool_config(path: str | None) -> PoolConfig | None:
    """The pool of ``--pool FILE``, else of ``$KVSTRATA_POOL``, else None."""
    return load_pool_config(path) if path else pool_from_env()


def slo_ms(ttft_ms: float, tpot_ms: float) -> Slo:
    """``--slo-ttft-ms`` and ``--slo-tpot-ms`` as an SLO; a target not > 0 is one line naming both flags."""
    try:
        return Slo(ttft_ms / 1e3, tpot_ms / 1e3)
    except ValueError:
        raise CliError(f"--slo-ttft-ms and --slo-tpot-ms must be > 0, got {ttft_ms:g} and {tpot_ms:g}") from None


def model_dir(path: str) -> Path:
    """``--model-dir``'s directory, which must hold a Hugging Face model (its config.json)."""
    if not (Path(path) / "config.json").is_file():
        raise CliError(f"--model-dir {path}: no config.json there (a Hugging Face model directory is expected)")
    return Path(path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstrata",
        description="Hardware-aware tiered KV cache: plan, inspect hardware, size KV.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from kvstrata.pool.embedded import PoolError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CliError, ValueError, FileNotFoundError) as exc:
        # Configuration and input errors carry a message naming what was wrong: one line, unwrapped.
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    except ModuleNotFoundError as exc:  # an optional package this command needs: the extra to install
        line = missing_extra(exc, f"kvstrata {args.command}")
        if line is None:
            raise
        Console(stderr=True).print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
        return 2
    except PoolError as exc:  # the embedded pool did not start: what its log said, and where it is
        kept = f" (its log: {exc.log})" if exc.log is not None and exc.log.exists() else ""
        Console(stderr=True).print(f"[bold red]error:[/] {escape(f'{exc}{kept}')}", highlight=False, soft_wrap=True)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
