"""``kvstrata kv-size``: bytes of KV per token, per GPU and per block, for a config or preset."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.table import Table

from kvstrata.cli import CliError, console
from kvstrata.kv import KVGeometry, list_presets, load_geometry
from kvstrata.kv.fields import GeometryError
from kvstrata.kv.groups import GroupKind, KVGroup
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
    if args.tp >= 1:
        _check_state_split(geometry, args.tp)
    try:
        check_tp(geometry, args.tp)
    except ValueError as exc:
        raise CliError(f"--tp {args.tp}: {exc}") from None
    if args.block_tokens < 1:
        raise CliError(f"--block-tokens must be at least 1, got {args.block_tokens}")
    if args.context is not None and args.context < 0:
        raise CliError(f"--context must be a non-negative number of tokens, got {args.context}")
    if args.context is not None and geometry.max_context is not None and args.context > geometry.max_context:
        raise CliError(
            f"--context {args.context:,} exceeds {geometry.name}'s {geometry.max_context:,}-token context "
            "(config field 'max_position_embeddings')"
        )
    report = kv_size_report(
        geometry, tp=args.tp, block_tokens=args.block_tokens, context_tokens=args.context
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        out = console()
        out.print(_table(report))
        for table in _group_tables(report):
            out.print(table)
    return 0


def _check_state_split(geometry: KVGeometry, tp: int) -> None:
    """A recurrent state splits by its own heads (gated delta net: its key heads; Mamba-2: its
    heads): say so when those, not the KV heads, refuse ``tp``."""
    for group in geometry.groups:
        if group.kind is GroupKind.STATE:
            try:
                group.heads_per_gpu(tp)
            except GeometryError:
                raise CliError(
                    f"--tp {tp}: {geometry.name}'s {group.label or 'state'} layers keep a state of "
                    f"{group.state_heads} heads, which does not split over {tp} GPUs"
                ) from None


def kv_size_report(
    geometry: KVGeometry, *, tp: int, block_tokens: int, context_tokens: int | None
) -> dict[str, Any]:
    """The figures ``kv-size`` prints, as plain JSON-ready data.

    ``bytes_per_token`` is what one more token adds once past every window (the layers that keep
    every token), ``state_bytes`` one sequence's fixed-size recurrent state, ``context_bytes``
    what a ``context_tokens``-long sequence holds: every token of full layers, at most a window
    (a chunk) of windowed ones, and the state. The ``_per_gpu`` figures and ``bytes_per_block``
    are for one GPU of the TP group, the others for the whole model. ``groups`` breaks them
    down by KV group (:mod:`kvstrata.kv.groups`).
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
        "hybrid": geometry.hybrid,
        "max_context": geometry.max_context,
        "bytes_per_token": geometry.bytes_per_token,
        "bytes_per_token_per_gpu": geometry.bytes_per_token_per_gpu(tp),
        "state_bytes": geometry.state_bytes(),
        "state_bytes_per_gpu": geometry.state_bytes(tp),
        "block_tokens": block_tokens,
        "bytes_per_block": geometry.bytes_per_block(block_tokens, tp),
        "total_params": geometry.total_params,
        "active_params": geometry.active_params,
        "uncounted_params": list(geometry.uncounted_params),
        "weight_bytes": geometry.weight_bytes(),
        "weight_dtype": geometry.effective_weight_dtype.value,
    }
    if context_tokens is not None:
        report["context_tokens"] = context_tokens
        report["context_bytes"] = geometry.kv_bytes(context_tokens)
        report["context_bytes_per_gpu"] = geometry.kv_bytes(context_tokens, tp)
    report["groups"] = [_group_report(group, tp, context_tokens) for group in geometry.groups]
    return report


