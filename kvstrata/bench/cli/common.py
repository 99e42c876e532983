"""What every ``kvstrata bench`` sub-command shares: the sub-command maker's type, the common
options, a run under a progress bar that ends in JSON or a table, and the table's cells.
Decimal GB/s (1 GB = 1e9 bytes)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from rich.console import Console
from rich.table import Table

from kvstrata import cli
from kvstrata.report import dumps
from kvstrata.timing import VerificationError

if TYPE_CHECKING:
    from kvstrata.bench.goals import Goal
    from kvstrata.rounds import Spread

MIB = 1 << 20
R = TypeVar("R")
# ``kvstrata.bench.cli``'s sub-command maker, as each bench command module's ``register`` gets it:
# (name, run, help, description) -> the sub-command's parser.
BenchParser = Callable[[str, Callable[[argparse.Namespace], int], str, str], argparse.ArgumentParser]


def rounds_args(p: argparse.ArgumentParser, repeats: int, per: str, workers_help: str | None = None) -> None:
    """``--repeats`` (see :mod:`kvstrata.rounds`), and ``--workers`` when it has a help text."""
    p.add_argument("--repeats", type=int, default=repeats,
                   help=f"timed rounds{per} after one warm-up, >= 3 (default: {repeats})")
    if workers_help is not None:
        p.add_argument("--workers", type=int, default=2, help=workers_help)


def dir_arg(p: argparse.ArgumentParser) -> None:
    """``--dir``: where the benchmark's scratch files go."""
    p.add_argument("--dir", metavar="DIR", help="where scratch files go (default: the temp directory)")


def run_and_report(
    args: argparse.Namespace,
    run: Callable[[cli.StepBar], R],
    render: Callable[[R], None],
    failures: dict[type[BaseException], str] | None = None,
) -> int:
    """Run a benchmark under a progress bar on stderr, then print its JSON or its table.

    ``failures`` maps exception types to a one-line label; each becomes exit code 1.
    """
    labels = {VerificationError: "verification failed", **(failures or {})}
    try:
        with cli.progress(32) as progress:
            report = run(cli.StepBar(progress))
    except tuple(labels) as exc:
        label = next(text for kind, text in labels.items() if isinstance(exc, kind))
        Console(stderr=True).print(f"[bold red]{label}:[/] {exc}", highlight=False)
        return 1
    if args.json:
        print(dumps(report))
    else:
        render(report)
    return 0


def gbps_cell(value: float) -> str:
    """A rate's cell: decimal GB/s, two decimals."""
    return f"{value:.2f}"


def spread_x(spread: Spread) -> str:
    """A paired ratio with its spread: ``1.05x (0.98-1.20)``."""
    return f"{spread.median:.2f}x ({spread.min:.2f}-{spread.max:.2f})"


def verdict_cells(goals: list[Goal]) -> tuple[str, str]:
    """A table cell of goals and one of their verdicts, a line each."""
    return ("\n".join(g.goal for g in goals),
            "\n".join("[green]pass[/]" if g.passed else "[bold red]FAIL[/]" for g in goals))


def figure_table(title: str, columns: tuple[tuple[str, str], ...]) -> Table:
    """A table of figures: ``columns`` as (name, justify); only the figure column wraps."""
    table = Table(title=title, title_justify="left")
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=name != "figure (what is timed)")  # type: ignore[arg-type]
    return table
