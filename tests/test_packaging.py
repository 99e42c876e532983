"""The package metadata builds without setuptools' deprecation warnings (the license as a
TOML table warned three times per install; builds stop accepting it in 2027)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BUILD_METADATA = """
import warnings
from setuptools import build_meta
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    name = build_meta.prepare_metadata_for_build_wheel("meta")
for w in caught:
    print("WARNING", w.category.__name__, str(w.message).splitlines()[0])
print("DIST", name)
"""


def test_metadata_builds_with_an_spdx_license_and_no_deprecation_warning(tmp_path):
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__}: the build itself asks for >= 77")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "kvstrata", tmp_path / "kvstrata", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "meta").mkdir()
    run = subprocess.run([sys.executable, "-c", BUILD_METADATA], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    warned = [line for line in (run.stdout + run.stderr).splitlines()
              if "deprecat" in line.lower() and "license" in line.lower()]
    assert warned == []
    (dist,) = [line.split()[1] for line in run.stdout.splitlines() if line.startswith("DIST ")]
    metadata = (tmp_path / "meta" / dist / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
