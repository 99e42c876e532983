"""``kvstrata trace``: analyze a Mooncake-format trace's prefix reuse, or generate a synthetic one."""

from __future__ import annotations

import argparse
import json
import time

from rich.table import Table

from kvstrata import cli
from kvstrata.sim.analyze import analyze
from kvstrata.sim.synthetic import Mix, SyntheticConfig, TraceKind, generate
from kvstrata.sim.trace import BLOCK_TOKENS
from kvstrata.sim.traceio import read_trace, write_trace

DEFAULT_CACHE_TOKENS = ("64K", "256K", "1M", "inf")
_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace", help="analyze or generate Mooncake-format request traces"
    )
    tsub = p.add_subparsers(dest="trace_command", metavar="ACTION", required=True)

    a = tsub.add_parser(
        "analyze", help="prefix-cache hit ratio of a trace at several LRU cache sizes"
    )
    a.add_argument("--trace", required=True, help="JSON-lines trace (Mooncake format)")
    a.add_argument(
        "--cache-tokens",
        nargs="+",
        default=list(DEFAULT_CACHE_TOKENS),
        metavar="N",
        help="cache sizes in tokens: integers, K/M/G suffixes (binary), or inf "
        f"(default {' '.join(DEFAULT_CACHE_TOKENS)})",
    )
    a.add_argument("--json", action="store_true", help="print JSON")
    a.set_defaults(func=run_analyze)

    g = tsub.add_parser(
        "generate",
        help="write a seeded synthetic trace (chat, shared system prompts, agents)",
    )
    g.add_argument("--out", required=True, help="file to write (JSON lines)")
    g.add_argument(
        "--requests", type=int, default=1000, help="number of requests (default 1000)"
    )
    g.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    g.add_argument(
        "--rate", type=float, default=1.0, help="mean arrivals per second (default 1.0)"
    )
    g.add_argument(
        "--kind",
        choices=[k.value for k in TraceKind],
        default="mix",
        help="traffic kind (default mix)",
    )
    g.set_defaults(func=run_generate)


def parse_cache_tokens(text: str) -> int | None:
    """``65536``, ``64K``, ``1M`` or ``inf`` (``None``, unlimited)."""
    s = text.strip().upper()
    if s in ("INF", "UNLIMITED"):
        return None
    scale = _SUFFIX.get(s[-1:], 1)
    digits = s[:-1] if scale > 1 else s
    if not digits.isdigit():
        raise cli.CliError(
            f"--cache-tokens {text!r}: expected a non-negative integer, K/M/G suffix, or inf"
        )
    return int(digits) * scale


def run_analyze(args: argparse.Namespace) -> int:
    capacities = [parse_cache_tokens(t) for t in args.cache_tokens]
    requests = read_trace(args.trace)
    if not requests:
        raise cli.CliError(f"trace {args.trace!r} has no requests (no non-blank line): nothing to analyze")
    start = time.perf_counter()
    result = analyze(requests, capacities)
    elapsed_s = time.perf_counter() - start
    if args.json:
        print(json.dumps(result.to_json(), indent=2, allow_nan=False))
        return 0
    console = cli.console()
    console.print(
        f"[bold]{args.trace}[/]: {result.requests:,} requests, mean input {result.mean_input:,.0f} tokens, "
        f"mean output {result.mean_output:,.0f}, {result.unique_blocks:,} unique {BLOCK_TOKENS}-token blocks; "
        f"replayed in {elapsed_s * 1e3:,.0f} ms"
    )
    t = Table(
        title="Prefix-cache hits replaying the trace through one LRU cache of blocks"
    )
    for col in ("cache tokens", "blocks", "hit tokens", "hit ratio"):
        t.add_column(col, justify="right")
    for c in result.capacities:
        t.add_row(
            "inf" if c.unlimited else f"{c.cache_tokens:,}",
            "inf" if c.unlimited else f"{c.cache_blocks:,}",
            f"{c.hit_tokens:,}",
            f"{c.hit_ratio:.2%}",
        )
    console.print(t)
    return 0


def run_generate(args: argparse.Namespace) -> int:
    if args.requests < 1:
        raise cli.CliError(f"--requests must be at least 1, got {args.requests}")
    if not args.rate > 0:
        raise cli.CliError(f"--rate must be a positive number of arrivals per second, got {args.rate}")
    config = SyntheticConfig(
        requests=args.requests,
        seed=args.seed,
        rate=args.rate,
        mix=Mix.of(TraceKind(args.kind)),
    )
    n = write_trace(args.out, generate(config))
    cli.console().print(
        f"wrote {n:,} {args.kind} requests (seed {args.seed}) to [bold]{args.out}[/]"
    )
    return 0
