"""Quantized matmuls at llama3-8b's linear shapes and decode (or, with --rows, prefill) widths on the GPU: the
Mosaic GPU int8 and int4 kernels (a few configs each), glint.model.quant's formulations (int8; "xla int4" as the
model picks per row count, which on Hopper is the Mosaic kernel up to tuning.INT4_MOSAIC_MAX_ROWS rows, and XLA's
ways forced: "xla int4 rows", "xla int4 dot", "xla int4 dot pad8"; fp8 x fp8) and the plain bf16 dot. Each is
checked against its reference, then timed as % of 4.3 TB/s of the bytes it must read (weights + scales), two
ways: chained inside one jit (a loop over enough distinct weight copies that they do not fit in L2) and as
separate calls.

  python tools/gpu_quant_kernels.py [--shapes gate_up,down] [--ways "xla int4,bf16 dot,mosaic"] [--rows 1,8]
      [--profile]
  (--ways: name prefixes, or whole names ending in $; --profile adds each way's GPU kernel time per call from a
  jax.profiler trace of its chained run, which leaves out the host and launch gaps that the two timings include)
"""
import collections
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from glint.model import quant
from glint.pallas_kernels.quant_matmul_mgpu import QuantBlocks, int4_matmul_t, int8_matmul_t

PEAK = 4.3e12
SHAPES = [(4096, 6144, "wqkv"), (4096, 4096, "wo"), (4096, 28672, "gate_up"), (14336, 4096, "down")]
ROWS = [1, 8, 64]
# The Mosaic GPU int8 kernel (weights [N, K], A operand in registers): block_m, block_k, stages, ctas (persistent grid).
MOSAIC = [QuantBlocks(64, 128, 4, 132), QuantBlocks(64, 128, 4, 132, probe=True), QuantBlocks(128, 128, 4, 132),
          QuantBlocks(64, 256, 4, 132), QuantBlocks(128, 256, 4, 132), QuantBlocks(128, 128, 4, 132, probe=True),
          QuantBlocks(128, 256, 4, 132, probe=True)]
# The Mosaic GPU int4 kernel (nibbles widened in registers, group scales applied to the widened tile).
# (Stages are as many of these as fit beside the x tile: quant_matmul_mgpu.fitted.)
MOSAIC4 = [QuantBlocks(128, 128, 4, 132), QuantBlocks(128, 128, 4, 132, probe=True), QuantBlocks(128, 128, 8, 132),
           QuantBlocks(128, 256, 4, 132), QuantBlocks(128, 256, 4, 132, probe=True),
           QuantBlocks(128, 128, 4, 132, splits=4), QuantBlocks(128, 128, 8, 132, splits=8),
           QuantBlocks(64, 128, 4, 132), QuantBlocks(64, 256, 4, 132), QuantBlocks(64, 256, 4, 132, probe=True)]
REPS = 20


def timed(fn, *args, repeats=3) -> float:
    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def chained(fn):
    """REPS rounds over every weight copy inside one jit; each call feeds the next (nothing is hoisted)."""
    @jax.jit
    def run(x, ws, ss):
        def body(i, x):
            for w, s in zip(ws, ss):
                y = fn(x, w, s)
                x = x + (y[:, :1] * 0).astype(x.dtype)
            return x
        return lax.fori_loop(0, REPS, body, x)
    return run


