"""Varlen paged attention (Pallas, Triton backend): flash and split-K paths,
and the entry point that also dispatches to the Mosaic GPU prefill kernel
(varlen_attention_mgpu.py) on Hopper.

One compiled kernel serves every mix of query and history lengths: the segment
table `seq_info` is read on the device. The grid is (query tile, kv head,
split). A query tile holds up to `block_q` rows of one segment times the query
heads of one kv head (GQA), `[block_q * group, D]`. Each program walks the key
blocks its rows can see, `[max(0, first_pos - window + 1), kv_end)`, with an
online softmax, looking pages up per key. With `num_splits > 1` the key range is
cut into that many chunks whose partial (acc, max, sum) are merged afterwards
(flash-decoding), which keeps the GPU busy when a decode step has few tiles.
See reference.py for the exact semantics.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from glint.pallas_kernels import decode_attention_mgpu, segments, tuning, varlen_attention_mgpu
from glint.pallas_kernels.reference import layer_error, scales_error, varlen_attention_reference
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["BlockSizes", "varlen_attention", "varlen_attention_reference", "default_block_sizes", "default_num_splits"]

_LOG2E = math.log2(math.e)
_SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# A pool may also hold float8_e4m3fn (half the bytes a decode step reads); the kernel widens its tiles to q's dtype
# (or float16, below) and, in a scaled cache, applies each key's scale to its logits and each value's to its
# softmax weights.
_FP8 = jnp.dtype(jnp.float8_e4m3fn)
_F16_MAX = float(jnp.finfo(jnp.float16).max)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes. block_m: query-tile rows (query rows x padded group heads);
    block_k: keys per inner step. Both powers of two, at least 16."""

    block_m: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_m", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"BlockSizes.{name} must be a power of two >= 16, got {value}")
        if self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"BlockSizes needs num_warps, num_stages >= 1, got {self}")


