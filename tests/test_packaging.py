"""The package metadata builds without setuptools' deprecation warnings (the license as a
TOML table warned three times per install; builds stop accepting it in 2027); the core install
leaves out plots, transformers, Prometheus, the pool engine and the engines, its commands run
without them, and one that needs an extra says which in one line."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvstrata.extras import EXTRAS, MissingExtra, install_line, require
from kvstrata.sim.synthetic import SyntheticConfig, generate
from kvstrata.sim.traceio import write_trace

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# What a GPU host installs in place of an extra's CPU build (vllm, mooncake-transfer-engine): by prefix.
INSTEAD_DISTS = ("vllm", "mooncake")
# Run in a fresh interpreter: the optional packages named in argv[1] (comma separated) made
# not installed, as a finder that fails their import, then the CLI's main on the rest of argv.
BLOCKED_CLI = """
import sys
blocked = tuple(sys.argv[1].split(","))

class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
from kvstrata.cli import main
sys.exit(main(sys.argv[2:]))
"""

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


def dist_name(requirement: str) -> str:
    """``prometheus_client>=0.18`` -> ``prometheus-client`` (PEP 503's normal form)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group()).lower()


def run_cli(*argv: str, blocked: tuple[str, ...] = tuple(EXTRAS), cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", BLOCKED_CLI, ",".join(blocked), *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_core_dependencies_leave_out_every_optional_package():
    core = {dist_name(r) for r in PROJECT["dependencies"]}
    optional = {dist_name(r) for extra in PROJECT["optional-dependencies"].values() for r in extra} - {"kvstrata"}
    assert "matplotlib" in optional and "transformers" in optional  # read from pyproject, not typed here
    assert core & optional == set()
    assert [d for d in core if d.startswith(INSTEAD_DISTS)] == []
    assert {"rich", "numpy", "xxhash", "torch"} <= core  # the CLI, the index's hashing, the cache's tiers


def test_every_extra_the_cli_names_is_defined_and_the_test_extra_takes_them():
    extras = PROJECT["optional-dependencies"]
    assert {extra for extra, _ in EXTRAS.values()} <= set(extras)
    (own,) = [r for r in extras["test"] if dist_name(r) == "kvstrata"]
    assert {"plots", "hf", "metrics"} <= set(own[own.index("[") + 1:own.index("]")].split(","))


def test_the_core_commands_run_without_any_optional_package(tmp_path):
    help_ = run_cli("--help")
    assert help_.returncode == 0 and "plan" in help_.stdout, help_.stderr
    plan = run_cli("plan")
    assert plan.returncode == 0, plan.stderr
    assert "KV restore per path" in plan.stdout
    trace = tmp_path / "t.jsonl"
    write_trace(trace, generate(SyntheticConfig(requests=20, rate=2.0, seed=1)))
    sim = run_cli("simulate", "--trace", str(trace), "--hardware", "h200-cx7-gen5", "--model", "llama-3-8b",
                  "--arch", "hbm", "--instances", "1", "--json")
    assert sim.returncode == 0, sim.stderr


def test_plan_imports_no_optional_package_nor_torch_even_where_installed():
    probe = subprocess.run(
        [sys.executable, "-c", "import sys\nfrom kvstrata.cli import main\nmain(['plan'])\n"
         f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({sorted(EXTRAS) + ['torch']!r})))"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120, check=False)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.splitlines()[-1] == "[]"


@pytest.mark.parametrize(("argv", "module", "extra"), [
    (("plan", "--plot", "restore.png"), "matplotlib", "plots"),
    (("model", "make-tiny", "tiny"), "transformers", "hf"),
    (("doctor", "metrics.txt"), "prometheus_client", "metrics"),
])
def test_a_command_missing_its_extra_says_which_in_one_line(tmp_path, argv, module, extra):
    (tmp_path / "metrics.txt").write_text("vllm:num_requests_running 1\n")
    run = run_cli(*argv, blocked=(module,), cwd=tmp_path)
    assert run.returncode == 2
    assert run.stderr.splitlines() == [f"error: kvstrata {argv[0]} needs the '{extra}' extra ({module}): "
                                       f"pip install 'kvstrata[{extra}]'"]
    assert not (tmp_path / "restore.png").exists()


def test_the_pool_engine_line_says_what_a_gpu_host_installs(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)  # as if not installed
    assert install_line("mooncake.store", "kvstrata pool") == (
        "kvstrata pool needs the 'remote' extra (mooncake): pip install 'kvstrata[remote]'; "
        "a GPU host installs mooncake-transfer-engine instead")


def test_require_names_the_extra_and_leaves_other_failures_alone(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(MissingExtra, match=r"^the figure needs the 'plots' extra \(matplotlib\): "
                                           r"pip install 'kvstrata\[plots\]'$") as missing:
        require("matplotlib", "the figure")
    assert missing.value.name == "matplotlib"
    with pytest.raises(ModuleNotFoundError) as other:
        require("no_such_package_at_all", "anything")
    assert not isinstance(other.value, MissingExtra)


def test_a_module_missing_inside_an_installed_package_is_not_called_a_missing_extra():
    as_if_optional = {**EXTRAS, "xxhash": ("plots", "")}  # installed here (a core dependency)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("kvstrata.extras.EXTRAS", as_if_optional)
        assert install_line("xxhash", "x") is None
        with pytest.raises(ModuleNotFoundError) as broken:
            require("xxhash.no_such_submodule", "x")
    assert not isinstance(broken.value, MissingExtra)


def test_the_cache_counts_without_prometheus_and_its_exposition_names_the_extra(monkeypatch):
    from kvstrata.media import Medium
    from kvstrata.metrics import CacheMetrics

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    metrics = CacheMetrics()
    metrics.lookup({Medium.HOST: 3}, missed=1)
    assert metrics.hit_blocks[Medium.HOST] == 3 and metrics.miss_blocks == 1
    with pytest.raises(MissingExtra, match="'metrics' extra"):
        metrics.exposition()
