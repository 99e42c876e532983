"""Typed reads of integer fields from a parsed model config, with errors that name the field."""

from __future__ import annotations

from collections.abc import Mapping


class GeometryError(ValueError):
    """A model config or geometry that cannot be sized; the message names the offending field."""


def check_int(label: str, value: object, *, minimum: int = 1) -> int:
    """Return ``value`` if it is an integer >= ``minimum`` (bools are not integers here).

    Args:
        label: How to name the value in an error, e.g. ``"config field 'head_dim'"``.
        value: The value to check.
        minimum: Smallest allowed value (1: positive, 0: non-negative).

    Raises:
        GeometryError: naming ``label``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise GeometryError(f"{label} must be {kind}, got {value!r}")
    return value


def get_int(section: Mapping[str, object], key: str, *, minimum: int = 1) -> int | None:
    """Read an optional integer field: None when absent or null, else checked.

    Raises:
        GeometryError: the field is present but not an integer >= ``minimum``.
    """
    value = section.get(key)
    return None if value is None else check_int(f"config field {key!r}", value, minimum=minimum)


def require_int(section: Mapping[str, object], *keys: str) -> int:
    """Read a required positive integer field, trying ``keys`` (canonical name first) in order.

    Raises:
        GeometryError: none of ``keys`` is set (naming the first), or the value is not positive.
    """
    for key in keys:
        value = get_int(section, key)
        if value is not None:
            return value
    aliases = f" (nor its aliases {', '.join(map(repr, keys[1:]))})" if len(keys) > 1 else ""
    raise GeometryError(f"config field {keys[0]!r} is missing{aliases}")
