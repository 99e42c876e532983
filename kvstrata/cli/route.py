"""``kvstrata route``: an OpenAI-compatible router over N ``vllm serve`` servers (see :mod:`kvstrata.fleet.front`)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from kvstrata import cli
from kvstrata.fleet.router import BLOCK_TOKENS, HEALTH_INTERVAL_S, PREFILL_TOKENS_PER_S, Limits
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
    p.add_argument("--block-size", type=int, default=BLOCK_TOKENS,
                   help=f"the servers' --block-size, in tokens (default {BLOCK_TOKENS})")
    p.add_argument("--hash-algo", default="sha256", help="the servers' --prefix-caching-hash-algo (default sha256)")
    p.add_argument("--prefill-tokens-per-s", type=float, default=PREFILL_TOKENS_PER_S,
                   help=f"each server's prefill rate, for predicted TTFT (default {PREFILL_TOKENS_PER_S:.0f}: a "
                        "placeholder, not a measurement; --calibration prices the servers as measured)")
    p.add_argument("--calibration", default=None, metavar="PROFILE.toml",
                   help="a host profile from kvstrata calibrate, with --model-dir: the servers' prefill and their "
                        "tiers' restores priced as the connector prices them (else --prefill-tokens-per-s, device only)")
    p.add_argument("--model-dir", default=None, metavar="DIR",
                   help="the served model's directory (its KV bytes per block, and its prefill's key in --calibration)")
    p.add_argument("--max-inflight-per-server", type=int, default=Limits.per_server,
                   help=f"requests in flight per server; beyond, others, then 429 (default {Limits.per_server})")
    p.add_argument("--max-inflight", type=int, default=Limits.total,
                   help=f"requests in flight through the router; beyond, 429 (default {Limits.total})")
    p.add_argument("--health-interval", type=float, default=HEALTH_INTERVAL_S,
                   help=f"seconds between /health checks (default {HEALTH_INTERVAL_S:g})")
    p.add_argument("--slo-ttft-ms", type=float, default=None, metavar="MS",
                   help="with --slo-tpot-ms, the targets predicted-ttft routes to meet: a server is chosen among "
                        "those predicted within both while any is (default: none, the least predicted TTFT)")
    p.add_argument("--slo-tpot-ms", type=float, default=None, metavar="MS",
                   help="the time per output token target (with --slo-ttft-ms)")
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
                       args.health_interval, server_cost=calibrated_cost(args), slo=slo(args))


def slo(args: argparse.Namespace):
    """``--slo-ttft-ms`` and ``--slo-tpot-ms``: both or neither; None for neither."""
    if args.slo_ttft_ms is None and args.slo_tpot_ms is None:
        return None
    if args.slo_ttft_ms is None or args.slo_tpot_ms is None:
        raise cli.CliError("give --slo-ttft-ms and --slo-tpot-ms together (the SLO has both targets)")
    return cli.slo_ms(args.slo_ttft_ms, args.slo_tpot_ms)


def calibrated_cost(args: argparse.Namespace):
    """``--calibration`` with ``--model-dir``: the servers' costs on this host; None without them."""
    if args.calibration is None:
        return None
    if args.model_dir is None:
        raise cli.CliError("--calibration needs --model-dir: the model's KV bytes and its prefill's name")
    from kvstrata.calibrate import load_calibration
    from kvstrata.fleet.cost import ServerCost
    from kvstrata.kv.presets import load_geometry

    model = cli.model_dir(args.model_dir)
    block_bytes = load_geometry(str(model)).bytes_per_token * args.block_size
    return ServerCost.from_calibration(load_calibration(args.calibration), model.resolve().name, args.block_size,
                                       block_bytes)


def run_route(args: argparse.Namespace) -> int:
    from aiohttp import web

    from kvstrata.fleet.front import make_app

    setting = config(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    target = (f", within TTFT {setting.slo.ttft_s * 1e3:g} ms and TPOT {setting.slo.tpot_s * 1e3:g} ms"
              if setting.slo is not None and setting.policy is Policy.PREDICTED_TTFT else "")
    print(f"kvstrata route: {setting.policy.value} over {len(setting.upstreams)} server(s){target} on "
          f"http://{args.host}:{args.port}/v1", flush=True)
    web.run_app(make_app(setting), host=args.host, port=args.port, print=None)
    return 0
