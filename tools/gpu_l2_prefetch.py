"""Does an L2 prefetch issued ahead of latency-bound kernels speed up the matmul after them? (H200, bf16)

A decode layer at batch 1 runs ~21 us of small kernels (qkv_write, the attention, the norms) during which the HBM
idles, then a matmul that streams its weights. `l2_prefetch` below is one short Mosaic GPU kernel whose CTAs
issue TMA bulk prefetches (`cp.async.bulk.prefetch.tensor.L2`) over a weight in boxes of up to 256 x 256 and exit
without waiting, hoping the memory system pulls the weight into L2 while the next kernels run. This times,
chained inside one jit over ROUNDS rounds:

    flush (x @ F, 235 MB: evicts L2) -> [l2_prefetch(W)] -> FILLER dependent tiny kernels -> x @ W

with and without the prefetch, and with W left in L2 by the round before (no flush: the ceiling), per weight
shape (llama3-8b's), and reports wall time per round, the GPU busy time and the top kernels from a
jax.profiler trace. The prefetch arms' outputs must equal the plain arm's bit for bit. Result (docs/perf.md,
2026-12-03): the prefetch does not help; not used by the model.

  python tools/gpu_l2_prefetch.py [--filler 0,8] [--shapes wo,wqkv,gate_up,down] [--fractions 1.0,0.15]
"""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(__file__))
from gpu_quant_kernels import kernel_times, timed

BOX = 256  # TMA's largest box side, in elements


def _matrix_shape(shape) -> tuple[int, int]:
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows, shape[-1]


def _box(rows: int, cols: int, itemsize: int) -> tuple[int, int]:
    """A box TMA can move: sides of at most 256 elements, the inner one a whole number of 16-byte units."""
    unit = 16 // itemsize
    return min(BOX, rows), min(BOX, cols) // unit * unit


def supports(w) -> bool:
    """Whether `w` (its leading dims flattened: a matrix) can be prefetched: rows of a multiple of 16 bytes."""
    itemsize = jnp.dtype(w.dtype).itemsize
    if w.ndim < 1 or itemsize not in (1, 2, 4, 8) or 0 in w.shape:
        return False
    _, cols = _matrix_shape(w.shape)
    return cols * itemsize % 16 == 0


