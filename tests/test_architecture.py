"""The package's shape, checked: a pure core, benchmarks as a leaf, short functions in the data plane.

Read from the source (``ast``), so a lazy import inside a function counts as much as one at the
top, and the pure core's imports are checked to stay inside the pure core (so nothing reaches
torch, the tiers, the pool or the cache through another module either).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvstrata"

# The pure core: deterministic, testable anywhere, no torch, no I/O but its loaders'.
PURE_PACKAGES = ("hardware", "kv", "index", "policies", "plan", "sim", "manager")
PURE_MODULES = ("media", "errors", "slo", "lab/spec", "lab/model",  # the lab's cluster and the planner's view of it
                # a fleet's events, index and routing (not their wire or socket: fleet/wire, fleet/publisher)
                "fleet/events", "fleet/index", "fleet/cost", "fleet/scorer", "fleet/pace", "fleet/recorder", "fleet/router",
                "fleet/prompt")
# Third-party modules the pure core may use (no torch, no engines, no sockets).
PURE_THIRD_PARTY = {"numpy", "xxhash", "tomllib", "tomli"}  # figures are drawn at the edge (kvstrata.plots)
# The functions of the pure core that read or write files: its loaders.
IO_ALLOWED = {
    ("hardware/profile.py", "load_profile"),
    ("hardware/profile.py", "builtin_text"),
    ("hardware/profile.py", "builtin_profiles"),
    ("kv/presets.py", "load_config"),
    ("kv/presets.py", "load_source"),
    ("kv/presets.py", "list_presets"),
    ("sim/traceio.py", "read_trace"),
    ("sim/traceio.py", "write_trace"),
}
# Calls that read or write files (builtin open; pathlib, os and matplotlib's names for it).
IO_CALLS = {"open", "read_text", "write_text", "read_bytes", "write_bytes", "savefig", "mkdir", "unlink", "rmdir",
            "iterdir", "glob", "rglob", "exists", "is_file", "is_dir", "scandir", "listdir", "makedirs"}
IO_MODULES = {"os", "shutil", "subprocess", "socket", "tempfile", "io"}
# The trace file reader and writer (a loader module); the block hash, which reads a bytes object
# through an in-memory io.BytesIO (no file: the fastest C-level cut into blocks, measured).
IO_MODULE_USERS = {"sim/traceio.py", "index/keys.py"}
# The one place the product names its benchmarks: the CLI registers ``kvstrata bench`` by the
# name of the module that makes it (module, name).
BENCH_COMMAND = ("cli/__init__.py", "kvstrata.bench.cli")
DATA_PLANE = ("cache", "manager", "transfer", "tiers", "integrations")
MAX_FUNCTION_LINES = 60
FACADE = ROOT / "cache" / "tiered.py"
FACADE_LINES = 330  # "at most ~300": the facade composes, the halves do the work
MAX_MODULE_LINES = 450  # one concept a module (STYLE.md: mostly 100-400 lines)


def modules(*parts: str) -> list[Path]:
    out: list[Path] = []
    for part in parts:
        path = ROOT / part
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
    return out


def imported(tree: ast.AST, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``tree``, relative ones resolved."""
    package = module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] if base == "kvstrata" else [base]
            found += [(node.lineno, name) for name in names]
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_pure(name: str) -> bool:
    top = name.split(".")
    return top[0] == "kvstrata" and len(top) > 1 and (top[1] in PURE_PACKAGES or "/".join(top[1:]) in PURE_MODULES)


def test_the_pure_core_imports_only_the_pure_core_and_plain_libraries():
    bad = []
    for path in modules(*PURE_PACKAGES, *PURE_MODULES):
        for line, name in imported(ast.parse(path.read_text()), module_name(path)):
            top = name.split(".")[0]
            if top == "__future__" or is_pure(name) or top in PURE_THIRD_PARTY:
                continue
            if top in sys.stdlib_module_names and (top not in IO_MODULES or str(path.relative_to(ROOT)) in IO_MODULE_USERS):
                continue
            bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert bad == [], "the pure core reaches outside itself:\n" + "\n".join(bad)


def test_the_pure_core_does_file_io_only_in_its_loaders():
    bad = []
    for path in modules(*PURE_PACKAGES, *PURE_MODULES):
        rel = str(path.relative_to(ROOT))
        for function, node in _calls(ast.parse(path.read_text())):
            call = node.func
            name = call.id if isinstance(call, ast.Name) else call.attr if isinstance(call, ast.Attribute) else ""
            if name in IO_CALLS and (rel, function) not in IO_ALLOWED:
                bad.append(f"{rel}:{node.lineno} {ast.unparse(call)} in {function or 'module level'}")
    assert bad == [], "file I/O in the pure core outside its loaders:\n" + "\n".join(bad)


def test_the_pure_core_leaves_torch_unloaded():
    """Imported in a fresh interpreter, every pure module leaves torch (and the tiers) unloaded."""
    names = [module_name(p) for p in modules(*PURE_PACKAGES, *PURE_MODULES)]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('kvstrata.tiers', 'kvstrata.cache', "
        "'kvstrata.pool', 'kvstrata.transfer', 'kvstrata.bench')))\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT.parent)


def test_nothing_outside_bench_imports_bench():
    """Benchmarks are a leaf: no module outside ``kvstrata/bench`` imports them, at the top or in a
    function, nor names one for ``importlib``, but the CLI, which names ``kvstrata.bench.cli`` (the
    ``kvstrata bench`` command) to register it. What the product and the benchmarks both need (the
    lab's restores, the serving calibration, rounds) lives in the product."""
    bad, registered = [], []
    for path in modules(""):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "bench":
            continue
        tree = ast.parse(path.read_text())
        for line, name in imported(tree, module_name(path)):
            if _is_bench(name):
                bad.append(f"{rel}:{line} imports {name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_bench(node.value):
                if (rel.as_posix(), node.value) == BENCH_COMMAND:
                    registered.append(BENCH_COMMAND)
                else:
                    bad.append(f"{rel}:{node.lineno} names {node.value}")
    assert bad == [], "the product imports its benchmarks:\n" + "\n".join(bad)
    assert registered == [BENCH_COMMAND], f"{BENCH_COMMAND[0]} no longer registers {BENCH_COMMAND[1]}: update BENCH_COMMAND"


def _is_bench(name: str) -> bool:
    """A module name (or the start of one, an f-string's) in ``kvstrata.bench``; prose is not."""
    return (name == "kvstrata.bench" or name.startswith("kvstrata.bench.")) and not any(c.isspace() for c in name)


@pytest.mark.parametrize("package", DATA_PLANE)
def test_no_function_in_the_data_plane_is_over_sixty_lines(package):
    long = []
    for path in modules(package):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert long == [], "\n".join(long)


def test_the_cache_facade_stays_a_facade():
    lines = len(FACADE.read_text().splitlines())
    assert lines <= FACADE_LINES, f"{FACADE.relative_to(ROOT)} has {lines} lines: move work into the manager or worker"


def test_no_module_is_over_450_lines():
    long = []
    for path in modules(""):
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert long == [], f"over {MAX_MODULE_LINES} lines (split it by concept):\n" + "\n".join(long)


def _calls(tree: ast.AST, owner: str = ""):
    """(outermost enclosing function's name, Call node) for every call in ``tree``."""
    for node in ast.iter_child_nodes(tree):
        inner = node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not owner else owner
        if isinstance(node, ast.Call):
            yield owner, node
        yield from _calls(node, inner)
