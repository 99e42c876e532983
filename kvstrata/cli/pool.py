"""``kvstrata pool start|stop|status``: the embedded Mooncake pool on loopback, or a configured one."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from kvstrata import cli
from kvstrata.pool import embedded
from kvstrata.pool.config import load_pool_config

GIB = 1024**3


_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": GIB, "t": 1024**4}


def _size(text: str) -> int:
    """``2GB``, ``512MiB``, ``1.5g`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if m is None or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GB, 512MB)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pool", help="start, stop or inspect the shared remote DRAM pool (Mooncake Store)")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    start = actions.add_parser("start", help="start a master and a pool daemon on loopback")
    start.add_argument("--segment-size", type=_size, default=2 * GIB, help="DRAM the daemon serves (default 2GB)")
    for q in (start, actions.add_parser("stop", help="stop the embedded pool"),
              actions.add_parser("status", help="is the pool up?")):
        q.add_argument("--dir", type=Path, default=None, help="run directory (default $KVSTRATA_POOL_DIR or ~/.cache)")
        q.add_argument("--config", default=None, help="a pool TOML pointing at an existing cluster (status only)")
        q.add_argument("--json", action="store_true")
    actions.add_parser("libs", help="the Debian packages of the system libraries the pool engine lacks here "
                       "(stdout; nothing: none), and why (stderr)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    console = cli.console()
    if args.action == "libs":
        return run_libs()
    if args.action == "start":
        state = embedded.start(args.segment_size, args.dir)
        doc = state.to_json() | {"state_file": str(Path(state.run_dir) / embedded.STATE)}
        if args.json:
            print(json.dumps(doc, indent=2))
        else:
            console.print(
                f"pool up: master {state.config.master}, daemon {state.config.daemon}, "
                f"{state.segment_bytes / GIB:.2f} GiB; use it with KVSTRATA_POOL={doc['state_file']}"
            )
        return 0
    if args.action == "stop":
        stopped = embedded.stop(args.dir)
        print(json.dumps({"stopped": stopped}) if args.json else ("pool stopped" if stopped else "no pool was running"))
        return 0
    if args.config:
        config = load_pool_config(args.config)
        # Each process must answer, not only accept (a stopped one still accepts); the daemon
        # too where the config names one: objects live there, and the master answers without it.
        named = {"master": config.master} | ({"daemon": config.daemon} if config.daemon else {})
        doc = {name: {"address": address, "up": embedded.answers(address, 2.0)} for name, address in named.items()}
        doc = {"running": all(p["up"] for p in doc.values())} | doc | {"config": config.to_json()}
    else:
        doc = embedded.status(args.dir)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        console.print(("[green]running[/]" if doc["running"] else "[red]not running[/]") + f": {doc}", highlight=False)
    return 0 if doc["running"] else 1


def run_libs() -> int:
    """The set-up scripts' check (``.ci/pool-libs``): on stdout the Debian packages of the
    missing system libraries (space-separated; nothing when none is missing), on stderr the
    line that names them; exit 1 when the engine is not installed or a missing library has no
    known package."""
    from kvstrata.pool import libs

    files = libs.engine_files()
    if not files:
        print(libs.problem(), file=sys.stderr)
        return 1
    missing = libs.missing_libraries(files)
    if not missing:
        return 0
    if libs.packages(missing):
        print(" ".join(libs.packages(missing)))
    print(libs.describe(missing), file=sys.stderr)
    return 0 if all(lib in libs.DEBIAN_PACKAGES for lib in missing) else 1
