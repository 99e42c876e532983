"""Where a long measurement reports how far it is: calibration, validation, the workload runner
and the benchmarks call ``start(total_steps)`` once, then ``step(label)`` per step done.

The command line draws a bar (``kvstrata.cli.StepBar``); tests and library callers pass nothing
and get :class:`NoProgress`.
"""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    """A sink for progress: ``start`` may be called again to begin from zero."""

    def start(self, total_steps: int) -> None: ...

    def step(self, label: str) -> None: ...


class NoProgress:
    """Progress reported nowhere."""

    def start(self, total_steps: int) -> None:
        pass

    def step(self, label: str) -> None:
        pass
