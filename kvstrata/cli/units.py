"""Sizes at the command line: one parser and one formatter, in decimal units.

kvstrata counts capacity in decimal units, as its hardware catalog and README do: 1 GB = 1e9
bytes (kB 1e3, MB 1e6, TB 1e12; a bare ``k``, ``m``, ``g`` or ``t`` too). Binary units are
read only when named (``KiB``, ``MiB``, ``GiB``, ``TiB``), so ``2GB`` is 2,000,000,000 bytes
and ``2GiB`` 2,147,483,648. Sizes are always printed in decimal units.
"""

from __future__ import annotations

import argparse
import re

_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*(?:([kmgt]?)(b?)|([kmgt])i(b?))\s*", re.IGNORECASE)
_PRINTED = ((10**12, "TB"), (10**9, "GB"), (10**6, "MB"), (10**3, "kB"))


def parse_size(text: str) -> int:
    """``"2GB"`` -> 2_000_000_000, ``"512MiB"`` -> 536_870_912, ``"4096"`` -> 4096 (bytes).

    Raises:
        ValueError: not a positive size; the message shows the accepted forms.
    """
    m = _SIZE.fullmatch(text)
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"not a size: {text!r} (e.g. 2GB = 2e9 bytes, 512MB, or 2GiB for binary units)")
    decimal, binary = m.group(2), m.group(4)
    scale = _BINARY[binary.lower()] if binary else _DECIMAL[decimal.lower()]
    return round(float(m.group(1)) * scale)


def size_arg(text: str) -> int:
    """``parse_size`` as an argparse ``type=``: a bad size is a usage error naming the value."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def format_size(size_bytes: int | float) -> str:
    """Bytes in the largest decimal unit that keeps the number >= 1, four significant figures:
    2_000_000_000 -> ``"2 GB"``, 2_147_483_648 -> ``"2.147 GB"``, 512 -> ``"512 B"``."""
    scale, unit = next(((s, u) for s, u in _PRINTED if abs(size_bytes) >= s), (1, "B"))
    value = size_bytes / scale
    return f"{value:.0f} {unit}" if abs(value) >= 1000 else f"{value:.4g} {unit}"  # never an exponent
