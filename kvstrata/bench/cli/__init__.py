"""``kvstrata bench``: benchmarks that print ours beside baselines measured in the same run.

``bench cache``: store and restore GB/s of each cache tier against plain copies, plain file
I/O and LMCache (when importable), and hash+lookup time. ``bench remote``: store and restore
GB/s through the remote tier (and the whole cache) against raw Mooncake calls, in TCP and
shared-memory modes, and time to first byte. ``bench sim``: wall seconds of the trace-driven
simulator per architecture on the Mooncake trace and on a 12,000-request tiling of it, beside a
plain replay of the same trace (``analyze``). ``bench recompute``: load or recompute on the tiny
model over capped disk rates. ``bench e2e``: the workload of ``kvstrata demo`` with LMCache
beside it. ``bench lookup`` and ``bench restart``: the lookup path against the bare hash chain,
and a restart's first hit. ``bench sglang``: kvstrata as SGLang's HiCache storage. ``bench
serve``: vLLM serving with the connector against without. ``bench route``: ``kvstrata route``'s
policies over vLLM servers on one pool.

This module registers the command; each family of sub-commands is a module of its own, which
makes its tables and every label in them: ``tiers`` (cache, remote), ``sim``, ``ttft``
(recompute, e2e), ``lookup`` (lookup, restart), ``sglang``, ``serve`` and ``route``; what they share is
``common``. ``kvstrata.cli`` registers this command by its module's name: the one place the
product names its benchmarks. Progress goes to stderr; ``--json`` prints
the report alone on stdout (:func:`kvstrata.report.to_json`). Decimal GB/s (1 GB = 1e9 bytes).
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

from kvstrata.bench.cli import lookup, route, serve, sglang, sim, tiers, ttft

# Each family's ``register``, in help order.
_FAMILIES = (tiers, sim, ttft, lookup, sglang, serve, route)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``bench`` and, through each family's ``register``, its sub-commands: ``cache``, ``remote``,
    ``sim``, ``recompute``, ``e2e``, ``lookup``, ``restart``, ``sglang``, ``serve`` and ``route``."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks: ours beside baselines measured in the same run",
        description="Measure kvstrata against plain copies, plain file I/O and other systems, "
        "in one run on the same bytes, and print the ratios.",
    )
    benches = parser.add_subparsers(dest="bench_command", metavar="BENCH", required=True)

    def bench(name: str, func: Callable[[argparse.Namespace], int], help: str, description: str) -> argparse.ArgumentParser:
        p = benches.add_parser(name, help=help, description=description)
        p.set_defaults(func=func)
        return p

    for family in _FAMILIES:
        family.register(bench)
