"""The fp8 (W8A8) MLP's middle in one pass (Pallas, Triton backend): gate_up's GEMM output to down's fp8 input.

Between an fp8 MLP's two GEMMs the model scales gate_up's raw product y [T, 2I] by the token and channel scales
(rounding to the activation dtype), takes SiLU(g) * u, and quantizes that hidden per token to float8_e4m3fn
(amax / 448 per row). XLA runs this as two kernels that each read y: the rows' amax, then the quantize, both
recomputing the scaling and the SiLU. At a 4096-token prefill step of llama3-8b that is 263 us a layer for
235 MB of y written as bfloat16 (tuning.FP8_GEMM_OUT; 470 MB as float32) (docs/perf.md). Here one program per token row reads its row's y twice, block by block: once for the
amax, once to quantize, and the second read comes from L2. It writes the fp8 hidden and the row's scale.

The reference, `gated_quantize_fp8_reference`, rounds where the model's unfused path rounds as written (the
scaled product, each op of jax.nn.silu, SiLU x u, each to the activation dtype): on the CPU it equals that path
and the interpreted kernel bit for bit; on the GPU, exp, division and XLA's fusions may differ in the last bit.
The tests hold the kernel to the reference and the reference to `model.quant`'s fp8_matmul /
quantize_activations_fp8 path. Not finite inputs: Triton's max and clip drop NaNs, so a row with a NaN or an Inf
quantizes to garbage where the reference gives NaN; the model's activations are finite.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from glint.pallas_kernels import tuning

__all__ = ["gated_quantize_fp8", "gated_quantize_fp8_reference"]

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)


def _hidden(y, xscale, wscale_g, wscale_u, dtype):
    """SiLU(g) * u in float32, rounded as the model rounds: each op of jax.nn.silu (x * (1 / (1 + exp(-x)))) and
    the product in `dtype`."""
    def rounded(v):
        return v.astype(dtype).astype(jnp.float32)

    g = rounded(y[0].astype(jnp.float32) * xscale * wscale_g)
    u = rounded(y[1].astype(jnp.float32) * xscale * wscale_u)
    sigmoid = rounded(1.0 / rounded(1.0 + rounded(jnp.exp(-g))))
    return rounded(rounded(g * sigmoid) * u)


def gated_quantize_fp8_reference(y, xscale, wscale, dtype):
    """y [T, 2I] (gate_up's raw fp8 x fp8 product), xscale f32[T, 1], wscale f32[2I] -> (hidden f8e4m3fn[T, I],
    scale f32[T, 1]): h = SiLU(g) * u of the scaled product in `dtype`, quantized per token."""
    g, u = jnp.split(y, 2, axis=-1)
    wg, wu = jnp.split(wscale, 2)
    h = _hidden((g, u), xscale, wg[None, :], wu[None, :], dtype)
    amax = jnp.max(jnp.abs(h), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return jnp.clip(h / scale, -FP8_MAX, FP8_MAX).astype(FP8), scale


def _kernel(y_ref, xscale_ref, wscale_ref, q_ref, scale_ref, *, width: int, block: int, dtype):
    t = pl.program_id(0)
    xscale = xscale_ref[t]
    cols = jnp.arange(block, dtype=jnp.int32)
    num_blocks = pl.cdiv(width, block)

    def hidden(b):
        c = b * block + cols
        ok = c < width
        g = plgpu.load(y_ref.at[t, c], mask=ok, other=0)
        u = plgpu.load(y_ref.at[t, width + c], mask=ok, other=0)
        wg = plgpu.load(wscale_ref.at[c], mask=ok, other=0)
        wu = plgpu.load(wscale_ref.at[width + c], mask=ok, other=0)
        return c, ok, _hidden((g, u), xscale, wg, wu, dtype)

    def amax_of(b, amax):
        _, ok, h = hidden(b)
        return jnp.maximum(amax, jnp.max(jnp.where(ok, jnp.abs(h), 0.0)))

    amax = jax.lax.fori_loop(0, num_blocks, amax_of, jnp.float32(0))
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    scale_ref[t] = scale

    def quantize(b, carry):
        c, ok, h = hidden(b)
        plgpu.store(q_ref.at[t, c], jnp.clip(h / scale, -FP8_MAX, FP8_MAX).astype(FP8), mask=ok)
        return carry

    jax.lax.fori_loop(0, num_blocks, quantize, 0)


def gated_quantize_fp8(y, xscale, wscale, dtype, *, interpret: bool = False):
    """As `gated_quantize_fp8_reference`, one Triton program per row."""
    if y.ndim != 2 or y.shape[1] % 2 or xscale.shape != (y.shape[0], 1) or wscale.shape != y.shape[1:]:
        raise ValueError(f"gated_quantize_fp8: y {y.shape} must be [T, 2I], xscale {xscale.shape} [T, 1], "
                         f"wscale {wscale.shape} [2I]")
    rows, width = y.shape[0], y.shape[1] // 2
    block = min(tuning.GATED_FP8_BLOCK, pl.next_power_of_2(width))
    q, scale = pl.pallas_call(
        functools.partial(_kernel, width=width, block=block, dtype=jnp.dtype(dtype)),
        grid=(rows,),
        out_shape=(jax.ShapeDtypeStruct((rows, width), FP8), jax.ShapeDtypeStruct((rows,), jnp.float32)),
        compiler_params=plgpu.CompilerParams(num_warps=tuning.GATED_FP8_NUM_WARPS, num_stages=1),
        interpret=interpret,
        name=f"gated_quantize_fp8_b{block}",
    )(y, xscale[:, 0].astype(jnp.float32), wscale.astype(jnp.float32))
    return q, scale[:, None]
