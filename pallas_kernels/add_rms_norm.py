"""Residual add + RMSNorm (Pallas, Triton backend): a layer's residual stream and its next norm in one kernel.

One program per step row reads the row's residual x and the sublayer output h, writes s = x + h, and writes s
RMS-normed and scaled by the norm's weight. In a decode step XLA runs this as three kernels (the add, with a
split-K GEMM's partial sums, the norm's reduction, its scaling), twice a layer, each a microsecond or two of
launch and latency; with this kernel the partial sums are XLA's one kernel before it. Measured on the H200
(docs/perf.md, "Residual add + RMSNorm in one kernel"): 3.0 us a call at one row, llama3-8b int4 decode 2.53 /
2.63 ms against 2.84 / 2.76 unfused in two calls; taking int4's split-K partial sums here instead was slower
(one program reading 7-8 float32 copies of the row: 5.6 us).

Its reference, `add_rms_norm_reference`, rounds where the model's unfused path rounds (h to the activation
dtype, s after the add, the normed row at the end); the tests hold the kernel to the reference and the reference
to the model's path (glint.model.transformer.rms_norm after the add).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from glint.pallas_kernels import tuning
from glint.pallas_kernels.reference import add_rms_norm_reference
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["add_rms_norm", "add_rms_norm_reference"]


def _add_rms_norm_kernel(
    x_ref,  # [T, D]
    h_ref,  # [T, D]
    weight_ref,  # f32[D]
    sum_ref,  # [T, D]: x + h
    out_ref,  # [T, D]: rms_norm(x + h) * weight
    *,
    eps: float,
):
    t = pl.program_id(0)
    dim = x_ref.shape[1]
    d = jnp.arange(pl.next_power_of_2(dim), dtype=jnp.int32)
    is_d_in = d < dim  # lanes past D load as 0, so they add nothing to the sum of squares
    dtype = x_ref.dtype
    h = plgpu.load(h_ref.at[t, d], mask=is_d_in, other=0).astype(dtype).astype(jnp.float32)
    x = plgpu.load(x_ref.at[t, d], mask=is_d_in, other=0).astype(jnp.float32)
    s = (x + h).astype(dtype)
    plgpu.store(sum_ref.at[t, d], s, mask=is_d_in)
    s = s.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.sum(s * s) / dim + eps)
    weight = plgpu.load(weight_ref.at[d], mask=is_d_in, other=0)
    plgpu.store(out_ref.at[t, d], (s * r * weight).astype(dtype), mask=is_d_in)


def _add_rms_norm_call(x, h, weight, *, eps: float, interpret: bool):
    num_rows, dim = x.shape
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pl.pallas_call(
        functools.partial(_add_rms_norm_kernel, eps=eps),
        grid=(num_rows,),
        out_shape=(out, out),
        compiler_params=plgpu.CompilerParams(num_warps=tuning.ADD_RMS_NORM_NUM_WARPS, num_stages=1),
        interpret=interpret,
        name=f"add_rms_norm_d{pl.next_power_of_2(dim)}",
    )(x, h, weight)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm(x, h, weight, *, eps: float = 1e-6, interpret: bool = False):
    """(x + h, RMSNorm(x + h) * weight): the residual stream after a sublayer and its next norm.

    Args:
      x: [T, D] residual stream, bfloat16, float16 or float32 (the activation dtype).
      h: [T, D] the sublayer's output in any float dtype, rounded to x's before the add (the model's linears
        return x's dtype).
      weight: [D] the norm's weight (widened to float32).
      eps: the RMSNorm's epsilon.
      interpret: run the Pallas interpreter (CPU tests).
    Returns:
      (x + h, its norm), both [T, D] in x's dtype; the norm in float32 from the rounded sum.
    """
    dtypes = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
    if x.ndim != 2 or h.shape != x.shape or weight.shape != x.shape[1:] or x.dtype not in dtypes \
            or h.dtype not in dtypes:
        raise ValueError(f"add_rms_norm: x and h [T, D] (bfloat16, float16 or float32), weight [D] expected, got x "
                         f"{x.dtype}{list(x.shape)}, h {h.dtype}{list(h.shape)}, weight {weight.dtype}"
                         f"{list(weight.shape)}")
    if x.shape[0] == 0:
        return x, x
    return _add_rms_norm_call(x, h, weight.astype(jnp.float32), eps=eps, interpret=interpret)
