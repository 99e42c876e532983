"""The progress bar the long commands draw on stderr: drawn as steps advance, no thread of its own."""

from __future__ import annotations

import io
import threading

from rich.console import Console
from rich.progress import BarColumn, TextColumn

from kvstrata.cli import StepProgress


def test_the_bar_is_drawn_as_steps_advance_and_runs_no_thread():
    out = io.StringIO()
    before = set(threading.enumerate())
    bar = StepProgress(TextColumn("{task.description}"), BarColumn(),
                       console=Console(file=out, force_terminal=True, width=60))
    bar.MIN_REDRAW_S = 0.0
    with bar:
        assert set(threading.enumerate()) == before  # no redraw thread
        task = bar.add_task("tier host", total=3)
        drawn = len(out.getvalue())
        bar.advance(task)
        assert len(out.getvalue()) > drawn and "tier host" in out.getvalue()
        drawn = len(out.getvalue())
        bar.update(task, description="tier disk")
        assert "tier disk" in out.getvalue()[drawn:]


def test_redraws_are_at_most_one_per_interval():
    out = io.StringIO()
    bar = StepProgress(TextColumn("{task.description}"), console=Console(file=out, force_terminal=True, width=60))
    bar.MIN_REDRAW_S = 3600.0
    with bar:
        task = bar.add_task("steps", total=1000)
        bar.advance(task)  # the first step draws
        drawn = len(out.getvalue())
        for _ in range(100):
            bar.advance(task)
        assert len(out.getvalue()) == drawn