def _rows_per_tile(blocks: BlockSizes, group: int) -> int:
    """Query rows in one Triton tile: block_m rows hold rows x the group's query heads (padded)."""
    return max(1, blocks.block_m // pl.next_power_of_2(group))


def _num_tiles(num_rows: int, num_segments: int, block_q: int) -> int:
    """Static tile count: segments do not overlap, so every tile holds at least one distinct row."""
    return max(1, min(pl.cdiv(num_rows, block_q) + num_segments, num_rows))


def _attention_kernel(
    tiles_ref,  # i32[NB, 2]: (segment or -1, query tile within segment)
    seq_info_ref,  # i32[S, 4]: (q_start, q_len, seq_slot, kv_end)
    page_table_ref,  # i32[R, P]
    q_ref,  # [T, Hq, D]
    k_ref,  # [num_pages * page_size, Hkv, D]
    v_ref,  # [num_pages * page_size, Hkv, D]
    *refs,  # scaled: k_scale, v_scale f32[num_pages * Hkv * page_size] (flat scale pools); then the outputs
    block_q: int,
    group: int,
    group_pad: int,
    head_dim: int,
    head_dim_pad: int,
    block_k: int,
    page_size: int,
    num_phys_rows: int,
    window: int,
    causal: bool,
    softcap: float,
    scale: float,
    num_splits: int,
    scaled: bool,
    f16_dots: bool,
):
    # flash: (o_init, o) [T, Hq, D]; split-K: acc f32[NS, T, Hq, D], m, l f32[NS, T, Hq]
    (ks_ref, vs_ref), out_refs = (refs[:2], refs[2:]) if scaled else ((None, None), refs)
    # Reversed so the longest tiles (last rows of each segment) start first.
    tile = pl.num_programs(0) - 1 - pl.program_id(0)
    kv_head, split = pl.program_id(1), pl.program_id(2)
    segment = tiles_ref[tile, 0]
    q_tile = tiles_ref[tile, 1]
    block_m = block_q * group_pad

    @pl.when(segment >= 0)
    def _():
        q_start = seq_info_ref[segment, 0]
        q_len = seq_info_ref[segment, 1]
        slot = seq_info_ref[segment, 2]
        kv_end = seq_info_ref[segment, 3]

        # Row i of the tile is query row first + i // group_pad, head i % group_pad.
        i = jnp.arange(block_m, dtype=jnp.int32)
        first = q_tile * block_q
        local = first + i // group_pad
        in_group = i % group_pad
        row_ok = (local < q_len) & (in_group < group)  # [M]
        q_rows = q_start + local
        heads = kv_head * group + in_group
        pos = kv_end - q_len + local
        d = jnp.arange(head_dim_pad, dtype=jnp.int32)
        # Padded head_dim lanes are masked; a power-of-two head_dim needs no mask.
        d_ok = (d < head_dim)[None, :] if head_dim_pad != head_dim else True
        q = plgpu.load(
            q_ref.at[q_rows[:, None], heads[:, None], d[None, :]], mask=row_ok[:, None] & d_ok, other=0
        )  # [M, Dp]
        # f16_dots: an fp8 pool's tiles widen to float16 (one conversion per two values on Hopper; to bfloat16 it
        # takes four), so the dots run in float16: q clipped to its range, and in a scaled cache the value-scaled
        # softmax weights normalized by the block's largest value scale (kept out of float16's subnormals).
        q_dot = jnp.clip(q.astype(jnp.float32), -_F16_MAX, _F16_MAX).astype(jnp.float16) if f16_dots else q

        # Keys the tile's rows can see: [lo, hi). Blocks inside [lo_full, hi_full)
        # are seen whole by every row and skip all masking.
        num_rows = jnp.minimum(block_q, q_len - first)
        first_pos = kv_end - q_len + first
        last_pos = first_pos + num_rows - 1
        lo = jnp.maximum(first_pos - window + 1, 0) if window > 0 else 0
        hi = jnp.minimum(last_pos + 1, kv_end) if causal else kv_end
        lo_full = jnp.maximum(last_pos - window + 1, 0) if window > 0 else 0
        hi_full = jnp.minimum(first_pos + 1, kv_end) if causal else kv_end
        blk_begin = lo // block_k
        num_blocks = jnp.where(hi > lo, (hi + block_k - 1) // block_k - blk_begin, 0)
        per_split = (num_blocks + num_splits - 1) // num_splits
        my_begin = blk_begin + split * per_split
        my_end = jnp.minimum(my_begin + per_split, blk_begin + num_blocks)
        full_begin = jnp.clip((lo_full + block_k - 1) // block_k, my_begin, my_end)
        full_end = jnp.clip(jnp.maximum(hi_full, 0) // block_k, full_begin, my_end)

        # Logits in log2 units so the softmax runs on exp2.
        logit_scale = scale if softcap > 0 else scale * _LOG2E

        def make_body(masked: bool):
            def body(blk, carry):
                acc, m, l = carry
                j = blk * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [bk]
                key_ok = (j >= lo) & (j < hi)
                r = j % num_phys_rows
                page = page_table_ref[slot, r // page_size]  # i32[bk], always in range
                kv_row = page * page_size + r % page_size
                # Scale pools are [num_pages, Hkv, page_size], flattened.
                scale_row = (page * k_ref.shape[1] + kv_head) * page_size + r % page_size if scaled else None
                # Rows outside [lo, hi) are never read: they may hold anything (NaN).
                kv_mask = key_ok[:, None] & d_ok if masked else d_ok
                kv_mask = None if kv_mask is True else kv_mask
                kv_other = None if kv_mask is None else 0.0  # a float: Triton casts it to an fp8 pool too
                k = plgpu.load(k_ref.at[kv_row[:, None], kv_head, d[None, :]], mask=kv_mask, other=kv_other)  # [bk, Dp]
                k = k.astype(q_dot.dtype)  # an fp8 pool: widened in registers
                s = plgpu.dot(q_dot, k, trans_b=True, allow_tf32=False) * logit_scale
                if scaled:  # q . (k * ks) = (q . k) * ks: one scale per key column
                    key_mask = key_ok if masked else None
                    s = s * plgpu.load(ks_ref.at[scale_row], mask=key_mask, other=0.0 if masked else None)
                if softcap > 0:
                    s = (softcap * _LOG2E) * jnp.tanh(s / softcap)  # f32[M, bk]
                if masked:
                    visible = row_ok[:, None] & key_ok[None, :]
                    if causal:
                        visible &= j[None, :] <= pos[:, None]
                    if window > 0:
                        visible &= j[None, :] > pos[:, None] - window
                    s = jnp.where(visible, s, -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(s, axis=1))
                # A row that has seen nothing keeps m = -inf; exp2 then needs a finite base.
                m_base = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
                alpha = jnp.exp2(m - m_base)
                p = jnp.exp2(s - m_base[:, None])
                l = l * alpha + jnp.sum(p, axis=1)
                v = plgpu.load(v_ref.at[kv_row[:, None], kv_head, d[None, :]], mask=kv_mask, other=kv_other)  # [bk, Dp]
                if scaled:
                    vs = plgpu.load(vs_ref.at[scale_row], mask=key_mask, other=0.0 if masked else None)
                    if f16_dots:  # p @ (v * vs) = ((p * vs / v_max) @ v) * v_max
                        v_max = jnp.max(vs)
                        v_max = jnp.where(v_max > 0, v_max, 1.0)
                        p = p * (vs / v_max)[None, :]
                    elif q.dtype == jnp.float16:  # p * vs would fall into float16's subnormals: widen v scaled
                        v = v.astype(jnp.float32) * vs[:, None]
                    else:  # p @ (v * vs) = (p * vs) @ v, one multiply per key; the row sum l keeps the unscaled p
                        p = p * vs[None, :]
                v = v.astype(q_dot.dtype)
                pv = plgpu.dot(p.astype(v.dtype), v, allow_tf32=False)
                acc = acc * alpha[:, None] + (pv * v_max if scaled and f16_dots else pv)
                return acc, m_new, l

            return body

        acc = jnp.zeros((block_m, head_dim_pad), jnp.float32)
        m = jnp.full((block_m,), -jnp.inf, jnp.float32)
        l = jnp.zeros((block_m,), jnp.float32)
        carry = lax.fori_loop(my_begin, full_begin, make_body(True), (acc, m, l))
        carry = lax.fori_loop(full_begin, full_end, make_body(False), carry)
        acc, m, l = lax.fori_loop(full_end, my_end, make_body(True), carry)

        out_mask = row_ok[:, None] & d_ok
        if num_splits == 1:
            _, o_ref = out_refs
            o = acc / jnp.where(l > 0, l, 1.0)[:, None]
            plgpu.store(o_ref.at[q_rows[:, None], heads[:, None], d[None, :]], o.astype(o_ref.dtype), mask=out_mask)
        else:
            acc_ref, m_ref, l_ref = out_refs
            plgpu.store(acc_ref.at[split, q_rows[:, None], heads[:, None], d[None, :]], acc, mask=out_mask)
            plgpu.store(m_ref.at[split, q_rows, heads], m, mask=row_ok)
            plgpu.store(l_ref.at[split, q_rows, heads], l, mask=row_ok)


def _varlen_attention_call(
    q,
    k_flat,
    v_flat,
    page_table,
    seq_info,
    scales,
    *,
    blocks: BlockSizes,
    num_splits: int,
    page_size: int,
    num_phys_rows: int,
    window: int,
    causal: bool,
    softcap: float,
    scale: float,
    interpret: bool,
):
    """pallas_call for one BlockSizes; returns [T, Hq, D] in q's dtype. `scales`: (k_scale, v_scale)
    f32[num_pages * Hkv * page_size] (flat scale pools) of a scaled fp8 cache, or ()."""
    num_rows, num_q_heads, head_dim = q.shape
    num_kv_heads = k_flat.shape[1]
    num_segments = seq_info.shape[0]
    group = num_q_heads // num_kv_heads
    group_pad = pl.next_power_of_2(group)
    block_q = _rows_per_tile(blocks, group)
    block_m = block_q * group_pad
    num_tiles = _num_tiles(num_rows, num_segments, block_q)
    tiles, _ = segments.tile_map((jnp.maximum(seq_info[:, 1], 0) + block_q - 1) // block_q, num_tiles)

    kernel = functools.partial(
        _attention_kernel,
        block_q=block_q,
        group=group,
        group_pad=group_pad,
        head_dim=head_dim,
        head_dim_pad=max(16, pl.next_power_of_2(head_dim)),
        block_k=blocks.block_k,
        page_size=page_size,
        num_phys_rows=num_phys_rows,
        window=window,
        causal=causal,
        softcap=softcap,
        scale=scale,
        num_splits=num_splits,
        scaled=bool(scales),
        f16_dots=bool(tuning.FP8_KV_F16_DOTS) and k_flat.dtype == _FP8 and q.dtype != jnp.float32,
    )
    params = plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    name = f"varlen_attention_m{block_m}_k{blocks.block_k}_s{num_splits}"
    grid = (num_tiles, num_kv_heads, num_splits)
    args = (tiles, seq_info, page_table, q, k_flat, v_flat, *scales)

    if num_splits == 1:
        # Rows no segment covers keep the zeros of the aliased output buffer.
        out = pl.pallas_call(
            kernel,
            grid=grid,
            name=name,
            interpret=interpret,
            compiler_params=params,
            out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
            input_output_aliases={len(args): 0},
        )(*args, jnp.zeros(q.shape, q.dtype))
        return out

    acc, m, l = pl.pallas_call(
        kernel,
        grid=grid,
        name=name,
        interpret=interpret,
        compiler_params=params,
        out_shape=(
            jax.ShapeDtypeStruct((num_splits, *q.shape), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, num_rows, num_q_heads), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, num_rows, num_q_heads), jnp.float32),
        ),
    )(*args)
    # Merge the splits; rows no segment covers were never written.
    m_all = jnp.max(m, axis=0)
    m_all = jnp.where(m_all == -jnp.inf, 0.0, m_all)
    w = jnp.exp2(m - m_all[None])  # [NS, T, Hq]; m is in log2 units
    l_all = jnp.sum(w * l, axis=0)
    o = jnp.sum(w[..., None] * acc, axis=0) / jnp.where(l_all > 0, l_all, 1.0)[..., None]
    o = jnp.where((segments.row_segments(seq_info, num_rows) > 0)[:, None, None], o, 0.0)
    return o.astype(q.dtype)


def default_block_sizes(num_rows: int, num_segments: int, head_dim: int, kv_dtype=None) -> BlockSizes:
    """Tuned tile for a step of `num_rows` query rows in `num_segments` segments over pools of `kv_dtype` (fp8
    pools decode with their own tile where the table has one)."""
    path = "decode" if num_rows <= tuning.DECODE_ROWS_PER_SEGMENT * num_segments else "prefill"
    key = (path, max(16, pl.next_power_of_2(head_dim)))
    if path == "decode" and kv_dtype is not None and jnp.dtype(kv_dtype) == _FP8 \
            and ("decode-fp8", key[1]) in tuning.ATTENTION_BLOCKS:
        return BlockSizes(**tuning.ATTENTION_BLOCKS["decode-fp8", key[1]])
    if key not in tuning.ATTENTION_BLOCKS:
        key = (path, min(256, key[1]))
    return BlockSizes(**tuning.ATTENTION_BLOCKS[key])


def default_num_splits(
    num_rows: int, num_segments: int, num_q_heads: int, num_kv_heads: int, max_kv_len: int, blocks: BlockSizes
) -> int:
    """Split-K factor for decode-heavy steps; 1 (plain flash) otherwise."""
    if num_rows > tuning.DECODE_ROWS_PER_SEGMENT * num_segments:
        return 1
    block_q = _rows_per_tile(blocks, num_q_heads // num_kv_heads)
    programs = _num_tiles(num_rows, num_segments, block_q) * num_kv_heads
    kv_blocks = pl.cdiv(max_kv_len, blocks.block_k)
    splits = min(tuning.MAX_SPLITS, pl.cdiv(tuning.TARGET_PROGRAMS, programs), kv_blocks // tuning.MIN_BLOCKS_PER_SPLIT)
    return max(1, splits)


def _use_mosaic(backend, *, q, k_pages, seq_info, ring_rows, window, softcap, num_splits, block_sizes, interpret):
    """Whether this call runs the Mosaic GPU prefill kernel (varlen_attention_mgpu.py); with backend "mosaic" and
    interpret, Pallas' GPU interpreter runs it (CPU tests)."""
    num_rows, _, head_dim = q.shape
    runnable = (
        varlen_attention_mgpu.supports(
            dtype=q.dtype,
            head_dim=head_dim,
            page_size=k_pages.shape[1],
            block_kv=tuning.MOSAIC_PREFILL["block_kv"],
            ring_rows=ring_rows,
            window=window,
        )
        and k_pages.dtype == q.dtype
        and num_splits in (None, 1)
        and block_sizes is None
    )
    if backend == "mosaic":
        if not (runnable and (interpret or varlen_attention_mgpu.is_hopper())):
            raise ValueError(
                f"varlen_attention: backend='mosaic' needs a Hopper GPU (or interpret), bf16/f16 pools of q's dtype, "
                f"head_dim % 64 == 0, page_size % 16 == 0, a ring a window in [1, ring_rows], num_splits and "
                f"block_sizes unset (q {q.shape} {q.dtype}, pools {k_pages.dtype}, page_size {k_pages.shape[1]}, "
                f"ring_rows={ring_rows}, window={window}, num_splits={num_splits}, interpret={interpret})"
            )
        return True
    prefill = num_rows > tuning.DECODE_ROWS_PER_SEGMENT * seq_info.shape[0]
    plain = ring_rows is None and not window and not softcap
    return (backend == "auto" and tuning.PREFILL_BACKEND == "mosaic" and prefill and runnable
            and (plain or not tuning.MOSAIC_PREFILL_PLAIN_ONLY) and not interpret and varlen_attention_mgpu.is_hopper())


def _use_mosaic_decode(backend, *, q, k_pages, scaled, seq_info, ring_rows, window, block_sizes, interpret):
    """Whether this call runs the Mosaic GPU decode kernel (decode_attention_mgpu.py); with backend
    "mosaic_decode" and interpret, Pallas' GPU interpreter runs it (CPU tests)."""
    num_rows, _, head_dim = q.shape
    runnable = (
        decode_attention_mgpu.supports(
            dtype=q.dtype,
            kv_dtype=k_pages.dtype,
            head_dim=head_dim,
            page_size=k_pages.shape[1],
            block_kv=tuning.MOSAIC_DECODE["block_kv"],
            ring_rows=ring_rows,
            window=window,
            scaled=scaled,
        )
        and block_sizes is None
    )
    if backend == "mosaic_decode":
        if not (runnable and (interpret or varlen_attention_mgpu.is_hopper())):
            raise ValueError(
                f"varlen_attention: backend='mosaic_decode' needs a Hopper GPU (or interpret), bf16/f16 q with pools "
                f"of its dtype or float8_e4m3fn (scaled: pages of a multiple of 32 keys), head_dim 64 or 128, "
                f"page_size a multiple of 16 that divides or is divided by {tuning.MOSAIC_DECODE['block_kv']}, a ring "
                f"a window in [1, ring_rows], block_sizes unset (q {q.shape} {q.dtype}, pools {k_pages.dtype}, "
                f"scaled={scaled}, page_size {k_pages.shape[1]}, ring_rows={ring_rows}, window={window}, "
                f"block_sizes={block_sizes}, interpret={interpret})"
            )
        return True
    decode = num_rows <= tuning.DECODE_ROWS_PER_SEGMENT * seq_info.shape[0]
    return (backend == "auto" and tuning.DECODE_BACKEND == "mosaic" and decode and runnable and not interpret
            and num_rows >= tuning.MOSAIC_DECODE_MIN_ROWS and varlen_attention_mgpu.is_hopper())


def _check_args(q, k_pages, v_pages, page_table, seq_info, k_scale, v_scale, ring_rows, window, softcap, num_splits,
                backend):
    def fail(msg):
        raise ValueError(
            f"varlen_attention: {msg} (q {q.shape} {q.dtype}, k_pages {k_pages.shape} "
            f"{k_pages.dtype}, v_pages {v_pages.shape} {v_pages.dtype}, page_table "
            f"{page_table.shape} {page_table.dtype}, seq_info {seq_info.shape} "
            f"{seq_info.dtype})"
        )

    if q.ndim != 3:
        fail("q must be [T, Hq, D]")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        fail("k_pages and v_pages must both be [num_pages, page_size, Hkv, D]")
    if k_pages.dtype != v_pages.dtype or k_pages.dtype not in (q.dtype, _FP8):
        fail("k_pages and v_pages must share q's dtype or be float8_e4m3fn")
    if q.dtype not in _SUPPORTED_DTYPES:
        fail(f"dtype must be one of {[str(t) for t in _SUPPORTED_DTYPES]}")
    _, page_size, num_kv_heads, head_dim = k_pages.shape
    if error := scales_error(k_pages, k_scale, v_scale):
        fail(error)
    if q.shape[2] != head_dim:
        fail(f"q head_dim {q.shape[2]} != pool head_dim {head_dim}")
    if q.shape[1] % num_kv_heads:
        fail(f"Hq={q.shape[1]} must be a multiple of Hkv={num_kv_heads}")
    if page_table.ndim != 2 or page_table.dtype != jnp.int32:
        fail("page_table must be i32[R, P]")
    if seq_info.ndim != 2 or seq_info.shape[1] != 4 or seq_info.dtype != jnp.int32:
        fail("seq_info must be i32[S, 4]")
    if seq_info.shape[0] < 1 or q.shape[0] < 1:
        fail("need at least one segment and one query row")
    if error := layer_error(page_table.shape[1] * page_size, ring_rows=ring_rows, window=window, softcap=softcap):
        fail(error)
    if num_splits is not None and num_splits < 1:
        fail(f"num_splits={num_splits} must be >= 1")
    if backend not in ("auto", "triton", "mosaic", "mosaic_decode"):
        fail(f"backend={backend!r} must be 'auto', 'triton', 'mosaic' or 'mosaic_decode'")


@functools.partial(
    jax.jit,
    static_argnames=(
        "ring_rows", "window", "causal", "softcap", "scale", "num_splits", "block_sizes", "backend", "interpret"
    ),
)
def varlen_attention(
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
    num_splits=None,
    block_sizes=None,
    backend="auto",
    interpret=False,
):
    """Attention of packed query rows over their sequences' paged K/V.

    Args:
      q: [T, Hq, D] bfloat16, float16 or float32; query head h reads kv head
        h // (Hq // Hkv).
      k_pages, v_pages: [num_pages, page_size, Hkv, D], q's dtype or float8_e4m3fn (an fp8 KV cache, read
        at half the bytes and widened to q's dtype in the kernel: the Triton kernel, or the Mosaic decode kernel
        where it is chosen and covers the pools).
      k_scale, v_scale: f32[num_pages, Hkv, page_size] with float8_e4m3fn pools: a scaled cache, key or value
        row o of page n, head h is pool[n, o, h] * scale[n, h, o] (reference.quantize_rows); None: unscaled.
      page_table: i32[R, P]; row seq_slot lists that sequence's pages.
      seq_info: i32[S, 4] = (q_start, q_len, seq_slot, kv_end) per segment; rows
        q_start .. q_start + q_len - 1 sit at positions kv_end - q_len + i.
        Segments must not overlap; q_len 0 marks padding.
      ring_rows: key j is stored at row j % ring_rows (ring layers); None: row j.
      window: sliding window (keys j > p - window); 0 for none.
      causal: keys j <= p only.
      softcap: logits become softcap * tanh(logits / softcap); 0 for none.
      scale: logit scale.
      num_splits: split-K chunks of each tile's key range; None picks one from T,
        S and the context capacity (1 = plain flash path).
      block_sizes: BlockSizes, or None for the tuned table.
      backend: "triton" (any call), "mosaic" (the Hopper TMA/wgmma prefill
        kernel, for the calls varlen_attention_mgpu.supports), "mosaic_decode"
        (the Hopper decode kernel, for the calls decode_attention_mgpu.supports;
        decode steps take it under "auto" when tuning.DECODE_BACKEND = "mosaic") or "auto": on
        Hopper, for prefill steps Mosaic covers (and tuning.PREFILL_BACKEND =
        "mosaic"; rings, windows and soft-caps only without
        tuning.MOSAIC_PREFILL_PLAIN_ONLY), each segment runs on the kernel that costs it less (long
        segments on Mosaic, decode rows and short chunks on Triton, see
        _mosaic_segments; the Mosaic kernel writes its rows into the Triton kernel's output); Triton otherwise.
      interpret: run the Pallas interpreter (CPU tests); with "mosaic" and
        "mosaic_decode", Pallas' GPU interpreter.
    Returns:
      [T, Hq, D] in q's dtype; rows outside every segment and rows that see no
      key are zero.
    """
    _check_args(q, k_pages, v_pages, page_table, seq_info, k_scale, v_scale, ring_rows, window, softcap, num_splits,
                backend)
    mosaic = _use_mosaic(
        backend,
        q=q,
        k_pages=k_pages,
        seq_info=seq_info,
        ring_rows=ring_rows,
        window=window,
        softcap=softcap,
        num_splits=num_splits,
        block_sizes=block_sizes,
        interpret=interpret,
    )
    run_triton = functools.partial(
        _triton_attention, q, k_pages, v_pages, page_table, scales=(k_scale, v_scale), ring_rows=ring_rows,
        window=window, causal=causal,
        softcap=softcap, scale=scale, num_splits=num_splits, block_sizes=block_sizes, interpret=interpret,
    )
    if not mosaic:
        if _use_mosaic_decode(backend, q=q, k_pages=k_pages, scaled=k_scale is not None, seq_info=seq_info,
                              ring_rows=ring_rows, window=window, block_sizes=block_sizes, interpret=interpret):
            if num_splits is None:
                # The most keys a tile walks: a ring's rows, a window and the step's rows, or the table's.
                keys = ring_rows or page_table.shape[1] * k_pages.shape[1]
                keys = min(keys, window + q.shape[0]) if window else keys
                num_splits = decode_attention_mgpu.num_splits_for(
                    q.shape[0], seq_info.shape[0], q.shape[1], k_pages.shape[2], keys,
                    tuning.MOSAIC_DECODE["block_kv"])
            return decode_attention_mgpu.decode_attention_mgpu(
                q, k_pages, v_pages, page_table, seq_info, k_scale=k_scale, v_scale=v_scale, ring_rows=ring_rows,
                window=window, causal=causal,
                softcap=softcap, scale=float(scale), num_splits=num_splits, interpret=interpret,
                max_ctas=tuning.MOSAIC_DECODE_MAX_CTAS or None,
                f16_dots=bool(tuning.FP8_KV_F16_DOTS) and k_scale is None, **tuning.MOSAIC_DECODE,
            )
        return run_triton(seq_info)

    def run_mosaic(info, out=None):
        return varlen_attention_mgpu.varlen_attention_mgpu(
            q, k_pages, v_pages, page_table, info, out=out, ring_rows=ring_rows, window=window, causal=causal,
            softcap=softcap, scale=float(scale), interpret=interpret, max_ctas=tuning.MOSAIC_PREFILL_MAX_CTAS or None,
            **tuning.MOSAIC_PREFILL
        )

    if backend == "mosaic":
        return run_mosaic(seq_info)
    # "auto": each segment goes to the kernel that costs it less. The Triton kernel's output (zeros outside its
    # segments) is the buffer the Mosaic kernel writes its segments' rows into.
    blocks = default_block_sizes(q.shape[0], seq_info.shape[0], q.shape[2])
    to_mosaic = _mosaic_segments(seq_info, _rows_per_tile(blocks, q.shape[1] // k_pages.shape[2]))
    q_len = seq_info[:, 1]
    mosaic_info = seq_info.at[:, 1].set(jnp.where(to_mosaic, q_len, 0))
    triton_info = seq_info.at[:, 1].set(jnp.where(to_mosaic, 0, q_len))
    return run_mosaic(mosaic_info, out=run_triton(triton_info))


def _mosaic_segments(seq_info, triton_tile_rows: int):
    """bool[S]: segments the Mosaic kernel runs more cheaply than the Triton one. Mosaic pads each
    segment to whole tiles of 2 * block_q query rows (Triton: `triton_tile_rows`) but runs a full
    tile about 1 / MOSAIC_ROW_COST times as fast, so short segments (decode rows, small chunks)
    stay on Triton."""
    q_len = jnp.maximum(seq_info[:, 1], 0)
    mosaic_rows = varlen_attention_mgpu.padded_rows(seq_info, 2 * tuning.MOSAIC_PREFILL["block_q"])
    triton_rows = (q_len + triton_tile_rows - 1) // triton_tile_rows * triton_tile_rows
    return (q_len > 0) & (mosaic_rows * tuning.MOSAIC_ROW_COST < triton_rows)


def _triton_attention(
    q, k_pages, v_pages, page_table, seq_info, *, scales, ring_rows, window, causal, softcap, scale, num_splits,
    block_sizes, interpret,
):
    num_rows, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    num_phys_rows = ring_rows or page_table.shape[1] * page_size
    blocks = block_sizes or default_block_sizes(num_rows, seq_info.shape[0], head_dim, k_pages.dtype)
    if num_splits is None:
        max_kv_len = page_table.shape[1] * page_size
        if window > 0:
            max_kv_len = min(max_kv_len, window + blocks.block_m)
        num_splits = default_num_splits(num_rows, seq_info.shape[0], num_q_heads, num_kv_heads, max_kv_len, blocks)
    flat = (num_pages * page_size, num_kv_heads, head_dim)
    scales = () if scales[0] is None else tuple(s.reshape(-1) for s in scales)
    return _varlen_attention_call(
        q,
        k_pages.reshape(flat),
        v_pages.reshape(flat),
        page_table,
        seq_info,
        scales,
        blocks=blocks,
        num_splits=num_splits,
        page_size=page_size,
        num_phys_rows=num_phys_rows,
        window=window,
        causal=causal,
        softcap=float(softcap),
        scale=float(scale),
        interpret=interpret,
    )
