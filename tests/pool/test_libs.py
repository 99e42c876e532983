"""A pool engine that cannot load a system library (kvstrata.pool.libs): found with ``ldd``,
said in one line with the command that installs it, and the real cause kept in the pool's
start error (its log is gone once a temporary run directory is removed).

A fresh Debian lacks libibverbs.so.1 (and libnuma.so.1, libcurl.so.4): the programs here are
real ones whose link to a system library is renamed to one no host has, so the loader fails
exactly as it does there.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from kvstrata.pool import embedded, libs



def absent(lib: str) -> str:
    """A library name no host has, as long as ``lib`` (``libc.so.6`` -> ``libq.so.6``)."""
    return "libq" + lib[4:]


def without_library(src: Path, dst: Path, lib: str) -> Path:
    """A copy of the ELF ``src`` that links ``absent(lib)`` instead of ``lib``."""
    data = src.read_bytes()
    assert data.count(lib.encode() + b"\0") >= 1, f"{src} does not link {lib}"
    dst.write_bytes(data.replace(lib.encode() + b"\0", absent(lib).encode() + b"\0"))
    dst.chmod(0o755)
    return dst


needs_ldd = pytest.mark.skipif(shutil.which("ldd") is None, reason="no ldd on this host")


@needs_ldd
def test_ldd_names_the_missing_library_and_none_when_all_are_there(tmp_path):
    program = without_library(Path(shutil.which("true")), tmp_path / "true", "libc.so.6")
    assert libs.missing_libraries([program]) == (absent("libc.so.6"),)
    assert libs.missing_libraries([Path(shutil.which("true"))]) == ()


def test_a_pool_program_that_cannot_load_says_why_without_its_log(tmp_path):
    program = without_library(Path(shutil.which("true")), tmp_path / "mooncake_master", "libc.so.6")
    log = tmp_path / "master.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(program)], stdout=out, stderr=subprocess.STDOUT)
    with pytest.raises(embedded.PoolError) as raised:
        embedded.wait_for("127.0.0.1:1", proc, log)
    log.unlink()  # as a temporary run directory is removed: the message must not need it
    message = str(raised.value)
    assert message.startswith("mooncake_master exited with 127: ")
    assert f"{absent('libc.so.6')}: cannot open shared object file" in message
    assert "see " not in message and str(log) not in message
    assert message.endswith(f"install: the packages that provide {absent('libc.so.6')}")


@pytest.mark.skipif(not getattr(zlib, "__file__", "").endswith(".so"), reason="zlib is built into this Python")
def test_a_module_that_cannot_load_names_the_library(tmp_path):
    module = without_library(Path(zlib.__file__), tmp_path / Path(zlib.__file__).name, "libz.so.1")
    spec = importlib.util.spec_from_file_location("zlib", module)
    with pytest.raises(ImportError) as raised:
        importlib.util.module_from_spec(spec)  # dlopen: the loader fails as for a Mooncake module
    assert libs.loader_error(str(raised.value)) == absent("libz.so.1")


def test_the_line_names_the_libraries_and_the_debian_command():
    sudo = "" if os.geteuid() == 0 else "sudo "
    line = libs.describe(("libcurl.so.4", "libibverbs.so.1", "libnuma.so.1"))
    assert line == ("the pool engine needs libcurl.so.4, libibverbs.so.1, libnuma.so.1, missing on this host; "
                    f"install: {sudo}apt-get install -y libcurl4 libibverbs1 libnuma1")
    assert libs.install_command(("libibverbs.so.1", "libfoo.so.2")) == (
        f"{sudo}apt-get install -y libibverbs1; and the packages that provide libfoo.so.2")


def test_the_engine_installed_here_loads(tmp_path):
    if not libs.engine_files():
        pytest.skip("the pool engine is not installed")
    assert libs.problem() is None
    done = subprocess.run([sys.executable, "-m", "kvstrata", "pool", "libs"], capture_output=True, text=True, check=False)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
