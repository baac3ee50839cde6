"""QKV write (Pallas, Triton backend): from the fused q/k/v projection straight to the attention's inputs.

One program per step row reads the row's q, k and v heads out of the projection's output, applies the
per-head RMSNorm (Qwen3 / Gemma 3 / Glimmer's q/k norm) and the rotate-half RoPE to q and k in float32,
writes k and v to the row's pool slot (as `ring_write`) and q to the output. In a decode step this one
kernel replaces four: RoPE of q, RoPE of k, the v slice and the ring write, each a few microseconds of
launch and latency in every layer.

Its reference, `qkv_write_reference`, rounds where the model's unfused path rounds (the normed q/k to the
activation dtype before RoPE, the rotated q/k after it); the tests hold the kernel to the reference and the
reference to the model's path (glint.model.transformer.QKVPrep.split, then `ring_write_reference`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from glint.pallas_kernels import tuning
from glint.pallas_kernels.reference import qkv_write_reference

__all__ = ["QK_NORMS", "qkv_write", "qkv_write_reference"]

QK_NORMS = ("none", "rms", "rms_scaleless")  # ModelConfig.qk_norm


def _qkv_write_kernel(
    slots_ref,  # i32[T]
    qkv_ref,  # [T, Hq + 2 Hkv, D]
    cos_ref,  # f32[T, D // 2]
    sin_ref,  # f32[T, D // 2]
    *refs,
    num_q_heads: int,
    num_kv_heads: int,
    is_rotated: bool,
    qk_norm: str,
    eps: float,
):
    if qk_norm == "rms":
        q_norm_ref, k_norm_ref, *refs = refs  # f32[D] each
    else:
        q_norm_ref = k_norm_ref = None
    _, _, q_out_ref, k_out_ref, v_out_ref = refs  # k/v in (aliased to out) [N, Hkv, D]; q out [T, Hq, D]
    t = pl.program_id(0)
    head_dim = qkv_ref.shape[2]
    half = head_dim // 2
    slot = slots_ref[t]
    is_slot_in = (slot >= 0) & (slot < k_out_ref.shape[0])  # out-of-range slots are dropped, as in ring_write
    d = jnp.arange(pl.next_power_of_2(half), dtype=jnp.int32)
    is_d_in = d < half

    def prepared(first: int, num_heads: int, norm_ref):
        """Heads [first, first + num_heads) of row t, normed and rotated: two halves [Hp, half_p] in qkv's dtype."""
        h = jnp.arange(pl.next_power_of_2(num_heads), dtype=jnp.int32)
        ok = (h < num_heads)[:, None] & is_d_in[None, :]
        x1 = plgpu.load(qkv_ref.at[t, first + h[:, None], d[None, :]], mask=ok, other=0).astype(jnp.float32)
        x2 = plgpu.load(qkv_ref.at[t, first + h[:, None], half + d[None, :]], mask=ok, other=0).astype(jnp.float32)
        dtype = qkv_ref.dtype
        if qk_norm != "none":  # rms_norm over each head's D values, rounded to the activation dtype
            r = jax.lax.rsqrt((jnp.sum(x1 * x1, axis=1) + jnp.sum(x2 * x2, axis=1)) / head_dim + eps)[:, None]
            x1, x2 = x1 * r, x2 * r
            if norm_ref is not None:
                x1 = x1 * plgpu.load(norm_ref.at[d], mask=is_d_in, other=0)[None, :]
                x2 = x2 * plgpu.load(norm_ref.at[half + d], mask=is_d_in, other=0)[None, :]
            x1, x2 = x1.astype(dtype).astype(jnp.float32), x2.astype(dtype).astype(jnp.float32)
        if is_rotated:
            cos = plgpu.load(cos_ref.at[t, d], mask=is_d_in, other=0)[None, :]
            sin = plgpu.load(sin_ref.at[t, d], mask=is_d_in, other=0)[None, :]
            x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        return h, ok, x1.astype(dtype), x2.astype(dtype)

    h, ok, q1, q2 = prepared(0, num_q_heads, q_norm_ref)
    plgpu.store(q_out_ref.at[t, h[:, None], d[None, :]], q1, mask=ok)
    plgpu.store(q_out_ref.at[t, h[:, None], half + d[None, :]], q2, mask=ok)
    h, ok, k1, k2 = prepared(num_q_heads, num_kv_heads, k_norm_ref)
    ok &= is_slot_in
    plgpu.store(k_out_ref.at[slot, h[:, None], d[None, :]], k1, mask=ok)
    plgpu.store(k_out_ref.at[slot, h[:, None], half + d[None, :]], k2, mask=ok)
    e = jnp.arange(pl.next_power_of_2(head_dim), dtype=jnp.int32)
    v_ok = (h < num_kv_heads)[:, None] & (e < head_dim)[None, :] & is_slot_in
    v = plgpu.load(qkv_ref.at[t, num_q_heads + num_kv_heads + h[:, None], e[None, :]], mask=v_ok)
    plgpu.store(v_out_ref.at[slot, h[:, None], e[None, :]], v, mask=v_ok)


