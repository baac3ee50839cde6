"""Subcommands that run the model: demo (the built-in default job)."""
from __future__ import annotations

import time


def _cmd_demo(args) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from glint.model import transformer
    from glint.model.attention import DenseMeta, dense_attention
    from glint.runtime.loading import load_model

    cfg, graphdef, params, _ = load_model(args.model, dtype=args.dtype)
    width = 64

    @jax.jit
    def next_token(params, tokens, length):
        idx = jnp.arange(width, dtype=jnp.int32)
        hidden, _ = transformer.forward(graphdef, params, tokens, idx, dense_attention, None,
                                        DenseMeta(idx, jnp.where(idx < length, 0, -1)))
        return jnp.argmax(transformer.compute_logits(graphdef, params, hidden[length - 1][None])[0])

    tokens = np.zeros(width, np.int32)
    tokens[0] = cfg.bos_token_id or 0
    start = time.perf_counter()
    for length in range(1, args.tokens + 1):
        tokens[length] = int(next_token(params, jnp.asarray(tokens), length))
    took = time.perf_counter() - start
    print(f"model {args.model}: {cfg.num_params:,} parameters, {cfg.num_layers} layers, windows {cfg.layer_windows}")
    print(f"greedy continuation of [{tokens[0]}] by full-sequence forwards (the engine is not built yet): "
          f"{tokens[1:args.tokens + 1].tolist()}")
    print(f"{args.tokens} tokens in {took:.2f}s on {jax.devices()[0].platform}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("demo", help="run the built-in default job on the demo model")
    p.add_argument("--model", default="demo", help="preset name or checkpoint folder")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--tokens", type=int, default=32)
    p.set_defaults(func=_cmd_demo)
