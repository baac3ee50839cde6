"""The fp8 (W8A8) MLP's middle in one pass (Pallas, Triton backend): gate_up's GEMM output to down's fp8 input.

Between an fp8 MLP's two GEMMs the model scales gate_up's raw product y [T, 2I] by the token and channel scales
(rounding to the activation dtype), takes SiLU(g) * u, and quantizes that hidden per token to float8_e4m3fn
(amax / 448 per row). XLA runs this as two kernels that each read y: the rows' amax, then the quantize, both
recomputing the scaling and the SiLU. At a 4096-token prefill step of llama3-8b that is 263 us a layer for
235 MB of y written as bfloat16 (tuning.FP8_GEMM_OUT; 470 MB as float32) (docs/perf.md). Here one program per
tile of token rows (tuning.GATED_FP8_ROWS) reads its rows' y twice, block by block: once for the amax, once to
quantize, the second read from L2. Each block's channel scales are read once for the tile's rows. It writes the
fp8 hidden and the rows' scales. One row per tile (its first version) ran as long as XLA's two kernels on the
H200 (docs/perf.md); tiles of several rows are not yet measured.

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


def _kernel(y_ref, xscale_ref, wscale_ref, q_ref, scale_ref, *, num_rows: int, width: int, tile: int, block: int,
            dtype):
    """One tile of `tile` token rows: the channel scales of a column block are read once for all its rows."""
    rows = pl.program_id(0) * tile + jnp.arange(tile, dtype=jnp.int32)
    row_ok = rows < num_rows
    xscale = plgpu.load(xscale_ref.at[rows], mask=row_ok, other=0)[:, None]
    cols = jnp.arange(block, dtype=jnp.int32)
    num_blocks = pl.cdiv(width, block)

    def hidden(b):
        c = b * block + cols
        ok = row_ok[:, None] & (c < width)[None, :]
        g = plgpu.load(y_ref.at[rows[:, None], c[None, :]], mask=ok, other=0)
        u = plgpu.load(y_ref.at[rows[:, None], width + c[None, :]], mask=ok, other=0)
        wg = plgpu.load(wscale_ref.at[c], mask=c < width, other=0)[None, :]
        wu = plgpu.load(wscale_ref.at[width + c], mask=c < width, other=0)[None, :]
        return c, ok, _hidden((g, u), xscale, wg, wu, dtype)  # masked lanes: g = u = 0, so h = 0

    def amax_of(b, amax):
        _, _, h = hidden(b)
        return jnp.maximum(amax, jnp.max(jnp.abs(h), axis=1))

    amax = jax.lax.fori_loop(0, num_blocks, amax_of, jnp.zeros((tile,), jnp.float32))
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    plgpu.store(scale_ref.at[rows], scale, mask=row_ok)

    def quantize(b, carry):
        c, ok, h = hidden(b)
        q = jnp.clip(h / scale[:, None], -FP8_MAX, FP8_MAX).astype(FP8)
        plgpu.store(q_ref.at[rows[:, None], c[None, :]], q, mask=ok)
        return carry

    jax.lax.fori_loop(0, num_blocks, quantize, 0)


def gated_quantize_fp8(y, xscale, wscale, dtype, *, interpret: bool = False):
    """As `gated_quantize_fp8_reference`, one Triton program per tile of tuning.GATED_FP8_ROWS token rows."""
    if y.ndim != 2 or y.shape[1] % 2 or xscale.shape != (y.shape[0], 1) or wscale.shape != y.shape[1:]:
        raise ValueError(f"gated_quantize_fp8: y {y.shape} must be [T, 2I], xscale {xscale.shape} [T, 1], "
                         f"wscale {wscale.shape} [2I]")
    rows, width = y.shape[0], y.shape[1] // 2
    block = min(tuning.GATED_FP8_BLOCK, pl.next_power_of_2(width))
    tile = min(tuning.GATED_FP8_ROWS, pl.next_power_of_2(rows))
    q, scale = pl.pallas_call(
        functools.partial(_kernel, num_rows=rows, width=width, tile=tile, block=block, dtype=jnp.dtype(dtype)),
        grid=(pl.cdiv(rows, tile),),
        out_shape=(jax.ShapeDtypeStruct((rows, width), FP8), jax.ShapeDtypeStruct((rows,), jnp.float32)),
        compiler_params=plgpu.CompilerParams(num_warps=tuning.GATED_FP8_NUM_WARPS, num_stages=1),
        interpret=interpret,
        name=f"gated_quantize_fp8_r{tile}_b{block}",
    )(y, xscale[:, 0].astype(jnp.float32), wscale.astype(jnp.float32))
    return q, scale[:, None]
