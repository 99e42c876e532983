"""``kvstrata kv-size``: bytes of KV per token, per GPU and per block, for a config or preset."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from kvstrata.cli import CliError
from kvstrata.kv import KVGeometry, list_presets, load_geometry
from kvstrata.plan.sizing import check_tp

_GB = 1e9  # decimal GB, as everywhere in kvstrata (see kvstrata.cli.units)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``kv-size`` sub-command."""
    parser = subparsers.add_parser(
        "kv-size",
        help="bytes of KV per token for a model config or preset",
        description="Size a model's KV cache: bytes per token, per GPU under tensor "
        "parallelism, per paged block and for a whole context.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--model",
        metavar="CONFIG_OR_PRESET",
        help="a Hugging Face config.json, a model directory holding one, or a preset name",
    )
    source.add_argument("--list", action="store_true", help="list the built-in presets")
    parser.add_argument(
        "--dtype", help="KV dtype: bf16, fp16, fp32, fp8 (default: the config's, else bf16)"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default: 1)")
    parser.add_argument(
        "--block-tokens", type=int, default=256, help="tokens per paged KV block (default: 256)"
    )
    parser.add_argument(
        "--context", type=int, metavar="TOKENS", help="also size a context this many tokens long"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the presets, or the KV sizes of ``args.model``; returns the exit code."""
    if args.list:
        names = list_presets()
        print(json.dumps(names, indent=2) if args.json else "\n".join(names))
        return 0
    geometry = load_geometry(args.model, dtype=args.dtype)
    try:
        check_tp(geometry, args.tp)
    except ValueError as exc:
        raise CliError(f"--tp {args.tp}: {exc}") from None
    if args.block_tokens < 1:
        raise CliError(f"--block-tokens must be at least 1, got {args.block_tokens}")
    if args.context is not None and args.context < 0:
        raise CliError(f"--context must be a non-negative number of tokens, got {args.context}")
    report = kv_size_report(
        geometry, tp=args.tp, block_tokens=args.block_tokens, context_tokens=args.context
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        Console().print(_table(report))
    return 0


def kv_size_report(
    geometry: KVGeometry, *, tp: int, block_tokens: int, context_tokens: int | None
) -> dict[str, Any]:
    """The figures ``kv-size`` prints, as plain JSON-ready data.

    ``bytes_per_block`` and ``context_bytes_per_gpu`` are for one GPU of the TP group;
    ``bytes_per_token`` and ``context_bytes`` for the whole model.
    """
    report: dict[str, Any] = {
        "model": geometry.name,
        "attention": geometry.attention.value,
        "dtype": geometry.dtype.value,
        "tp": tp,
        "num_layers": geometry.num_layers,
        "num_attention_heads": geometry.num_attention_heads,
        "num_kv_heads": geometry.num_kv_heads,
        "head_dim": geometry.head_dim,
        "bytes_per_token": geometry.bytes_per_token,
        "bytes_per_token_per_gpu": geometry.bytes_per_token_per_gpu(tp),
        "block_tokens": block_tokens,
        "bytes_per_block": geometry.bytes_per_block(block_tokens, tp),
        "total_params": geometry.total_params,
        "active_params": geometry.active_params,
        "weight_bytes": geometry.weight_bytes(),
        "weight_dtype": geometry.effective_weight_dtype.value,
    }
    if context_tokens is not None:
        report["context_tokens"] = context_tokens
        report["context_bytes"] = geometry.kv_bytes(context_tokens)
        report["context_bytes_per_gpu"] = geometry.kv_bytes(context_tokens, tp)
    return report


def _table(report: dict[str, Any]) -> Table:
    table = Table(title="KV size", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    tp = report["tp"]
    heads = f"{report['attention'].upper()} ({report['num_attention_heads']} query heads)"
    rows = [
        ("model", report["model"]),
        ("attention", heads),
        ("layers", f"{report['num_layers']}"),
        ("KV heads", f"{report['num_kv_heads']}"),
        ("head dim", f"{report['head_dim']}"),
        ("KV dtype", report["dtype"]),
        ("bytes / token", f"{report['bytes_per_token']:,}"),
        (f"bytes / token / GPU (TP {tp})", f"{report['bytes_per_token_per_gpu']:,}"),
        (
            f"bytes / block ({report['block_tokens']} tokens, per GPU)",
            f"{report['bytes_per_block']:,}",
        ),
    ]
    if "context_tokens" in report:
        context = f"KV of {report['context_tokens']:,} tokens"
        rows += [
            (context, _gb(report["context_bytes"])),
            (f"{context} per GPU (TP {tp})", _gb(report["context_bytes_per_gpu"])),
        ]
    params = f"{report['total_params'] / 1e9:.2f} B / {report['active_params'] / 1e9:.2f} B"
    rows += [
        (f"weights ({report['weight_dtype']}, unsharded)", _gb(report["weight_bytes"])),
        ("params total / active", params),
    ]
    for label, value in rows:
        table.add_row(label, value)
    return table


def _gb(size_bytes: int) -> str:
    return f"{size_bytes / _GB:,.2f} GB"
