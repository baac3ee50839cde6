"""GPU check and timing of glint's Pallas kernels, in one run.

  PYTHONUNBUFFERED=1 python3 tools/gpu_kernels.py [--skip-sweep] [--skip-timing]

1. Sweep: the CPU test matrix at GPU sizes, compiled for real (interpret=False),
   against the jnp reference on the same device; prints PASS/FAIL per case.
2. Timing: decode (q_len 1) as achieved HBM GB/s over the K/V bytes read, and
   causal prefill as TFLOP/s, next to jax.nn.dot_product_attention(cudnn) on the
   same shapes (contiguous K/V for cuDNN, shuffled pages for glint).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from glint.pallas_kernels import (
    BlockSizes,
    default_block_sizes,
    default_num_splits,
    ring_write,
    ring_write_reference,
    varlen_attention,
    varlen_attention_reference,
)
from glint.pallas_kernels.testing import AttentionCase as C, as_fp8, make_attention_inputs

TOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 1e-2}


DECODE_VARIANTS = (("default", {}), ("flash", dict(num_splits=1)))
PREFILL_VARIANTS = (("default", {}), ("splitk3", dict(num_splits=3)))
SMALL = (("small", dict(num_splits=1, block_sizes=BlockSizes(16, 16))),)
TRITON = (("triton", dict(backend="triton")),)
MOSAIC = (("mosaic", dict(backend="mosaic")),)
MOSAIC_DECODE = (("mosaic_decode", dict(backend="mosaic_decode")),)
# The case's pools as an fp8 cache (testing.as_fp8), checked against the reference over those pools: the Triton
# kernel and the Mosaic decode kernel. A scaled cache reaches the Mosaic kernel only in pages of 32 keys or more.
FP8_PLAIN = (("triton_fp8", dict(backend="triton", fp8="plain")),
             ("mosaic_decode_fp8", dict(backend="mosaic_decode", fp8="plain")))
FP8_SCALED = (("triton_fp8s", dict(backend="triton", fp8="scaled")),
              ("mosaic_decode_fp8s", dict(backend="mosaic_decode", fp8="scaled")))


def sweep_cases():
    """(name, case, variants): the CPU test matrix at GPU sizes."""
    dec = tuple((1, n) for n in (1, 17, 300, 1024, 2047, 513, 64, 999))
    pre = ((128, 128), (77, 77), (256, 256))
    chunk = ((64, 700), (100, 1000), (1, 33))
    mixed = ((1, 900), (48, 48), (0, 0), (7, 260), (1, 5), (130, 400), (1, 1500))
    ring = ((1, 3000), (1, 800), (40, 1040), (5, 129), (1, 4095))
    cases = [
        (
            f"decode-{dtype}-d{d}-g4-p16",
            C(dec, group=4, head_dim=d, dtype=dtype, num_kv_heads=2, gaps=3, num_padding_segments=2),
            DECODE_VARIANTS + (MOSAIC if dtype == "bfloat16" else ())
            + (MOSAIC_DECODE + FP8_PLAIN if d <= 128 and dtype != "float32" else ()),
        )
        for dtype, d in (("bfloat16", 64), ("bfloat16", 128), ("bfloat16", 256), ("float32", 128))
    ]
    cases += [
        (
            "decode-g8-p32-softcap",
            C(dec, group=8, page_size=32, dtype="bfloat16", num_kv_heads=2, softcap=30.0),
            DECODE_VARIANTS + MOSAIC + MOSAIC_DECODE + FP8_SCALED,
        ),
        (
            "prefill-g4-p16",
            C(pre, group=4, dtype="bfloat16", num_kv_heads=2, head_dim=128, gaps=5),
            PREFILL_VARIANTS + TRITON + MOSAIC + MOSAIC_DECODE,
        ),
        ("prefill-g8-d256", C(pre, group=8, dtype="bfloat16", num_kv_heads=1, head_dim=256), PREFILL_VARIANTS + MOSAIC),
        (
            "prefill-noncausal-g4",
            C(pre, group=4, dtype="bfloat16", causal=False, head_dim=128),
            PREFILL_VARIANTS + MOSAIC + MOSAIC_DECODE,
        ),
        ("prefill-g4-p64-f16", C(pre, group=4, dtype="float16", page_size=64, head_dim=128),
         PREFILL_VARIANTS + MOSAIC + MOSAIC_DECODE),
        ("prefill-g1-p256-d64", C(pre, group=1, dtype="bfloat16", page_size=256, num_kv_heads=2),
         MOSAIC + MOSAIC_DECODE),
        ("prefill-f32-g1-p32-d64", C(pre, group=1, dtype="float32", num_kv_heads=4, page_size=32), PREFILL_VARIANTS),
        (
            "chunked-g4-p16",
            C(chunk, group=4, dtype="bfloat16", num_kv_heads=2, head_dim=128),
            PREFILL_VARIANTS + MOSAIC + MOSAIC_DECODE,
        ),
        (
            "mixed-g4-p16",
            C(mixed, group=4, dtype="bfloat16", num_kv_heads=2, head_dim=128, gaps=9, num_padding_segments=3),
            PREFILL_VARIANTS + SMALL + TRITON + MOSAIC + MOSAIC_DECODE,
        ),
        ("mixed-g6-d80", C(mixed, group=6, dtype="bfloat16", num_kv_heads=1, head_dim=80), PREFILL_VARIANTS),
        ("mixed-f32-window", C(mixed, group=4, dtype="float32", window=128, head_dim=128), PREFILL_VARIANTS),
        ("mixed-window-g4", C(mixed, group=4, dtype="bfloat16", window=100, head_dim=128), MOSAIC + MOSAIC_DECODE),
        (
            "ring-window-g4-p16",
            C(ring, group=4, dtype="bfloat16", ring_rows=192, window=128, head_dim=128),
            PREFILL_VARIANTS + SMALL + MOSAIC + MOSAIC_DECODE,
        ),
        (
            "ring-window-noncausal-softcap",
            C(ring, group=2, dtype="bfloat16", ring_rows=256, window=200, causal=False, softcap=50.0, page_size=32),
            PREFILL_VARIANTS + SMALL + MOSAIC + MOSAIC_DECODE + FP8_SCALED,
        ),
        ("underflow", C(((9, 4), (1, 50)), group=4, dtype="bfloat16"), PREFILL_VARIANTS + MOSAIC + MOSAIC_DECODE),
    ]
    return cases


def _to_device(inputs, dtype):
    return {k: jnp.asarray(v, dtype) if v.dtype == np.float32 else jnp.asarray(v) for k, v in inputs.items()}


def case_options(case) -> dict:
    """varlen_attention's keywords that a case fixes."""
    return dict(ring_rows=case.ring_rows, window=case.window, causal=case.causal, softcap=case.softcap,
                scale=case.scale)


