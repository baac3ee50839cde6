"""What the Mosaic GPU attention kernels (varlen_attention_mgpu.py, decode_attention_mgpu.py) share about a
sequence's keys: which key blocks a tile of query rows walks and which of their keys it sees (flat layers in key
order, ring layers in storage order, windows), their logits, and the TMA copies of a block's pages."""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_LOG2E = math.log2(math.e)
ALIGN = 8  # TMA row offsets into the tiled query / K / V views are multiples of this


_PROFILE_RANGES = 512  # a warpgroup's profiled ranges under GLINT_MOSAIC_PROFILE


def compiler_params(**params) -> plgpu.CompilerParams:
    """The kernels' compiler parameters; with GLINT_MOSAIC_PROFILE=DIR set, each call also writes a trace of its
    warpgroups' named scopes into DIR (Mosaic GPU's profiler: room for _PROFILE_RANGES ranges a warpgroup, in shared
    memory, see profile_smem_bytes; a JSON file per call, see tools/mosaic_trace.py), at some cost in time."""
    if where := os.environ.get("GLINT_MOSAIC_PROFILE"):
        params.update(profile_space=_PROFILE_RANGES, profile_dir=where, profile_bounds_check=True)
    return plgpu.CompilerParams(**params)


def profile_smem_bytes(warpgroups: int) -> int:
    """The shared memory compiler_params' profiler takes in a CTA of `warpgroups` warpgroups (0 when off): two
    events a range, two 4-byte entries an event."""
    return warpgroups * _PROFILE_RANGES * 2 * 2 * 4 if os.environ.get("GLINT_MOSAIC_PROFILE") else 0


