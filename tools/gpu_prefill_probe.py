"""Where does causal prefill attention top out on this GPU? Times, on the same shapes (GQA 32/8, D 128, bf16):
cuDNN, JAX's stock Pallas kernels (Triton `mha`, contiguous, K/V repeated to 32 heads; Mosaic GPU FA3
`attention_mgpu`, contiguous GQA), and glint's paged kernel under several tile choices and page sizes.
Also greps the PTX of glint's prefill kernel for wgmma / mma.sync / cp.async.

  PYTHONUNBUFFERED=1 python3 tools/gpu_prefill_probe.py [--ptx-dir DIR]
  PYTHONUNBUFFERED=1 python3 tools/gpu_prefill_probe.py --mosaic   # the Mosaic kernels only, every shape

--mosaic times, chained, cuDNN, JAX's stock Mosaic FA3 (contiguous, no paging, not varlen) and glint's
Mosaic kernel alone (backend "mosaic") over pages of 16, 64 and 256, causal and not, on its persistent grid (one
CTA per multiprocessor), and "auto" (the Triton pass and the Mosaic kernel): where glint trails the stock kernel,
paging and varlen cost it; where both trail cuDNN, the FlashAttention-3 layout they share does.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
from glint.pallas_kernels import BlockSizes, tuning, varlen_attention
from glint.pallas_kernels.varlen_attention_mgpu import varlen_attention_mgpu
from gpu_kernels import bench, contiguous, paged_setup

HQ, HKV, D = 32, 8, 128
SHAPES = [(16, 512), (8, 1024), (2, 4096)]
MOSAIC_SHAPES = [(16, 512), (8, 1024), (4, 2048), (2, 4096), (1, 8192)]
SMS = 132  # an H100's and an H200's multiprocessors: one CTA each for the persistent grid


def tflops(batch, q_len, t):
    return 2 * batch * HQ * q_len * q_len * D / t / 1e12


def row(label, batch, q_len, fn, args):
    try:
        t = bench(fn, args, iters=5, repeats=3)
        print(f"{label:34s} {batch:>3}x{q_len:<5} {t * 1e3:8.3f} ms {tflops(batch, q_len, t):6.0f} TF/s", flush=True)
    except Exception as e:
        print(f"{label:34s} {batch:>3}x{q_len:<5} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)


def stock_kernels(batch, q_len, paged):
    from jax.experimental.pallas.ops.gpu import attention as tri
    from jax.experimental.pallas.ops.gpu import attention_mgpu as mg

    q, k, v = contiguous(*paged[:4], batch, q_len)
    scale = D**-0.5
    row("cudnn", batch, q_len, lambda q_, k_, v_: jax.nn.dot_product_attention(
        q_, k_, v_, scale=scale, is_causal=True, implementation="cudnn"), (q, k, v))
    k32, v32 = jnp.repeat(k, HQ // HKV, axis=2), jnp.repeat(v, HQ // HKV, axis=2)
    for bq, bk, w, s in ((128, 64, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3)):
        fn = lambda q_, k_, v_, bq=bq, bk=bk, w=w, s=s: tri.mha(
            q_, k_, v_, None, sm_scale=scale, causal=True, block_sizes=tri.BlockSizes(bq, bk), num_warps=w, num_stages=s)
        row(f"triton mha q{bq} k{bk} w{w} s{s}", batch, q_len, fn, (q, k32, v32))
    for dtype in (jnp.bfloat16, jnp.float16):
        for bkv, steps in ((64, 2), (128, 2), (128, 3)):
            cfg = mg.TuningConfig(block_q=64, block_kv=bkv, max_concurrent_steps=steps, causal=True)
            fn = lambda q_, k_, v_, cfg=cfg: mg.attention(q_ * scale, k_, v_, cfg)
            row(f"mgpu fa3 kv{bkv} st{steps} {jnp.dtype(dtype).name}", batch, q_len, fn,
                (q.astype(dtype), k.astype(dtype), v.astype(dtype)))


def glint_variants(batch, q_len):
    scale = D**-0.5
    variants = {
        "m64 k64 w4 s3 (table)": None,
        "m128 k64 w8 s3": BlockSizes(128, 64, 8, 3),
        "m128 k128 w8 s3": BlockSizes(128, 128, 8, 3),
        "m128 k64 w4 s3": BlockSizes(128, 64, 4, 3),
        "m64 k128 w4 s3": BlockSizes(64, 128, 4, 3),
        "m128 k32 w8 s4": BlockSizes(128, 32, 8, 4),
        "m64 k64 w4 s2": BlockSizes(64, 64, 4, 2),
    }
    for ps in (16, 128):
        paged = paged_setup(jax.random.key(0), batch, q_len, q_len, HQ, HKV, D, ps, jnp.bfloat16)
        for name, blocks in variants.items():
            fn = lambda q_, *a, blocks=blocks: varlen_attention(q_, *a, scale=scale, block_sizes=blocks)
            row(f"glint p{ps} {name}", batch, q_len, fn, paged)
    return paged_setup(jax.random.key(0), batch, q_len, q_len, HQ, HKV, D, 16, jnp.bfloat16)


def ptx_report(dump_dir):
    """Compile glint's default prefill kernel in a child process with XLA dumps on; count MMA flavours."""
    code = (
        "import jax, jax.numpy as jnp, sys; sys.path.insert(0, 'tools');"
        "from gpu_kernels import paged_setup; from glint.pallas_kernels import varlen_attention;"
        "a = paged_setup(jax.random.key(0), 2, 512, 512, 32, 8, 128, 16, jnp.bfloat16);"
        "jax.block_until_ready(varlen_attention(*a, scale=0.1))"
    )
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump_dir} --xla_dump_hlo_as_text")
    subprocess.run([sys.executable, "-c", code], env=env, check=False, timeout=120)
    files = glob.glob(f"{dump_dir}/**/*.ptx", recursive=True) + glob.glob(f"{dump_dir}/**/*triton*", recursive=True)
    print(f"ptx dump: {len(files)} files under {dump_dir}")
    for path in files:
        try:
            text = open(path, errors="ignore").read()
        except IsADirectoryError:
            continue
        counts = {pat: len(re.findall(pat, text)) for pat in ("wgmma", "mma.sync", "cp.async", "ldmatrix", "cp.async.bulk")}
        if any(counts.values()):
            print(f"  {os.path.basename(path)[:60]}: {counts}")


