"""Pure-jnp references for the paged-KV kernels.

These define the semantics the Pallas kernels are tested against, and they are
the attention the engine runs on CPU, so they avoid materialising
`[T, all_keys, Hkv, D]`: attention walks the segments one at a time and each
segment's query rows in blocks of `block_q`.

Layout (shared with the kernels):
  k_pages, v_pages: [num_pages, page_size, Hkv, D]; page 0 is scratch.
  k_scale, v_scale: f32[num_pages, Hkv, page_size] beside float8_e4m3fn pools (a scaled fp8 cache): offset o
                    of page n, head h holds x / scale[n, h, o], so x = pool * scale (`quantize_rows`). A
                    page's scales of one head lie together (`scale_pool_shape`).
  q:                [T, Hq, D], query head h reads kv head h // (Hq // Hkv).
  seq_info:         i32[S, 4] = (q_start, q_len, seq_slot, kv_end).
  page_table:       i32[R, P]; row seq_slot lists the pages of that sequence.
Row i of a segment sits at position p = kv_end - q_len + i and sees keys j with
j < kv_end, j <= p (causal) and j > p - window (window > 0). Key j lives at
row j % ring_rows (ring storage) or j (flat) of the sequence's pages.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["qkv_write_reference", "quantize_rows", "ring_write_reference", "row_scales", "scale_pool",
           "scale_pool_shape",
           "varlen_attention_reference"]


FP8_MAX = 448.0
FP8 = jnp.dtype(jnp.float8_e4m3fn)
F32 = jnp.dtype(jnp.float32)


def to_pool_dtype(x, dtype):
    """x in a pool's dtype; into float8_e4m3fn saturating at +-448 (a plain cast would give NaN), unscaled."""
    if jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn):
        x = jnp.clip(x.astype(jnp.float32), -FP8_MAX, FP8_MAX)
    return x.astype(dtype)


def quantize_rows(x):
    """x [T, H, D] -> (float8_e4m3fn [T, H, D], f32[T, H]): one scale per row and head, its largest magnitude
    mapped to 448 (llama.cpp's q8_0 blocks, one block per head), so no value saturates and small rows keep
    e4m3's relative precision instead of falling into its subnormals. x = q * scale; an all-zero row has
    scale 1."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return to_pool_dtype(x32 / scale[..., None], FP8), scale


def scale_pool_shape(num_pages: int, page_size: int, num_kv_heads: int) -> tuple[int, int, int]:
    """A scaled cache's scale pool beside pools [num_pages, page_size, Hkv, D]: f32[num_pages, Hkv, page_size],
    head-major within a page, so that one head's scales of a page are one contiguous run (a TMA copy of
    page_size * 4 bytes, whatever Hkv) and a page stays the first axis, as in the pools."""
    return num_pages, num_kv_heads, page_size


def row_scales(scale_pool):
    """A scale pool [num_pages, Hkv, page_size] as [num_pages, page_size, Hkv]: the pool's rows and heads."""
    return jnp.swapaxes(scale_pool, 1, 2)


def scale_pool(row_scales):
    """Scales [num_pages, page_size, Hkv] (a row and head each, as `quantize_rows` gives them for whole pages) as a
    scale pool [num_pages, Hkv, page_size]."""
    return jnp.swapaxes(row_scales, 1, 2)