def variant_call(args: dict, kw: dict) -> tuple[dict, dict]:
    """A variant's arguments and keywords: an fp8 variant (kw "fp8") gets the case's pools as that cache."""
    if fp8 := kw.get("fp8"):
        return as_fp8(args, scaled=fp8 == "scaled"), {k: v for k, v in kw.items() if k != "fp8"}
    return args, kw


def run_sweep(rng, *, interpret=False, max_cases=None, only=None, variant_names=None, shard=(0, 1)):
    """Every sweep case (or those named in `only`) against the reference; shard (k, n): the k-th of every n cases."""
    results = []
    k, n = shard
    for name, case, variants in sweep_cases()[:max_cases][k::n]:
        if only and not any(o in name for o in only):
            continue
        inputs = make_attention_inputs(case, rng)
        args = _to_device(inputs, case.dtype)
        opts = case_options(case)
        want = np.asarray(varlen_attention_reference(**args, **opts), np.float32)
        covered = np.zeros(want.shape[0], bool)
        for q_start, q_len, _, _ in inputs["seq_info"]:
            covered[q_start : q_start + q_len] = True
        for variant, kw in variants:
            if variant_names and variant not in variant_names:
                continue
            try:
                call_args, kw = variant_call(args, kw)
                variant_want = want
                if call_args is not args:  # the reference over the same fp8 pools
                    variant_want = np.asarray(varlen_attention_reference(**call_args, **opts), np.float32)
                got = np.asarray(varlen_attention(**call_args, **opts, **kw, interpret=interpret), np.float32)
                err = np.abs(got - variant_want)
                rel = np.linalg.norm(got - variant_want) / max(np.linalg.norm(variant_want), 1e-30)
                tol = TOL[case.dtype]
                ok = (
                    np.isfinite(got).all() and not got[~covered].any()
                    and bool(np.all(err <= tol + tol * np.abs(variant_want)))
                )
                print(f"{'PASS' if ok else 'FAIL'} {name:32s} {variant:8s} max_abs={err.max():.2e} rel={rel:.2e}")
            except Exception as e:  # keep sweeping; the report lists the failure
                ok = False
                print(f"ERROR {name} {variant}: {type(e).__name__}: {str(e)[:2000]}")
                traceback.print_exc(limit=3)
            results.append(ok)
    # ring_write against its reference (page 0 excluded: scratch)
    for dtype in ("bfloat16", "float32"):
        try:
            shape = (300, 16, 8, 128)
            k = jnp.asarray(rng.standard_normal(shape), dtype)
            v = jnp.asarray(rng.standard_normal(shape), dtype)
            n = 1000
            slots = jnp.asarray(
                np.concatenate([rng.choice(np.arange(16, 300 * 16), n - 8, replace=False), np.zeros(8, int)]), jnp.int32
            )
            kn = jnp.asarray(rng.standard_normal((n, 8, 128)), dtype)
            vn = jnp.asarray(rng.standard_normal((n, 8, 128)), dtype)
            kr, vr = ring_write_reference(k, v, kn, vn, slots)
            kr, vr = np.asarray(kr, np.float32)[1:], np.asarray(vr, np.float32)[1:]
            ko, vo = ring_write(k, v, kn, vn, slots, interpret=interpret)
            ok = np.array_equal(np.asarray(ko, np.float32)[1:], kr) and np.array_equal(
                np.asarray(vo, np.float32)[1:], vr
            )
            print(f"{'PASS' if ok else 'FAIL'} ring_write {dtype}")
        except Exception as e:
            ok = False
            print(f"ERROR ring_write {dtype}: {type(e).__name__}: {str(e)[:2000]}")
        results.append(ok)
    print(f"sweep: {sum(results)}/{len(results)} passed")


