"""Decode attention over bf16, fp8 (float8_e4m3fn) and scaled fp8 (a float32 scale per row and head, the engine's
fp8 cache) KV pools on the GPU: the Triton kernel checked against the jnp reference on the same pools, then timed
chained inside one jit and as separate calls, as % of 4.3 TB/s of the K/V bytes (and scales) it must read.
llama3-8b's attention shape (32 query / 8 KV heads of 128, page 16).

  python tools/gpu_fp8_kv.py [BATCH CONTEXT] [--sweep] [--mosaic] [--page=N]
      --sweep: then the scaled fp8 pools and bf16's at each decode tile in SWEEP, chained, each checked against the
      reference. --mosaic: then the same pools through the Mosaic GPU decode kernel (backend "mosaic_decode", its
      own split count) at the tiles in MOSAIC_TILES (the last on a persistent grid), with its time against
      Triton's on the same pools from this call; a scaled cache there needs pages of a multiple of 32 keys
      (--page=32). --page: the page size (16).
"""
import dataclasses
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from glint.pallas_kernels import BlockSizes, tuning, varlen_attention, varlen_attention_reference
from glint.pallas_kernels.reference import quantize_rows, scale_pool, to_pool_dtype

PEAK, REPS, PAGE, HKV, GROUP, D = 4.3e12, 20, 16, 8, 4, 128
SWEEP = [BlockSizes(16, k, w, st) for k in (64, 128, 256) for w in (4, 8) for st in (2, 3, 4)]
# --mosaic: (keys per block, stages, persistent grid: tuning.MOSAIC_DECODE_CTAS CTAs over the work items, else one
# CTA per item); the first is the default
MOSAIC_TILES = [(128, 2, False), (128, 3, False), (128, 4, False), (64, 4, False), (128, 2, True)]


def timed(fn, *args):
    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def attention(page_table, seq_info, blocks=None, backend="triton"):
    """varlen_attention over (q, k, v[, k_scale, v_scale]) at this table, jitted (blocks: None, the defaults)."""
    return jax.jit(lambda q, k, v, *s: varlen_attention(q, k, v, page_table, seq_info, scale=D ** -0.5,
                                                         block_sizes=blocks, backend=backend,
                                                         **dict(zip(("k_scale", "v_scale"), s))))


def error(attend, q, pool, page_table, seq_info) -> float:
    """Max |attend - the jnp reference| over the same pools, relative to the reference's largest value."""
    got = np.asarray(attend(q, *pool), np.float32)
    want = np.asarray(varlen_attention_reference(q, *pool[:2], page_table, seq_info, scale=D ** -0.5,
                                                 **dict(zip(("k_scale", "v_scale"), pool[2:]))), np.float32)
    return float(np.abs(got - want).max() / np.abs(want).max())


def chained_time(attend, q, pool) -> float:
    """Seconds per call, REPS calls chained inside one jit (each feeds the next)."""
    chained = jax.jit(lambda q, *pool: lax.fori_loop(0, REPS, lambda i, q: q + 0 * attend(q, *pool), q))
    return timed(chained, q, *pool) / REPS