def quantize_into(k_new, v_new, slots, k_scale, v_scale):
    """A scaled cache's share of a ring write: (k_new and v_new quantized by `quantize_rows`, (k_scale, v_scale)
    f32[num_pages, Hkv, page_size] with each row's scales at its slot; out-of-range slots dropped, as the ring
    write drops them)."""
    (k_new, ks), (v_new, vs) = quantize_rows(k_new), quantize_rows(v_new)
    num_pages, num_kv_heads, page_size = k_scale.shape
    # A slot outside [0, num_pages * page_size) gets an out-of-range page (negative ones too): dropped.
    page = jnp.where((slots >= 0) & (slots < num_pages * page_size), slots // page_size, num_pages)[:, None]
    heads, offset = jnp.arange(num_kv_heads)[None, :], (slots % page_size)[:, None]

    def write(pool, scale):
        return pool.at[page, heads, offset].set(scale, mode="drop")

    return k_new, v_new, (write(k_scale, ks), write(v_scale, vs))


def scales_error(k_pages, k_scale, v_scale) -> str | None:
    """What is wrong with a scaled cache's scale pools beside `k_pages` (None: nothing, or no scales at all): the
    ring write's and the attention's argument check."""
    if (k_scale is None) != (v_scale is None):
        return "give both k_scale and v_scale or neither"
    if k_scale is None:
        return None
    if k_pages.dtype != FP8:
        return "k_scale and v_scale go with float8_e4m3fn pools"
    want = scale_pool_shape(*k_pages.shape[:3])
    if {k_scale.shape, v_scale.shape} != {want} or {k_scale.dtype, v_scale.dtype} != {F32}:
        return (f"k_scale {k_scale.shape} {k_scale.dtype} and v_scale {v_scale.shape} {v_scale.dtype} must be "
                f"f32[num_pages, Hkv, page_size] = f32{list(want)}")
    return None


def layer_error(table_rows: int, *, ring_rows, window: int, softcap: float) -> str | None:
    """What is wrong with a layer's ring, window and soft-cap (None: nothing), given the page table's rows per
    sequence: the attention kernels' argument check."""
    if ring_rows is not None and not 0 < ring_rows <= table_rows:
        return f"ring_rows={ring_rows} must be in [1, {table_rows}] (the page table's rows, P * page_size)"
    if window < 0 or softcap < 0:
        return f"window={window} and softcap={softcap} must be >= 0"
    return None


@jax.jit
def ring_write_reference(k_pages, v_pages, k_new, v_new, slots, k_scale=None, v_scale=None):
    """Writes `k_new[t], v_new[t]` ([T, Hkv, D]) to flat pool row `slots[t]`.

    `slots` is i32[T], `page * page_size + offset` (outside the pool: dropped). Returns the updated pools,
    and with scale pools (k_scale, v_scale f32[num_pages, Hkv, page_size], beside
    float8_e4m3fn pools) the rows are quantized by `quantize_rows` and the
    updated scale pools follow: (k, v, k_scale, v_scale). Rows sharing a slot
    (padding rows aimed at the scratch page) leave one of their values there,
    unspecified which.
    """
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    flat_shape = (num_pages * page_size, num_kv_heads, head_dim)
    scales = ()
    if k_scale is not None:
        k_new, v_new, scales = quantize_into(k_new, v_new, slots, k_scale, v_scale)
    drop = {"mode": "drop", "wrap_negative_indices": False}  # slots outside the pool are dropped, as the kernel does
    k_flat = k_pages.reshape(flat_shape).at[slots].set(to_pool_dtype(k_new, k_pages.dtype), **drop)
    v_flat = v_pages.reshape(flat_shape).at[slots].set(to_pool_dtype(v_new, v_pages.dtype), **drop)
    return k_flat.reshape(k_pages.shape), v_flat.reshape(v_pages.shape), *scales


def qkv_write_reference(k_pages, v_pages, qkv, slots, rope=None, q_norm=None, k_norm=None, *, qk_norm="none",
                        eps=1e-6):
    """The fused q/k/v write's semantics: split qkv [T, Hq + 2 Hkv, D] into q, k, v heads; with qk_norm RMSNorm
    each q and k head in float32 (times q_norm / k_norm f32[D] when "rms"), rounded to qkv's dtype; with rope
    ((cos, sin) f32[T, D // 2]) rotate-half RoPE in float32, rounded again; k and v to their slots as
    `ring_write_reference`. Returns (q [T, Hq, D], k_pages, v_pages)."""
    num_kv_heads = k_pages.shape[2]
    num_q_heads = qkv.shape[1] - 2 * num_kv_heads
    q, k, v = jnp.split(qkv, [num_q_heads, num_q_heads + num_kv_heads], axis=1)

    def norm(x, weight):
        x32 = x.astype(jnp.float32)
        y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return (y if weight is None else y * weight).astype(x.dtype)

    def rotate(x):
        cos, sin = (c[:, None, :] for c in rope)
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)

    if qk_norm != "none":
        q, k = norm(q, q_norm), norm(k, k_norm)
    if rope is not None:
        q, k = rotate(q), rotate(k)
    return (q, *ring_write_reference(k_pages, v_pages, k, v, slots))


def _key_counts(pos, kv_end, num_phys_rows, *, window, causal):
    """i32[B, R]: how many visible keys of query positions `pos` ([B]) live in
    each physical row r < R (more than one only when the visible range wraps
    the ring)."""
    lo = jnp.maximum(pos - window + 1, 0) if window > 0 else jnp.zeros_like(pos)
    hi = jnp.minimum(pos + 1, kv_end) if causal else jnp.broadcast_to(kv_end, pos.shape)
    r = jnp.arange(num_phys_rows, dtype=jnp.int32)[None, :]
    # Keys j in [lo, hi) with j % R == r, counted in closed form.
    n = jnp.floor_divide(hi[:, None] - 1 - r, num_phys_rows) - jnp.floor_divide(lo[:, None] - 1 - r, num_phys_rows)
    return jnp.where((hi > lo)[:, None], n, 0)


