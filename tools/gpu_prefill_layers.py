"""The Mosaic prefill kernel against the Triton one on ring layers, sliding windows and soft-caps (#13 item 2).

For each layer shape below: a prefill step of `batch` chunks of `q_len` rows ending at key `kv_end`, on Triton
(as "auto" runs it today) and on the Mosaic prefill kernel (backend "mosaic"), each chained (`--iters` dependent
calls in one jit, default 20) and as separate calls (one jit call each, waited for). TFLOP/s counts the
(query, key) pairs each row sees. Every Mosaic output is checked against Triton's (relative error); whether
tuning.MOSAIC_PREFILL_PLAIN_ONLY can go is read off the "x triton" columns.

    python3 tools/gpu_prefill_layers.py [--iters N]
On a CPU machine: a dry run on tiny shapes (Pallas' GPU interpreters, no timing worth reading).
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_kernels import bench, give_interpreter_threads, paged_setup, rel_err, report_errors  # noqa: E402
from gpu_quant_kernels import timed  # noqa: E402

from glint.pallas_kernels import varlen_attention  # noqa: E402

PS = 16
ERR_LIMIT = 1e-2
# (name, batch, q_len, kv_end, Hq, Hkv, D, window, ring_rows, softcap): ring rows as the engine sizes them with
# the default 512-row prefill chunk limit would be window + 511; these chunks are wider, so their rings are too.
SHAPES = [
    ("gemma2-global softcap", 8, 1024, 1024, 16, 8, 256, 0, None, 50.0),
    ("gemma2-local window+softcap", 2, 4096, 8192, 16, 8, 256, 4096, None, 50.0),
    ("mistral window", 4, 2048, 4096, 32, 8, 128, 1024, None, 0.0),
    ("gemma3-local ring", 8, 1024, 3072, 8, 4, 256, 1024, 1024 + 1024 - 1, 0.0),
    ("glimmer-local ring", 8, 512, 4096, 32, 8, 128, 2048, 2048 + 512 - 1, 0.0),
    ("ring chunk 512 softcap", 16, 512, 2560, 16, 8, 128, 1024, 1024 + 512 - 1, 30.0),
]
CPU_SHAPES = [("cpu window+softcap", 2, 70, 150, 2, 1, 64, 40, None, 5.0),
              ("cpu ring", 2, 40, 300, 2, 1, 64, 50, 89, 0.0)]


def pairs(q_len: int, kv_end: int, window: int) -> int:
    """(query, key) pairs of one causal chunk: row p sees keys max(0, p - window + 1) .. p."""
    pos = np.arange(kv_end - q_len, kv_end)
    lo = np.maximum(pos - window + 1, 0) if window else np.zeros_like(pos)
    return int((pos + 1 - lo).sum())


def main():
    cpu = jax.default_backend() == "cpu"
    argv = sys.argv[1:]
    iters = int(argv[1]) if argv[:1] == ["--iters"] else 20
    key = jax.random.key(0)
    print("times in ms (chained / separate); TF/s over the visible pairs; x triton = triton time / mosaic time")
    print(f"{'shape':<28} | {'triton':>15} {'TF/s':>5} | {'mosaic':>15} {'TF/s':>5} | {'err':>7} | "
          f"{'x triton c/s':>12}")
    errors = []
    for name, batch, q_len, kv_end, hq, hkv, d, window, ring_rows, softcap in CPU_SHAPES if cpu else SHAPES:
        rows = ring_rows or kv_end  # pool rows per sequence
        q, k_pages, v_pages, page_table, seq_info = paged_setup(key, batch, rows, q_len, hq, hkv, d, PS, jnp.bfloat16)
        paged = (q, k_pages, v_pages, page_table, seq_info.at[:, 3].set(kv_end))
        layer = dict(ring_rows=ring_rows, window=window, softcap=softcap, scale=d**-0.5, interpret=cpu)
        flops = 4 * batch * hq * d * pairs(q_len, kv_end, window)

        def kernel(backend, layer=layer):
            return lambda q_, *a: varlen_attention(q_, *a, backend=backend, **layer)

        def both(fn, paged=paged):
            return bench(fn, paged, iters=2 if cpu else iters, repeats=1 if cpu else 5), \
                timed(jax.jit(fn), *paged, repeats=1 if cpu else 20)

        line = f"{name:<28} |"
        try:
            tt, tm = both(kernel("triton")), both(kernel("mosaic"))
            err = rel_err(jax.jit(kernel("mosaic"))(*paged), jax.jit(kernel("triton"))(*paged))
            errors.append(err)
            line += (f" {tt[0] * 1e3:7.3f} {tt[1] * 1e3:7.3f} {flops / tt[0] / 1e12:5.0f} | {tm[0] * 1e3:7.3f} "
                     f"{tm[1] * 1e3:7.3f} {flops / tm[0] / 1e12:5.0f} | {err:7.1e} | {tt[0] / tm[0]:5.2f} "
                     f"{tt[1] / tm[1]:5.2f}")
        except Exception as e:  # keep timing the other shapes; the line says what failed
            line += f" ERROR {type(e).__name__}: {str(e)[:600]}"
            errors.append(float("nan"))
        print(line, flush=True)
    report_errors(errors, ERR_LIMIT, "Triton's")


if __name__ == "__main__":
    give_interpreter_threads()  # a CPU dry run interprets the kernel; a GPU machine's cores are enough already
    main()