def l2_prefetch(w, *after, ctas: int = 132, fraction: float = 1.0):
    """Start pulling the first `fraction` of `w`'s rows (its leading dims flattened) into L2, after `after`;
    -> a token int32[1] (0) for what must follow."""
    if not supports(w):
        raise ValueError(f"l2_prefetch: {w.shape} {w.dtype} is not a prefetchable matrix (rows of a multiple of "
                         "16 bytes)")
    if not 0 < fraction <= 1:
        raise ValueError(f"l2_prefetch: fraction {fraction} is not in (0, 1]")
    rows, cols = _matrix_shape(w.shape)
    br, bc = _box(rows, cols, jnp.dtype(w.dtype).itemsize)
    row_boxes, col_boxes = pl.cdiv(max(br, int(rows * fraction)), br), pl.cdiv(cols, bc)
    boxes = row_boxes * col_boxes
    grid = min(ctas, boxes)

    def kernel(m_ref, *refs):
        *_, token_ref = refs  # `after`: never read

        @pl.loop(lax.axis_index("ctas"), boxes, step=grid)
        def _(b):
            # a ragged last box is moved back to end at the edge; prefetching rows twice is harmless
            r0 = jnp.minimum((b // col_boxes) * br, rows - br)
            c0 = jnp.minimum((b % col_boxes) * bc, cols - bc)
            plgpu.async_prefetch(m_ref.at[pl.ds(r0, br), pl.ds(c0, bc)])

        token_ref[0] = jnp.int32(0)  # every CTA writes the same 0

    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((1,), jnp.int32), grid=(grid,),
                        grid_names=("ctas",), kernel_name=f"l2_prefetch_{rows}x{cols}_{round(fraction * 100)}pc")(
        w.reshape(rows, cols), *after)


def tie(x, token):
    """x, after `token` is made: x's bits OR-ed with the token's 0 (one elementwise op XLA fuses with x's
    neighbours; nothing changes, not even the sign of a zero)."""
    bits = jnp.dtype(f"uint{jnp.dtype(x.dtype).itemsize * 8}")
    return lax.bitcast_convert_type(lax.bitcast_convert_type(x, bits) | token[0].astype(bits), x.dtype)


SHAPES = {"wo": (4096, 4096), "wqkv": (4096, 6144), "gate_up": (4096, 28672), "down": (14336, 4096)}
ROUNDS = 8


def build(k: int, n: int, filler: int, fraction: float | None, flush: bool = True):
    """One jitted program of ROUNDS rounds; `fraction` None: no prefetch; `flush` False: w stays in L2 from
    round to round where it fits (the ceiling a prefetch could reach)."""
    @jax.jit
    def run(x, w, f, small):
        s = x[:, :256].astype(jnp.float32)
        for _ in range(ROUNDS):
            if flush:
                flushed = x[:, :4096] @ f
                x = x + (flushed[:, :1] * 1e-9).astype(x.dtype)
                if fraction is not None:
                    s = tie(s, l2_prefetch(w, flushed, fraction=fraction))  # after the flush, before the filler
            for _ in range(filler):
                s = jnp.tanh(s @ small)
            x, s = lax.optimization_barrier((x, s))
            y = x @ w
            x = (y[:, :k] if n >= k else jnp.tile(y, (1, k // n + 1))[:, :k]) * 1e-3 + s[:, :1].astype(x.dtype)
        return x
    return run


def main() -> None:
    args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
    fillers = [int(v) for v in args.get("--filler", "0,8").split(",")]
    shapes = args.get("--shapes", ",".join(SHAPES)).split(",")
    fractions = [float(v) for v in args.get("--fractions", "1.0").split(",")]
    key = jax.random.key(0)
    f = (jax.random.normal(key, (4096, 28672), jnp.float32) * 0.01).astype(jnp.bfloat16)
    small = jax.random.normal(jax.random.key(1), (256, 256), jnp.float32) * 0.05
    rows = []
    for name in shapes:
        k, n = SHAPES[name]
        w = (jax.random.normal(jax.random.key(2), (k, n), jnp.float32) * 0.01).astype(jnp.bfloat16)
        x = jax.random.normal(jax.random.key(3), (1, k), jnp.float32).astype(jnp.bfloat16)
        for filler in fillers:
            arms = {"none": build(k, n, filler, None)}
            for fr in fractions:
                arms[f"prefetch {fr:g}"] = build(k, n, filler, fr)
            hot = build(k, n, filler, None, flush=False)
            outs = {a: np.asarray(fn(x, w, f, small).astype(jnp.float32)) for a, fn in arms.items()}
            for a, o in outs.items():
                assert np.array_equal(o, outs["none"]), f"{name} filler {filler} {a}: output differs"
            arms["hot, no flush"] = hot
            base = None
            for arm, fn in arms.items():
                wall = timed(fn, x, w, f, small, repeats=20) / ROUNDS * 1e6
                table = kernel_times(fn, x, w, f, small)
                pf = sum(t for nm, (t, c) in table.items() if "prefetch" in nm) / ROUNDS
                busy = sum(t for t, _ in table.values()) / ROUNDS
                top = sorted(table.items(), key=lambda kv: -kv[1][0])[:5]
                base = wall if base is None else base
                rows.append((name, filler, arm, wall, wall - base, busy, pf))
                print(f"{name:8s} filler {filler:2d} {arm:14s} wall {wall:7.1f} us/round ({wall - base:+6.1f})  "
                      f"gpu busy {busy:7.1f}  prefetch kernel {pf:5.2f}  top: "
                      + "; ".join(f"{nm[:40]} {t / c:.1f} us x{c}" for nm, (t, c) in top), flush=True)
    print("\nshape    filler arm            wall us/round  vs none  gpu busy  prefetch kernel")
    for name, filler, arm, wall, delta, busy, pf in rows:
        print(f"{name:8s} {filler:6d} {arm:14s} {wall:13.1f} {delta:+8.1f} {busy:9.1f} {pf:8.2f}")


if __name__ == "__main__":
    main()
