"""An engine's extra config (decoded JSON: strings, numbers, booleans), parsed at that edge: the
value parsers the vLLM connector and the SGLang backend share. Each takes the key's name and its
value; one that refuses a value raises ValueError in one line, ``label`` then the key (the
integration's name, and the prefix its keys carry)."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any

from kvstrata.pool.config import PoolConfig, load_pool_config, pool_from_env

Parser = Callable[[str, Any], Any]


POOL_BUDGETS = ("pool_timeout_s", "pool_connect_timeout_s", "pool_backoff_s", "pool_backoff_max_s")


def pool_budgets(settings: Any) -> dict[str, float]:
    """An engine's settings' pool time budgets by name (CacheConfig's and check_budgets' names)."""
    return {name: getattr(settings, name) for name in POOL_BUDGETS}


def as_is(name: str, value: Any) -> Any:
    return value


def whole(name: str, value: Any) -> Any:
    """JSON writes 1e9 as a float: a whole number is taken as an int (the field checks the rest)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def empty_is_none(name: str, value: Any) -> Any:
    """An empty string: not given."""
    return None if value == "" else value


def path(label: str) -> Parser:
    """A path (``pathlib.Path``); None or an empty string: none."""
    def parse(name: str, value: Any) -> Path | None:
        if value is None or value == "":
            return None
        if not isinstance(value, (str, Path)):
            raise ValueError(f"{label}{name} must be a path, got {value!r}")
        return Path(value)
    return parse


def choice(kind: type[Enum], label: str) -> Parser:
    """One of ``kind``'s values (or a member of it)."""
    def parse(name: str, value: Any) -> Enum:
        if isinstance(value, kind):
            return value
        choices = [k.value for k in kind]
        if value not in choices:
            raise ValueError(f"{label}{name} must be one of {choices}, got {value!r}")
        return kind(value)
    return parse


def check_whole(label: str, name: str, value: Any, least: int, what: str) -> None:
    """A setting that must be a whole number >= ``least`` (a bool is not one); ``what`` says so."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{label}{name} must be {what}, got {value!r}")


def check_text(label: str, name: str, value: Any) -> None:
    """A setting that is not given (None) or a non-empty string (a pool file, a model id)."""
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{label}{name} must be a non-empty string or None, got {value!r}")


def pool_of(value: str | None, label: str) -> PoolConfig | None:
    """The pool a ``pool`` key names: a pool config file (TOML, or an embedded pool's pool.json),
    ``"env"`` for ``$KVSTRATA_POOL``; None: no pool (the file is read here, at the edge)."""
    if value is None:
        return None
    if value == "env":
        config = pool_from_env()
        if config is None:
            raise ValueError(f"{label}pool='env' but $KVSTRATA_POOL is not set")
        return config
    return load_pool_config(value)
