"""The figures themselves, read back from matplotlib: titles, axes and units, SLO lines, and
curves that coincide told apart."""

from __future__ import annotations

import pytest
from matplotlib.colors import to_hex

from kvstrata.hardware.profile import load_profile
from kvstrata.hardware.whatif import apply_upgrades
from kvstrata.kv.presets import load_geometry
from kvstrata.plots import coincident, png_bytes, save_png
from kvstrata.plots.cdf import TPOT, TTFT, Slo, cdf_figure
from kvstrata.plots.restore import restore_figure

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def curves(ax):
    """The plotted data lines (not SLO or guide lines), by legend label."""
    return {line.get_label(): line for line in ax.get_lines() if len(line.get_xdata()) > 2}


def test_coincident_names_the_first_equal_series_and_ignores_empty_ones():
    series = {"a": [1.0, 2.0], "b": [1.0, 3.0], "c": [1.0, 2.0], "d": [1.0, 2.0], "e": [], "f": []}
    assert coincident(series) == {"c": "a", "d": "a"}


def test_ttft_cdf_has_a_title_grid_seconds_and_the_slo_lines():
    samples = {"hbm": [0.05 * i for i in range(1, 41)], "nvme": [0.1 * i for i in range(1, 41)]}
    fig = cdf_figure(samples, TTFT, "t.jsonl: llama-3-8b on h200-cx7-gen5", Slo(90, 2.0))
    ax = fig.axes[0]
    assert "TTFT CDF" in ax.get_title() and "t.jsonl: llama-3-8b on h200-cx7-gen5" in ax.get_title()
    assert ax.get_xlabel() == "TTFT, time to first token (s)"
    assert ax.get_ylabel() == "fraction of requests"
    assert any(g.get_visible() for g in ax.get_xgridlines()) and any(g.get_visible() for g in ax.get_ygridlines())
    slo = [line for line in ax.get_lines() if line.get_label().startswith("SLO")]
    assert len(slo) == 1 and list(slo[0].get_xdata()) == [2.0, 2.0]  # vertical, at 2 s
    assert slo[0].get_label() == "SLO: TTFT p90 <= 2 s"
    assert any(list(line.get_ydata()) == [0.9, 0.9] for line in ax.get_lines())  # the percentile it applies to
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["hbm", "nvme", "SLO: TTFT p90 <= 2 s"]
    assert max(curves(ax)["nvme"].get_xdata()) == pytest.approx(4.0)


def test_tpot_cdf_is_in_milliseconds_like_the_table():
    fig = cdf_figure({"hbm": [0.004, 0.005, 0.006]}, TPOT, "x", Slo(99, 0.1))
    ax = fig.axes[0]
    assert ax.get_xlabel().endswith("(ms)")
    assert max(curves(ax)["hbm"].get_xdata()) == pytest.approx(6.0)
    assert [line.get_label() for line in ax.get_lines() if line.get_label().startswith("SLO")] == [
        "SLO: TPOT p99 <= 100 ms"
    ]
    assert ax.get_xscale() == "log"  # 4-6 ms beside a 100 ms SLO: a linear axis would squash the curve
    fig.canvas.draw()
    assert {"10", "100"} <= {t.get_text() for t in ax.get_xticklabels()}  # plain numbers, in ms


def test_identical_curves_get_their_own_style_markers_and_a_legend_note():
    same = [0.01 * i for i in range(1, 101)]
    fig = cdf_figure({"hbm": same, "local-dram": same, "remote-gdr": same, "nvme": [2 * x for x in same]},
                     TTFT, "x", Slo(90, 2.0))
    lines = curves(fig.axes[0])
    assert set(lines) == {"hbm", "local-dram (same curve as hbm)", "remote-gdr (same curve as hbm)", "nvme"}
    styles = {(line.get_linestyle(), line.get_marker()) for line in lines.values()}
    assert len(styles) == 4  # no two share both line style and marker
    assert len({to_hex(line.get_color()) for line in lines.values()}) == 4
    offsets = {line.get_markevery()[0] for name, line in lines.items() if name.startswith(("hbm", "local", "remote"))}
    assert len(offsets) == 3  # the identical curves' markers fall on different points


def test_without_an_slo_the_cdf_marks_p50_p90_p99_and_empty_samples_say_so():
    fig = cdf_figure({"hbm": [], "nvme": []}, TPOT, "x", None)
    ax = fig.axes[0]
    assert {t.get_text() for t in ax.texts} == {"p50", "p90", "p99", "no samples"}
    assert not any(line.get_label().startswith("SLO") for line in ax.get_lines())
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["hbm (no samples)", "nvme (no samples)"]
    assert png_bytes(fig).startswith(PNG_MAGIC)


def test_restore_figure_names_the_hardware_and_says_which_paths_an_upgrade_leaves_alone(tmp_path):
    base = load_profile("h200-cx7-gen5")
    fig = restore_figure(load_geometry("llama-3-8b"), [base, apply_upgrades(base, "+cx8")], None, 4096)
    ax = fig.axes[0]
    assert "llama-3-8b" in ax.get_title() and "on h200-cx7-gen5 vs h200-cx7-gen5+cx8" in ax.get_title()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    # CX-8 speeds the NIC up; the local DRAM path is the same line on both profiles.
    assert "h200-cx7-gen5+cx8: DRAM -> HBM (same as h200-cx7-gen5)" in labels
    assert "h200-cx7-gen5+cx8: remote -> HBM (GDR)" in labels
    out = save_png(png_bytes(fig), tmp_path / "deep" / "r.png")
    assert out.read_bytes().startswith(PNG_MAGIC)
