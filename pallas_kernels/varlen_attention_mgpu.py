"""Varlen paged prefill attention on Hopper (Pallas, Mosaic GPU: TMA + wgmma).

The FlashAttention-3 layout of JAX's `pallas/ops/gpu/attention_mgpu.py` made
varlen and paged. One CTA holds three warpgroups: two compute warpgroups own
`block_q` query rows each of one query head (a 2 * block_q row tile of one
segment), and a memory warpgroup streams the segment's K/V blocks into a ring
of `num_stages` shared-memory slots with TMA, one copy per page chunk, reading
the page table on the device. The compute warpgroups take turns on the tensor
cores (a schedule barrier) so one's softmax overlaps the other's matmuls.

Scope: flat (non-ring) layers without sliding window or soft-cap, bf16/f16,
head_dim a multiple of 64, page sizes a multiple of 16 that divide or are
divided by `block_kv` (16, 64 and 256 were checked on the H200). Everything else runs on the Triton kernel
(varlen_attention.py), which `varlen_attention` picks by itself.

Output rows are written per tile into a padded buffer and gathered back to
the packed query layout afterwards, so a tile's rows past its segment never
touch another segment's output. Pool rows past kv_end can hold anything: the
block that crosses kv_end has those V rows zeroed in shared memory before
P @ V, and their logits are masked.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from glint.pallas_kernels import segments
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_LOG2E = math.log2(math.e)
_COMPUTE_WGS = 2
_ALIGN = 8  # TMA row offsets into the tiled query / K / V views are multiples of this


def block_kv_for(head_dim: int, block_kv: int) -> int:
    """Keys per block: head_dim 256 halves it so Q and two K/V stages fit in shared memory."""
    return block_kv if head_dim <= 128 else min(block_kv, 64)


def supports(*, dtype, head_dim: int, page_size: int, block_kv: int, ring_rows, window: int, softcap: float) -> bool:
    """Whether the Mosaic kernel covers this call (else the Triton kernel does)."""
    block_kv = block_kv_for(head_dim, block_kv)
    return (
        jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and head_dim % 64 == 0
        and head_dim <= 256
        and page_size % 16 == 0
        and (block_kv % page_size == 0 or page_size % block_kv == 0)
        and ring_rows is None
        and window == 0
        and softcap == 0
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


def copy_kv_block(page_table_ref, seq_slot, block, pools, kv_head, bufs, slot, barriers, *, page_size: int):
    """Starts the TMA copies of key block `block` of sequence `seq_slot` (its rows of kv head `kv_head` in the flat
    pools (k, v)) into slot `slot` of the shared-memory buffers (k, v), one copy per page chunk, K first (needed
    first), each arriving at its buffer's barrier for the slot. A block past the table's last page reads that page."""
    block_kv = bufs[0].shape[1]
    chunk = min(page_size, block_kv)
    last_page = page_table_ref.shape[1] - 1
    rows = []
    for i in range(block_kv // chunk):
        key = block * block_kv + i * chunk
        page = page_table_ref[seq_slot, jnp.minimum(lax.div(key, jnp.int32(page_size)), last_page)]
        rows.append(pl.ds(pl.multiple_of(page * page_size + lax.rem(key, jnp.int32(page_size)), _ALIGN), chunk))
    for ref, buf, barrier in zip(pools, bufs, barriers):
        for i, src in enumerate(rows):
            plgpu.copy_gmem_to_smem(ref.at[src, kv_head], buf.at[slot, pl.ds(i * chunk, chunk)], barrier.at[slot])


def _kernel(
    tiles_ref,
    seq_info_ref,
    page_table_ref,
    q_ref,  # [T, Hq, D]
    k_ref,  # [num_pages * page_size, Hkv, D]
    v_ref,
    out_ref,  # [num_tiles * 2 * block_q, Hq, D]
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
):
    smem, kv_barriers, consumed_barriers, schedule_barrier = scoped
    qo_smem2, k_smem, v_smem = smem
    k_barriers, v_barriers, q_barriers = kv_barriers
    k_consumed, v_consumed = consumed_barriers
    head = lax.axis_index("heads")
    tile = num_tiles - 1 - lax.axis_index("tiles")  # longest tiles (segment ends) first
    wg = lax.axis_index("wg")
    kv_head = lax.div(head, jnp.int32(group))
    head_dim = q_ref.shape[-1]
    dtype = q_ref.dtype
    tile_rows = _COMPUTE_WGS * block_q

    segment = tiles_ref[tile, 0]
    seg = jnp.maximum(segment, 0)
    q_tile = tiles_ref[tile, 1]
    q_start = seq_info_ref[seg, 0]
    q_len = jnp.where(segment >= 0, seq_info_ref[seg, 1], 0)
    seq_slot = seq_info_ref[seg, 2]
    kv_end = seq_info_ref[seg, 3]
    first = q_tile * tile_rows - lax.rem(q_start, jnp.int32(_ALIGN))  # tile's first row, within the segment
    offset = kv_end - q_len  # position of the segment's query row 0

    def kv_blocks(rows_begin, rows_end):
        """Blocks that rows [rows_begin, rows_end) of the segment see (0 if no rows)."""
        rows_end = jnp.minimum(rows_end, q_len)
        hi = jnp.minimum(offset + rows_end, kv_end) if causal else kv_end
        return jnp.where(rows_end > jnp.maximum(rows_begin, 0), lax.div(jnp.maximum(hi, 0) + block_kv - 1, block_kv), 0)

    tile_steps = kv_blocks(first, first + tile_rows)

    def schedule_barrier_sync():
        plgpu.barrier_arrive(schedule_barrier)
        plgpu.barrier_wait(schedule_barrier)

    # Padding tiles (segment -1) do nothing: their rows of out_pad are never gathered.
    @pl.when((wg < _COMPUTE_WGS) & (segment >= 0))
    def _compute_wg():
        plgpu.set_max_registers(232, action="increase")
        qo_smem = qo_smem2.at[wg]
        row0 = first + wg * block_q
        kv_steps = kv_blocks(row0, row0 + block_q)
        # Blocks every row of this warpgroup sees whole: no mask needed.
        full_end = jnp.minimum(offset + row0 + 1, kv_end) if causal else kv_end
        full_steps = jnp.clip(lax.div(jnp.maximum(full_end, 0), jnp.int32(block_kv)), 0, kv_steps)

        q_rows = pl.ds(pl.multiple_of(q_start + row0, _ALIGN), block_q)
        plgpu.copy_gmem_to_smem(q_ref.at[q_rows, head], qo_smem, q_barriers.at[wg])
        plgpu.barrier_wait(q_barriers.at[wg])

        m_i = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l_i = plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.full((block_q, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

        @pl.when(kv_steps > 0)
        def _():
            plgpu.barrier_wait(k_barriers.at[0])

        pl.when(wg == 1)(schedule_barrier_sync)
        c = scale * _LOG2E

        def kv_loop(step, carry, *, masked: bool):
            acc, m_i, l_i = carry
            slot = lax.rem(step, jnp.int32(num_stages))

            def compute_qk(acc_ref):
                plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                schedule_barrier_sync()
                return acc_ref[...]

            qk = pl.run_scoped(compute_qk, plgpu.ACC((block_q, block_kv), jnp.float32))
            plgpu.barrier_arrive(k_consumed.at[slot])
            if masked:
                rows = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 0, layout=plgpu.Layout.WGMMA)
                keys = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 1, layout=plgpu.Layout.WGMMA)
                keys = keys + step * block_kv
                visible = keys < kv_end
                if causal:
                    visible = visible & (keys <= rows + (offset + row0))
                qk = jnp.where(visible, qk, -jnp.inf)
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
                # V rows past kv_end come from whatever the pool holds there (NaN * 0 is NaN): zero them.
                @pl.when((step + 1) * block_kv > kv_end)
                def _():
                    v_tile = v_smem.at[slot]
                    vrows = plgpu.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0, layout=plgpu.Layout.WGMMA)
                    v_tile[...] = jnp.where(vrows + step * block_kv < kv_end, v_tile[...], 0).astype(dtype)
                    plgpu.commit_smem()

            def compute_pv(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                nxt = step + 1

                @pl.when(nxt < kv_steps)
                def _():
                    plgpu.barrier_wait(k_barriers.at[lax.rem(nxt, jnp.int32(num_stages))])

            acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_consumed.at[slot])
            return acc, m_ij, l_i

        def drain(step, _):
            # Blocks the other warpgroup still needs: release them in step with it.
            slot = lax.rem(step, jnp.int32(num_stages))
            plgpu.barrier_arrive(k_consumed.at[slot])
            plgpu.barrier_arrive(v_consumed.at[slot])
            schedule_barrier_sync()
            schedule_barrier_sync()

        carry = (acc, m_i, l_i)
        carry = lax.fori_loop(0, full_steps, functools.partial(kv_loop, masked=False), carry)
        acc, m_i, l_i = lax.fori_loop(full_steps, kv_steps, functools.partial(kv_loop, masked=True), carry)
        lax.fori_loop(kv_steps, tile_steps, drain, None)
        pl.when(wg == 0)(schedule_barrier_sync)

        acc /= lax.broadcast_in_dim(jnp.where(l_i > 0, l_i, 1.0), (block_q, head_dim), [0])
        qo_smem[...] = acc.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[pl.ds(tile * tile_rows + wg * block_q, block_q), head])
        plgpu.wait_smem_to_gmem(0)

    @pl.when((wg == _COMPUTE_WGS) & (segment >= 0))
    def _memory_wg():
        plgpu.set_max_registers(40, action="decrease")

        def load(step, slot):
            copy_kv_block(page_table_ref, seq_slot, step, (k_ref, v_ref), kv_head, (k_smem, v_smem), slot,
                          (k_barriers, v_barriers), page_size=page_size)

        @pl.loop(0, jnp.minimum(tile_steps, num_stages))
        def _prologue(step):
            load(step, step)

        @pl.loop(num_stages, jnp.maximum(tile_steps, num_stages))
        def _steady(step):
            slot = lax.rem(step, jnp.int32(num_stages))
            plgpu.barrier_wait(k_consumed.at[slot])
            plgpu.barrier_wait(v_consumed.at[slot])
            load(step, slot)


@functools.partial(
    jax.jit, static_argnames=("causal", "scale", "block_q", "block_kv", "num_stages")
)
def varlen_attention_mgpu(
    q, k_pages, v_pages, page_table, seq_info, *, causal=True, scale, block_q=64, block_kv=128, num_stages=2
):
    """Same contract as `varlen_attention` (no ring, window or soft-cap); see supports().

    A tile is 2 * block_q query rows of one segment and one query head; block_kv keys per pipeline
    step (halved for head_dim 256); num_stages K/V shared-memory slots."""
    if num_stages < 2:
        # The memory warpgroup refills a slot only after both its K and V were consumed.
        raise ValueError(f"varlen_attention_mgpu: num_stages={num_stages} must be >= 2")
    num_rows, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    block_kv = block_kv_for(head_dim, block_kv)
    tile_rows = _COMPUTE_WGS * block_q
    num_segments = seq_info.shape[0]
    num_tiles = max_tiles(num_rows, num_segments, tile_rows)
    tiles, first_tile = _tiles(seq_info, tile_rows, num_tiles)
    flat = (num_pages * page_size, num_kv_heads, head_dim)
    dtype = q.dtype

    def entry(tiles_ref, seq_info_ref, page_table_ref, q_ref, k_ref, v_ref, out_ref):
        transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        smem = (
            plgpu.SMEM((_COMPUTE_WGS, block_q, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((num_stages, block_kv, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((num_stages, block_kv, head_dim), dtype, transforms=transforms),
        )
        copies = block_kv // min(page_size, block_kv)
        pl.run_scoped(
            lambda *scoped: _kernel(
                tiles_ref, seq_info_ref, page_table_ref, q_ref, k_ref, v_ref, out_ref, scoped,
                block_q=block_q, block_kv=block_kv, num_stages=num_stages, page_size=page_size,
                group=num_q_heads // num_kv_heads, causal=causal, scale=scale, num_tiles=num_tiles,
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

    # The tiled TMA view of q needs a row count that is a multiple of _ALIGN.
    q = jnp.pad(q, ((0, -num_rows % _ALIGN), (0, 0), (0, 0)))
    out_pad = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((num_tiles * tile_rows, num_q_heads, head_dim), dtype),
        grid=(num_q_heads, num_tiles),
        grid_names=("heads", "tiles"),
        num_threads=_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(tiles, seq_info, page_table, q, k_pages.reshape(flat), v_pages.reshape(flat))
    return _gather_rows(out_pad, seq_info, first_tile, tile_rows, num_rows)
