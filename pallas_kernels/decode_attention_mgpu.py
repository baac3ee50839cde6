"""Varlen paged attention for decode-heavy steps on Hopper (Pallas, Mosaic GPU: TMA + wgmma, split-K).

A tile packs one kv head's whole query group: query row t, head kv_head * group + g becomes packed row
t * group + g of the kv head, so a decode row (group rows) and a short speculative chunk share one
64-row wgmma tile and read each K/V block once for all the group's heads. A compute warpgroup per CTA walks its
slice of the segment's key blocks (flash-decoding: `num_splits` slices, merged afterwards) while a memory
warpgroup reads the page table and issues TMA copies of each block's page chunks, `num_stages` blocks ahead.

Any layout of segments is correct (a long segment takes several tiles), but the kernel is built for
rows of few tokens: the Triton and Mosaic prefill kernels serve prefill steps.

Scope: flat and ring layers (a ring with a window that fits it), sliding windows and soft-caps; bf16/f16 q with
pools of its dtype or float8_e4m3fn (plain, or a scaled cache in pages of a multiple of 32 keys: `supports`), each
fp8 block widened to q's dtype (or float16, `f16_dots`) in shared memory before the dots (`_widen`; by the compute
warpgroup, or by a third one, `widen_warpgroup`), head_dim 64 or 128, page sizes a
multiple of 16 that divide or are divided by `block_kv` (a multiple of 64). A windowed flat layer's blocks start
at the block of the tile's first visible key; a ring layer's walk its storage blocks from the one holding that
key's row, wrapping past the last, each row standing for the latest key it holds (mosaic_keys.KeyWalk).

A CTA serves one work item (a tile of one kv head over one split of its keys), or on a persistent grid
(`max_ctas`) every max_ctas-th item: its memory warpgroup then loads the next item's query tile (two query
slots) and first key blocks while the compute warpgroup finishes the last item's, so a short item's pipeline
does not drain and refill (256 rows x 640 keys give 2,048 items of 5 blocks each).

Each CTA writes its tile's rows (normalized; float32 with their log2-sum-exp when the keys are split) to
padded outputs; the merge over splits gathers each query row back to the packed [T, Hq, D] layout. With one
split the rows go out in q's dtype through the query tile's shared memory, so the CTA needs no float32 tile:
64-key blocks in 2 stages then take 88 KB of shared memory at head_dim 128, room for two CTAs per H200
multiprocessor. Pool rows of keys no row of a tile sees (past kv_end, before a window, never written in a
ring) can hold anything: their logits are masked and their V rows zeroed in shared memory before P @ V.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from glint.pallas_kernels import mosaic_keys, segments, tuning, varlen_attention_mgpu
from glint.pallas_kernels.reference import layer_error, scales_error
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_BLOCK_M = 64  # packed rows per tile: one wgmma tile of one warpgroup
# TMA row offsets into the tiled query view are multiples of this, as in the prefill kernel, whose tile counting
# (padded_rows, max_tiles) this kernel shares over packed rows.
_ALIGN = mosaic_keys.ALIGN
_FP8 = jnp.dtype(jnp.float8_e4m3fn)
_SCALE_BYTES = 4  # a scale pool's float32
_F16_MAX = float(jnp.finfo(jnp.float16).max)
# Of the 232,448 bytes of shared memory a Hopper CTA may take, what the tiles may: the barriers and alignment took
# 2,192 more at 128 keys (an H100, 2026-12-06)
_SMEM_BYTES = 232448 - 3 * 1024
_WIDE_SLOTS = 2  # K and V tiles each that a widening warpgroup fills in turn
_TMA_SMEM_ALIGN = 128  # bytes: where a TMA copy may land in shared memory


def supports(*, dtype, kv_dtype, head_dim: int, page_size: int, block_kv: int, ring_rows, window: int,
             scaled: bool = False) -> bool:
    """Whether this kernel covers the call (else the Triton kernel does); a ring as mosaic_keys.covers_ring. fp8
    pools: a scaled cache's scales arrive by TMA a page chunk at a time, each into shared memory at a 128-byte
    boundary (TMA's alignment), so its chunks (min(page_size, block_kv) keys) must be multiples of 32 keys."""
    fp8 = jnp.dtype(kv_dtype) == _FP8
    return (
        mosaic_keys.covers_ring(ring_rows, window)
        and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and (jnp.dtype(kv_dtype) == jnp.dtype(dtype) or fp8)
        and (not scaled or (fp8 and min(page_size, block_kv) * _SCALE_BYTES % _TMA_SMEM_ALIGN == 0))
        and head_dim in (64, 128)  # 256 would overflow shared memory with the float32 output tile
        and block_kv % 64 == 0  # whole wgmma row tiles when zeroing V rows past kv_end
        and page_size % 16 == 0
        and (block_kv % page_size == 0 or page_size % block_kv == 0)
    )


def _widen(tile_ref, scale_ref, dtype, seen=None):
    """An fp8 tile [block_kv, D] of shared memory in `dtype`, in registers (WGMMA layout): e4m3 to float16 (one
    conversion per two values on Hopper; to bfloat16 it takes more), then (a scaled cache, or bfloat16) float32,
    times each row's scale from `scale_ref` [block_kv] (None: unscaled), clipped to float16's range when that is
    `dtype`, then `dtype`. Rows where `seen` (bool, WGMMA layout) is false become zero: their pool rows and scales
    may hold anything (NaN)."""
    x = plgpu.layout_cast(plgpu.load(tile_ref, layout=plgpu.Layout.WGMMA_UPCAST_2X), plgpu.Layout.WGMMA)
    x = x.astype(jnp.float16)
    if scale_ref is not None or dtype != jnp.float16:
        x = x.astype(jnp.float32)
    if scale_ref is not None:
        x = x * lax.broadcast_in_dim(plgpu.load(scale_ref, layout=plgpu.Layout.WGMMA.reduce(1)), x.shape, [0])
        if dtype == jnp.float16:
            x = jnp.clip(x, -_F16_MAX, _F16_MAX)
    if seen is not None:
        x = jnp.where(seen, x, 0.0)
    return x.astype(dtype)


def widen_wg_fits(*, q_slots: int, head_dim: int, block_kv: int, num_stages: int, scaled: bool, num_splits: int,
                  p_in_registers: bool) -> bool:
    """Whether a widening warpgroup's second K and V tiles fit in shared memory beside the rest of a CTA over fp8
    pools (a persistent grid's two query tiles with a scaled cache's scales, or the float32 output tile of split
    keys, at 128 keys and head_dim 128 do not): otherwise the compute warpgroup widens each block itself."""
    tiles = (q_slots * _BLOCK_M * head_dim * 2 + 2 * num_stages * block_kv * head_dim  # queries, fp8 K and V
             + 2 * _WIDE_SLOTS * block_kv * head_dim * 2  # the wide K and V tiles
             + (0 if p_in_registers else _BLOCK_M * block_kv * 2)
             + (0 if num_splits == 1 else _BLOCK_M * (head_dim + 1) * 4)  # the float32 output tile and lse
             + (2 * num_stages * block_kv * _SCALE_BYTES if scaled else 0))
    return tiles + mosaic_keys.profile_smem_bytes(3) <= _SMEM_BYTES


def _transforms(minor: int, dtype) -> tuple:
    """Tiling + swizzle of a shared-memory tile whose rows hold `minor` elements of `dtype` (at most 128 bytes
    swizzled)."""
    size = jnp.dtype(dtype).itemsize
    swizzle = min(128, minor * size)
    return plgpu.TilingTransform((8, swizzle // size)), plgpu.SwizzleTransform(swizzle)


def _packed_info(seq_info, group: int):
    """seq_info counted in a kv head's packed rows: each segment's q_start and q_len times the group."""
    return seq_info.at[:, :2].multiply(group)


def _tiles(seq_info, group: int, num_tiles: int):
    """i32[num_tiles, 2] (segment or -1, tile within it) and each segment's first tile: the prefill kernel's tiles
    of _BLOCK_M rows over the packed rows, each segment's starting at its first packed row rounded down to _ALIGN
    (TMA reads the query view from aligned rows)."""
    counts = varlen_attention_mgpu.padded_rows(_packed_info(seq_info, group), _BLOCK_M) // _BLOCK_M
    return segments.tile_map(counts, num_tiles)


def num_tiles_for(num_rows: int, num_segments: int, group: int) -> int:
    """Static tile count that covers any layout of non-overlapping segments in `num_rows` rows: the prefill
    kernel's bound (varlen_attention_mgpu.max_tiles) over the num_rows * group packed rows."""
    return varlen_attention_mgpu.max_tiles(num_rows * group, num_segments, _BLOCK_M)


def num_splits_for(num_rows: int, num_segments: int, num_q_heads: int, num_kv_heads: int, max_kv_len: int,
                   block_kv: int) -> int:
    """Split-K factor: as many splits as fit tuning.MOSAIC_DECODE_CTAS CTAs in one wave (rounded down), at most
    tuning.MAX_SPLITS, and no more splits than key blocks in `max_kv_len` (the table's capacity)."""
    ctas = num_tiles_for(num_rows, num_segments, num_q_heads // num_kv_heads) * num_kv_heads
    blocks = -(-max_kv_len // block_kv)
    return max(1, min(tuning.MAX_SPLITS, tuning.MOSAIC_DECODE_CTAS // ctas, blocks))


class _Item(NamedTuple):
    """One work item of a CTA: a tile's rows of one kv head over one split of their key blocks."""
    has_rows: jax.Array  # rows to write (zero if they see no key)
    kv_head: jax.Array
    tile: jax.Array
    split: jax.Array
    seq_slot: jax.Array
    q_rows: pl.Slice  # the tile's packed query rows, from an aligned row
    first: jax.Array  # tile row 0, as a packed row of the segment
    offset: jax.Array  # position of the segment's query row 0
    lo_row: jax.Array  # the tile's rows of the segment: [lo_row, hi_row)
    hi_row: jax.Array
    walk: mosaic_keys.KeyWalk
    begin: jax.Array  # the split's key blocks [begin, end), of which [full_begin, full_end) need no mask
    end: jax.Array
    full_begin: jax.Array
    full_end: jax.Array


def _item(tiles_ref, index, *, num_kv_heads: int, num_splits: int, block_kv: int, group: int, causal: bool,
          ring_rows, window: int) -> _Item:
    """Work item `index` of (tile, kv head, split), splits fastest: neighbouring CTAs share a tile's page table."""
    split = lax.rem(index, jnp.int32(num_splits))
    kv_head = lax.rem(lax.div(index, jnp.int32(num_splits)), jnp.int32(num_kv_heads))
    tile = lax.div(index, jnp.int32(num_splits * num_kv_heads))
    segment, q_tile = tiles_ref[tile, 0], tiles_ref[tile, 1]
    q_len, seq_slot, kv_end = tiles_ref[tile, 3], tiles_ref[tile, 4], tiles_ref[tile, 5]
    row_start = tiles_ref[tile, 2] * group
    row_len = q_len * group
    first = q_tile * _BLOCK_M - lax.rem(row_start, jnp.int32(_ALIGN))
    offset = kv_end - q_len
    lo_row = jnp.maximum(first, 0)
    hi_row = jnp.minimum(first + _BLOCK_M, row_len)
    has_rows = (segment >= 0) & (hi_row > lo_row)
    # Keys the tile's rows see: [lo, hi) in all; [lo_full, hi_full) by every row.
    lo, hi, lo_full, hi_full = mosaic_keys.seen_keys(offset, lo_row, hi_row, kv_end, window=window, causal=causal,
                                                     group=group)
    walk = mosaic_keys.KeyWalk(kv_end, lo, block_kv, ring_rows)
    blk_lo, blk_hi = walk.blocks(lo, hi)
    num_blocks = jnp.where(has_rows, blk_hi - blk_lo, 0)
    per_split = lax.div(num_blocks + num_splits - 1, jnp.int32(num_splits))
    begin = blk_lo + jnp.minimum(split * per_split, num_blocks)
    end = blk_lo + jnp.minimum(split * per_split + per_split, num_blocks)
    q_rows = pl.ds(pl.multiple_of(row_start - lax.rem(row_start, jnp.int32(_ALIGN)) + q_tile * _BLOCK_M, _ALIGN),
                   _BLOCK_M)
    return _Item(has_rows, kv_head, tile, split, seq_slot, q_rows, first, offset, lo_row, hi_row, walk, begin, end,
                 *walk.full_blocks(lo_full, hi_full, begin, end))


def _kernel(
    tiles_ref,  # i32[num_tiles, 6]: (segment or -1, tile within it, q_start, q_len, seq_slot, kv_end)
    page_table_ref,  # i32[R, P]
    q_ref,  # [Hkv, T * group (padded to a multiple of _ALIGN), D]: each kv head's packed query rows
    k_ref,  # [num_pages * page_size, Hkv, D]: q's dtype, or float8_e4m3fn
    v_ref,
    scale_refs,  # a scaled fp8 cache's (k, v) scale pools f32[num_pages * Hkv, page_size], or ()
    o_ref,  # [num_splits, num_tiles, Hkv, _BLOCK_M, D]: float32, or the dots' dtype with one split
    lse_ref,  # f32[num_splits, num_tiles, Hkv, _BLOCK_M], or None with one split
    scoped,
    *,
    num_items: int,
    num_ctas: int,
    block_kv: int,
    num_stages: int,
    page_size: int,
    group: int,
    causal: bool,
    scale: float,
    num_splits: int,
    ring_rows: int | None,
    window: int,
    softcap: float,
    widen_wg: bool,
):
    smem, (k_barriers, v_barriers, q_barriers), (consumed, q_consumed), wide_barriers = scoped
    q_smem, k_smem, v_smem, p_smem, o_smem, lse_smem, k_wide, v_wide, k_scales, v_scales = smem
    wg = lax.axis_index("wg")
    cta = lax.axis_index("ctas")
    head_dim = q_smem.shape[-1]
    dtype = q_smem.dtype
    q_slots = q_smem.shape[0]
    # This CTA's work items: cta, cta + num_ctas, ... (a persistent grid: one wave of CTAs, each over many items,
    # its memory warpgroup loading the next item's query and first blocks while the last blocks are computed).
    item = functools.partial(_item, tiles_ref, num_kv_heads=k_ref.shape[1], num_splits=num_splits,
                             block_kv=block_kv, group=group, causal=causal, ring_rows=ring_rows, window=window)

    def for_each_item(fn):
        """fn(item, key blocks before it, queries before it) for each of this CTA's items with rows, in order (both
        counts are the K/V and query slots'); returns both counts over all of them."""
        return mosaic_keys.for_each_item(item, cta, num_ctas, num_items, fn)

    def widened(pool_smem, scale_smem, wide, slot, seen=None):
        """Slot `slot` of an fp8 K or V buffer in the dots' dtype (a scaled cache: each row times its scale; rows
        where `seen` is false zero), stored in `wide` for the dots."""
        wide[...] = _widen(pool_smem.at[slot], None if scale_smem is None else scale_smem.at[slot], dtype, seen)
        plgpu.commit_smem()
        return wide

    def walk_blocks(it, body, carry):
        """body(block, carry, masked=...) over the item's key blocks in order: masked ones before and after the
        blocks every row sees whole."""
        carry = lax.fori_loop(it.begin, it.full_begin, functools.partial(body, masked=True), carry)
        carry = lax.fori_loop(it.full_begin, it.full_end, functools.partial(body, masked=False), carry)
        return lax.fori_loop(it.full_end, it.end, functools.partial(body, masked=True), carry)

    if widen_wg:
        # A third warpgroup widens each fp8 block into one of _WIDE_SLOTS K and V tiles while the compute
        # warpgroup runs the last block's dots and softmax: it frees the fp8 slot once both are widened, and the
        # compute warpgroup frees a wide tile once its dot has read it.
        k_ready, v_ready, k_free, v_free = wide_barriers

        @pl.when(wg == 2)
        def _widen_wg():
            def widen_item(it, done, queries):
                del queries

                def body(block, carry, *, masked: bool):
                    step = done + block - it.begin
                    slot, w = lax.rem(step, jnp.int32(num_stages)), lax.rem(step, jnp.int32(_WIDE_SLOTS))
                    with jax.named_scope("k8"):
                        plgpu.barrier_wait(k_barriers.at[slot])
                    with jax.named_scope("k_free"):
                        pl.when(step >= _WIDE_SLOTS)(lambda: plgpu.barrier_wait(k_free.at[w]))
                    with jax.named_scope("widen_k"):
                        widened(k_smem, k_scales, k_wide.at[w], slot)
                    plgpu.barrier_arrive(k_ready.at[w])
                    with jax.named_scope("v8"):
                        plgpu.barrier_wait(v_barriers.at[slot])
                    with jax.named_scope("v_free"):
                        pl.when(step >= _WIDE_SLOTS)(lambda: plgpu.barrier_wait(v_free.at[w]))
                    seen = it.walk.seen_rows(block, v_wide.shape[-2:]) if masked else None
                    with jax.named_scope("widen_v"):
                        widened(v_smem, v_scales, v_wide.at[w], slot, seen)
                    plgpu.barrier_arrive(v_ready.at[w])
                    plgpu.barrier_arrive(consumed.at[slot])  # both widened: the fp8 slot can be refilled
                    return carry

                walk_blocks(it, body, ())

            steps, _ = for_each_item(widen_item)
            mosaic_keys.drain_slots(steps, _WIDE_SLOTS, (k_free, v_free))

    @pl.when(wg == 1)
    def _memory_wg():
        if widen_wg:
            plgpu.set_max_registers(40, action="decrease")
        # The memory warpgroup reads the page table and issues the copies: each item's query tile, then its key
        # blocks, num_stages blocks ahead of the dots, counting slots over all of the CTA's items.
        def load_item(it, issued, queries):
            q_slot = lax.rem(queries, jnp.int32(q_slots))

            @pl.when(queries >= q_slots)
            def _():
                plgpu.barrier_wait(q_consumed.at[q_slot])

            plgpu.copy_gmem_to_smem(q_ref.at[it.kv_head, it.q_rows], q_smem.at[q_slot], q_barriers.at[q_slot])

            def locate(block):
                return mosaic_keys.block_chunks(page_table_ref, it.seq_slot, it.walk.storage(block),
                                                block_kv=block_kv, page_size=page_size)

            def copy(chunks, slot):  # K first (needed first), each pool with its scales if any
                pools = ((k_ref, k_smem, k_barriers, k_scales), (v_ref, v_smem, v_barriers, v_scales))
                for j, (pool, buf, barriers, scale_buf) in enumerate(pools):
                    mosaic_keys.copy_pool_block(chunks, pool, it.kv_head, buf, slot, barriers, page_size=page_size,
                                                scales=scale_refs[j] if scale_refs else None,
                                                scale_buf=scale_buf)

            mosaic_keys.stream_blocks(it.begin, it.end, issued, num_stages, locate, [((consumed,), copy)])

        issued, queries = for_each_item(load_item)
        mosaic_keys.drain_slots(issued, num_stages, (consumed,))

        @pl.loop(jnp.maximum(queries - q_slots, 0), queries)
        def _drain_queries(n):
            plgpu.barrier_wait(q_consumed.at[lax.rem(n, jnp.int32(q_slots))])

    @pl.when(wg == 0)
    def _compute_wg():
        if widen_wg:
            plgpu.set_max_registers(232, action="increase")

        def attend(it, done, q_tile):
            """The item's rows over its key blocks: (acc, m, l) of the online softmax, in registers."""
            def body(block, carry, *, masked: bool):
                acc, m_i, l_i = carry
                step = done + block - it.begin
                slot = lax.rem(step, jnp.int32(num_stages))
                w = lax.rem(step, jnp.int32(_WIDE_SLOTS)) if widen_wg else None
                with jax.named_scope("k"):  # (named scopes: ranges of mosaic_keys.compiler_params' profiles)
                    if widen_wg:
                        plgpu.barrier_wait(k_ready.at[w])
                        k_tile = k_wide.at[w]
                    else:
                        plgpu.barrier_wait(k_barriers.at[slot])
                        k_tile = k_smem.at[slot] if k_wide is None else widened(k_smem, k_scales, k_wide, slot)

                def qk_dot(acc_ref):
                    plgpu.wgmma(acc_ref, q_tile, k_tile.transpose((1, 0)))
                    return acc_ref[...]

                with jax.named_scope("qk"):
                    qk = pl.run_scoped(qk_dot, plgpu.ACC((_BLOCK_M, block_kv), jnp.float32))
                if widen_wg:
                    plgpu.barrier_arrive(k_free.at[w])
                qk, c = mosaic_keys.log2_logits(qk, scale=scale, softcap=softcap)
                if masked:
                    rows = plgpu.broadcasted_iota(jnp.int32, qk.shape, 0, layout=plgpu.Layout.WGMMA) + it.first
                    # Tile rows outside the segment are never written out: any mask serves them.
                    row_pos = it.offset + lax.div(jnp.maximum(rows, 0), jnp.int32(group))
                    qk = jnp.where(it.walk.visible(block, row_pos, qk.shape, window=window, causal=causal), qk,
                                   -jnp.inf)
                m_ij = jnp.maximum(m_i, qk.max(axis=1) * c)
                # A row that has seen nothing keeps m = -inf; exp2 needs a finite base.
                base = jnp.where(m_ij == -jnp.inf, 0.0, m_ij) if masked else m_ij
                alpha = jnp.exp2(m_i - base)
                p = jnp.exp2(qk * c - lax.broadcast_in_dim(base, qk.shape, [0]))
                l_i = l_i * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                with jax.named_scope("v"):
                    if widen_wg:  # widened, unseen rows zeroed
                        plgpu.barrier_wait(v_ready.at[w])
                        v_tile = v_wide.at[w]
                    elif v_wide is not None:  # V rows of keys no row sees are zeroed as they widen
                        plgpu.barrier_wait(v_barriers.at[slot])
                        seen = it.walk.seen_rows(block, v_wide.shape[-2:]) if masked else None
                        v_tile = widened(v_smem, v_scales, v_wide, slot, seen)
                        plgpu.barrier_arrive(consumed.at[slot])  # the dots read the widened tiles: refill now
                    else:
                        plgpu.barrier_wait(v_barriers.at[slot])
                        if masked:
                            it.walk.zero_unseen(v_smem.at[slot], block, dtype)
                        v_tile = v_smem.at[slot]

                if p_smem is None:  # P from registers, accumulated in place (compiled only)
                    def pv_dot(acc_ref):
                        plgpu.wgmma(acc_ref, p.astype(dtype), v_tile)

                    with jax.named_scope("pv"):
                        acc = pl.run_state(pv_dot)(plgpu.ACC.init(acc))
                else:
                    # P through shared memory, into a fresh accumulator: the GPU interpreter takes wgmma operands
                    # from refs only and does not run pl.run_state.
                    p_smem[...] = p.astype(dtype)
                    plgpu.commit_smem()

                    def pv_dot(acc_ref):
                        plgpu.wgmma(acc_ref, p_smem, v_tile)
                        return acc_ref[...]

                    acc = acc + pl.run_scoped(pv_dot, plgpu.ACC((_BLOCK_M, head_dim), jnp.float32))
                if widen_wg:
                    plgpu.barrier_arrive(v_free.at[w])
                elif v_wide is None:
                    plgpu.barrier_arrive(consumed.at[slot])  # both dots have read the slot: refill it
                return acc, m_ij, l_i

            acc = plgpu.layout_cast(jnp.full((_BLOCK_M, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)
            m_i = plgpu.layout_cast(jnp.full((_BLOCK_M,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.full((_BLOCK_M,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            return walk_blocks(it, body, (acc, m_i, l_i))

        def write_rows(it, acc, m_i, l_i, out_smem):
            seen = l_i > 0
            acc = acc / lax.broadcast_in_dim(jnp.where(seen, l_i, 1.0), acc.shape, [0])
            out_smem[...] = acc.astype(out_smem.dtype)
            if lse_smem is not None:
                lse_smem[...] = jnp.where(seen, m_i + jnp.log2(jnp.where(seen, l_i, 1.0)), -jnp.inf)
            plgpu.commit_smem()

            # Only the _ALIGN-row groups that hold rows of the segment go out.
            @pl.loop(lax.div(it.lo_row - it.first, jnp.int32(_ALIGN)),
                     lax.div(it.hi_row - it.first + _ALIGN - 1, jnp.int32(_ALIGN)))
            def _store(i):
                rows = pl.ds(pl.multiple_of(i * _ALIGN, _ALIGN), _ALIGN)
                plgpu.copy_smem_to_gmem(out_smem.at[rows], o_ref.at[it.split, it.tile, it.kv_head, rows])

            if lse_smem is not None:
                plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[it.split, it.tile, it.kv_head])

        def compute_item(it, done, queries):
            q_slot = lax.rem(queries, jnp.int32(q_slots))
            q_tile = q_smem.at[q_slot]
            with jax.named_scope("q"):
                plgpu.barrier_wait(q_barriers.at[q_slot])
            acc, m_i, l_i = attend(it, done, q_tile)
            if o_smem is None:  # one split: the rows go out through the query tile
                write_rows(it, acc, m_i, l_i, q_tile)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.barrier_arrive(q_consumed.at[q_slot])  # the tile is free for a later item's query
            else:
                plgpu.barrier_arrive(q_consumed.at[q_slot])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last item's rows have left the output tiles
                write_rows(it, acc, m_i, l_i, o_smem)

        for_each_item(compute_item)
        plgpu.wait_smem_to_gmem(0)


@functools.partial(
    jax.jit, static_argnames=("ring_rows", "window", "causal", "softcap", "scale", "num_splits", "block_kv",
                              "num_stages", "p_in_registers", "max_ctas", "f16_dots",
                              "widen_warpgroup", "interpret")
)
def decode_attention_mgpu(
    q, k_pages, v_pages, page_table, seq_info, *, k_scale=None, v_scale=None, ring_rows=None, window=0, causal=True,
    softcap=0.0, scale, num_splits=1, block_kv=128, num_stages=2, p_in_registers=False, max_ctas=None,
    f16_dots=False, widen_warpgroup=False, interpret=False,
):
    """Same contract as `varlen_attention` (see supports()). fp8 pools (scaled or not): each K and V block
    arrives as fp8 and is widened to q's dtype in shared memory (`_widen`) before the dots; with f16_dots to
    float16 (e4m3 to float16 directly, where bfloat16 takes a float32 round trip), the dots then running in
    float16 on q clipped to its range, the output rounded to q's dtype (tuning.FP8_KV_F16_DOTS; with one split
    through float16, whose subnormals below ~6e-5 keep less precision than bfloat16 would). With
    widen_warpgroup a third warpgroup widens them, into two K and two V tiles, while the compute warpgroup runs
    the dots of the block before (fp8 pools, where the 64 KB more shared memory at 128 keys and head_dim 128 fit).

    num_splits: key slices per tile, merged after the kernel; block_kv keys per pipeline step; num_stages
    K/V shared-memory slots. p_in_registers: P @ V takes P from registers into the running accumulator, as
    FlashAttention-3 does; otherwise, and always under interpret (the interpreter has no wgmma from registers), P goes
    through shared memory into a fresh accumulator. max_ctas: a persistent grid of at most this many CTAs, each
    over every max_ctas-th work item (tile, kv head, split), with a second query tile in shared memory (16 KB at
    head_dim 128 in bf16: a tile near the limit may then not fit); None: a CTA per work item. interpret: run Pallas'
    GPU interpreter (CPU tests)."""
    num_rows, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    if num_stages < 1 or num_splits < 1 or num_rows < 1 or (max_ctas is not None and max_ctas < 1):
        raise ValueError(f"decode_attention_mgpu: num_stages={num_stages}, num_splits={num_splits}, "
                         f"max_ctas={max_ctas} and the query rows ({num_rows}) must be >= 1")
    if error := layer_error(page_table.shape[1] * page_size, ring_rows=ring_rows, window=window, softcap=softcap):
        raise ValueError(f"decode_attention_mgpu: {error}")
    if error := scales_error(k_pages, k_scale, v_scale):
        raise ValueError(f"decode_attention_mgpu: {error}")
    scaled = k_scale is not None
    p_in_registers = p_in_registers and not interpret
    if not supports(dtype=q.dtype, kv_dtype=k_pages.dtype, head_dim=head_dim, page_size=page_size, block_kv=block_kv,
                    ring_rows=ring_rows, window=window, scaled=scaled):
        raise ValueError(
            f"decode_attention_mgpu: needs bf16/f16 q with pools of its dtype or float8_e4m3fn (scaled: pages and "
            f"key blocks of multiples of 32 keys), head_dim 64 or 128, page_size a multiple of 16 that divides or "
            f"is divided by block_kv, block_kv a multiple of 64, and a ring a window in [1, ring_rows] (q {q.shape} "
            f"{q.dtype}, pools {k_pages.shape} {k_pages.dtype}, scaled={scaled}, block_kv={block_kv}, "
            f"ring_rows={ring_rows}, window={window})"
        )
    group = num_q_heads // num_kv_heads
    num_segments = seq_info.shape[0]
    num_tiles = num_tiles_for(num_rows, num_segments, group)
    tiles, first_tile = _tiles(seq_info, group, num_tiles)
    # Each tile's segment fields beside it: a CTA reads one row, not a row that names another.
    tile_info = jnp.concatenate([tiles, seq_info[jnp.maximum(tiles[:, 0], 0)]], axis=1)
    flat = (num_pages * page_size, num_kv_heads, head_dim)
    out_dtype = q.dtype
    kv_dtype = k_pages.dtype
    wide = kv_dtype != q.dtype  # fp8 pools: widened into tiles of the dots' dtype
    if wide and f16_dots and q.dtype != jnp.float16:
        q = jnp.clip(q.astype(jnp.float32), -_F16_MAX, _F16_MAX).astype(jnp.float16)
    dtype = q.dtype

    # Each kv head's packed rows (at one query row a bitcast). A tile's TMA read past the last row is filled with
    # zeros (by the interpreter too); the tiled view needs a row count below _ALIGN or a multiple of it.
    packed = num_rows * group
    q_packed = q.reshape(num_rows, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    q_packed = q_packed.reshape(num_kv_heads, packed, head_dim)
    if packed > _ALIGN and packed % _ALIGN:
        q_packed = jnp.pad(q_packed, ((0, 0), (0, -packed % _ALIGN), (0, 0)))

    single = num_splits == 1  # no merge: the kernel writes final rows, and no float32 tile or lse

    num_items = num_tiles * num_kv_heads * num_splits
    num_ctas = num_items if max_ctas is None else min(num_items, max_ctas)
    # A CTA over several items loads the next item's query tile while this one's rows are computed.
    q_slots = 1 if num_ctas == num_items else 2
    widen_wg = wide and widen_warpgroup and widen_wg_fits(
        q_slots=q_slots, head_dim=head_dim, block_kv=block_kv, num_stages=num_stages, scaled=scaled,
        num_splits=num_splits, p_in_registers=p_in_registers)

    def entry(tiles_ref, page_table_ref, q_ref, k_ref, v_ref, *refs):
        scale_refs, (o_ref, lse_ref) = refs[:2 * scaled], (*refs[2 * scaled:], None)[:2]
        transforms = _transforms(head_dim, dtype)
        copies = block_kv // min(page_size, block_kv)
        arrivals = copies * (2 if scaled else 1)  # a scaled cache's scales arrive with their K or V
        pl.run_scoped(
            lambda *scoped: _kernel(
                tiles_ref, page_table_ref, q_ref, k_ref, v_ref, scale_refs, o_ref, lse_ref, scoped,
                num_items=num_items, num_ctas=num_ctas, block_kv=block_kv, num_stages=num_stages,
                page_size=page_size, group=group, causal=causal, scale=scale, num_splits=num_splits,
                ring_rows=ring_rows, window=window, softcap=softcap, widen_wg=widen_wg,
            ),
            (
                plgpu.SMEM((q_slots, _BLOCK_M, head_dim), dtype, transforms=transforms),
                plgpu.SMEM((num_stages, block_kv, head_dim), kv_dtype, transforms=_transforms(head_dim, kv_dtype)),
                plgpu.SMEM((num_stages, block_kv, head_dim), kv_dtype, transforms=_transforms(head_dim, kv_dtype)),
                None if p_in_registers else plgpu.SMEM((_BLOCK_M, block_kv), dtype,
                                                       transforms=_transforms(block_kv, dtype)),
                None if single else plgpu.SMEM((_BLOCK_M, head_dim), jnp.float32),
                None if single else plgpu.SMEM((_BLOCK_M,), jnp.float32),
                *(plgpu.SMEM((*(_WIDE_SLOTS,) * widen_wg, block_kv, head_dim), dtype, transforms=transforms)
                  if wide else None for _ in "kv"),
                plgpu.SMEM((num_stages, block_kv), jnp.float32) if scaled else None,
                plgpu.SMEM((num_stages, block_kv), jnp.float32) if scaled else None,
            ),
            (
                plgpu.Barrier(num_arrivals=arrivals, num_barriers=num_stages),
                plgpu.Barrier(num_arrivals=arrivals, num_barriers=num_stages),
                plgpu.Barrier(num_barriers=q_slots),
            ),
            (  # the compute (or widening) warpgroup's releases of K/V and query slots
                plgpu.Barrier(num_arrivals=1, num_barriers=num_stages),
                plgpu.Barrier(num_arrivals=1, num_barriers=q_slots),
            ),
            # widen_wg: K and V widened (ready) and read by the dots (free), per wide tile
            tuple(plgpu.Barrier(num_arrivals=1, num_barriers=_WIDE_SLOTS) for _ in range(4 * widen_wg)),
            collective_axes="wg",
        )

    o_type = jax.ShapeDtypeStruct((num_splits, num_tiles, num_kv_heads, _BLOCK_M, head_dim),
                                  dtype if single else jnp.float32)
    lse_type = jax.ShapeDtypeStruct((num_splits, num_tiles, num_kv_heads, _BLOCK_M), jnp.float32)
    o, *lse = plgpu.kernel(
        entry,
        out_type=(o_type,) if single else (o_type, lse_type),
        grid=(num_ctas,),
        grid_names=("ctas",),
        num_threads=3 if widen_wg else 2,  # a compute and a memory warpgroup (and one widening fp8 blocks)
        thread_name="wg",
        compiler_params=mosaic_keys.compiler_params(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(tile_info, page_table, q_packed, k_pages.reshape(flat), v_pages.reshape(flat),
      *((k_scale.reshape(-1, page_size), v_scale.reshape(-1, page_size)) if scaled else ()))
    return _merge(o, lse[0] if lse else None, seq_info, first_tile, group, num_rows).astype(out_dtype)


def _merge(o, lse, seq_info, first_tile, group: int, num_rows: int):
    """[T, Hq, D] in the query's layout from the per-tile split outputs: rows outside every segment and
    rows that saw no key are zero."""
    num_kv_heads = o.shape[2]
    start = _packed_info(seq_info, group)[:, 0]
    seg1 = segments.row_segments(seq_info, num_rows)
    seg = jnp.maximum(seg1 - 1, 0)
    t = jnp.arange(num_rows, dtype=jnp.int32)[:, None]
    hq = jnp.arange(num_kv_heads * group, dtype=jnp.int32)[None, :]
    # Packed row of (t, hq) within its segment's tiles, counted from the aligned first row.
    packed = (t - seq_info[seg, 0][:, None]) * group + hq % group + (start[seg] % _ALIGN)[:, None]
    tile = first_tile[seg][:, None] + packed // _BLOCK_M
    tile = jnp.clip(tile, 0, o.shape[1] - 1)
    row, kv = packed % _BLOCK_M, hq // group
    o_rows = o[:, tile, kv, row]  # [NS, T, Hq, D]
    if lse is None:
        out = o_rows[0]
    else:
        lse_rows = lse[:, tile, kv, row]  # [NS, T, Hq]
        m = jnp.max(lse_rows, axis=0)
        w = jnp.exp2(lse_rows - jnp.where(m == -jnp.inf, 0.0, m)[None])
        total = jnp.sum(w, axis=0)
        out = jnp.sum(w[..., None] * o_rows, axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
    return jnp.where((seg1 > 0)[:, None, None], out, 0.0)