def bench(fn, args, *, iters=10, repeats=5):
    """Median seconds per call of fn(*args): `iters` dependent calls unrolled in
    one jit (no while-loop round trips to the host), so launches queue back to
    back."""

    def chain(*a):
        carry = jnp.float32(0)
        for _ in range(iters):
            q = a[0] + (carry * 0).astype(a[0].dtype)  # keep each call live and ordered
            carry = carry + fn(q, *a[1:]).reshape(-1)[0].astype(jnp.float32)
        return carry

    return _median_seconds(jax.jit(chain), args, repeats) / iters


def bench_separate(fn, args, *, calls=20):
    """Median seconds of one jitted fn(*args) call, dispatched alone and waited for (what a lone call pays: its
    launch and any per-call bookkeeping outside the kernel)."""
    return _median_seconds(jax.jit(fn), args, calls)


def _median_seconds(jitted, args, repeats: int) -> float:
    """Median seconds of `repeats` waited calls of jitted(*args), after one that compiles it."""
    jax.block_until_ready(jitted(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def give_interpreter_threads():
    """Before the CPU client starts: Pallas' GPU interpreter runs each warpgroup on a thread of the client's pool,
    which on 2 cores is too small for a three-warpgroup kernel (tests/conftest.py); at least four threads."""
    os.environ.setdefault("PJRT_NPROC", str(max(4, os.cpu_count() or 1)))


def report_errors(errors, limit: float, against: str):
    """Prints how many of `errors` (relative errors; NaN counts as bad) are within `limit` of `against`; exits 1
    unless all are."""
    bad = sum(not e <= limit for e in errors)
    print(f"values: {len(errors) - bad} of {len(errors)} Mosaic outputs within {limit:g} of {against}"
          + ("" if not bad else f"; {bad} NOT"))
    if bad:
        raise SystemExit(1)


def rel_err(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def paged_setup(key, batch, ctx, q_len, hq, hkv, d, page_size, dtype):
    """Shuffled pages for `batch` sequences of `ctx` keys; query rows q_len each."""
    pages_per_seq = -(-ctx // page_size)
    num_pages = batch * pages_per_seq + 1
    k1, k2, k3 = jax.random.split(key, 3)
    k_pages = jax.random.normal(k1, (num_pages, page_size, hkv, d), dtype)
    v_pages = jax.random.normal(k2, (num_pages, page_size, hkv, d), dtype)
    perm = np.random.default_rng(0).permutation(np.arange(1, num_pages))
    page_table = jnp.asarray(perm.reshape(batch, pages_per_seq), jnp.int32)
    seq_info = jnp.asarray([[b * q_len, q_len, b, ctx] for b in range(batch)], jnp.int32)
    q = jax.random.normal(k3, (batch * q_len, hq, d), dtype)
    return q, k_pages, v_pages, page_table, seq_info


def contiguous(q, k_pages, v_pages, page_table, batch, ctx):
    """The same data laid out for cuDNN: [B, L, H, D]."""
    _, page_size, hkv, d = k_pages.shape
    k = k_pages[page_table].reshape(batch, -1, hkv, d)[:, :ctx]
    v = v_pages[page_table].reshape(batch, -1, hkv, d)[:, :ctx]
    return q.reshape(batch, -1, *q.shape[1:]), k, v


def run_timing(*, quick=False, interpret=False, tables="decode,prefill", reference_times=True):
    hq, hkv, d, ps, dtype = 32, 8, 128, 16, jnp.bfloat16
    decode_shapes = [
        (8, 1024),
        (8, 8192),
        (8, 32768),
        (32, 4096),
        (32, 32768),
        (64, 16384),
        (128, 8192),
        (256, 1024),
        (256, 4096),
        (256, 8192),
    ]
    variant_shapes = [(8, 32768), (64, 16384), (256, 4096)]
    prefill_shapes = [(16, 512), (8, 1024), (4, 2048), (2, 4096), (1, 8192)]
    if quick:  # a dry run of the script itself
        decode_shapes, variant_shapes, prefill_shapes = [(2, 64)], [(2, 64)], [(1, 64)]
    scale = d**-0.5
    key = jax.random.key(0)

    def glint(**kw):
        return lambda q_, *a: varlen_attention(q_, *a, scale=scale, interpret=interpret, **kw)

    def reference(q_, *a):  # the engine's non-Pallas path (attention="reference"), jitted jnp
        return varlen_attention_reference(q_, *a, scale=scale)

    def cudnn(causal):
        return lambda q_, k_, v_: jax.nn.dot_product_attention(
            q_, k_, v_, scale=scale, is_causal=causal, implementation="cudnn"
        )

    if "decode" not in tables:
        decode_shapes, variant_shapes = [], []
    if "prefill" not in tables:
        prefill_shapes = []
    print(
        "\nDECODE (q_len 1, Hq 32 / Hkv 8, D 128, bf16, page 16, shuffled pages): "
        "GB/s = K/V bytes / time; err = |glint - cudnn| / |cudnn|; x cuDNN = cudnn time / glint time (this call)"
    )
    print(
        f"{'batch':>5} {'ctx':>6} | {'glint us':>9} {'GB/s':>6} {'splits':>6} | "
        f"{'1split us':>9} {'GB/s':>6} | {'cudnn us':>9} {'GB/s':>6} | {'err':>7} | {'x cuDNN':>7} | {'jnp ref us':>10}"
    )
    for batch, ctx in decode_shapes:
        kv_bytes = 2 * batch * ctx * hkv * d * 2
        line = f"{batch:>5} {ctx:>6} |"
        try:
            paged = paged_setup(key, batch, ctx, 1, hq, hkv, d, ps, dtype)
            blocks = default_block_sizes(batch, batch, d)
            splits = default_num_splits(batch, batch, hq, hkv, paged[3].shape[1] * ps, blocks)
            t = bench(glint(), paged)
            line += f" {t * 1e6:9.1f} {kv_bytes / t / 1e9:6.0f} {splits:>6} |"
            if splits > 1:
                t1 = bench(glint(num_splits=1), paged)
                line += f" {t1 * 1e6:9.1f} {kv_bytes / t1 / 1e9:6.0f} |"
            else:
                line += f" {'-':>9} {'-':>6} |"
            ours = glint()(*paged)
            dense = contiguous(*paged[:4], batch, ctx)
            tc = bench(cudnn(False), dense)
            err = rel_err(ours.reshape(batch, 1, hq, d), cudnn(False)(*dense))
            line += f" {tc * 1e6:9.1f} {kv_bytes / tc / 1e9:6.0f} | {err:7.1e} | {tc / t:6.2f}x"
            line += f" | {bench(reference, paged) * 1e6:10.1f}"
            del paged, dense, ours
        except Exception as e:
            line += f" ERROR {type(e).__name__}: {str(e)[:400]}"
        print(line)

    print("\nDECODE block variants (us): default vs other BlockSizes, default splits")
    variants = {
        "k128s2": BlockSizes(16, 128, 4, 2),
        "k32s4": BlockSizes(16, 32, 4, 4),
        "k64s4w8": BlockSizes(16, 64, 8, 4),
    }
    print(f"{'batch':>5} {'ctx':>6} | {'default':>8} | " + " | ".join(f"{n:>8}" for n in variants))
    for batch, ctx in variant_shapes:
        line = f"{batch:>5} {ctx:>6} |"
        try:
            paged = paged_setup(key, batch, ctx, 1, hq, hkv, d, ps, dtype)
            line += f" {bench(glint(), paged) * 1e6:8.1f} |"
            for blocks in variants.values():
                line += f" {bench(glint(block_sizes=blocks), paged) * 1e6:8.1f} |"
            del paged
        except Exception as e:
            line += f" ERROR {type(e).__name__}: {str(e)[:400]}"
        print(line)

    print("\nPREFILL (causal, q_len = ctx, Hq 32 / Hkv 8, D 128, bf16, page 16): TFLOP/s; glint = the engine's choice; "
          "x cuDNN = cudnn time / glint time (this call); chained (in one jit) / separate (one waited call)")
    print(
        f"{'batch':>5} {'q_len':>6} | {'glint ms':>8} {'TF/s':>5} | {'triton ms':>9} {'TF/s':>5} | "
        f"{'cudnn ms':>8} {'TF/s':>5} | {'err':>7} | {'x cuDNN':>7} | {'jnp ref ms':>10} | "
        f"{'glint sep':>9} {'cudnn sep':>9} {'x cuDNN':>7}"
    )
    for batch, q_len in prefill_shapes:
        flops = 2 * batch * hq * q_len * q_len * d  # QK^T and PV over the causal half
        line = f"{batch:>5} {q_len:>6} |"
        try:
            paged = paged_setup(key, batch, q_len, q_len, hq, hkv, d, ps, dtype)
            t = bench(glint(), paged)
            line += f" {t * 1e3:8.3f} {flops / t / 1e12:5.0f} |"
            t2 = bench(glint(backend="triton"), paged)
            line += f" {t2 * 1e3:9.3f} {flops / t2 / 1e12:5.0f} |"
            dense = contiguous(*paged[:4], batch, q_len)
            tc = bench(cudnn(True), dense)
            err = rel_err(glint()(*paged).reshape(batch, q_len, hq, d), cudnn(True)(*dense))
            line += f" {tc * 1e3:8.3f} {flops / tc / 1e12:5.0f} | {err:7.1e} | {tc / t:6.2f}x"
            timed_ref = q_len <= 4096 and reference_times
            line += f" | {bench(reference, paged) * 1e3:10.3f}" if timed_ref else f" | {'-':>10}"
            ts, tcs = bench_separate(glint(), paged), bench_separate(cudnn(True), dense)
            line += f" | {ts * 1e3:9.3f} {tcs * 1e3:9.3f} {tcs / ts:6.2f}x"
            del paged, dense
        except Exception as e:
            line += f" ERROR {type(e).__name__}: {str(e)[:400]}"
        print(line)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--interpret", action="store_true", help="CPU dry run of the sweep")
    parser.add_argument("--max-cases", type=int, default=None)
    parser.add_argument("--only", default="", help="comma-separated substrings of sweep case names")
    parser.add_argument("--variants", default="", help="comma-separated sweep variants to run (default all)")
    parser.add_argument("--shard", default="0/1", help="K/N: run the K-th of every N sweep cases (0-based)")
    parser.add_argument("--quick", action="store_true", help="tiny timing shapes")
    parser.add_argument("--tables", default="decode,prefill", help="timing tables to run")
    parser.add_argument("--skip-reference", action="store_true", help="no jnp reference column in the prefill table")
    flags = parser.parse_args()
    if flags.interpret:
        give_interpreter_threads()
    print(jax.__version__, jax.devices())
    t0 = time.time()
    if not flags.skip_sweep:
        k, n = map(int, flags.shard.split("/"))
        if not 0 <= k < n:
            parser.error(f"--shard {flags.shard}: needs 0 <= K < N")
        run_sweep(np.random.default_rng(int(time.time())), interpret=flags.interpret, max_cases=flags.max_cases,
                  only=[o for o in flags.only.split(",") if o],
                  variant_names=[v for v in flags.variants.split(",") if v], shard=(k, n))
        print(f"sweep took {time.time() - t0:.0f}s")
    if not flags.skip_timing:
        run_timing(quick=flags.quick, interpret=flags.interpret, tables=flags.tables,
                   reference_times=not flags.skip_reference)
    print(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
