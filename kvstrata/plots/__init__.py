"""Figures for the command line's ``--plot`` and ``--html``, drawn with matplotlib.

An edge, like the CLI: the pure core (:mod:`kvstrata.plan`, :mod:`kvstrata.sim`) computes the
numbers and these modules draw them, one module per figure. Figures are built with
matplotlib's object API (``Figure``, no pyplot), so no global state or GUI backend is involved,
and a figure is drawn once, to PNG bytes, that a command saves as a file or embeds in a page
(:mod:`kvstrata.page`), or both.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

DPI = 120


def png_bytes(fig: Figure) -> bytes:
    """``fig`` drawn as a PNG."""
    buf = io.BytesIO()
    fig.savefig(buf, dpi=DPI, format="png")
    return buf.getvalue()


def save_png(png: bytes, path: str | Path) -> Path:
    """Write a PNG (from :func:`png_bytes`) to ``path``, its folder made if missing; the path written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png)
    return path


def coincident(series: Mapping[str, Sequence[float]]) -> dict[str, str]:
    """Each non-empty series equal to an earlier one -> the name of the first it equals.

    A figure uses it to say, in its legend, which curve hides under which.
    """
    same: dict[str, str] = {}
    names = list(series)
    for i, name in enumerate(names):
        for first in names[:i]:
            if first not in same and len(series[name]) and np.array_equal(series[name], series[first]):
                same[name] = first
                break
    return same
