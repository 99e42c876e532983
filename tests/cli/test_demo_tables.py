"""``kvstrata demo``'s tables (the workload's two, then the planner's) fit an 80- and a
120-column terminal: every table within the width, no cell cut or broken inside a word."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvstrata.cli.plan import render, resolve_profile
from kvstrata.cli.workload import render_tiers
from kvstrata.hardware.profile import builtin_profiles
from kvstrata.kv.presets import load_geometry
from kvstrata.media import Medium
from kvstrata.plan.planner import make_plan
from kvstrata.workload import TierReport, Workload, WorkloadReport

WIDTHS = (80, 120)
DEVICE, HOST, DISK, REMOTE = Medium.DEVICE, Medium.HOST, Medium.DISK, Medium.REMOTE
DEMO_TITLE = ("kvstrata demo: tiny-llama, 4 conversations x 3 turns, blocks of 256 tokens; restore time summed over "
              "turns; predicted by a quick calibration of this host, run first")


class Collect:
    """A stand-in console keeping what is printed, to render each table alone."""

    def __init__(self) -> None:
        self.printed: list[object] = []

    def print(self, *objects: object, **_options: object) -> None:
        self.printed.extend(objects)


def tables_of(draw) -> list[Table]:
    out = Collect()
    draw(out)
    tables = [o for o in out.printed if isinstance(o, Table)]
    assert tables
    return tables


def served(tier: Medium, routes: dict, slow: float = 1.0) -> TierReport:
    """A tier's report with the widest figures a demo run gives (ms in the thousands)."""
    return TierReport(tier, turns=12, ttft_cold_s=1.2345 * slow, ttft_warm_s=0.4321 * slow, hit_tokens=9000,
                      prompt_tokens=10000, restored_bytes=123_400_000, restore_s=1.5 * slow, restore_alone_s=0.9 * slow,
                      predicted_restore_s=0.0123, paths=routes, loads=11, load_sizes=((11_200_000, 21),) * 11)


def demo_reports() -> tuple[WorkloadReport, WorkloadReport]:
    """One with the remote tier skipped (its reason under the tables), one with it served."""
    staged, direct = (REMOTE, HOST, DEVICE), (REMOTE, DEVICE)
    tiers = {
        DEVICE: served(DEVICE, {(DEVICE,): 30}, slow=0.1),
        HOST: served(HOST, {(HOST, DEVICE): 30}),
        DISK: served(DISK, {(DISK, HOST, DEVICE): 12, (DISK, DEVICE): 18}, slow=9.0),
        REMOTE: TierReport(REMOTE, skipped="pool did not start: mooncake_master exited with 127: libibverbs.so.1 missing"),
    }
    report = WorkloadReport(Path("/m/tiny-llama"), Workload(conversations=4, turns=3), tiers, load_average=3.1, cpus=2)
    also_remote = {**tiers, REMOTE: served(REMOTE, {staged: 7, direct: 23}, slow=20.0)}
    return report, WorkloadReport(report.model_dir, report.workload, also_remote)


def cell_texts(table: Table) -> list[str]:
    texts = [str(table.title or "")]
    for column in table.columns:
        texts += [str(column.header), *(str(c) for c in column.cells)]
    return [Text.from_markup(t).plain for t in texts]


def assert_fits(table: Table, width: int) -> None:
    """The table renders within ``width`` columns, and every word of every cell (header and
    title too) appears whole on one line of it: nothing cut ("…") or folded mid-word."""
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(table)
    lines = out.getvalue().splitlines()
    assert all(len(line.rstrip()) <= width for line in lines), f"wider than {width}:\n{out.getvalue()}"
    assert "…" not in out.getvalue(), f"a word broken (cut) at width {width}:\n{out.getvalue()}"
    for text in cell_texts(table):
        for word in text.split():
            assert any(word in line for line in lines), f"{word!r} broken at width {width}:\n{out.getvalue()}"


@pytest.mark.parametrize("width", WIDTHS)
def test_the_workloads_tables_fit_without_breaking_a_word(width):
    for report in demo_reports():
        for table in tables_of(lambda out: render_tiers(out, report, DEMO_TITLE)):
            assert_fits(table, width)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("profile", builtin_profiles())
@pytest.mark.parametrize("model", ["llama-3-70b", "gemma-3-27b", "qwen3-next-80b-a3b"])
def test_the_planners_tables_fit_without_breaking_a_word(width, profile, model):
    """The demo's planner view (its default model, and hybrid ones for the groups' table) on
    every built-in profile, at the demo's prompt sizes and at ``kvstrata plan``'s default."""
    geometry, hardware = load_geometry(model), resolve_profile(profile)
    for context, cached in ((835, 256), (32768, 32768)):
        for table in tables_of(lambda out: render(out, make_plan(geometry, hardware, context, cached))):
            assert_fits(table, width)


def test_a_cut_word_is_caught():
    """The check itself: a table squeezed below its words fails it."""
    table = Table()
    table.add_column("bottleneck")
    table.add_row("gen4-x4 media nvme0->nvme0.ctrl")
    with pytest.raises(AssertionError, match="broken"):
        assert_fits(table, 12)