def main(batch: int, context: int, sweep: bool = False, mosaic: bool = False) -> None:
    rng = np.random.default_rng(0)
    pages_per_seq = context // PAGE
    num_pages = 1 + batch * pages_per_seq
    page_table = jnp.asarray(1 + np.arange(batch * pages_per_seq, dtype=np.int32).reshape(batch, pages_per_seq))
    seq_info = jnp.asarray(np.stack([np.arange(batch), np.ones(batch), np.arange(batch),
                                     np.full(batch, context)], 1).astype(np.int32))
    q = jnp.asarray(rng.standard_normal((batch, HKV * GROUP, D)), jnp.bfloat16)
    shape = (num_pages, PAGE, HKV, D)
    k = jax.random.normal(jax.random.key(1), shape, jnp.bfloat16)
    v = jax.random.normal(jax.random.key(2), shape, jnp.bfloat16)
    (k8, ks), (v8, vs) = (quantize_rows(x.reshape(-1, HKV, D)) for x in (k, v))
    pools = {"bf16": (k, v), "fp8": (to_pool_dtype(k, jnp.float8_e4m3fn), to_pool_dtype(v, jnp.float8_e4m3fn)),
             "fp8-scaled": (k8.reshape(shape), v8.reshape(shape), scale_pool(ks.reshape(shape[:3])),
                            scale_pool(vs.reshape(shape[:3])))}
    attend = attention(page_table, seq_info)
    rows = []
    for name, pool in pools.items():
        err = error(attend, q, pool, page_table, seq_info)
        nbytes = 2 * batch * context * HKV * (D * pool[0].dtype.itemsize + 4 * (len(pool) > 2))
        t_chain = chained_time(attend, q, pool)
        t_sep = timed(lambda q, *pool: [attend(q, *pool) for _ in range(REPS)][-1], q, *pool) / REPS
        rows.append((name, err, t_chain, t_sep, nbytes))
        print(rows[-1], flush=True)
    full = pools["bf16"]
    fp8_vs_bf16 = np.abs(np.asarray(attend(q, *pools["fp8"]), np.float32) - np.asarray(attend(q, *full), np.float32))
    print(f"decode attention {batch} x {context}, GQA {HKV * GROUP}/{HKV}, d{D}, page {PAGE}")
    print("pools | max err vs reference | chained us | chained % of 4.3 TB/s | separate us | separate %")
    for name, err, tc, ts, nbytes in rows:
        print(f"{name} | {err:.2e} | {tc * 1e6:.1f} | {100 * nbytes / tc / PEAK:.0f} | {ts * 1e6:.1f} | "
              f"{100 * nbytes / ts / PEAK:.0f}")
    print(f"fp8 / bf16 time: chained {rows[0][2] / rows[1][2]:.2f}x faster, separate {rows[0][3] / rows[1][3]:.2f}x; "
          f"fp8 output vs bf16 output max |diff| {fp8_vs_bf16.max():.4f}")
    scaled_vs_bf16 = np.abs(np.asarray(attend(q, *pools["fp8-scaled"]), np.float32) - np.asarray(attend(q, *full),
                                                                                                 np.float32))
    print(f"scaled fp8 / bf16 time: chained {rows[0][2] / rows[2][2]:.2f}x faster, separate "
          f"{rows[0][3] / rows[2][3]:.2f}x; scaled fp8 output vs bf16 output max |diff| {scaled_vs_bf16.max():.4f}")
    if mosaic:
        print("Mosaic decode kernel, keys per block x stages | pools | max err vs reference | chained us | chained % | "
              "separate us | separate % | Triton / Mosaic time, chained | separate")
    default_tile, default_ctas = dict(tuning.MOSAIC_DECODE), tuning.MOSAIC_DECODE_MAX_CTAS
    # The default tile and deeper ones: an fp8 block has half a bf16 block's bytes, so the same stages keep half
    # the bytes in flight (the widened K and V tiles take the shared memory that bf16's wider slots would)
    try:
        for block_kv, stages, persistent in MOSAIC_TILES if mosaic else ():
            tuning.MOSAIC_DECODE = {**default_tile, "block_kv": block_kv, "num_stages": stages}
            tuning.MOSAIC_DECODE_MAX_CTAS = tuning.MOSAIC_DECODE_CTAS if persistent else 0
            tile = f"{block_kv}x{stages}" + (f" on {tuning.MOSAIC_DECODE_CTAS} CTAs" if persistent else "")
            attend_mosaic = attention(page_table, seq_info, backend="mosaic_decode")
            for name, _, tc, ts, nbytes in rows:
                if name == "fp8-scaled" and PAGE % 32:
                    print(f"mosaic {tile} | {name} | not covered in pages of {PAGE} (a scaled cache needs "
                          f"--page=32 or more)")
                    continue
                try:
                    err = error(attend_mosaic, q, pools[name], page_table, seq_info)
                except ValueError as e:  # a tile past the shared memory (bf16 slots at 3-4 stages, with splits)
                    why = "does not fit" if "exceeds available shared memory" in str(e) else "refused"
                    print(f"mosaic {tile} | {name} | {why}: {str(e).splitlines()[0][:160]}", flush=True)
                    continue
                t_chain = chained_time(attend_mosaic, q, pools[name])
                t_sep = timed(lambda q, *pool, f=attend_mosaic: [f(q, *pool) for _ in range(REPS)][-1], q,
                              *pools[name]) / REPS
                print(f"mosaic {tile} | {name} | {err:.2e} | {t_chain * 1e6:.1f} | "
                      f"{100 * nbytes / t_chain / PEAK:.0f} | {t_sep * 1e6:.1f} | {100 * nbytes / t_sep / PEAK:.0f} | "
                      f"{tc / t_chain:.2f}x | {ts / t_sep:.2f}x", flush=True)
    finally:
        tuning.MOSAIC_DECODE, tuning.MOSAIC_DECODE_MAX_CTAS = default_tile, default_ctas
    if sweep:
        print("tile (block_m, block_k, warps, stages) | pools | max err vs reference | chained us | % of 4.3 TB/s")
    for blocks in SWEEP if sweep else ():
        tiled = attention(page_table, seq_info, blocks)
        for name, _, _, _, nbytes in rows:
            if name != "fp8":
                err, t = error(tiled, q, pools[name], page_table, seq_info), chained_time(tiled, q, pools[name])
                print(f"{dataclasses.astuple(blocks)} | {name} | {err:.2e} | {t * 1e6:.1f} | "
                      f"{100 * nbytes / t / PEAK:.0f}", flush=True)


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:] if not a.startswith("--")] or [64, 4096]
    PAGE = next((int(a.split("=")[1]) for a in sys.argv if a.startswith("--page=")), PAGE)
    main(*args, sweep="--sweep" in sys.argv, mosaic="--mosaic" in sys.argv)