def _group_report(group: KVGroup, tp: int, context_tokens: int | None) -> dict[str, Any]:
    """One KV group's figures: its per-token bytes (windowed ones too), its state, its share of the context."""
    out: dict[str, Any] = {
        "kind": group.kind.value,
        "label": group.label,
        "layers": list(group.layers),
        "num_layers": group.num_layers,
        "kv_heads": group.kv_heads,
        "head_dim": group.head_dim,
        "span": group.span,
        "dtype": group.dtype.value,
        "state_heads": group.state_heads,
        "bytes_per_token": group.token_bytes(),
        "bytes_per_token_per_gpu": group.token_bytes(tp),
        "state_bytes": group.state_bytes_per_gpu(),
        "state_bytes_per_gpu": group.state_bytes_per_gpu(tp),
    }
    if context_tokens is not None:
        out["context_bytes"] = group.bytes_for(context_tokens)
        out["context_bytes_per_gpu"] = group.bytes_for(context_tokens, tp)
    return out


def _table(report: dict[str, Any]) -> Table:
    table = Table(title="KV size", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    tp = report["tp"]
    heads = f"{report['attention'].upper()} ({report['num_attention_heads']} query heads)"
    per_token = "bytes / token" + (" (past every window)" if report["hybrid"] else "")
    rows = [
        ("model", report["model"]),
        ("attention", heads),
        ("layers", f"{report['num_layers']}"),
        ("KV heads", f"{report['num_kv_heads']}"),
        ("head dim", f"{report['head_dim']}"),
        ("KV dtype", report["dtype"]),
        (per_token, f"{report['bytes_per_token']:,}"),
        (f"{per_token} / GPU (TP {tp})", f"{report['bytes_per_token_per_gpu']:,}"),
    ]
    if report["state_bytes"]:
        rows += [
            ("state bytes / sequence", f"{report['state_bytes']:,}"),
            (f"state bytes / sequence / GPU (TP {tp})", f"{report['state_bytes_per_gpu']:,}"),
        ]
    rows.append((
        f"bytes / block ({report['block_tokens']} tokens, per GPU)",
        f"{report['bytes_per_block']:,}",
    ))
    if report["max_context"] is not None:
        rows.append(("max context", f"{report['max_context']:,} tokens"))
    if "context_tokens" in report:
        context = f"KV of {report['context_tokens']:,} tokens"
        rows += [
            (context, _gb(report["context_bytes"])),
            (f"{context} per GPU (TP {tp})", _gb(report["context_bytes_per_gpu"])),
        ]
    params = f"{report['total_params'] / 1e9:.2f} B / {report['active_params'] / 1e9:.2f} B"
    at_least = "at least " if report["uncounted_params"] else ""
    rows += [
        (f"weights ({report['weight_dtype']}, unsharded)", at_least + _gb(report["weight_bytes"])),
        ("params total / active", at_least + params),
    ]
    if report["uncounted_params"]:
        rows.append(("params not counted", ", ".join(report["uncounted_params"])))
    for label, value in rows:
        table.add_row(label, value)
    return table


def _group_tables(report: dict[str, Any]) -> list[Table]:
    """A row per KV group (none for a one-group model: the table above says it all)."""
    groups = report["groups"]
    if len(groups) < 2 and not report["hybrid"]:
        return []
    context = "context_tokens" in report
    table = Table(title="KV groups (B: bytes)")
    table.add_column("group")
    table.add_column("config kind", no_wrap=True, min_width=len("linear_attention"))
    for name in ("layers", "heads x dim", "span", "dtype", "B / token", "state B / seq"):
        table.add_column(name, justify="right")
    if context:
        table.add_column(f"KV of {report['context_tokens']:,} tok", justify="right")
    for group in groups:
        per_token = group["state_heads"] == 0
        row = [
            group["kind"],
            group["label"] or "-",
            f"{group['num_layers']}",
            f"{group['kv_heads']}x{group['head_dim']}" if per_token else "-",
            f"{group['span']:,} tok" if group["span"] else "-",
            group["dtype"],
            f"{group['bytes_per_token']:,}" if per_token else "-",
            f"{group['state_bytes']:,}" if not per_token else "-",
        ]
        if context:
            row.append(_gb(group["context_bytes"]))
        table.add_row(*row)
    return [table]


def _gb(size_bytes: int) -> str:
    return f"{size_bytes / _GB:,.2f} GB"
