"""The ``kvstrata`` command line: the edge where strings, files and env vars are parsed.

Each sub-command lives in its own module exposing ``register(subparsers)``; the module sets
``func`` on its parser, which takes the parsed ``argparse.Namespace`` and returns an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from rich.console import Console

# Modules under kvstrata.cli that each register one or more sub-commands, in help order.
_COMMAND_MODULES = ("plan", "demo", "hardware", "kv", "model", "pool", "bench", "trace", "simulate", "calibrate")


def console() -> Console:
    """A console for tables: the terminal's width (or $COLUMNS), else 120 columns when piped."""
    out = Console()
    return out if out.is_terminal or "COLUMNS" in os.environ else Console(width=120)


class CliError(Exception):
    """A user error worth one clear line on stderr and exit code 2, never a traceback."""


class StepBar:
    """A rich progress bar (one task) for ``kvstrata.bench.timing.Progress``: ``start(total)``
    then ``step(label)`` per step; a second ``start`` begins again from zero."""

    def __init__(self, progress) -> None:
        self._progress = progress
        self._task = progress.add_task("starting", total=None)

    def start(self, total_steps: int) -> None:
        self._progress.update(self._task, total=total_steps, completed=0)

    def step(self, label: str) -> None:
        self._progress.update(self._task, advance=1, description=label)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstrata",
        description="Hardware-aware tiered KV cache: plan, inspect hardware, size KV.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _COMMAND_MODULES:
        importlib.import_module(f"kvstrata.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CliError, ValueError, FileNotFoundError) as exc:
        # Configuration and input errors carry a message naming what was wrong.
        Console(stderr=True).print(f"[bold red]error:[/] {exc}", highlight=False)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
