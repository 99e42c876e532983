"""Restore time vs context length per path, for ``kvstrata plan --plot`` and ``--html``."""

from __future__ import annotations

from matplotlib.figure import Figure

from kvstrata.hardware.specs import HardwareProfile
from kvstrata.kv.geometry import KVGeometry
from kvstrata.plan.planner import make_plan
from kvstrata.plots import coincident

STYLES = ("-", "--", ":", "-.")  # one line style and marker per profile, one colour per path
MARKERS = ("o", "s", "^", "D")


def context_grid(max_tokens: int) -> list[int]:
    """Powers of two from 1K up to ``max_tokens``, and ``max_tokens`` itself."""
    grid, tokens = [], 1024
    while tokens < max_tokens:
        grid.append(tokens)
        tokens *= 2
    return grid + [max_tokens]


def restore_figure(
    geometry: KVGeometry, profiles: list[HardwareProfile], gpus: int | None, max_tokens: int
) -> Figure:
    """Each available path's restore time from 1K to ``max_tokens`` cached tokens, on each profile.

    The title names the model, the profiles (``a vs b`` for a what-if) and the GPU count.
    """
    grid = context_grid(max_tokens)
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    curves: dict[str, tuple[int, int, list[float]]] = {}  # label -> (profile, path, seconds per grid point)
    for i, profile in enumerate(profiles):
        plans = [make_plan(geometry, profile, n, gpus=gpus) for n in grid]
        for path_index, restore in enumerate(plans[0].restore):
            if restore.available:
                label = restore.path.value if len(profiles) == 1 else f"{profile.name}: {restore.path.short}"
                curves[label] = (i, path_index, [p.restore[path_index].seconds for p in plans])
    # The same path on two profiles is often the same line (an upgrade leaves DRAM -> HBM alone).
    same = coincident({label: seconds for label, (_, _, seconds) in curves.items()})
    for label, (i, path_index, seconds) in curves.items():
        if label in same:
            label += f" (same as {same[label].partition(':')[0]})"
        ax.plot(grid, seconds, STYLES[i % len(STYLES)], color=f"C{path_index}", marker=MARKERS[i % len(MARKERS)],
                markersize=4 + 3 * i, fillstyle="full" if i == 0 else "none", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cached context (tokens)")
    ax.set_ylabel("restore time (s)")
    tp = make_plan(geometry, profiles[0], grid[-1], gpus=gpus).tp
    hardware = " vs ".join(p.name for p in profiles)
    ax.set_title(
        f"KV restore time per path: {geometry.name} ({geometry.dtype.name.lower()}), {tp} GPU(s)\non {hardware}",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig
