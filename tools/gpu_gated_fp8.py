"""The fp8 MLP middle (pallas_kernels/gated_fp8.py) alone on the GPU at llama3-8b's hidden width: each tile arm
(token rows x column block x warps [x stages]) against XLA's unfused path from the same gate_up product y, each checked
against the reference, timed as GPU time per call (a profiler trace) and as % of 4.3 TB/s of the bytes it must
move (y read once, the fp8 hidden written).

  python3 tools/gpu_gated_fp8.py [--tokens 4096,256,1] [--hidden 14336] [--arms 1x16384x16,8x256x4]
      [--gemm-out bfloat16]
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

from glint.model import quant
from glint.pallas_kernels import gated_fp8, tuning
from gpu_quant_kernels import PEAK, kernel_times

ARMS = "2x16384x16,1x2048x16,1x2048x16x2,1x1024x16,1x2048x32,1x16384x32"
REPS = 10


def xla_path(y, xscale, wscale):
    """The model's unfused MLP middle: the scaled product, SiLU(g) * u, per-token fp8 (model/quant.py)."""
    g, u = jnp.split((y.astype(jnp.float32) * xscale * wscale).astype(jnp.bfloat16), 2, axis=-1)
    return quant.quantize_activations_fp8(jax.nn.silu(g) * u)


# Bandwidth baselines on the same y: a row reduction (reads y) and an elementwise pass (reads y, writes as many bytes).
BASELINES = {"read y": (lambda y, xscale, wscale: jnp.max(jnp.abs(y), axis=-1), 1),
             "copy y": (lambda y, xscale, wscale: y * 2, 2)}


def repeated(fn):
    """REPS calls in one jit, each on a different y (so none is hoisted and y never sits in L2)."""
    @jax.jit
    def run(ys, xscale, wscale):
        return [fn(y, xscale, wscale) for y in ys]
    return run


def arm(spec: str):
    rows, block, warps, stages = map(int, (spec + "x1").split("x")[:4])
    tuning.GATED_FP8_ROWS, tuning.GATED_FP8_BLOCK = rows, block
    tuning.GATED_FP8_NUM_WARPS, tuning.GATED_FP8_STAGES = warps, stages
    return lambda y, xscale, wscale: gated_fp8.gated_quantize_fp8(y, xscale, wscale)


def main(tokens, hidden, arms):
    print(f"{'tokens':>6} {'way':>12} {'us/call':>8} {'% of 4.3 TB/s':>13} {'q == ref':>8} {'max |dq|':>8}")
    for t in tokens:
        keys = jax.random.split(jax.random.key(t), REPS + 2)
        out = jnp.dtype(tuning.FP8_GEMM_OUT)
        ys = [(jax.random.normal(k, (t, 2 * hidden), jnp.float32) * 300).astype(out) for k in keys[:REPS]]
        xscale = jax.random.uniform(keys[-2], (t, 1), jnp.float32, 1e-3, 1e-2)
        wscale = jax.random.uniform(keys[-1], (2 * hidden,), jnp.float32, 1e-3, 1e-2)
        moved = REPS * (ys[0].nbytes + t * hidden + 4 * t)
        want, _ = jax.jit(gated_fp8.gated_quantize_fp8_reference)(ys[0], xscale, wscale)
        want = np.asarray(want, np.float32)
        for name, (fn, copies) in BASELINES.items():
            run = repeated(fn)
            us = sum(u for u, _ in kernel_times(run, ys, xscale, wscale).values())
            print(f"{t:>6} {name:>12} {us / REPS:8.1f} {100 * copies * REPS * ys[0].nbytes / (us * 1e-6) / PEAK:13.1f}")
        for name in ["xla", *arms]:
            fn = xla_path if name == "xla" else arm(name)
            run = repeated(fn)
            got = np.asarray(run(ys, xscale, wscale)[0][0], np.float32)
            us = sum(u for u, _ in kernel_times(run, ys, xscale, wscale).values())
            print(f"{t:>6} {name:>12} {us / REPS:8.1f} {100 * moved / (us * 1e-6) / PEAK:13.1f} "
                  f"{(got == want).mean():8.4f} {np.abs(got - want).max():8.3g}", flush=True)


def _option(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


if __name__ == "__main__":
    tuning.FP8_GEMM_OUT = _option("--gemm-out", "bfloat16")
    main([int(t) for t in _option("--tokens", "4096,256,1").split(",")], int(_option("--hidden", "14336")),
         _option("--arms", ARMS).split(","))
