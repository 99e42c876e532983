"""Reports as JSON, in one place: every typed result the command line prints with ``--json``
(benchmark reports, the workload runner's) goes through :func:`to_json`.

Results are trees of frozen dataclasses keyed by the project's types; the words a reader
sees are made here (JSON) or at the CLI (tables), never used as keys in between:

* a dataclass: an object of its fields in order (``init=False`` fields too), each under its
  name or the key :func:`key` gives it; a field whose metadata is :data:`FLATTEN` or
  :func:`flatten` (a dataclass) has its keys merged into the parent's (prefixed or renamed
  there, so one figure type serves reports whose keys were named apart), one whose metadata is
  :data:`OMIT` is left out (bulk data kept for the caller, e.g. prompts), one whose metadata is
  :data:`OMIT_NONE` is left out while it is None (a part of a report that only an option adds);
* a :class:`~kvstrata.media.Medium`: its label (``"host"``), as a value or as a key;
* a route (a non-empty tuple of media): its text (``"remote -> host -> device"``), as a value
  or as a key;
* any other enum: its value (``RemoteMode.TCP`` -> ``"tcp"``);
* a path: its text; tuples and lists: lists; dict keys: strings (ints as their digits);
* floats: as they are, except that JSON has no infinity or NaN: those become ``null``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

from kvstrata.media import Medium, route_text

OMIT = {"json": "omit"}
OMIT_NONE = {"json": "omit_none"}


def flatten(prefix: str = "", **keys: str) -> dict[str, Any]:
    """Field metadata: merge the field's dataclass into the parent object, each of its keys
    prefixed by ``prefix`` except those ``keys`` renames (its key -> the key in the parent).

    ``flatten("store_", baseline_gbps="raw_store_gbps")`` puts ``{"gbps", "baseline_gbps",
    "ratio"}`` in the parent as ``store_gbps``, ``raw_store_gbps`` and ``store_ratio``.
    """
    return {"json": "flatten", "prefix": prefix, "keys": keys}


FLATTEN = flatten()


def key(template: str) -> dict[str, str]:
    """Field metadata: the field's JSON key, ``template`` filled in from the object's fields
    (``key("min_{unit}")`` on an object whose ``unit`` is ``"ms"``: ``min_ms``)."""
    return {"key": template}


def to_json(obj: Any) -> Any:
    """``obj`` as JSON-ready Python: dicts, lists, strings, numbers, booleans and None."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Medium):
        return obj.label
    if isinstance(obj, enum.Enum):
        return to_json(obj.value)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _fields(obj)
    if isinstance(obj, Mapping):
        return {_key(k): to_json(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and _is_route(obj):
        return route_text(obj)
    if isinstance(obj, (tuple, list)):
        return [to_json(v) for v in obj]
    if isinstance(obj, PurePath):
        return str(obj)
    raise TypeError(f"no JSON form for {type(obj).__name__}: {obj!r}")


def dumps(obj: Any) -> str:
    """:func:`to_json` of ``obj`` as indented JSON text."""
    return json.dumps(to_json(obj), indent=2, allow_nan=False)


def _fields(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        how = f.metadata.get("json")
        if how == "omit":
            continue
        value = getattr(obj, f.name)
        if how == "omit_none" and value is None:
            continue
        if how == "flatten":
            if not dataclasses.is_dataclass(value):
                raise TypeError(f"{type(obj).__name__}.{f.name}: only a dataclass can be flattened")
            renamed, prefix = f.metadata["keys"], f.metadata["prefix"]
            out.update((renamed.get(k, prefix + k), v) for k, v in _fields(value).items())
        else:
            out[_field_key(obj, f)] = to_json(value)
    return out


def _field_key(obj: Any, f: dataclasses.Field) -> str:
    template = f.metadata.get("key")
    if template is None:
        return f.name
    return template.format_map({g.name: getattr(obj, g.name) for g in dataclasses.fields(obj)})


def _is_route(value: tuple) -> bool:
    return bool(value) and all(isinstance(m, Medium) for m in value)


def _key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, tuple) and _is_route(key):
        return route_text(key)
    if isinstance(key, (Medium, enum.Enum, int, PurePath)) and not isinstance(key, bool):
        return str(to_json(key))
    raise TypeError(f"no JSON key for {type(key).__name__}: {key!r}")