@functools.partial(jax.jit, static_argnames=("ring_rows", "window", "causal", "softcap", "scale", "block_q"))
def varlen_attention_reference(
    q,
    k_pages,
    v_pages,
    page_table,
    seq_info,
    *,
    k_scale=None,
    v_scale=None,
    ring_rows=None,
    window=0,
    causal=True,
    softcap=0.0,
    scale,
    block_q=None,
):
    """Varlen paged attention in plain jnp; see the module docstring.

    Args:
      q: [T, Hq, D] packed queries.
      k_pages, v_pages: [num_pages, page_size, Hkv, D] page pools.
      k_scale, v_scale: f32[num_pages, Hkv, page_size], the scales of a scaled fp8 cache (both or neither).
      page_table: i32[R, P].
      seq_info: i32[S, 4] = (q_start, q_len, seq_slot, kv_end).
      ring_rows: ring length in rows (None: flat storage).
      window: sliding window in keys (0: none).
      causal: mask keys after each query's position.
      softcap: logit soft cap (0: none).
      scale: logit scale.
      block_q: query rows per step (default from T and S; 1 for decode).
    Returns:
      [T, Hq, D] in q's dtype; rows no segment covers and fully masked rows are 0.
    """
    num_rows, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_segments = seq_info.shape[0]
    pages_per_seq = page_table.shape[1]
    group = num_q_heads // num_kv_heads
    num_phys_rows = ring_rows if ring_rows else pages_per_seq * page_size
    if block_q is None:
        block_q = max(1, min(64, num_rows // max(num_segments, 1)))

    q_pad = jnp.pad(q, ((0, block_q), (0, 0), (0, 0)))
    out = jnp.zeros((num_rows + block_q, num_q_heads, head_dim), q.dtype)

    def segment(s, out):
        q_start, q_len, slot, kv_end = (seq_info[s, i] for i in range(4))
        pages = page_table[slot]  # i32[P]
        k_seq = k_pages[pages].reshape(-1, num_kv_heads, head_dim)[:num_phys_rows]
        v_seq = v_pages[pages].reshape(-1, num_kv_heads, head_dim)[:num_phys_rows]
        k_seq = k_seq.astype(jnp.float32)  # [R, Hkv, D]
        v_seq = v_seq.astype(jnp.float32)
        if k_scale is not None:
            k_seq = k_seq * row_scales(k_scale[pages]).reshape(-1, num_kv_heads)[:num_phys_rows, :, None]
            v_seq = v_seq * row_scales(v_scale[pages]).reshape(-1, num_kv_heads)[:num_phys_rows, :, None]

        def chunk(c, out):
            local = c * block_q + jnp.arange(block_q, dtype=jnp.int32)  # [B]
            row_ok = local < q_len
            pos = kv_end - q_len + local
            counts = _key_counts(pos, kv_end, num_phys_rows, window=window, causal=causal)
            counts = jnp.where(row_ok[:, None], counts, 0)  # [B, R]
            start = q_start + c * block_q
            qc = lax.dynamic_slice_in_dim(q_pad, start, block_q).astype(jnp.float32)
            qc = qc.reshape(block_q, num_kv_heads, group, head_dim)
            s_ = jnp.einsum("bkgd,rkd->bkgr", qc, k_seq, precision=lax.Precision.HIGHEST) * scale
            if softcap > 0:
                s_ = softcap * jnp.tanh(s_ / softcap)
            seen = (counts > 0)[:, None, None, :]
            s_ = jnp.where(seen, s_, -jnp.inf)
            m = jnp.max(s_, axis=-1, keepdims=True)
            m = jnp.where(jnp.isfinite(m), m, 0.0)
            p = counts[:, None, None, :].astype(jnp.float32) * jnp.exp(s_ - m)
            denom = jnp.sum(p, axis=-1, keepdims=True)
            # Rows no query of this block sees may hold anything (NaN included).
            v_used = jnp.where(jnp.any(counts > 0, axis=0)[:, None, None], v_seq, 0.0)
            o = jnp.einsum("bkgr,rkd->bkgd", p, v_used, precision=lax.Precision.HIGHEST)
            o = o / jnp.where(denom > 0, denom, 1.0)
            o = o.reshape(block_q, num_q_heads, head_dim).astype(q.dtype)
            current = lax.dynamic_slice_in_dim(out, start, block_q)
            o = jnp.where(row_ok[:, None, None], o, current)
            return lax.dynamic_update_slice_in_dim(out, o, start, 0)

        return lax.fori_loop(0, (q_len + block_q - 1) // block_q, chunk, out)

    out = lax.fori_loop(0, num_segments, segment, out)
    return out[:num_rows]
