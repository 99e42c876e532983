"""``kvstrata pool start|stop|status|metrics|libs``: the embedded Mooncake pool on loopback, or a configured one.

Sizes are decimal (``--segment-size 2GB`` is 2e9 bytes; ``2GiB`` for binary), see ``kvstrata.cli.units``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.table import Table

from kvstrata import cli
from kvstrata.cli.units import format_size, size_arg
from kvstrata.pool import embedded
from kvstrata.pool.config import ENV as POOL_ENV
from kvstrata.pool.config import load_pool_config
from kvstrata.pool.network import PoolNetwork

DEFAULT_SEGMENT_BYTES = 2 * 10**9  # 2 GB of DRAM served by the daemon (decimal, as every size here)
PROCESSES = ("master", "daemon")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pool", help="start, stop or inspect the shared remote DRAM pool (Mooncake Store)")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    start = actions.add_parser("start", help="start a master and a pool daemon on loopback")
    start.add_argument("--segment-size", type=size_arg, default=DEFAULT_SEGMENT_BYTES, metavar="SIZE",
                       help="DRAM the daemon serves: 2GB = 2e9 bytes, 512MB, or binary 2GiB (default 2GB)")
    start.add_argument("--secret-file", type=Path, default=None, metavar="FILE",
                       help="the deployment secret clients seal pool values with (64 hex digits, 0600, yours); "
                            "default: the run directory's pool.key, made if absent")
    start.add_argument("--network", choices=[n.value for n in PoolNetwork], default=PoolNetwork.AUTO.value,
                       help="where the pool listens: private, a network namespace of its own (root only; nothing "
                            "on the host's network, where Mooncake's transfer ports would be on every interface); "
                            "host, the host's loopback; auto (default), private where this user can make it")
    metrics = actions.add_parser("metrics", help="the master's Prometheus metrics (fill, objects), fetched from "
                                 "inside the pool's network (print them, or write them for a textfile collector)")
    metrics.add_argument("--dir", type=Path, default=None, help="run directory (default $KVSTRATA_POOL_DIR or ~/.cache)")
    for q in (start, actions.add_parser("stop", help="stop the embedded pool"),
              actions.add_parser("status", help="is the pool up?")):
        q.add_argument("--dir", type=Path, default=None, help="run directory (default $KVSTRATA_POOL_DIR or ~/.cache)")
        q.add_argument("--config", default=None, help="a pool TOML pointing at an existing cluster (status only)")
        q.add_argument("--json", action="store_true")
    actions.add_parser("libs", help="the Debian packages of the system libraries the pool engine lacks here "
                       "(stdout; nothing: none), and why (stderr)")
    p.set_defaults(func=run)


def status_table(doc: dict[str, Any]) -> Table:
    """The processes of a ``status`` document, one a row: address, pid (embedded only), answering."""
    table = Table(box=None, pad_edge=False, show_edge=False)
    for column in ("process", "address", "pid", "answers"):
        table.add_column(column)
    for name in PROCESSES:
        if name in doc:
            p = doc[name]
            table.add_row(name, p["address"], str(p.get("pid", "-")), "[green]yes[/]" if p["up"] else "[red]no[/]")
    return table


def status_notes(doc: dict[str, Any]) -> list[str]:
    """What else a ``status`` document says, one line each: segment, config, how to use it."""
    notes = []
    if "segment_bytes" in doc:
        notes.append(f"segment: {format_size(doc['segment_bytes'])} ({doc['segment_bytes']} bytes)")
    if "network" in doc:
        notes.append("network: " + ("the host's loopback (Mooncake's transfer ports on every interface)"
                                    if doc["network"] == "host" else f"namespace {doc['network']} (root only)"))
    if "config" in doc:
        c = doc["config"]
        notes.append(f"protocol: {c['protocol']}, metadata: {c['metadata_server']}, "
                     "secret: " + (f"{c['secret_file']} (values sealed; caches encrypt them unless pool_encrypt=False)"
                                   if c["secret_file"] else "none (values not sealed nor encrypted)"))
    if "state_file" in doc:
        notes.append(f"use it with {POOL_ENV}={doc['state_file']}")
    return notes


def _print_status(doc: dict[str, Any], where: str) -> None:
    console = cli.console()
    if "reason" in doc:
        console.print(f"[red]not running[/]: {doc['reason']}", highlight=False)
        return
    state = "[green]running[/]" if doc["running"] else "[red]not running[/]"
    console.print(f"pool {state} ({where})", highlight=False)
    console.print(status_table(doc), highlight=False)
    for note in status_notes(doc):
        console.print(note, highlight=False)


def run(args: argparse.Namespace) -> int:
    if args.action == "libs":
        return run_libs()
    if args.action == "start":
        state = embedded.start(args.segment_size, args.dir, args.secret_file, PoolNetwork(args.network))
        doc = state.to_json() | {"state_file": str(Path(state.run_dir) / embedded.STATE)}
        if args.json:
            print(json.dumps(doc, indent=2))
        else:
            cli.console().print(
                f"pool up: master {state.config.master}, daemon {state.config.daemon}"
                + (f" in network namespace {state.config.network}" if state.config.network else " on the host's loopback")
                + f", {format_size(state.segment_bytes)} segment; use it with {POOL_ENV}={doc['state_file']}",
                highlight=False,
            )
        return 0
    if args.action == "metrics":
        try:
            sys.stdout.write(embedded.master_metrics(args.dir))
        except embedded.PoolError as error:
            print(error, file=sys.stderr)
            return 1
        return 0
    if args.action == "stop":
        stopped = embedded.stop(args.dir)
        if args.json:
            print(json.dumps({"stopped": stopped.recorded, "not_signalled": list(stopped.unknown_pids),
                              "interrupted_start_processes": stopped.interrupted}))
        else:
            print("pool stopped" if stopped.recorded else "no pool was running")
            if stopped.interrupted:
                print(f"stopped {stopped.interrupted} process(es) a killed `pool start` had left running")
            if stopped.unknown_pids:
                print(stopped.describe(), file=sys.stderr)
        return 0
    if args.config:
        config = load_pool_config(args.config)
        # Each process must answer, not only accept (a stopped one still accepts); the daemon
        # too where the config names one: objects live there, and the master answers without it.
        named = {"master": config.master} | ({"daemon": config.daemon} if config.daemon else {})
        doc = {name: {"address": address, "up": embedded.answers_in(config.network, address, 2.0)}
               for name, address in named.items()}
        doc = {"running": all(p["up"] for p in doc.values())} | doc | {"config": config.to_json()}
        where = f"configured by {config.config_file}"
    else:
        doc = embedded.status(args.dir)
        where = f"embedded, run directory {Path(doc['state_file']).parent}" if "state_file" in doc else ""
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        _print_status(doc, where)
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