def mosaic_rows(batch, q_len):
    from jax.experimental.pallas.ops.gpu import attention_mgpu as stock

    scale = D**-0.5
    for causal in (True, False):
        kind = "causal" if causal else "full"
        paged = paged_setup(jax.random.key(0), batch, q_len, q_len, HQ, HKV, D, 16, jnp.bfloat16)
        q, k, v = contiguous(*paged[:4], batch, q_len)
        row(f"cudnn {kind}", batch, q_len, lambda q_, k_, v_, c=causal: jax.nn.dot_product_attention(
            q_, k_, v_, scale=scale, is_causal=c, implementation="cudnn"), (q, k, v))
        for dtype in (jnp.bfloat16, jnp.float16):
            cfg = stock.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal)
            row(f"stock mgpu fa3 {kind} {jnp.dtype(dtype).name}", batch, q_len,
                lambda q_, k_, v_, cfg=cfg: stock.attention(q_ * scale, k_, v_, cfg),
                (q.astype(dtype), k.astype(dtype), v.astype(dtype)))
        del q, k, v
        for ps in (16, 64, 256):
            paged = paged_setup(jax.random.key(0), batch, q_len, q_len, HQ, HKV, D, ps, jnp.bfloat16)
            row(f"glint mosaic {kind} p{ps}", batch, q_len, lambda q_, *a, c=causal: varlen_attention(
                q_, *a, scale=scale, causal=c, backend="mosaic"), paged)
            if ps == 16:
                row(f"glint auto {kind} p16", batch, q_len, lambda q_, *a, c=causal: varlen_attention(
                    q_, *a, scale=scale, causal=c), paged)
                row(f"glint mosaic {kind} p16 persistent {SMS}", batch, q_len, lambda q_, *a, c=causal: (
                    varlen_attention_mgpu(q_, *a, scale=scale, causal=c, max_ctas=SMS, **tuning.MOSAIC_PREFILL)),
                    paged)
        # TF/s above count the causal half's flops; the full rows did twice the work


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ptx-dir", default=os.path.join(os.environ.get("OUT", "out"), "dump"))
    parser.add_argument("--mosaic", action="store_true", help="the Mosaic kernels only (see the docstring)")
    flags = parser.parse_args()
    print(jax.__version__, jax.devices())
    if flags.mosaic:
        for batch, q_len in MOSAIC_SHAPES:
            mosaic_rows(batch, q_len)
        return
    ptx_report(flags.ptx_dir)
    for batch, q_len in SHAPES:
        paged = glint_variants(batch, q_len)
        stock_kernels(batch, q_len, paged)


if __name__ == "__main__":
    main()
