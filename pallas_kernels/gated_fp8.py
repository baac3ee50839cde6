"""The fp8 (W8A8) MLP's middle in one pass (Pallas, Triton backend): gate_up's GEMM output to down's fp8 input.

Between an fp8 MLP's two GEMMs the model scales gate_up's raw product y [T, 2I] by the token and channel scales,
takes SiLU(g) * u, and quantizes that hidden per token to float8_e4m3fn (amax / 448 per row). XLA runs this as two
kernels that each read y (the rows' amax, then the quantize), both recomputing the scaling and the SiLU in the
activations' dtype, op by op. Here one program per tile of token rows (tuning.GATED_FP8_ROWS) computes the hidden
in float32 (no rounding before the fp8 one, which dominates: the fused MLP's error is the unfused one's, tested)
and writes the fp8 hidden and the rows' scales. When a row fits one block of tuning.GATED_FP8_BLOCK columns it
reads y once, holding the rows in registers; wider rows are read twice, block by block, once for the amax and
once to quantize.

The reference, `gated_quantize_fp8_reference`, computes the same in jnp: on the CPU it equals the interpreted
kernel bit for bit; on the GPU exp and division may differ in the last bit. Not finite inputs: Triton's max and
clip drop NaNs, so a row with a NaN or an Inf quantizes to garbage where the reference gives NaN; the model's
activations are finite.
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


def _hidden(y, xscale, wscale_g, wscale_u):
    """SiLU(g) * u of the scaled product in float32 throughout: no rounding before the fp8 one."""
    g = y[0].astype(jnp.float32) * xscale * wscale_g
    u = y[1].astype(jnp.float32) * xscale * wscale_u
    return g * u / (1.0 + jnp.exp(-g))


def _scales(amax):
    """Rows' amax -> (448 / amax, scale = amax / 448), both 1 for an all-zero row."""
    return jnp.where(amax > 0, FP8_MAX / amax, 1.0), jnp.where(amax > 0, amax / FP8_MAX, 1.0)


def _to_fp8(h, inverse):
    """h [rows, cols] times its rows' 448 / amax, in float8_e4m3fn."""
    return jnp.clip(h * inverse[:, None], -FP8_MAX, FP8_MAX).astype(FP8)


def gated_quantize_fp8_reference(y, xscale, wscale):
    """y [T, 2I] (gate_up's raw fp8 x fp8 product), xscale f32[T, 1], wscale f32[2I] -> (hidden f8e4m3fn[T, I],
    scale f32[T, 1]): h = SiLU(g) * u of the scaled product, quantized per token."""
    g, u = jnp.split(y, 2, axis=-1)
    wg, wu = jnp.split(wscale, 2)
    h = _hidden((g, u), xscale, wg[None, :], wu[None, :])
    inverse, scale = _scales(jnp.max(jnp.abs(h), axis=-1))
    return _to_fp8(h, inverse), scale[:, None]


def _kernel(y_ref, xscale_ref, wscale_ref, q_ref, scale_ref, *, num_rows: int, width: int, tile: int, block: int):
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
        return c, ok, _hidden((g, u), xscale, wg, wu)  # masked lanes: g = u = 0, so h = 0

    def store(c, ok, h, inverse):
        plgpu.store(q_ref.at[rows[:, None], c[None, :]], _to_fp8(h, inverse), mask=ok)

    if num_blocks == 1:  # the tile's whole rows in registers: y read once
        c, ok, h = hidden(0)
        inverse, scale = _scales(jnp.max(jnp.abs(h), axis=1))
        store(c, ok, h, inverse)
    else:
        def amax_of(b, amax):
            _, _, h = hidden(b)
            return jnp.maximum(amax, jnp.max(jnp.abs(h), axis=1))

        inverse, scale = _scales(jax.lax.fori_loop(0, num_blocks, amax_of, jnp.zeros((tile,), jnp.float32)))

        def quantize(b, carry):
            store(*hidden(b), inverse)
            return carry

        jax.lax.fori_loop(0, num_blocks, quantize, 0)
    plgpu.store(scale_ref.at[rows], scale, mask=row_ok)


def gated_quantize_fp8(y, xscale, wscale, *, interpret: bool = False):
    """As `gated_quantize_fp8_reference`, one Triton program per tile of tuning.GATED_FP8_ROWS token rows."""
    if y.ndim != 2 or y.shape[1] % 2 or xscale.shape != (y.shape[0], 1) or wscale.shape != y.shape[1:]:
        raise ValueError(f"gated_quantize_fp8: y {y.shape} must be [T, 2I], xscale {xscale.shape} [T, 1], "
                         f"wscale {wscale.shape} [2I]")
    rows, width = y.shape[0], y.shape[1] // 2
    block = min(tuning.GATED_FP8_BLOCK, pl.next_power_of_2(width))
    tile = min(tuning.GATED_FP8_ROWS, pl.next_power_of_2(rows))
    q, scale = pl.pallas_call(
        functools.partial(_kernel, num_rows=rows, width=width, tile=tile, block=block),
        grid=(pl.cdiv(rows, tile),),
        out_shape=(jax.ShapeDtypeStruct((rows, width), FP8), jax.ShapeDtypeStruct((rows,), jnp.float32)),
        compiler_params=plgpu.CompilerParams(num_warps=tuning.GATED_FP8_NUM_WARPS,
                                             num_stages=tuning.GATED_FP8_STAGES),
        interpret=interpret,
        name=f"gated_quantize_fp8_r{tile}_b{block}",
    )(y, xscale[:, 0].astype(jnp.float32), wscale.astype(jnp.float32))
    return q, scale[:, None]
