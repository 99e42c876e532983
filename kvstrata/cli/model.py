"""``kvstrata model make-tiny DIR``: a small random-weight Llama (or, with ``--hybrid``, a Gemma 2
sliding-window or Qwen3-Next linear-attention hybrid; with ``--mla``, a DeepSeek-V2-Lite-shaped
MLA model) model and tokenizer, offline."""

from __future__ import annotations

import argparse
from kvstrata import cli


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="models for the engine integrations")
    msub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    m = msub.add_parser("make-tiny", help="write a tiny random-weight Llama model + tokenizer (no download)")
    m.add_argument("dir", help="output directory (created; reused if it holds the same tiny model)")
    defaults = _Defaults()
    for name in ("hidden", "layers", "heads", "kv_heads", "vocab", "seed"):
        m.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    m.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=defaults.dtype)
    m.add_argument("--hybrid", choices=("sliding", "linear"), default=None,
                   help="a hybrid instead: Gemma 2 sliding + full attention, or Qwen3-Next linear + full attention")
    m.add_argument("--mla", action="store_true",
                   help="a DeepSeek-V2-Lite-shaped MLA + MoE model instead (its latent: 512 + 64, as vLLM's CPU MLA takes)")
    m.add_argument("--overwrite", action="store_true", help="replace a different tiny model in DIR")
    m.set_defaults(func=run_make_tiny)


def _Defaults():
    from kvstrata.integrations.tiny import TinySpec

    return TinySpec()


def run_make_tiny(args: argparse.Namespace) -> int:
    from kvstrata.integrations.tiny import TinySpec, make_tiny

    if args.hybrid is not None:
        return _make_tiny_hybrid(args)
    if args.mla:
        return _make_tiny_mla(args)

    spec = TinySpec(
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=-(-8 * args.hidden // 3 // 16) * 16,  # Llama's ~8/3 x hidden, a multiple of 16
        vocab=args.vocab,
        seed=args.seed,
        dtype=args.dtype,
    )
    try:
        out = make_tiny(args.dir, spec, overwrite=args.overwrite)
    except FileExistsError as e:
        raise cli.CliError(str(e)) from None
    params = spec.vocab * spec.hidden * 2 + spec.layers * (
        2 * spec.hidden * spec.hidden
        + 2 * spec.hidden * spec.hidden // spec.heads * spec.kv_heads
        + 3 * spec.hidden * spec.intermediate
    )
    cli.console().print(
        f"tiny Llama in {out}: {spec.layers} layers, hidden {spec.hidden}, {spec.heads} heads "
        f"({spec.kv_heads} KV), vocab {spec.vocab}, {spec.dtype}, ~{params / 1e6:.1f}M parameters"
    )
    return 0


def _make_tiny_hybrid(args: argparse.Namespace) -> int:
    from kvstrata.integrations.tiny import HybridKind, TinyHybridSpec, make_tiny_hybrid

    try:
        spec = TinyHybridSpec(kind=HybridKind(args.hybrid), hidden=args.hidden, layers=args.layers, heads=args.heads,
                              kv_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                              intermediate=2 * args.hidden, vocab=args.vocab, seed=args.seed, dtype=args.dtype)
        out = make_tiny_hybrid(args.dir, spec, overwrite=args.overwrite)
    except (FileExistsError, ValueError) as e:
        raise cli.CliError(str(e)) from None
    cli.console().print(f"tiny {spec.kind.value} hybrid in {out}: {spec.layers} layers, hidden {spec.hidden}, "
                        f"{spec.heads} heads ({spec.kv_heads} KV), vocab {spec.vocab}, {spec.dtype}")
    return 0


def _make_tiny_mla(args: argparse.Namespace) -> int:
    from kvstrata.integrations.tiny import TinyMLASpec, make_tiny_mla

    try:
        spec = TinyMLASpec(hidden=args.hidden, layers=args.layers, heads=args.heads, vocab=args.vocab,
                           seed=args.seed, dtype=args.dtype)
        out = make_tiny_mla(args.dir, spec, overwrite=args.overwrite)
    except (FileExistsError, ValueError) as e:
        raise cli.CliError(str(e)) from None
    cli.console().print(f"tiny MLA model in {out}: {spec.layers} layers ({spec.first_dense_layers} dense), hidden "
                        f"{spec.hidden}, {spec.heads} heads, latent {spec.kv_lora_rank} + {spec.qk_rope_head_dim}, "
                        f"{spec.routed_experts} experts (top {spec.experts_per_token}), vocab {spec.vocab}, {spec.dtype}")
    return 0
