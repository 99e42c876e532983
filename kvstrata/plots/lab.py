"""``kvstrata lab --plot``: each restore's throughput, measured against the planner's, per link rate."""

from __future__ import annotations

from matplotlib.figure import Figure

from kvstrata.lab.report import GOAL, LabReport
from kvstrata.media import FetchPath

MIB = 1 << 20


def lab_figure(report: LabReport) -> Figure:
    """Left: GB/s per restore size, one colour per link rate, predicted (line) and measured
    (markers: circles direct, squares staged), with the goal's band around the prediction.
    Right: the two-port speedup and each host's share of a shared uplink, measured beside the
    planner's figure."""
    fig = Figure(figsize=(12, 5))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1]})
    rates = sorted({r.rate_gbit for r in report.link}, key=lambda x: (x is None, x or 0))
    for c, rate in enumerate(rates):
        label = "unshaped" if rate is None else f"{rate:g} Gbit/s"
        direct = sorted((r for r in report.link if r.rate_gbit == rate and r.path is FetchPath.DIRECT), key=lambda r: r.nbytes)
        if direct:
            sizes = [r.nbytes / MIB for r in direct]
            predicted = [r.nbytes / r.predicted_s / 1e9 for r in direct]
            left.plot(sizes, predicted, "-", color=f"C{c}", label=f"{label}: planner ({direct[0].predicted_bound.value})")
            left.fill_between(sizes, [p * (1 - GOAL) for p in predicted], [p * (1 + GOAL) for p in predicted],
                              color=f"C{c}", alpha=0.12)
        for path, marker in ((FetchPath.DIRECT, "o"), (FetchPath.STAGED, "s")):
            rows = sorted((r for r in report.link if r.rate_gbit == rate and r.path is path), key=lambda r: r.nbytes)
            left.plot([r.nbytes / MIB for r in rows], [r.measured_gbps for r in rows], marker, color=f"C{c}",
                      fillstyle="full" if path is FetchPath.DIRECT else "none", linestyle="none")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("restore size (MiB)")
    left.set_ylabel("GB/s (bytes / restore time)")
    left.set_title(f"one link: measured (o direct, □ staged) vs planner (±{GOAL:.0%} band)", fontsize=10)
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=7, loc="lower right")
    bars: list[tuple[str, float, float]] = []
    bars += [(f"2 ports / 1\n{r.nbytes // MIB} MiB", r.speedup, r.predicted_speedup) for r in report.ports]
    bars += [(f"share {r.host}\n{r.nbytes // MIB} MiB", r.share, r.predicted_share) for r in report.uplink]
    if bars:
        x = range(len(bars))
        right.bar([i - 0.2 for i in x], [b[1] for b in bars], 0.4, label="measured")
        right.bar([i + 0.2 for i in x], [b[2] for b in bars], 0.4, label="planner (max-min)")
        right.set_xticks(list(x), [b[0] for b in bars], fontsize=8)
        right.set_title("two ports' speedup; each host's share of one uplink", fontsize=10)
        right.legend(fontsize=7)
        right.grid(True, axis="y", alpha=0.3)
    else:
        right.set_axis_off()
    fig.tight_layout()
    return fig
