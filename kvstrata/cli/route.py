"""``kvstrata route``: an OpenAI-compatible router over N ``vllm serve`` servers (see :mod:`kvstrata.fleet.front`)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from kvstrata import cli
from kvstrata.fleet.router import Limits
from kvstrata.fleet.scorer import Policy


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("route", help="an OpenAI-compatible router over vllm serve servers, by predicted TTFT")
    p.add_argument("--server", action="append", default=[], metavar="URL",
                   help="a vllm serve base URL (http://127.0.0.1:8000); repeat for each server")
    p.add_argument("--events", action="append", default=[], metavar="ENDPOINT",
                   help="the KV event endpoint of the --server in the same position (tcp://127.0.0.1:5557, as "
                        "its --kv-events-config publishes; '-' for none); none given: no index, prefix-blind")
    p.add_argument("--servers-file", type=Path, default=None, metavar="FILE",
                   help="servers one per line: URL [ENDPOINT] ('#' starts a comment), besides any --server")
    p.add_argument("--policy", default=Policy.PREDICTED_TTFT.value, metavar="POLICY",
                   help=f"routing policy: {', '.join(x.value for x in Policy)} (default predicted-ttft)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    p.add_argument("--block-size", type=int, default=16, help="the servers' --block-size, in tokens (default 16)")
    p.add_argument("--hash-algo", default="sha256", help="the servers' --prefix-caching-hash-algo (default sha256)")
    p.add_argument("--prefill-tokens-per-s", type=float, default=10_000.0,
                   help="each server's prefill rate, for predicted TTFT (default 10000)")
    p.add_argument("--max-inflight-per-server", type=int, default=Limits.per_server,
                   help=f"requests in flight per server; beyond, others, then 429 (default {Limits.per_server})")
    p.add_argument("--max-inflight", type=int, default=Limits.total,
                   help=f"requests in flight through the router; beyond, 429 (default {Limits.total})")
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between /health checks (default 2)")
    p.set_defaults(func=run_route)


def upstreams(args: argparse.Namespace) -> tuple:
    """The servers of ``--server``/``--events`` and ``--servers-file``, checked."""
    from kvstrata.fleet.front import Upstream

    if args.events and len(args.events) != len(args.server):
        raise cli.CliError(f"{len(args.events)} --events for {len(args.server)} --server: give one per server "
                           f"('-' for a server without one), or none")
    events = [None if e == "-" else e for e in args.events] or [None] * len(args.server)
    out = [Upstream(url, e) for url, e in zip(args.server, events)]
    if args.servers_file is not None:
        try:
            lines = args.servers_file.read_text().splitlines()
        except OSError as e:
            raise cli.CliError(f"--servers-file {args.servers_file}: {e.strerror}") from None
        for n, line in enumerate(lines, 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) > 2:
                raise cli.CliError(f"{args.servers_file}:{n}: expected URL [ENDPOINT], got {line.strip()!r}")
            out.append(Upstream(fields[0], fields[1] if len(fields) == 2 else None))
    return tuple(out)


def config(args: argparse.Namespace):
    """The front's configuration from the command line (ValueError: one line)."""
    from kvstrata.fleet.front import FrontConfig

    return FrontConfig(upstreams(args), Policy.parse(args.policy), args.block_size, args.hash_algo,
                       Limits(args.max_inflight_per_server, args.max_inflight), args.prefill_tokens_per_s,
                       args.health_interval)


def run_route(args: argparse.Namespace) -> int:
    from aiohttp import web

    from kvstrata.fleet.front import make_app

    setting = config(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    print(f"kvstrata route: {setting.policy.value} over {len(setting.upstreams)} servers on "
          f"http://{args.host}:{args.port}/v1", flush=True)
    web.run_app(make_app(setting), host=args.host, port=args.port, print=None)
    return 0
