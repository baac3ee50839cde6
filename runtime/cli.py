"""The `glint` command line: convert, info, demo, generate, bench, serve."""
from __future__ import annotations

import argparse
import sys


def _cmd_convert(args) -> int:
    from glint.export.checkpoint import convert

    cfg = convert(args.hf_dir, args.out_dir, dtype=args.dtype)
    print(f"wrote {args.out_dir}: {cfg.model_type}, {cfg.num_layers} layers, {cfg.num_params:,} parameters, "
          f"{cfg.dtype}")
    return 0


def _cmd_info(args) -> int:
    from glint.runtime.loading import resolve_config

    cfg = resolve_config(args.checkpoint)
    print(cfg.to_json())
    print(f"parameters: {cfg.num_params:,}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glint", description="Batched LLM inference in JAX with Pallas kernels.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="convert an HF safetensors folder to an orbax checkpoint")
    p.add_argument("hf_dir")
    p.add_argument("out_dir")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("info", help="print the model config of a checkpoint or preset")
    p.add_argument("checkpoint", help="HF folder, orbax folder or preset name")
    p.set_defaults(func=_cmd_info)

    from glint.runtime import bench, commands

    commands.register(sub)
    bench.register(sub)
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
