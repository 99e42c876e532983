"""Calibration: measure this host's transfer paths (``measure``, with the timed steps of
``probes``), check restores against the prediction (``validate``), and read and write the
hardware profile that carries the fits.

A calibrated profile is a hardware profile's TOML (the topology loader ignores the extra
tables) plus a ``[calibration]`` table (``HostCalibration.to_toml``) and, on a GPU host,
``[efficiency]`` overrides derived from the measurements.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

from kvstrata.hardware.profile import builtin_profiles, builtin_text
from kvstrata.plan.host import HostCalibration

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_EFFICIENCY_HEADER = re.compile(r"^\[efficiency\]\s*(#.*)?$", re.MULTILINE)


def load_calibration(path: str | Path) -> HostCalibration:
    """The ``[calibration]`` of a profile written by ``kvstrata calibrate``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not TOML, or no (or a malformed) ``[calibration]`` table; names the field.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibrated profile {str(path)!r} does not exist")
    try:
        doc = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: invalid TOML: {exc}") from None
    try:
        return HostCalibration.from_mapping(doc)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def base_profile_text(name_or_path: str) -> str:
    """The TOML text of a built-in profile or a profile file, without any ``[calibration]``."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists() or name_or_path not in builtin_profiles():
        if not path.is_file():
            raise FileNotFoundError(
                f"base profile {name_or_path!r} is neither a file nor built-in ({', '.join(builtin_profiles())})"
            )
        text = path.read_text()
    else:
        text = builtin_text(name_or_path)
    if "calibration" in tomllib.loads(text):
        raise ValueError(f"base profile {name_or_path!r} is already calibrated: start from the profile it was based on")
    return text


def profile_text(calibration: HostCalibration, base_text: str) -> str:
    """``base_text`` with the calibration appended; measured efficiencies join the base's
    ``[efficiency]`` table if it has one (the base's own value wins on a clash: it was set
    by hand)."""
    base_efficiency = tomllib.loads(base_text).get("efficiency", {})
    if not base_efficiency and not _EFFICIENCY_HEADER.search(base_text):
        return base_text.rstrip("\n") + "\n\n" + calibration.to_toml()
    measured = {k: v for k, v in calibration.efficiency.items() if k not in base_efficiency}
    lines = "".join(f'"{k}" = {v!r}  # measured by kvstrata calibrate\n' for k, v in measured.items())
    merged = _EFFICIENCY_HEADER.sub(lambda m: m.group(0) + "\n" + lines.rstrip("\n"), base_text, count=1) if lines else base_text
    own = dataclasses.replace(calibration, efficiency={})  # every fit kept; the efficiencies joined the base's table
    return merged.rstrip("\n") + "\n\n" + own.to_toml()
