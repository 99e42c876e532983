"""``kvstrata lab --plot``: a restore's measured GB/s against the planner's, per link rate."""

from __future__ import annotations

from kvstrata.lab.model import Bound, LabPaths
from kvstrata.lab.report import LabReport, LinkRow, PortsRow, UplinkRow
from kvstrata.lab.run import LabConfig
from kvstrata.media import FetchPath
from kvstrata.plan.host import PathFit
from kvstrata.plots import png_bytes
from kvstrata.plots.lab import lab_figure

MIB = 1 << 20


def _row(rate, path, size, predicted, measured):
    bound = Bound.MEMORY if rate is None else Bound.LINK
    return LinkRow(rate, path, size, predicted, (measured,), bound, bound, "x", 0.0)


def test_the_figure_draws_every_rate_and_both_paths_beside_the_planner():
    rows = tuple(_row(rate, path, size, size / 0.3e9, size / 0.29e9)
                 for rate in (None, 2.5) for path in FetchPath if path is not FetchPath.AUTO for size in (16 * MIB, 64 * MIB))
    report = LabReport(LabConfig(), LabPaths(PathFit(0.0, 1.0), PathFit(0.0, 8.0)), rows,
                       (PortsRow(1.0, 64 * MIB, (0.55,), (0.28,), 0.55, 0.28, "x"),),
                       (UplinkRow("inf0", 1.0, 64 * MIB, (0.55,), (1.1,), 0.55, 1.1, "x"),))
    fig = lab_figure(report)
    left, right = fig.axes
    assert len(left.lines) == 2 * 3  # per rate: the planner's line, direct and staged markers
    assert [t.get_text() for t in left.get_legend().get_texts()] == [
        "2.5 Gbit/s: planner (link)", "unshaped: planner (memory path)"]
    assert len(right.patches) == 4  # two figures, measured and planned
    assert png_bytes(fig).startswith(b"\x89PNG")
