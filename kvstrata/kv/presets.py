"""The loader edge of :mod:`kvstrata.kv`: model configs from files or built-in presets.

A preset is a verbatim copy of a public Hugging Face ``config.json``, shipped as
``kvstrata/kv/presets/<name>.json``, so a preset and a downloaded config go through the same
:func:`~kvstrata.kv.readconfig.geometry_from_config`.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from kvstrata.kv.geometry import DType, GeometryError, KVGeometry
from kvstrata.kv.readconfig import geometry_from_config

_PRESET_SUFFIX = ".json"


def _preset_dir() -> resources.abc.Traversable:
    return resources.files("kvstrata.kv").joinpath("presets")


def list_presets() -> list[str]:
    """Names of the built-in model presets, sorted."""
    return sorted(
        entry.name.removesuffix(_PRESET_SUFFIX)
        for entry in _preset_dir().iterdir()
        if entry.name.endswith(_PRESET_SUFFIX)
    )


def load_config(model: str) -> tuple[str, dict[str, Any]]:
    """Load a model config from a path or a preset name (see :func:`load_source`)."""
    name, config, _ = load_source(model)
    return name, config


def load_source(model: str) -> tuple[str, dict[str, Any], str]:
    """Load a model config from a path or a preset name, saying where it came from.

    Args:
        model: A ``config.json`` file, a model directory holding one, or a preset name.

    Returns:
        ``(name, config, source)``: the model's name (the directory name for a ``config.json``,
        else the file stem or preset name), the parsed config, and where it was read (the file's
        path, or ``preset 'name'``) for messages.

    Raises:
        FileNotFoundError: ``model`` looks like a path (or is a directory without
            ``config.json``) but no such file exists.
        GeometryError: ``model`` is neither a path nor a preset (the message lists the
            presets), or the file is not a JSON object.
    """
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model directory {model!r} has no config.json")
    if path.is_file():
        name = path.parent.resolve().name if path.name == "config.json" else path.stem
        return name, _parse_json(path.read_text(encoding="utf-8"), str(path)), str(path)
    if model in list_presets():
        text = _preset_dir().joinpath(model + _PRESET_SUFFIX).read_text(encoding="utf-8")
        source = f"preset {model!r}"
        return model, _parse_json(text, source), source
    available = ", ".join(list_presets())
    if path.suffix == _PRESET_SUFFIX or len(path.parts) > 1:
        raise FileNotFoundError(f"no such model config file: {model!r} (presets: {available})")
    raise GeometryError(
        f"unknown model {model!r}: not a config file, a model directory or a preset "
        f"(presets: {available})"
    )


def load_geometry(model: str, dtype: DType | str | None = None) -> KVGeometry:
    """Load a model config (see :func:`load_config`) and derive its KV geometry.

    Args:
        model: A ``config.json`` file, a model directory holding one, or a preset name.
        dtype: KV dtype; defaults to the config's own, else bf16.

    Raises:
        GeometryError: as :func:`load_config`, or the config cannot be sized; the message
            starts with the file (or preset) and names the field.
    """
    if isinstance(dtype, str):
        dtype = DType.parse(dtype)  # the caller's value: its error is not the file's
    name, config, source = load_source(model)
    try:
        return geometry_from_config(config, name=name, dtype=dtype)
    except GeometryError as exc:
        raise GeometryError(f"{source}: {exc}") from None


def _parse_json(text: str, source: str) -> dict[str, Any]:
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GeometryError(f"{source} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise GeometryError(f"{source} must hold a JSON object, got {type(config).__name__}")
    return config
