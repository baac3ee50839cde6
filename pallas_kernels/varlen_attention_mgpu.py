"""Varlen paged prefill attention on Hopper (Pallas, Mosaic GPU: TMA + wgmma).

The FlashAttention-3 layout of JAX's `pallas/ops/gpu/attention_mgpu.py` made
varlen and paged. One CTA holds three warpgroups: two compute warpgroups own
`block_q` query rows each of one query head (a 2 * block_q row tile of one
segment), and a memory warpgroup streams the segment's K/V blocks into a ring
of `num_stages` shared-memory slots with TMA, one copy per page chunk, reading
the page table on the device. The compute warpgroups take turns on the tensor
cores (a schedule barrier) so one's softmax overlaps the other's matmuls. A CTA takes one work item (a tile
and a query head), or on a persistent grid (max_ctas) every max_ctas-th item, its K/V slots counted on across
items so the memory warpgroup streams the next item's blocks while the last ones are computed.

Scope: flat and ring layers (a ring with a window that fits it), sliding windows and soft-caps; bf16/f16 pools
of q's dtype (no fp8), head_dim a multiple of 64 up to 256, page sizes a multiple of 16 that divide or are divided
by `block_kv` (16, 64 and 256 were checked on the H200, flat layers without window or soft-cap; the rest has run
only in Pallas' GPU interpreter, so `varlen_attention`'s "auto" leaves it to the Triton kernel while
tuning.MOSAIC_PREFILL_PLAIN_ONLY is set).

The memory warpgroup streams the blocks any row of the tile sees (mosaic_keys.KeyWalk: a flat layer's in key
order from the window's start, a ring's storage blocks from the one holding the tile's first key, wrapping). Each
compute warpgroup computes on its own rows' blocks (a ring's: all of the tile's) and releases the others in step
with the other warpgroup, masking the blocks that hold keys some of its rows do not see.

Output rows go straight into the packed [T, Hq, D] output, which the call may hand in (varlen_attention's "auto"
passes the Triton kernel's, so the two kernels share one buffer): whole 8-row chunks of a segment in one TMA copy
each, the rows of a chunk it shares with a neighbour one by one (_write_rows), so no tile writes a row outside its
segment. Where that stage does not fit in shared memory (head_dim 256) a tile's rows go into a padded buffer
gathered back afterwards. Pool rows of keys no row of the tile sees (past kv_end, before a window, never written
in a ring) can hold anything: their logits are masked and their V rows zeroed in shared memory before P @ V.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from glint.pallas_kernels import mosaic_keys, segments
from glint.pallas_kernels.reference import layer_error
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_COMPUTE_WGS = 2
_ALIGN = mosaic_keys.ALIGN
_SMEM_BYTES = 220 * 1024  # of the 227 KB a CTA may take on Hopper, leaving room for the barriers


def block_kv_for(head_dim: int, block_kv: int) -> int:
    """Keys per block: head_dim 256 halves it so Q and two K/V stages fit in shared memory."""
    return block_kv if head_dim <= 128 else min(block_kv, 64)


def supports(*, dtype, head_dim: int, page_size: int, block_kv: int, ring_rows, window: int) -> bool:
    """Whether the Mosaic kernel covers this call (else the Triton kernel does); a ring as
    mosaic_keys.covers_ring."""
    block_kv = block_kv_for(head_dim, block_kv)
    return (
        mosaic_keys.covers_ring(ring_rows, window)
        and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and head_dim % 64 == 0
        and head_dim <= 256
        and page_size % 16 == 0
        and (block_kv % page_size == 0 or page_size % block_kv == 0)
    )


def is_hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and getattr(dev, "compute_capability", "") == "9.0"


def padded_rows(seq_info, tile_rows: int):
    """i32[S]: query rows each segment occupies in whole tiles (0 for empty segments)."""
    q_len = jnp.maximum(seq_info[:, 1], 0)
    return jnp.where(q_len > 0, (q_len + seq_info[:, 0] % _ALIGN + tile_rows - 1) // tile_rows * tile_rows, 0)


def max_tiles(num_rows: int, num_segments: int, tile_rows: int) -> int:
    """Static tile count that covers any layout of `num_segments` segments in `num_rows` rows.

    Segment i takes 1 + m_i tiles. Its first m_i tiles, counted from its aligned start
    floor8(q_start_i), end before its last row, so these runs are disjoint and lie in [0, num_rows):
    the m_i sum to at most num_rows // tile_rows. Each tile holds a row, so never more than num_rows."""
    return max(1, min(num_rows // tile_rows + num_segments, num_rows))


def _tiles(seq_info, tile_rows: int, num_tiles: int):
    """i32[num_tiles, 2] (segment or -1, tile within it) and each segment's first tile.

    TMA reads query rows from multiples of _ALIGN, so a segment's tiles start aligned: tile k of a
    segment covers its rows [k * tile_rows - q_start % _ALIGN, ...) (rows before 0 are not its own)."""
    return segments.tile_map(padded_rows(seq_info, tile_rows) // tile_rows, num_tiles)


def _gather_rows(out_pad, seq_info, first_tile, tile_rows: int, num_rows: int):
    """Packed [T, Hq, D] from the per-tile padded output; uncovered rows zero."""
    q_start = seq_info[:, 0]
    seg1 = segments.row_segments(seq_info, num_rows)
    seg = jnp.maximum(seg1 - 1, 0)
    t = jnp.arange(num_rows, dtype=jnp.int32)
    src = first_tile[seg] * tile_rows + (t - q_start[seg]) + q_start[seg] % _ALIGN
    src = jnp.clip(src, 0, out_pad.shape[0] - 1)
    return jnp.where((seg1 > 0)[:, None, None], out_pad[src], 0).astype(out_pad.dtype)


class _Item(NamedTuple):
    """One work item of a CTA: a tile of one segment's query rows and one query head."""
    head: jax.Array
    kv_head: jax.Array
    tile: jax.Array
    segment: jax.Array  # -1: a padding tile, which does nothing
    q_start: jax.Array
    q_len: jax.Array
    seq_slot: jax.Array
    kv_end: jax.Array
    first: jax.Array  # tile row 0, as a row of the segment (negative: the tile starts at an aligned row before it)
    offset: jax.Array  # position of the segment's query row 0
    walk: mosaic_keys.KeyWalk | None
    begin: jax.Array | None  # the key blocks any row of the tile sees: [begin, end) of the walk
    end: jax.Array | None

    @property
    def has_rows(self):
        return self.segment >= 0


def stage_fits(*, head_dim: int, block_q: int, block_kv: int, num_stages: int) -> bool:
    """Whether shared memory holds the output stage (_write_rows) beside Q and the K/V stages: head_dim up to
    192 at the default tile, not 256."""
    block_kv = block_kv_for(head_dim, block_kv)
    rows = 2 * _COMPUTE_WGS * block_q + 2 * num_stages * block_kv  # Q and the stage, K and V
    return rows * head_dim * 2 <= _SMEM_BYTES


def _write_rows(out, qo_smem, stage, out_ref, head, row, row0, q_len):
    """Stores a warpgroup's output rows that belong to its segment straight into the packed out_ref [T, Hq, D].

    `out` is the block's rows row0 .. row0 + block_q of the segment (row0 may be negative: the tile starts at an
    aligned row), the first at row `row` of out_ref (a multiple of _ALIGN). Rows of the block outside the segment
    belong to a neighbour or to no segment, and are not written. A block wholly inside goes out in one TMA copy
    (through the swizzled query tile); otherwise through `stage` (untiled): each _ALIGN-row chunk wholly inside in
    one copy, and the rows of the segment's first and last chunks, which it may share with a neighbour, one by one.
    """
    block_q = out.shape[0]
    whole = (row0 >= 0) & (row0 + block_q <= q_len)

    @pl.when(whole)
    def _():
        qo_smem[...] = out
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[pl.ds(row, block_q), head])

    lo, hi = jnp.clip(-row0, 0, block_q), jnp.clip(q_len - row0, 0, block_q)  # the segment's rows of the block

    @pl.when(~whole & (hi > lo))
    def _():
        stage[...] = out
        plgpu.commit_smem()
        for j in range(0, block_q, _ALIGN):
            pl.when((j >= lo) & (j + _ALIGN <= hi))(functools.partial(
                plgpu.copy_smem_to_gmem, stage.at[pl.ds(j, _ALIGN)], out_ref.at[pl.ds(row + j, _ALIGN), head]))

        def one_row(i):
            start = i - lax.rem(i, jnp.int32(_ALIGN))
            partial = (start < lo) | (start + _ALIGN > hi)  # its chunk holds rows outside the segment
            pl.when(partial)(functools.partial(
                plgpu.copy_smem_to_gmem, stage.at[pl.ds(i, 1)], out_ref.at[pl.ds(row + i, 1), head]))

        # Only the first and the last chunk holding rows of the segment can be cut.
        pl.loop(lo, jnp.minimum(lo + _ALIGN, hi))(one_row)
        pl.loop(jnp.maximum(hi - _ALIGN, lo + _ALIGN), hi)(one_row)


def _kernel(
    tiles_ref,
    seq_info_ref,
    page_table_ref,
    q_ref,  # [T, Hq, D]
    k_ref,  # [num_pages * page_size, Hkv, D]
    v_ref,
    out_ref,  # [T (a multiple of _ALIGN), Hq, D], or [num_tiles * 2 * block_q, Hq, D] without a stage buffer
    scoped,
    *,
    block_q: int,
    block_kv: int,
    num_stages: int,
    page_size: int,
    group: int,
    causal: bool,
    scale: float,
    num_tiles: int,
    num_items: int,
    num_ctas: int,
    ring_rows: int | None,
    window: int,
    softcap: float,
):
    smem, kv_barriers, consumed_barriers, schedule_barrier = scoped
    qo_smem2, k_smem, v_smem, p_smem2, stage2 = smem
    k_barriers, v_barriers, q_barriers = kv_barriers
    k_consumed, v_consumed = consumed_barriers
    wg = lax.axis_index("wg")
    cta = lax.axis_index("ctas")
    head_dim = q_ref.shape[-1]
    dtype = q_ref.dtype
    tile_rows = _COMPUTE_WGS * block_q
    # This CTA's work items (tile, query head): cta, cta + num_ctas, ... in the order the two-axis grid (heads,
    # tiles) launched its CTAs: a head's tiles, longest (segment ends) first, then the next head's. With fewer CTAs
    # than items (a persistent grid) the memory warpgroup streams the next item's blocks while the last ones are
    # computed.
    def item(index):
        head = lax.div(index, jnp.int32(num_tiles))
        tile = num_tiles - 1 - lax.rem(index, jnp.int32(num_tiles))
        segment = tiles_ref[tile, 0]
        seg = jnp.maximum(segment, 0)
        q_start = seq_info_ref[seg, 0]
        q_len = jnp.where(segment >= 0, seq_info_ref[seg, 1], 0)
        kv_end = seq_info_ref[seg, 3]
        first = tiles_ref[tile, 1] * tile_rows - lax.rem(q_start, jnp.int32(_ALIGN))  # tile row 0, in the segment
        it = _Item(head, lax.div(head, jnp.int32(group)), tile, segment, q_start, q_len, seq_info_ref[seg, 2],
                   kv_end, first, kv_end - q_len, None, None, None)
        # The memory warpgroup streams the blocks any row of the tile sees; each compute warpgroup computes on its
        # own rows' blocks among them and releases the others in step with the other warpgroup.
        tile_lo, tile_hi, _, _ = rows_keys(it, first, tile_rows)
        walk = mosaic_keys.KeyWalk(kv_end, tile_lo, block_kv, ring_rows)
        begin, end = walk.blocks(tile_lo, tile_hi)
        return it._replace(walk=walk, begin=begin, end=end)

    def rows_keys(it, row_begin, num_rows: int):
        """seen_keys of the segment's rows among [row_begin, row_begin + num_rows)."""
        return mosaic_keys.seen_keys(it.offset, jnp.maximum(row_begin, 0),
                                     jnp.minimum(row_begin + num_rows, it.q_len), it.kv_end, window=window,
                                     causal=causal)

    def for_each_item(fn):
        """fn(item, key blocks streamed before it) for each of this CTA's items with rows, in order: every
        warpgroup counts K/V slots this way. Returns the blocks streamed over all of them."""
        return mosaic_keys.for_each_item(item, cta, num_ctas, num_items, lambda it, blocks, _: fn(it, blocks))[0]

    def schedule_barrier_sync():
        plgpu.barrier_arrive(schedule_barrier)
        plgpu.barrier_wait(schedule_barrier)

    def compute_item(it, done):
        """This warpgroup's rows of item `it`; `done`: key blocks streamed before it."""
        tile_begin, tile_end, walk, head = it.begin, it.end, it.walk, it.head

        def slot_of(block):
            return lax.rem(done + block - tile_begin, jnp.int32(num_stages))

        qo_smem = qo_smem2.at[wg]
        row0 = it.first + wg * block_q
        lo, hi, lo_full, hi_full = rows_keys(it, row0, block_q)
        if ring_rows is None:
            begin, end = walk.blocks(lo, hi)
        else:  # a ring tile's walk is a window and a tile of rows: each warpgroup with rows takes all of it
            begin, end = tile_begin, jnp.where(hi > lo, tile_end, tile_begin)
        begin, end = jnp.clip(begin, tile_begin, tile_end), jnp.clip(end, tile_begin, tile_end)
        begin = jnp.where(end > begin, begin, tile_end)  # no blocks: release them all
        end = jnp.maximum(end, begin)
        full_begin, full_end = walk.full_blocks(lo_full, hi_full, begin, end)

        q_rows = pl.ds(pl.multiple_of(it.q_start + row0, _ALIGN), block_q)
        plgpu.copy_gmem_to_smem(q_ref.at[q_rows, head], qo_smem, q_barriers.at[wg])
        plgpu.barrier_wait(q_barriers.at[wg])

        m_i = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l_i = plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.full((block_q, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

        pl.when(wg == 1)(schedule_barrier_sync)

        def kv_loop(block, carry, *, masked: bool):
            acc, m_i, l_i = carry
            slot = slot_of(block)

            def compute_qk(acc_ref):
                plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                schedule_barrier_sync()
                return acc_ref[...]

            qk = pl.run_scoped(compute_qk, plgpu.ACC((block_q, block_kv), jnp.float32))
            plgpu.barrier_arrive(k_consumed.at[slot])
            qk, c = mosaic_keys.log2_logits(qk, scale=scale, softcap=softcap)
            if masked:
                rows = plgpu.broadcasted_iota(jnp.int32, qk.shape, 0, layout=plgpu.Layout.WGMMA) + row0
                row_pos = rows + it.offset  # rows outside the segment are never written out: any mask serves them
                qk = jnp.where(walk.visible(block, row_pos, qk.shape, window=window, causal=causal), qk, -jnp.inf)
            m_ij = jnp.maximum(m_i, qk.max(axis=1) * c)
            if masked:  # a row that has seen nothing keeps m = -inf; exp2 needs a finite base
                m_ij_base = jnp.where(m_ij == -jnp.inf, 0.0, m_ij)
            else:
                m_ij_base = m_ij
            alpha = jnp.exp2(m_i - m_ij_base)
            p = jnp.exp2(qk * c - lax.broadcast_in_dim(m_ij_base, qk.shape, [0]))
            acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
            l_i *= alpha
            p16 = p.astype(dtype)
            l_i += p.sum(axis=1)
            acc, l_i, m_ij, p16 = lax.optimization_barrier((acc, l_i, m_ij, p16))
            plgpu.barrier_arrive(schedule_barrier)
            plgpu.barrier_wait(v_barriers.at[slot])
            plgpu.barrier_wait(schedule_barrier)
            if masked:
                # Both warpgroups may zero rows of this slot (the same values). The other's P @ V of this block is
                # done by now: the schedule barrier orders it before this point, and its run_state waits for the
                # wgmma. A P @ V left in flight past the barrier (FlashAttention-3's wgmma_wait(1)) would race.
                walk.zero_unseen(v_smem.at[slot], block, dtype)

            # Computed outside run_state: the lowering cannot pass a value computed in run_state's body out of it.
            next_slot = slot_of(block + 1)

            def compute_pv(acc_ref):
                plgpu.wgmma(acc_ref, p16 if p_smem2 is None else p_smem2.at[wg], v_smem.at[slot])

                @pl.when(block + 1 < end)
                def _():
                    plgpu.barrier_wait(k_barriers.at[next_slot])

            if p_smem2 is None:  # P from registers into the running accumulator
                acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
            else:
                # Interpreted: P through shared memory into a fresh accumulator (the GPU interpreter takes wgmma
                # operands from refs only and does not run pl.run_state).
                p_smem2.at[wg][...] = p16
                plgpu.commit_smem()

                def fresh_pv(acc_ref):
                    compute_pv(acc_ref)
                    return acc_ref[...]

                acc = acc + pl.run_scoped(fresh_pv, plgpu.ACC((block_q, head_dim), jnp.float32))
            plgpu.barrier_arrive(v_consumed.at[slot])
            return acc, m_ij, l_i

        def release(block, _):
            # A block the other warpgroup needs and this one does not: released in step with the other.
            slot = slot_of(block)
            plgpu.barrier_wait(k_barriers.at[slot])  # every warpgroup observes every phase of each barrier
            plgpu.barrier_wait(v_barriers.at[slot])
            plgpu.barrier_arrive(k_consumed.at[slot])
            plgpu.barrier_arrive(v_consumed.at[slot])
            schedule_barrier_sync()
            schedule_barrier_sync()

        lax.fori_loop(tile_begin, begin, release, None)

        @pl.when(end > begin)
        def _():
            plgpu.barrier_wait(k_barriers.at[slot_of(begin)])

        carry = lax.fori_loop(begin, full_begin, functools.partial(kv_loop, masked=True), (acc, m_i, l_i))
        carry = lax.fori_loop(full_begin, full_end, functools.partial(kv_loop, masked=False), carry)
        acc, m_i, l_i = lax.fori_loop(full_end, end, functools.partial(kv_loop, masked=True), carry)
        lax.fori_loop(end, tile_end, release, None)
        pl.when(wg == 0)(schedule_barrier_sync)

        acc /= lax.broadcast_in_dim(jnp.where(l_i > 0, l_i, 1.0), (block_q, head_dim), [0])
        if stage2 is None:  # a tile of the padded output, gathered back afterwards
            qo_smem[...] = acc.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[pl.ds(it.tile * tile_rows + wg * block_q, block_q), head])
        else:
            _write_rows(acc.astype(dtype), qo_smem, stage2.at[wg], out_ref, head,
                        pl.multiple_of(it.q_start + row0, _ALIGN), row0, it.q_len)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the next item's query may land in qo_smem

    @pl.when(wg < _COMPUTE_WGS)
    def _compute_wg():
        plgpu.set_max_registers(232, action="increase")
        for_each_item(compute_item)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _COMPUTE_WGS)
    def _memory_wg():
        plgpu.set_max_registers(40, action="decrease")

        def load_item(it, streamed):
            # A slot's K is refilled once both Q @ K^T read it, before their P @ V are done with its V.
            def locate(block):
                return mosaic_keys.block_chunks(page_table_ref, it.seq_slot, it.walk.storage(block),
                                                block_kv=block_kv, page_size=page_size)

            def copier(pool, buf, barriers):
                def copy(chunks, slot):
                    mosaic_keys.copy_pool_block(chunks, pool, it.kv_head, buf, slot, barriers, page_size=page_size)
                return copy

            mosaic_keys.stream_blocks(it.begin, it.end, streamed, num_stages, locate, [
                ((k_consumed,), copier(k_ref, k_smem, k_barriers)), ((v_consumed,), copier(v_ref, v_smem, v_barriers))])

        mosaic_keys.drain_slots(for_each_item(load_item), num_stages, (k_consumed, v_consumed))


@functools.partial(
    jax.jit, static_argnames=("ring_rows", "window", "causal", "softcap", "scale", "block_q", "block_kv",
                              "num_stages", "max_ctas", "interpret")
)
def varlen_attention_mgpu(
    q, k_pages, v_pages, page_table, seq_info, *, out=None, ring_rows=None, window=0, causal=True, softcap=0.0,
    scale, block_q=64, block_kv=128, num_stages=2, max_ctas=None, interpret=False,
):
    """Same contract as `varlen_attention` (unscaled pools of q's dtype; see supports()).

    A tile is 2 * block_q query rows of one segment and one query head; block_kv keys per pipeline
    step (halved for head_dim 256); num_stages K/V shared-memory slots. out: [T, Hq, D] of q's dtype whose rows
    outside these segments are returned as they are (another kernel's rows; None: zeros). The kernel writes its
    rows into it in place where its output stage fits in shared memory (stage_fits), else into a padded buffer
    gathered back. max_ctas: a persistent grid of at most this many CTAs, each over every max_ctas-th work item
    (tile, query head), its memory warpgroup streaming the next item's key blocks while the last are computed; None:
    a CTA per work item. interpret: run Pallas' GPU interpreter (CPU tests), P @ V then taking P through shared
    memory."""
    if num_stages < 2:
        # The memory warpgroup refills a slot's K, then its V, only after both compute warpgroups consumed them.
        raise ValueError(f"varlen_attention_mgpu: num_stages={num_stages} must be >= 2")
    if max_ctas is not None and max_ctas < 1:
        raise ValueError(f"varlen_attention_mgpu: max_ctas={max_ctas} must be >= 1")
    num_rows, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    if error := layer_error(page_table.shape[1] * page_size, ring_rows=ring_rows, window=window, softcap=softcap):
        raise ValueError(f"varlen_attention_mgpu: {error}")
    if k_pages.dtype != q.dtype or not supports(dtype=q.dtype, head_dim=head_dim, page_size=page_size,
                                                block_kv=block_kv, ring_rows=ring_rows, window=window):
        raise ValueError(
            f"varlen_attention_mgpu: needs bf16/f16 pools of q's dtype, head_dim a multiple of 64 up to 256, "
            f"page_size a multiple of 16 that divides or is divided by block_kv, and a ring a window in [1, "
            f"ring_rows] (q {q.shape} {q.dtype}, pools {k_pages.shape} {k_pages.dtype}, block_kv={block_kv}, "
            f"ring_rows={ring_rows}, window={window})"
        )
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"varlen_attention_mgpu: out {out.shape} {out.dtype} must be q's {q.shape} {q.dtype}")
    direct = stage_fits(head_dim=head_dim, block_q=block_q, block_kv=block_kv, num_stages=num_stages)
    block_kv = block_kv_for(head_dim, block_kv)
    tile_rows = _COMPUTE_WGS * block_q
    num_segments = seq_info.shape[0]
    num_tiles = max_tiles(num_rows, num_segments, tile_rows)
    num_items = num_tiles * num_q_heads
    num_ctas = min(max_ctas or num_items, num_items)
    tiles, first_tile = _tiles(seq_info, tile_rows, num_tiles)
    flat = (num_pages * page_size, num_kv_heads, head_dim)
    dtype = q.dtype

    def entry(tiles_ref, seq_info_ref, page_table_ref, q_ref, k_ref, v_ref, out_ref):
        transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        smem = (
            plgpu.SMEM((_COMPUTE_WGS, block_q, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((num_stages, block_kv, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((num_stages, block_kv, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((_COMPUTE_WGS, block_q, block_kv), dtype, transforms=transforms) if interpret else None,
            plgpu.SMEM((_COMPUTE_WGS, block_q, head_dim), dtype) if direct else None,
        )
        copies = block_kv // min(page_size, block_kv)
        pl.run_scoped(
            lambda *scoped: _kernel(
                tiles_ref, seq_info_ref, page_table_ref, q_ref, k_ref, v_ref, out_ref, scoped,
                block_q=block_q, block_kv=block_kv, num_stages=num_stages, page_size=page_size,
                group=num_q_heads // num_kv_heads, causal=causal, scale=scale, num_tiles=num_tiles,
                num_items=num_items, num_ctas=num_ctas, ring_rows=ring_rows, window=window, softcap=softcap,
            ),
            smem,
            (
                plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
                plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
                plgpu.Barrier(num_barriers=_COMPUTE_WGS),
            ),
            (plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=num_stages),) * 2,
            plgpu.Barrier(num_arrivals=_COMPUTE_WGS),
            collective_axes="wg",
        )

    # The tiled TMA views of q and of the output need a row count that is a multiple of _ALIGN.
    pad = ((0, -num_rows % _ALIGN), (0, 0), (0, 0))
    q = jnp.pad(q, pad)
    base = jnp.zeros(q.shape, dtype) if out is None else jnp.pad(out, pad)
    kernel = functools.partial(
        plgpu.kernel,
        entry,
        grid=(num_ctas,),
        grid_names=("ctas",),
        num_threads=_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=mosaic_keys.compiler_params(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    args = (tiles, seq_info, page_table, q, k_pages.reshape(flat), v_pages.reshape(flat))
    if direct:  # the kernel writes its rows of `base` in place (a Ref operand: not under shard_map's check_vma)
        ref = jax.new_ref(base)
        kernel(out_type=())(*args, ref)
        return ref[...][:num_rows]
    out_pad = kernel(out_type=jax.ShapeDtypeStruct((num_tiles * tile_rows, num_q_heads, head_dim), dtype))(*args)
    rows = _gather_rows(out_pad, seq_info, first_tile, tile_rows, num_rows)
    if out is None:
        return rows
    return jnp.where((segments.row_segments(seq_info, num_rows) > 0)[:, None, None], rows, out)
