"""The Mosaic GPU decode kernel (decode_attention_mgpu.py) against the Triton one and cuDNN, both timings (#13).

For each (batch, context, capacity): the Triton decode kernel as the engine runs it (its default tile and
split-K), the Mosaic decode kernel at its default (tuning.MOSAIC_DECODE, split-K from the capacity) and cuDNN on
the same values laid out contiguously, each chained (`--iters` dependent calls in one jit, default 40) and as
separate calls (one jit call each, waited for); then, on VARIANT_SHAPES, the Mosaic kernel at the other tiles
(TILES: keys per block, stages, P in registers) and at half and twice the split count num_splits_for gives each,
chained; on every shape, the kernel on a persistent grid (PERSISTENT), both timings.
Every Mosaic output is checked against cuDNN's first (relative error). GB/s counts the K/V bytes of the context.

    python3 tools/gpu_decode_mgpu.py                       # every shape below
    python3 tools/gpu_decode_mgpu.py 1x512x768 256x640x640  # batch x context x capacity, these only
    python3 tools/gpu_decode_mgpu.py --iters 10 1x512x768   # 10 calls a chain
    python3 tools/gpu_decode_mgpu.py --iters 40 --no-tiles 256x640x640  # no TILES variants
    python3 tools/gpu_decode_mgpu.py --page 64 --no-tiles 256x640x640   # pages of 64 rows (default 16)
    python3 tools/gpu_decode_mgpu.py --runs --no-tiles 256x640x640      # each sequence's pages back to back (as a
                                                                        # fresh prompt's are), not shuffled
Chains of 10 put the same 15-60 us kernel up to 2-3x apart in two runs (2026-12-04, docs/perf.md); chains of 40
(one run so far) still leave some variants of those shapes out of order, by up to ~2x.
On a CPU machine: a dry run on tiny shapes (Pallas' GPU interpreter, no cuDNN, no timing worth reading).
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_decode_splits import _shape  # noqa: E402
from gpu_kernels import bench, contiguous, paged_setup, rel_err, report_errors  # noqa: E402
from gpu_quant_kernels import timed  # noqa: E402

from glint.pallas_kernels import tuning, varlen_attention  # noqa: E402
from glint.pallas_kernels.decode_attention_mgpu import decode_attention_mgpu, num_splits_for  # noqa: E402

HQ, HKV, D, PS = 32, 8, 128, 16
SHAPES = [  # (batch, context, capacity)
    (1, 512, 768), (1, 4096, 4608), (1, 32768, 33024), (8, 1024, 1024), (8, 8192, 8192), (32, 4096, 4096),
    (64, 16384, 16384), (128, 8192, 8192), (256, 640, 640), (256, 1024, 1024), (256, 4096, 4096), (256, 8192, 8192),
]
TILES = [(128, 2, False), (128, 2, True), (64, 2, True), (64, 4, True)]  # (block_kv, num_stages, p_in_registers)
ERR_LIMIT = 1e-2  # relative error against cuDNN (bf16 kernels measured 8e-5 to 2.5e-3, 2026-12-04)
# A persistent grid (max_ctas): one wave of tuning.MOSAIC_DECODE_CTAS CTAs, each over every so-many-th work item,
# at these tiles (block_kv, num_stages; P in registers), timed both ways on every shape.
PERSISTENT = [(128, 2), (64, 4)]
VARIANT_SHAPES = {(1, 512, 768), (1, 4096, 4608), (1, 32768, 33024), (8, 1024, 1024), (8, 8192, 8192),
                  (256, 640, 640), (256, 4096, 4096)}


def main():
    cpu = jax.default_backend() == "cpu"
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shapes", nargs="*", type=_shape, help="batch x context x capacity (default SHAPES)")
    p.add_argument("--iters", type=int, default=40, help="dependent calls a chain")
    p.add_argument("--page", type=int, default=PS, help="rows per page")
    p.add_argument("--runs", action="store_true", help="each sequence's pages back to back, not shuffled")
    p.add_argument("--no-tiles", action="store_true", help="the default tile and the persistent grid only")
    args = p.parse_args()
    iters, page_size, runs = args.iters, args.page, args.runs
    tiles = [] if args.no_tiles else TILES
    chosen = args.shapes
    shapes = [(1, 100, 128), (3, 70, 128)] if cpu else chosen or SHAPES
    scale = D ** -0.5
    key = jax.random.key(0)
    default = tuple(tuning.MOSAIC_DECODE[k] for k in ("block_kv", "num_stages", "p_in_registers"))
    print(f"Mosaic default tile: block_kv {default[0]}, {default[1]} stages, P in registers {default[2]}; pages of "
          f"{page_size}; times in us (chained / separate)")
    print(f"{'batch':>5} {'ctx':>6} {'cap':>6} | {'triton':>15} | {'mosaic':>15} {'splits':>6} {'err':>7} | "
          f"{'cudnn':>15} | {'GB/s mos':>8} {'cudnn':>6} | {'x cuDNN c/s':>11} | {'x triton c/s':>12}")
    variants = []  # the Mosaic kernel's other tiles and splits on this shape, printed after its line
    errors = []  # every Mosaic output's relative error against cuDNN's (CPU: Triton's)
    for batch, ctx, cap in shapes:
        q, k_pages, v_pages, page_table, seq_info = paged_setup(key, batch, cap, 1, HQ, HKV, D, page_size,
                                                                jnp.bfloat16)
        seq_info = seq_info.at[:, 3].set(ctx)
        if runs:  # each sequence's pages back to back, as pages allocated together are
            page_table = jnp.arange(1, page_table.size + 1, dtype=jnp.int32).reshape(page_table.shape)
        paged = (q, k_pages, v_pages, page_table, seq_info)
        kv_bytes = 2 * batch * ctx * HKV * D * 2
        splits = num_splits_for(batch, batch, HQ, HKV, cap, default[0])

        def mosaic(block_kv=default[0], num_stages=default[1], p_in_registers=default[2], num_splits=splits,
                   max_ctas=None):
            return lambda q_, *a: decode_attention_mgpu(q_, *a, scale=scale, block_kv=block_kv, num_stages=num_stages,
                                                        num_splits=num_splits, p_in_registers=p_in_registers,
                                                        max_ctas=max_ctas, interpret=cpu)

        def triton(q_, *a):
            return varlen_attention(q_, *a, scale=scale, backend="triton", interpret=cpu)

        def both(fn, args):
            return bench(fn, args, iters=3 if cpu else iters, repeats=1 if cpu else 5), \
                timed(jax.jit(fn), *args, repeats=1 if cpu else 30)

        line = f"{batch:>5} {ctx:>6} {cap:>6} |"
        try:
            tt = both(triton, paged)
            tm = both(mosaic(), paged)
            got = np.asarray(jax.jit(mosaic())(*paged), np.float32)
            if cpu:
                want = np.asarray(jax.jit(triton)(*paged), np.float32)
                tc = (float("nan"),) * 2
            else:
                dense = contiguous(q, k_pages, v_pages, page_table, batch, cap)
                dense = (dense[0], dense[1][:, :ctx], dense[2][:, :ctx])

                def cudnn(q_, k_, v_):
                    return jax.nn.dot_product_attention(q_, k_, v_, scale=scale, implementation="cudnn")

                tc = both(cudnn, dense)
                want = np.asarray(jax.jit(cudnn)(*dense), np.float32).reshape(got.shape)
            err = rel_err(got, want)
            errors.append(err)
            line += (f" {tt[0] * 1e6:7.1f} {tt[1] * 1e6:7.1f} | {tm[0] * 1e6:7.1f} {tm[1] * 1e6:7.1f} {splits:>6} "
                     f"{err:7.1e} | {tc[0] * 1e6:7.1f} {tc[1] * 1e6:7.1f} | {kv_bytes / tm[0] / 1e9:8.0f} "
                     f"{kv_bytes / tc[0] / 1e9:6.0f} | {tc[0] / tm[0]:5.2f} {tc[1] / tm[1]:5.2f} | "
                     f"{tt[0] / tm[0]:6.2f} {tt[1] / tm[1]:5.2f}")
            for block_kv, stages in PERSISTENT:
                tile_splits = num_splits_for(batch, batch, HQ, HKV, cap, block_kv)
                fn = mosaic(block_kv, stages, True, tile_splits, max_ctas=tuning.MOSAIC_DECODE_CTAS)
                e = rel_err(np.asarray(jax.jit(fn)(*paged), np.float32), want)
                errors.append(e)
                t = both(fn, paged)
                variants.append(f"  persistent {batch:>5} {ctx:>6} | block_kv {block_kv:>3} stages {stages} P regs "
                                f"splits {tile_splits:>2} | {t[0] * 1e6:8.1f} / {t[1] * 1e6:8.1f} us, "
                                f"{tm[0] / t[0]:5.2f} / {tm[1] / t[1]:5.2f}x default, {tc[0] / t[0]:5.2f} / "
                                f"{tc[1] / t[1]:5.2f}x cuDNN | err {e:7.1e}")
            for block_kv, stages, in_regs in tiles if cpu or (batch, ctx, cap) in VARIANT_SHAPES else ():
                tile_splits = num_splits_for(batch, batch, HQ, HKV, cap, block_kv)
                for s in sorted({max(1, tile_splits // 2), tile_splits, min(tuning.MAX_SPLITS, 2 * tile_splits)}):
                    if (block_kv, stages, in_regs, s) == (*default, splits):
                        continue
                    fn = mosaic(block_kv, stages, in_regs, s)
                    e = rel_err(np.asarray(jax.jit(fn)(*paged), np.float32), want)
                    errors.append(e)
                    t = bench(fn, paged, iters=3 if cpu else iters, repeats=1 if cpu else 5)
                    variants.append(f"  variant {batch:>5} {ctx:>6} | block_kv {block_kv:>3} stages {stages} "
                                    f"{'P regs' if in_regs else 'P smem'} splits {s:>2} | {t * 1e6:8.1f} us chained, "
                                    f"{tm[0] / t:5.2f}x default | err {e:7.1e}")
        except Exception as e:
            line += f" ERROR {type(e).__name__}: {str(e)[:600]}"
        print("\n".join([line, *variants]), flush=True)
        variants.clear()
    report_errors(errors, ERR_LIMIT, "cuDNN's (CPU: Triton's)")


if __name__ == "__main__":
    main()