def kernel_times(run, *args) -> dict[str, tuple[float, int]]:
    """GPU time (us) and count per kernel name in one call of `run`, from a jax.profiler trace (copies left out)."""
    jax.block_until_ready(run(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            jax.block_until_ready(run(*args))
        [path] = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
        with gzip.open(path) as f:
            events = json.load(f)["traceEvents"]
    gpus = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and "/device:GPU" in e["args"]["name"]}
    us, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpus and not e["name"].startswith("Memcpy"):
            us[e["name"]] += e.get("dur", 0)
            count[e["name"]] += 1
    return {name: (us[name], count[name]) for name in us}


def device_us(run, *args) -> float:
    """The GPU's kernel time in one call of `run` (a jax.profiler trace's kernel events on the GPU summed), us."""
    return sum(t for t, _ in kernel_times(run, *args).values())


def separate(fn):
    jitted = jax.jit(fn)

    def run(x, ws, ss):
        y = None
        for _ in range(REPS):
            for w, s in zip(ws, ss):
                y = jitted(x, w, s)
        return y
    return run


def int4_rows(x, packed, scale):
    return quant._int4_rows(x, packed, scale).astype(x.dtype)


def int4_dot(rows: int = 0):
    """quant._int4_dot, x padded to `rows` rows when it has fewer."""
    def run(x, packed, scale):
        pad = max(0, rows - x.shape[0])
        y = quant._int4_dot(jnp.pad(x, ((0, pad), (0, 0))), packed, scale)
        return y[:x.shape[0]].astype(x.dtype)
    return run


def main(shapes: set[str] | None = None, only: set[str] | None = None) -> None:
    rng = np.random.default_rng(0)
    rows = []
    for k, n, name in SHAPES:
        if shapes and name not in shapes:
            continue
        w = jnp.asarray(rng.standard_normal((k, n)) * k ** -0.5, jnp.bfloat16)
        q, s = quant.quantize_int8(w)  # [N, K]
        q4, s4 = quant.quantize_int4(w, quant.DEFAULT_GROUP)
        q8, s8 = quant.quantize_fp8(w)

        def copies(a, nbytes):  # > 200 MB per round: past the 50 MB L2
            return [a] + [jnp.roll(a, i, axis=0) for i in range(1, max(2, -(-200_000_000 // nbytes)))]

        int8_bytes, int4_bytes = k * n + 4 * n, q4.size + 2 * s4.size
        qs, q4s, q8s = copies(q, int8_bytes), copies(q4, int4_bytes), copies(q8, int8_bytes)
        bf = copies(w, 2 * k * n)[:4]
        for m in sorted(int(r) for r in _option("--rows") or ROWS):
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
            want = np.asarray(x.astype(jnp.float32) @ quant.dequantize_int8(q, s))
            want4 = np.asarray(x.astype(jnp.float32) @ quant.dequantize_int4(q4, s4, k))
            want8 = np.asarray(x.astype(jnp.float32) @ quant.dequantize_fp8(q8, s8))
            ways = {"xla int8": (quant.int8_matmul, qs, [s] * len(qs), int8_bytes, want),
                    "xla int4": (quant.int4_matmul, q4s, [s4] * len(q4s), int4_bytes, want4),
                    "xla int4 rows": (int4_rows, q4s, [s4] * len(q4s), int4_bytes, want4),
                    "xla int4 dot": (int4_dot(), q4s, [s4] * len(q4s), int4_bytes, want4),
                    "xla int4 dot pad8": (int4_dot(rows=8), q4s, [s4] * len(q4s), int4_bytes, want4),
                    "xla fp8": (quant.fp8_matmul, q8s, [s8] * len(q8s), int8_bytes, want8),
                    "bf16 dot": (lambda x, w, s: jnp.dot(x, w), bf, [s] * len(bf), 2 * k * n, None)}
            for c in MOSAIC:
                way = f"mosaic int8 m{c.block_m} k{c.block_k} st{c.stages} c{c.ctas} s{c.splits}{' probe' * c.probe}"
                ways[way] = (lambda x, q, s, c=c: int8_matmul_t(x, q, s, blocks=c), qs, [s] * len(qs),
                             int8_bytes, None if c.probe else want)
            for c in MOSAIC4:
                way = f"mosaic int4 m{c.block_m} k{c.block_k} st{c.stages} c{c.ctas} s{c.splits}{' probe' * c.probe}"
                ways[way] = (lambda x, q, s, c=c: int4_matmul_t(x, q, s, blocks=c), q4s, [s4] * len(q4s),
                             int4_bytes, None if c.probe else want4)
            for way, (fn, ws, scales, nbytes, ref) in ways.items():
                if only and not any(way == o[:-1] if o.endswith("$") else way.startswith(o) for o in only):
                    continue
                try:
                    got = np.asarray(fn(x, ws[0], scales[0]), np.float32)
                    if ref is not None:  # fp8 also rounds the activations: a looser bound
                        err = float(np.abs(got - ref).max() / (np.abs(ref).max() + 1e-9))
                        assert err < (0.1 if way == "xla fp8" else 2e-2), f"{way}: relative error {err}"
                    calls, run = REPS * len(ws), chained(fn)
                    t_chain = timed(run, x, ws, scales) / calls
                    t_sep = timed(separate(fn), x, ws, scales) / calls
                    us_dev = device_us(run, x, ws, scales) / calls if "--profile" in sys.argv else 0
                    rows.append((name, k, n, m, way, 1e6 * t_chain, 100 * nbytes / t_chain / PEAK, 1e6 * t_sep,
                                 100 * nbytes / t_sep / PEAK, us_dev))
                except Exception as e:  # report and go on: one config failing to compile is data too
                    rows.append((name, k, n, m, way, float("nan"), 0.0, float("nan"), 0.0, float("nan")))
                    print(f"FAIL {name} m={m} {way}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                print(rows[-1], flush=True)
    bf16 = {(name, m): (tc, ts, td) for name, k, n, m, way, tc, pc, ts, ps, td in rows if way == "bf16 dot"}
    print("linear | K x N | M | way | chained us | chained % of 4.3 TB/s | separate us | separate % | TFLOP/s chained "
          "| device us (--profile: kernels of the chained run per call) | bf16 dot's time / this (chained, separate, "
          "device)")
    for name, k, n, m, way, tc, pc, ts, ps, td in rows:
        tflops = 2 * m * k * n / tc / 1e6
        ratio = " / ".join(f"{b / t:.2f}" for b, t in zip(bf16[name, m], (tc, ts, td)) if t) \
            if (name, m) in bf16 else "-"
        print(f"{name} | {k} x {n} | {m} | {way} | {tc:.1f} | {pc:.0f} | {ts:.1f} | {ps:.0f} | {tflops:.0f} | "
              f"{td:.1f} | {ratio}")
    best = {}
    for name, k, n, m, way, tc, pc, ts, ps, td in rows:
        if way.startswith("mosaic") and not way.endswith("probe") and pc > best.get((name, m), ("", 0))[1]:
            best[name, m] = (way, pc)
    print("best kernel config per shape and M (chained):", best)


def _option(name: str) -> set[str] | None:
    return set(sys.argv[sys.argv.index(name) + 1].split(",")) if name in sys.argv else None


if __name__ == "__main__":
    main(_option("--shapes"), _option("--ways"))
