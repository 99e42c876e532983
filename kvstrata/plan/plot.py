"""Restore time vs context length per path, drawn with matplotlib (writes a PNG)."""

from __future__ import annotations

from pathlib import Path

from kvstrata.hardware.profile import HardwareProfile
from kvstrata.kv.geometry import KVGeometry
from kvstrata.plan.planner import make_plan


def context_grid(max_tokens: int) -> list[int]:
    """Powers of two from 1K up to ``max_tokens``, and ``max_tokens`` itself."""
    grid, tokens = [], 1024
    while tokens < max_tokens:
        grid.append(tokens)
        tokens *= 2
    return grid + [max_tokens]


def plot_restore_curves(
    geometry: KVGeometry, profiles: list[HardwareProfile], gpus: int | None, max_tokens: int, out: Path
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = context_grid(max_tokens)
    fig, ax = plt.subplots(figsize=(8, 5))
    styles = ["-", "--", ":", "-."]
    for i, profile in enumerate(profiles):
        plans = [make_plan(geometry, profile, n, gpus=gpus) for n in grid]
        for path_index, restore in enumerate(plans[0].restore):
            if not restore.available:
                continue
            seconds = [p.restore[path_index].seconds for p in plans]
            label = restore.path.value if len(profiles) == 1 else f"{profile.name}: {restore.path.short}"
            color = f"C{path_index}"  # one colour per path, one line style per profile
            ax.plot(grid, seconds, styles[i % len(styles)], color=color, marker="o", markersize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cached context (tokens)")
    ax.set_ylabel("restore time (s)")
    tp = make_plan(geometry, profiles[0], grid[-1], gpus=gpus).tp
    ax.set_title(f"{geometry.name} ({geometry.dtype.name.lower()}) on {tp} GPU(s): KV restore time per path")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
