"""The `glint` command line: convert, info, demo, generate, bench, serve."""
from __future__ import annotations

import argparse
import sys


def _cmd_convert(args) -> int:
    from glint.export.checkpoint import convert

    cfg = convert(args.hf_dir, args.out_dir, dtype=args.dtype, quantize=args.quantize, group=args.group_size,
                  quantize_head=args.quantize_head)
    print(f"wrote {args.out_dir}: {cfg.model_type}, {cfg.num_layers} layers, {cfg.num_params:,} parameters, "
          f"{cfg.dtype}" + (f", linears {cfg.linears_label}" if cfg.quantize != "none" or cfg.quantize_head else ""))
    return 0


def _cmd_info(args) -> int:
    import collections

    from glint.runtime.loading import resolve_config

    cfg = resolve_config(args.checkpoint, quantize=args.quantize, quantize_head=args.quantize_head)
    if args.json:
        print(cfg.to_json())
        return 0

    def runs(values) -> str:  # per-layer values as "value x count", in order of first appearance
        return ", ".join(f"{v} x{n}" for v, n in collections.Counter(values).items())

    windows = runs("global" if w == 0 else f"window {w}" for w in cfg.layer_windows)
    ropes = runs("none" if r is None else f"{r.kind} theta {r.theta:g}" + (f" factor {r.factor:g}" if r.kind != "default"
                                                                           else "") for r in cfg.layer_rope)
    extras = [name for name, on in (("q/k norm " + cfg.qk_norm, cfg.qk_norm != "none"), ("sandwich norms",
              cfg.sandwich_norm), ("embedding norm", cfg.embed_norm), ("attention output gate", cfg.attn_output_gate),
              (f"attention soft-cap {cfg.attn_softcap:g}", cfg.attn_softcap), (f"logit soft-cap {cfg.final_softcap:g}",
              cfg.final_softcap), ("tied embeddings", cfg.tie_embeddings)) if on]
    print(f"{cfg.model_type}: {cfg.num_params:,} parameters, {cfg.dtype}"
          + (f", linears {cfg.linears_label}" if cfg.quantize != "none" or cfg.quantize_head else ""))
    print(f"  {cfg.num_layers} layers, hidden {cfg.hidden_size}, MLP {cfg.intermediate_size} ({cfg.activation})")
    print(f"  attention: {cfg.num_heads} query / {cfg.num_kv_heads} KV heads of {cfg.head_dim}; {windows}")
    print(f"  RoPE: {ropes}")
    print(f"  vocab {cfg.vocab_size}, context {cfg.max_position_embeddings}, BOS {cfg.bos_token_id}, "
          f"EOS {list(cfg.eos_token_ids)}")
    if extras:
        print(f"  {', '.join(extras)}")
    from glint.model import transformer
    from glint.runtime.weights import decode_weight_bytes

    weights = decode_weight_bytes(transformer.split(transformer.abstract_model(cfg))[1], cfg.tie_embeddings)
    size = f"{weights / 1e9:.3f} GB" if weights >= 1e8 else f"{weights / 1e6:.3f} MB"
    print(f"  a decode step reads {size} of weights: at {args.bandwidth / 1e12:g} TB/s at most "
          f"{args.bandwidth / weights:,.0f} steps/s ({weights / args.bandwidth * 1e3:.4g} ms each, before the KV)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from glint.runtime import commands  # no jax import: --help answers at once

    parser = argparse.ArgumentParser(prog="glint", description="Batched LLM inference in JAX with Pallas kernels.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="convert an HF safetensors folder to an orbax checkpoint",
                       formatter_class=commands.Help)
    p.add_argument("hf_dir")
    p.add_argument("out_dir")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="stored dtype (default: the checkpoint's torch_dtype)")
    p.add_argument("--quantize", choices=commands.QUANT_FORMATS, default="none",
                   help=f"store the layers' linears quantized ({commands.QUANTIZE_HELP}); embedding, head and norms "
                        "keep --dtype")
    p.add_argument("--group-size", type=int, default=128, help="--quantize int4: input rows per scale")
    p.add_argument("--quantize-head", action="store_true", help=commands.QUANTIZE_HEAD_HELP)
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("info", help="summarise the model config of a checkpoint or preset",
                       formatter_class=commands.Help)
    p.add_argument("checkpoint", help="HF folder, orbax folder or preset name")
    p.add_argument("--bandwidth", type=float, default=4.3e12,
                   help="memory bandwidth in bytes/s for the decode roofline (default: the H200's measured copy rate)")
    p.add_argument("--quantize", choices=commands.QUANT_FORMATS,
                   help="a preset's or HF folder's linears in this format (a converted checkpoint shows its own)")
    p.add_argument("--quantize-head", action="store_true", help=commands.QUANTIZE_HEAD_HELP)
    p.add_argument("--json", action="store_true", help="print the whole config as JSON")
    p.set_defaults(func=_cmd_info)

    commands.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"glint {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