def block_chunks(page_table_ref, seq_slot, block, *, block_kv: int, page_size: int):
    """Where key block `block` of sequence `seq_slot` lies in the flat pools: for each of its page chunks, the
    chunk's page and its first row's offset in that page (a block past the table's last page reads that page). The
    page table reads are global loads: a memory warpgroup issues them before it waits for a slot."""
    chunk = min(page_size, block_kv)
    last_page = page_table_ref.shape[1] - 1
    chunks = []
    for i in range(block_kv // chunk):
        key = block * block_kv + i * chunk
        page = page_table_ref[seq_slot, jnp.minimum(lax.div(key, jnp.int32(page_size)), last_page)]
        chunks.append((page, pl.multiple_of(lax.rem(key, jnp.int32(page_size)), ALIGN)))
    return chunks


def copy_pool_block(chunks, pool, kv_head, buf, slot, barrier, *, page_size: int, scales=None, scale_buf=None):
    """Starts the TMA copies of one pool's block (`chunks` from block_chunks; its rows of kv head `kv_head` in the
    flat pool) into slot `slot` of `buf`, one copy per chunk, each arriving at `barrier` for the slot. A scaled fp8
    cache's scale pool, flat [num_pages * Hkv, page_size] (one row per page and head), goes into `scale_buf`
    [stages, block_kv] a copy per chunk, arriving at the same barrier."""
    chunk = buf.shape[1] // len(chunks)
    for i, (page, offset) in enumerate(chunks):
        src = pl.ds(pl.multiple_of(page * page_size + offset, ALIGN), chunk)
        plgpu.copy_gmem_to_smem(pool.at[src, kv_head], buf.at[slot, pl.ds(i * chunk, chunk)], barrier.at[slot])
    if scales is not None:  # pools [rows, Hkv, D]: a page's row of scales for kv_head is page * Hkv + kv_head
        for i, (page, offset) in enumerate(chunks):
            plgpu.copy_gmem_to_smem(scales.at[page * pool.shape[1] + kv_head, pl.ds(offset, chunk)],
                                    scale_buf.at[slot, pl.ds(i * chunk, chunk)], barrier.at[slot])


def for_each_item(item, cta, num_ctas: int, num_items: int, fn):
    """A CTA's work items cta, cta + num_ctas, ... below num_items (`item(index)`: an object with has_rows, begin
    and end, its key blocks), in order: fn(it, blocks, items) for each with rows, `blocks` the key blocks and `items`
    the items with rows before it, which every warpgroup counts its K/V and query slots by. Returns both counts over
    all of them."""
    def step(i, counts):
        blocks, items = counts
        it = item(cta + i * num_ctas)
        pl.when(it.has_rows)(lambda: fn(it, blocks, items))
        return blocks + jnp.where(it.has_rows, it.end - it.begin, 0), items + it.has_rows.astype(jnp.int32)

    mine = lax.div(num_items - 1 - cta, jnp.int32(num_ctas)) + 1
    return lax.fori_loop(0, mine, step, (jnp.int32(0), jnp.int32(0)))


def stream_blocks(begin, end, streamed, num_stages: int, locate, stages):
    """A memory warpgroup's loop over one work item's key blocks [begin, end), the CTA's `streamed` blocks before
    them, through a ring of `num_stages` slots. For each block, locate(block) first (its page table reads: global
    loads whose latency then passes while the slot is still in use); then for each (consumed, copy) of `stages`, in
    order, it waits for every barrier in `consumed` to say the slot's last block was read there and starts
    copy(where, slot), `where` being what locate returned."""
    @pl.loop(begin, end)
    def _(block):
        step = streamed + block - begin
        slot = lax.rem(step, jnp.int32(num_stages))
        with jax.named_scope("locate"):
            where = locate(block)
        for consumed, copy in stages:
            with jax.named_scope("slot_wait"):
                pl.when(step >= num_stages)(functools.partial(_wait_all, consumed, slot))
            with jax.named_scope("copy"):
                copy(where, slot)


def _wait_all(barriers, slot):
    for barrier in barriers:
        plgpu.barrier_wait(barrier.at[slot])


def drain_slots(streamed, num_stages: int, consumed):
    """After the CTA's last item: observes the releases of the last (up to num_stages) of its `streamed` blocks too,
    so every barrier in `consumed` ends each phase it began."""
    @pl.loop(jnp.maximum(streamed - num_stages, 0), streamed)
    def _(step):
        for barrier in consumed:
            plgpu.barrier_wait(barrier.at[lax.rem(step, jnp.int32(num_stages))])


def covers_ring(ring_rows, window: int) -> bool:
    """Whether a layer's ring (if any) suits the kernels: each ring row stands for one key, so a query row must see
    at most ring_rows keys, a window that fits the ring (the engine's rings hold a step's writes beside the window:
    ring_rows >= window + q_len - 1, which the kernels cannot check)."""
    return ring_rows is None or 0 < window <= ring_rows


def seen_keys(offset, row_lo, row_hi, kv_end, *, window: int, causal: bool, group: int = 1):
    """Keys that a segment's rows [row_lo, row_hi) see (rows packed `group` to a position; row 0 at position
    `offset`): [lo, hi) in all, empty (hi <= lo) without rows, and [lo_full, hi_full) by every row."""
    def pos(row):
        return offset + lax.div(row, jnp.int32(group))

    lo = jnp.maximum(pos(row_lo) - window + 1, 0) if window else jnp.int32(0)
    hi = jnp.minimum(pos(row_hi - 1) + 1, kv_end) if causal else kv_end
    lo_full = jnp.maximum(pos(row_hi - 1) - window + 1, 0) if window else jnp.int32(0)
    hi_full = jnp.minimum(pos(row_lo) + 1, kv_end) if causal else kv_end
    return lo, jnp.where(row_hi > row_lo, hi, lo), lo_full, hi_full


@dataclasses.dataclass(frozen=True)
class KeyWalk:
    """How a tile's key blocks of `block_kv` pool rows walk a sequence's keys below kv_end, `lo` the first any row
    of the tile sees. A flat layer's block b holds keys [b * block_kv, ...) in order. A ring layer's storage rows
    [0, ring_rows) are split into blocks the same way; row r holds the latest key below kv_end that is r mod
    ring_rows (wrapped keys being those of rows past kv_end's own). A ring's walk counts its blocks on past the
    last one, block b standing for storage block b mod (blocks in the ring), so that it can start at the block
    holding its first key and wrap (`storage`)."""

    kv_end: jax.Array
    lo: jax.Array
    block_kv: int
    ring_rows: int | None

    @property
    def rows_end(self):
        return self.kv_end if self.ring_rows is None else jnp.minimum(self.kv_end, self.ring_rows)

    @property
    def ring_blocks(self) -> int:
        return -(-self.ring_rows // self.block_kv)

    def storage(self, block):
        """The storage block that walk block `block` copies."""
        return block if self.ring_rows is None else lax.rem(block, jnp.int32(self.ring_blocks))

    def blocks(self, lo, hi):
        """[begin, end): the walk's blocks that hold keys [lo, hi) (none if hi <= lo). A ring's start at the
        block holding lo's row and wrap past its last block, every block at most once (hi - lo <= ring_rows: a
        ring's tile sees at most a window and its rows)."""
        bk = jnp.int32(self.block_kv)
        if self.ring_rows is None:
            begin, end = lax.div(lo, bk), lax.div(hi + self.block_kv - 1, bk)
        else:
            ring = jnp.int32(self.ring_rows)
            first_row, last_row = lax.rem(lo, ring), lax.rem(jnp.maximum(hi - 1, lo), ring)
            begin, last = lax.div(first_row, bk), lax.div(last_row, bk)
            wraps = first_row + (hi - lo) > self.ring_rows
            count = jnp.where(wraps, self.ring_blocks - begin + last + 1, last - begin + 1)
            end = begin + jnp.minimum(count, self.ring_blocks)
        return begin, jnp.where(hi > lo, end, begin)

    def full_blocks(self, lo_full, hi_full, begin, end):
        """[full_begin, full_end) within [begin, end): blocks of keys in [lo_full, hi_full) only, which rows that
        all see those keys need not mask (a ring's blocks are always masked)."""
        if self.ring_rows is not None:
            return begin, begin
        full_begin = jnp.clip(lax.div(lo_full + self.block_kv - 1, jnp.int32(self.block_kv)), begin, end)
        full_end = jnp.clip(lax.div(jnp.maximum(hi_full, 0), jnp.int32(self.block_kv)), full_begin, end)
        return full_begin, full_end

    def keys(self, block, shape, dim: int):
        """The key each row of walk block `block` holds, as an iota along `dim` of `shape` (WGMMA layout), and
        whether that row holds a key below kv_end (its storage row below rows_end)."""
        rows = (plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)
                + self.storage(block) * self.block_kv)
        if self.ring_rows is None:
            return rows, rows < self.kv_end
        ring = jnp.int32(self.ring_rows)
        last_lap, last_row = lax.div(self.kv_end - 1, ring), lax.rem(self.kv_end - 1, ring)
        return rows + (last_lap - jnp.where(rows > last_row, 1, 0)) * ring, rows < self.rows_end

    def visible(self, block, row_pos, shape, *, window: int, causal: bool):
        """bool[shape]: whether the query at position `row_pos` (along rows; broadcast to `shape`) sees the key each
        column of walk block `block` holds."""
        keys, visible = self.keys(block, shape, 1)
        if causal:
            visible = visible & (keys <= row_pos)
        if window:
            visible = visible & (keys > row_pos - window)
        return visible

    def holds_unseen(self, block):
        """Whether walk block `block` holds a row of a key before lo or a row past rows_end."""
        start = self.storage(block) * self.block_kv
        stop = start + self.block_kv
        if self.ring_rows is None:
            return (start < self.lo) | (stop > self.rows_end)
        # The ring's keys before lo, [oldest, lo), sit in rows [stale_start, stale_end) mod ring_rows.
        ring = jnp.int32(self.ring_rows)
        oldest = self.kv_end - self.rows_end
        stale_start = lax.rem(oldest, ring)
        stale_end = stale_start + jnp.maximum(self.lo - oldest, 0)
        return ((stop > self.rows_end) | (start < stale_end - ring)
                | ((stale_end > stale_start) & (start < jnp.minimum(stale_end, ring)) & (stale_start < stop)))

    def seen_rows(self, block, shape):
        """bool[shape] (WGMMA layout, along rows): whether each row of walk block `block` holds a key some row of the
        tile sees. The others may hold anything (NaN * 0 is NaN); keys past a row's own are some later row's: they
        hold real values."""
        keys, stored = self.keys(block, shape, 0)
        return stored & (keys >= self.lo)

    def zero_unseen(self, v_tile, block, dtype):
        """Zeroes the V rows of walk block `block` (in shared memory) that `seen_rows` leaves out."""
        @pl.when(self.holds_unseen(block))
        def _():
            v_tile[...] = jnp.where(self.seen_rows(block, v_tile.shape), v_tile[...], 0).astype(dtype)
            plgpu.commit_smem()


def log2_logits(qk, *, scale: float, softcap: float):
    """(x, c): the logits in log2 units are x * c, from q . k. Soft-capped (softcap * tanh(q . k * scale /
    softcap)) they are x itself (c = 1); otherwise c = scale * log2(e), left for the exp2's multiply-add."""
    if softcap:
        return (softcap * _LOG2E) * jnp.tanh(qk * (scale / softcap)), 1.0
    return qk, scale * _LOG2E
