"""``kvstrata validate --serve --plot``: per configuration, the measured and the simulated TTFT
CDFs on one axis (solid: measured; dashed: simulated; one colour per report), and TPOT below."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure

from kvstrata.calibrate.serving.validate import ServeValidation



def validation_figure(validations: Sequence[tuple[str, ServeValidation]]) -> Figure:
    """One column per configuration, TTFT above and TPOT below, every report's pair of curves."""
    names = list(dict.fromkeys(n for _, v in validations for n in v.measured if n in v.simulated))
    fig = Figure(figsize=(3.6 * max(1, len(names)), 6.5))
    axes = fig.subplots(2, max(1, len(names)), squeeze=False)
    for col, name in enumerate(names):
        for row, (attr, what) in enumerate((("ttft_s", "TTFT"), ("tpot_s", "TPOT"))):
            ax = axes[row][col]
            for i, (path, v) in enumerate(validations):
                if name not in v.measured or name not in v.simulated:
                    continue
                for figures, style, who in ((v.measured, "-", "measured"), (v.simulated, "--", "simulated")):
                    xs = np.sort(np.asarray(getattr(figures[name], attr), dtype=float)) * 1e3
                    if len(xs):
                        ys = np.arange(1, len(xs) + 1) / len(xs)
                        label = f"{who}" + (f" (report {i + 1})" if len(validations) > 1 else "")
                        ax.plot(xs, ys, style, color=f"C{i % 10}", drawstyle="steps-post", label=label)
            ax.set_xlabel(f"{what} (ms)")
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(validations[0][1].labels.get(name, name), fontsize=10)
            if col == 0:
                ax.set_ylabel("fraction of requests")
    if names:
        axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle("bench serve measured (solid) vs kvstrata's serving simulator (dashed)", fontsize=11)
    fig.tight_layout()
    return fig