def _qkv_write_call(k_flat, v_flat, qkv, slots, rope, norms, *, qk_norm: str, eps: float, interpret: bool):
    """pallas_call over flat pools [num_pages * page_size, Hkv, D], updated in place; -> (q, k_flat, v_flat)."""
    (num_rows, num_heads, head_dim), num_kv_heads = qkv.shape, k_flat.shape[1]
    num_q_heads = num_heads - 2 * num_kv_heads
    is_rotated = rope is not None
    if not is_rotated:  # never read; the kernel's signature stays one
        rope = (jnp.zeros((num_rows, head_dim // 2), jnp.float32),) * 2
    args = (slots, qkv, *rope, *norms, k_flat, v_flat)
    kernel = functools.partial(_qkv_write_kernel, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                               is_rotated=is_rotated, qk_norm=qk_norm, eps=eps)
    variant = ("_rope" if is_rotated else "") + ("" if qk_norm == "none" else f"_{qk_norm}")
    return pl.pallas_call(
        kernel,
        grid=(num_rows,),
        out_shape=(jax.ShapeDtypeStruct((num_rows, num_q_heads, head_dim), qkv.dtype),
                   jax.ShapeDtypeStruct(k_flat.shape, k_flat.dtype), jax.ShapeDtypeStruct(v_flat.shape, v_flat.dtype)),
        input_output_aliases={len(args) - 2: 1, len(args) - 1: 2},
        compiler_params=plgpu.CompilerParams(num_warps=tuning.QKV_WRITE_NUM_WARPS, num_stages=1),
        interpret=interpret,
        name=f"qkv_write_h{pl.next_power_of_2(num_q_heads)}_d{pl.next_power_of_2(head_dim // 2)}{variant}",
    )(*args)


def _check_args(k_pages, v_pages, qkv, slots, rope, q_norm, k_norm, qk_norm):
    def fail(msg):
        raise ValueError(
            f"qkv_write: {msg} (k_pages {k_pages.shape} {k_pages.dtype}, v_pages {v_pages.shape} {v_pages.dtype}, "
            f"qkv {qkv.shape} {qkv.dtype}, slots {slots.shape} {slots.dtype}, qk_norm {qk_norm!r})"
        )

    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        fail("k_pages and v_pages must both be [num_pages, page_size, Hkv, D]")
    if {k_pages.dtype, v_pages.dtype} != {qkv.dtype}:
        fail("the pools must be in qkv's dtype")
    num_kv_heads, head_dim = k_pages.shape[2:]
    if qkv.ndim != 3 or qkv.shape[2] != head_dim or qkv.shape[1] <= 2 * num_kv_heads:
        fail("qkv must be [T, Hq + 2 Hkv, D] with the pools' Hkv and D and Hq >= 1")
    if (qkv.shape[1] - 2 * num_kv_heads) % num_kv_heads:
        fail("Hq must be a multiple of Hkv")
    if head_dim % 2:
        fail("head_dim must be even (rotate-half RoPE)")
    if slots.shape != qkv.shape[:1] or slots.dtype != jnp.int32:
        fail("slots must be i32[T]")
    if rope is not None and (len(rope) != 2 or any(x.shape != (qkv.shape[0], head_dim // 2)
                                                   or x.dtype != jnp.float32 for x in rope)):
        fail(f"rope must be (cos, sin) f32[T, D // 2], got {[(x.shape, x.dtype) for x in rope]}")
    if qk_norm not in QK_NORMS:
        fail(f"qk_norm must be one of {QK_NORMS}")
    if (qk_norm == "rms") != (q_norm is not None and k_norm is not None):
        fail("q_norm and k_norm (f32[D]) go with qk_norm='rms', and only with it")
    if q_norm is not None and {q_norm.shape, k_norm.shape} != {(head_dim,)}:
        fail(f"q_norm {q_norm.shape} and k_norm {k_norm.shape} must be [D] (widened to f32)")


@functools.partial(jax.jit, static_argnames=("qk_norm", "eps", "interpret"), donate_argnums=(0, 1))
def qkv_write(k_pages, v_pages, qkv, slots, rope=None, q_norm=None, k_norm=None, *, qk_norm="none", eps=1e-6,
              interpret=False):
    """q for the attention, and this step's k/v rows written into the pools in place (the pools are donated).

    Args:
      k_pages, v_pages: [num_pages, page_size, Hkv, D] pools in qkv's dtype (a float8 pool takes ring_write).
      qkv: [T, Hq + 2 Hkv, D], the fused projection's output: q heads, then k heads, then v heads.
      slots: i32[T], flat pool row `page * page_size + offset` of each row (as ring_write); out of range: dropped.
      rope: (cos, sin) f32[T, D // 2] of each row's position, or None (no RoPE on this layer).
      q_norm, k_norm: f32[D] RMSNorm weights with qk_norm="rms".
      qk_norm: "none", "rms" (weighted) or "rms_scaleless" RMSNorm of each q and k head before RoPE.
      eps: the RMSNorm's epsilon.
      interpret: run the Pallas interpreter (CPU tests).
    Returns:
      (q [T, Hq, D] in qkv's dtype, k_pages, v_pages).
    """
    _check_args(k_pages, v_pages, qkv, slots, rope, q_norm, k_norm, qk_norm)
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    num_rows = qkv.shape[0]
    if num_rows == 0:
        return jnp.zeros((0, qkv.shape[1] - 2 * num_kv_heads, head_dim), qkv.dtype), k_pages, v_pages
    flat = (num_pages * page_size, num_kv_heads, head_dim)
    q, k_out, v_out = _qkv_write_call(
        k_pages.reshape(flat), v_pages.reshape(flat), qkv, slots, rope,
        (q_norm.astype(jnp.float32), k_norm.astype(jnp.float32)) if qk_norm == "rms" else (),
        qk_norm=qk_norm, eps=eps, interpret=interpret)
    return q, k_out.reshape(k_pages.shape), v_out.reshape(v_pages.shape)
