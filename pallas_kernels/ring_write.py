"""Ring write (Pallas, Triton backend): scatter a step's new K/V rows into the
page pools in place.

One program per new row writes all its heads to flat pool row `slots[t]`
(`page * page_size + offset`; flat and ring layers alike, padding rows aimed
at the scratch page 0). The pools are aliased to the outputs, so under a
donating jit nothing but the T rows moves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from glint.pallas_kernels import tuning
from glint.pallas_kernels.reference import quantize_into, ring_write_reference, scales_error, to_pool_dtype

__all__ = ["ring_write", "ring_write_reference"]


def _ring_write_kernel(
    slots_ref,  # i32[T]
    k_new_ref,  # [T, Hkv * D]
    v_new_ref,  # [T, Hkv * D]
    k_in_ref,  # [num_pages * page_size, Hkv * D], aliased to k_out_ref
    v_in_ref,  # [num_pages * page_size, Hkv * D], aliased to v_out_ref
    k_out_ref,  # [num_pages * page_size, Hkv * D]
    v_out_ref,  # [num_pages * page_size, Hkv * D]
    *,
    block_c: int,
):
    del k_in_ref, v_in_ref
    t = pl.program_id(0)
    slot = slots_ref[t]
    num_slots, row_width = k_out_ref.shape
    c = jnp.arange(block_c, dtype=jnp.int32)
    # Out-of-range slots are dropped rather than written out of bounds.
    ok = (c < row_width) & (slot >= 0) & (slot < num_slots)
    # no `other`: the masked lanes are not stored (and Triton cannot cast a fill value to fp8)
    k = plgpu.load(k_new_ref.at[t, c], mask=ok)
    v = plgpu.load(v_new_ref.at[t, c], mask=ok)
    plgpu.store(k_out_ref.at[slot, c], k, mask=ok)
    plgpu.store(v_out_ref.at[slot, c], v, mask=ok)


def _ring_write_call(k_flat, v_flat, k_new, v_new, slots, *, block_c: int, interpret: bool):
    """pallas_call for rows of up to `block_c` elements; pools updated in place."""
    return pl.pallas_call(
        functools.partial(_ring_write_kernel, block_c=block_c),
        grid=(k_new.shape[0],),
        out_shape=(jax.ShapeDtypeStruct(k_flat.shape, k_flat.dtype), jax.ShapeDtypeStruct(v_flat.shape, v_flat.dtype)),
        input_output_aliases={3: 0, 4: 1},
        compiler_params=plgpu.CompilerParams(num_warps=tuning.RING_WRITE_NUM_WARPS, num_stages=1),
        interpret=interpret,
        name=f"ring_write_c{block_c}",
    )(slots, k_new, v_new, k_flat, v_flat)


def _check_args(k_pages, v_pages, k_new, v_new, slots, k_scale, v_scale):
    def fail(msg):
        raise ValueError(
            f"ring_write: {msg} (k_pages {k_pages.shape} {k_pages.dtype}, v_pages "
            f"{v_pages.shape} {v_pages.dtype}, k_new {k_new.shape} {k_new.dtype}, "
            f"v_new {v_new.shape} {v_new.dtype}, slots {slots.shape} {slots.dtype})"
        )

    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        fail("k_pages and v_pages must both be [num_pages, page_size, Hkv, D]")
    if k_pages.dtype != v_pages.dtype:
        fail("k_pages and v_pages must share one dtype")
    if k_new.ndim != 3 or k_new.shape != v_new.shape:
        fail("k_new and v_new must both be [T, Hkv, D]")
    if k_new.shape[1:] != k_pages.shape[2:]:
        fail("k_new's [Hkv, D] must match the pools'")
    if slots.shape != k_new.shape[:1] or slots.dtype != jnp.int32:
        fail("slots must be i32[T]")
    if error := scales_error(k_pages, k_scale, v_scale):
        fail(error)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0, 1, 5, 6))
def ring_write(k_pages, v_pages, k_new, v_new, slots, k_scale=None, v_scale=None, *, interpret=False):
    """Writes new K/V rows into the page pools in place (the pools are donated).

    Args:
      k_pages, v_pages: [num_pages, page_size, Hkv, D] pools.
      k_new, v_new: [T, Hkv, D], cast to the pools' dtype (to_pool_dtype: fp8 saturates at +-448).
      slots: i32[T], flat row `page * page_size + offset` for each new row;
        padding rows point at the scratch page 0. Slots outside the pool are
        dropped; rows sharing a slot leave one of their values, unspecified which.
      k_scale, v_scale: f32[num_pages, Hkv, page_size] beside float8_e4m3fn pools (a scaled cache, donated):
        each row and head is quantized with its own scale (reference.quantize_rows), stored at the row's slot.
      interpret: run the Pallas interpreter (CPU tests).
    Returns:
      (k_pages, v_pages) updated; with scales (k_pages, v_pages, k_scale, v_scale).
    """
    _check_args(k_pages, v_pages, k_new, v_new, slots, k_scale, v_scale)
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    num_rows = k_new.shape[0]
    row_width = num_kv_heads * head_dim
    scales = ()
    if k_scale is not None:
        k_new, v_new, scales = quantize_into(k_new, v_new, slots, k_scale, v_scale)
    if num_rows == 0:
        return k_pages, v_pages, *scales
    flat = (num_pages * page_size, row_width)
    k_out, v_out = _ring_write_call(
        k_pages.reshape(flat),
        v_pages.reshape(flat),
        to_pool_dtype(k_new, k_pages.dtype).reshape(num_rows, row_width),
        to_pool_dtype(v_new, v_pages.dtype).reshape(num_rows, row_width),
        slots,
        block_c=1 << (row_width - 1).bit_length(),
        interpret=interpret,
    )
    return k_out.reshape(k_pages.shape), v_out.reshape(v_pages.shape), *scales
