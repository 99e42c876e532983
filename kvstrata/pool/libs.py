"""Whether this host can load the pool engine: the shared libraries that Mooncake's programs
(``mooncake_master``, ``mooncake_client``) and Python module (``mooncake.store``) take from the
system, and the command that installs the missing ones.

Mooncake's wheel bundles most of its libraries but links a few from the system (0.3.13:
``libibverbs.so.1``, ``libnuma.so.1``, ``libcurl.so.4``), which a fresh Debian lacks. A
program missing one exits 127 before it logs a line (``error while loading shared libraries:
libibverbs.so.1: cannot open shared object file``), and the module's import fails with that
message; the loader names only the first. ``ldd`` names every one at once.

``kvstrata pool libs`` prints the Debian packages to install (nothing: none missing) and the
line that says why, for the set-up scripts (``.ci/pool-libs``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

from kvstrata.extras import pip_command

# Debian (and Ubuntu) packages of the libraries Mooncake links from the system.
DEBIAN_PACKAGES = {
    "libibverbs.so.1": "libibverbs1",
    "librdmacm.so.1": "librdmacm1",
    "libnuma.so.1": "libnuma1",
    "libcurl.so.4": "libcurl4",
    "libnl-3.so.200": "libnl-3-200",
    "libnl-route-3.so.200": "libnl-route-3-200",
}
ENGINE_FILES = ("mooncake_master", "mooncake_client", "store.so")
_LOADER = re.compile(r"(\S+\.so(?:\.[\w.]+)?): cannot open shared object file")
_NOT_FOUND = re.compile(r"^\s*(\S+) => not found", re.MULTILINE)


def engine_files() -> list[Path]:
    """The installed pool engine's programs and module library (none: not installed)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return []
    found = []
    for location in spec.submodule_search_locations:
        found += [Path(location) / name for name in ENGINE_FILES if (Path(location) / name).is_file()]
    return found


def missing_libraries(files: list[Path] | None = None) -> tuple[str, ...]:
    """Shared libraries that ``files`` (default: the pool engine's) need and the loader does
    not find on this host, as ``ldd`` lists them (empty without ``ldd``)."""
    ldd = shutil.which("ldd")
    if ldd is None:
        return ()
    missing: set[str] = set()
    for path in engine_files() if files is None else files:
        try:
            done = subprocess.run([ldd, str(path)], capture_output=True, text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        missing.update(_NOT_FOUND.findall(done.stdout))
    return tuple(sorted(missing))


def loader_error(text: str) -> str | None:
    """The library a loader error in ``text`` names (``libibverbs.so.1: cannot open shared
    object file``), or None."""
    match = _LOADER.search(text)
    return match.group(1) if match else None


def packages(libraries: tuple[str, ...]) -> tuple[str, ...]:
    """The Debian packages of ``libraries`` that have a known one."""
    return tuple(dict.fromkeys(DEBIAN_PACKAGES[lib] for lib in libraries if lib in DEBIAN_PACKAGES))


def install_command(libraries: tuple[str, ...]) -> str:
    """The command that installs ``libraries`` (Debian/Ubuntu), ``sudo`` unless root."""
    names = packages(libraries)
    unknown = [lib for lib in libraries if lib not in DEBIAN_PACKAGES]
    sudo = "" if os.geteuid() == 0 else "sudo "
    command = f"{sudo}apt-get install -y {' '.join(names)}" if names else ""
    if unknown:
        command += ("; and " if command else "") + f"the packages that provide {', '.join(unknown)}"
    return command


def describe(libraries: tuple[str, ...]) -> str:
    """One line: what is missing and the command that installs it."""
    return (f"the pool engine needs {', '.join(libraries)}, missing on this host; "
            f"install: {install_command(libraries)}")


def problem() -> str | None:
    """Why the pool engine cannot run here, in one line (None: installed, and loads)."""
    if not engine_files():
        return f"the pool engine is not installed: {pip_command('mooncake')}"
    missing = missing_libraries()
    return describe(missing) if missing else None
