"""``kvstrata model make DIR --like MODEL``: a random-weight model of a real model's shape
(:mod:`kvstrata.integrations.shaped`). ``kvstrata model make-tiny DIR``: a small random-weight Llama (or, with ``--hybrid``, a Gemma 2
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

    s = msub.add_parser("make", help="write a random-weight model of a real model's shape + tokenizer (no download)",
                        description="A model of a real model's shape with seeded random weights: the published "
                                    "config.json of a model people serve, its layers, widths and vocabulary exact, so "
                                    "its prefill costs what the real model's does and its KV has the same bytes per "
                                    "token; its answers mean nothing. Presets: " + ", ".join(_SHAPES) + ".")
    s.add_argument("dir", help="output directory (created; reused if it holds the same model)")
    s.add_argument("--like", required=True, metavar="MODEL",
                   help="a preset name (" + ", ".join(_SHAPES) + ", or any of kvstrata's presets) or a config.json "
                        "file or model directory")
    s.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--overwrite", action="store_true", help="replace a different model in DIR")
    s.set_defaults(func=run_make)


_SHAPES = ("qwen2.5-0.5b", "qwen3-0.6b", "llama-3.2-1b", "qwen2.5-1.5b")  # small dense models people serve


def run_make(args: argparse.Namespace) -> int:
    from kvstrata.integrations.shaped import ShapedSpec, make_shaped
    from kvstrata.kv.geometry import GeometryError

    try:
        built = make_shaped(args.dir, ShapedSpec(args.like, args.dtype, args.seed), overwrite=args.overwrite)
    except (FileExistsError, FileNotFoundError, GeometryError, ValueError) as e:
        raise cli.CliError(str(e)) from None
    cli.console().print(f"{built.name}-shaped model in {built.directory}: {built.parameters / 1e6:,.0f}M parameters, "
                        f"{built.dtype}, KV {built.kv_bytes_per_token / 1024:,.0f} KiB per token (random weights, "
                        f"from {built.source})")
    return 0


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
