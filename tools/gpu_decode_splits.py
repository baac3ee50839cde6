"""Decode attention per split-K factor, next to cuDNN, both timings (issue #13 items 2 and 4).

For each (batch, context, pool capacity): the Triton decode kernel at every split count in SPLITS (capped at the
key blocks the capacity holds), chained (10 dependent calls in one jit) and as separate calls (one jit call
each, waited for), and cuDNN on the same values, contiguous, both ways. "capacity" is the page table's width in
keys: the engine sizes split-K from it, not from the context (1 x 512 in a 768-key engine is its batch-1 decode).
Each split's output is checked against the single-split one first. Prints one table; the best split per shape
and timing are marked.

    python3 tools/gpu_decode_splits.py                      # every shape below
    python3 tools/gpu_decode_splits.py 1x512x768 8x1024x1024  # batch x context x capacity, these only
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_kernels import bench, contiguous, paged_setup, rel_err  # noqa: E402
from gpu_quant_kernels import timed  # noqa: E402

from glint.pallas_kernels import varlen_attention  # noqa: E402
from glint.pallas_kernels.varlen_attention import default_block_sizes, default_num_splits  # noqa: E402

HQ, HKV, D, PS = 32, 8, 128, 16
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
SHAPES = [  # (batch, context, capacity)
    (1, 512, 768), (1, 4096, 4608), (1, 32768, 33024), (4, 2048, 2304), (8, 1024, 1024), (8, 8192, 8192),
    (32, 4096, 4096), (64, 1024, 1024), (256, 1024, 1024),
]


def _shape(arg: str) -> tuple[int, int, int]:
    """"BxCTXxCAP" -> (batch, context, capacity); the context must fit the capacity."""
    parts = arg.split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"shape {arg!r}: expected BATCHxCONTEXTxCAPACITY, e.g. 1x512x768")
    batch, ctx, cap = map(int, parts)
    if ctx > cap:
        raise SystemExit(f"shape {arg!r}: context {ctx} exceeds the capacity {cap}")
    return batch, ctx, cap


def main():
    cpu = jax.default_backend() == "cpu"  # a dry run of the script: interpreted kernels, tiny shapes, no cuDNN
    chosen = [_shape(a) for a in sys.argv[1:]]
    if cpu and chosen:
        print(f"CPU dry run: the shapes given ({' '.join(sys.argv[1:])}) are replaced by tiny ones")
    shapes = [(1, 48, 64), (2, 100, 128)] if cpu else chosen or SHAPES
    scale = D ** -0.5
    key = jax.random.key(0)
    print(f"{'batch':>5} {'ctx':>6} {'cap':>6} {'default':>7} | {'splits':>6} {'chained us':>10} {'separate us':>11} "
          f"{'err':>7}")
    for batch, ctx, cap in shapes:
        q, k_pages, v_pages, page_table, seq_info = paged_setup(key, batch, cap, 1, HQ, HKV, D, PS, jnp.bfloat16)
        seq_info = seq_info.at[:, 3].set(ctx)  # `ctx` keys cached in a table of `cap`
        paged = (q, k_pages, v_pages, page_table, seq_info)
        blocks = default_block_sizes(batch, batch, D)
        default = default_num_splits(batch, batch, HQ, HKV, cap, blocks)
        one = None
        rows = []
        for s in SPLITS:
            if s > 1 and (-(-cap // blocks.block_k) < s or cpu and s > 4):
                continue
            fn = lambda q_, *a, s=s: varlen_attention(q_, *a, scale=scale, num_splits=s, interpret=cpu)  # noqa: E731
            out = np.asarray(jax.jit(fn)(*paged), np.float32)
            one = out if one is None else one
            rows.append((s, bench(fn, paged) * 1e6, timed(jax.jit(fn), *paged, repeats=30) * 1e6, rel_err(out, one)))
        best_c = min(rows, key=lambda r: r[1])[0]
        best_s = min(rows, key=lambda r: r[2])[0]
        for s, tc, ts, err in rows:
            mark = ("  <- best chained" if s == best_c else "") + ("  <- best separate" if s == best_s else "")
            print(f"{batch:>5} {ctx:>6} {cap:>6} {default:>7} | {s:>6} {tc:10.1f} {ts:11.1f} {err:7.1e}{mark}")
        if cpu:
            continue
        dense = contiguous(q, k_pages, v_pages, page_table, batch, cap)
        dense = (dense[0], dense[1][:, :ctx], dense[2][:, :ctx])

        def cudnn(q_, k_, v_):
            return jax.nn.dot_product_attention(q_, k_, v_, scale=scale, implementation="cudnn")

        print(f"{batch:>5} {ctx:>6} {cap:>6} {'':>7} | {'cuDNN':>6} {bench(cudnn, dense) * 1e6:10.1f} "
              f"{timed(jax.jit(cudnn), *dense, repeats=30) * 1e6:11.1f}", flush=True)


if __name__ == "__main__":
    main()
