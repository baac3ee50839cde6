"""Segment bookkeeping shared by the attention kernels' wrappers (plain jnp, run before and after a kernel).

seq_info is i32[S, 4] = (q_start, q_len, seq_slot, kv_end); segments do not overlap and q_len <= 0 marks
padding. Both kernels cut each segment into query tiles and need to know which rows a segment covers.
"""

from __future__ import annotations

import jax.numpy as jnp


def tile_map(tiles_per_segment, num_tiles: int):
    """(i32[num_tiles, 2], i32[S]): (segment or -1, tile within it) for every tile of every segment, in
    segment order, with -1 segments padding the static count; and each segment's first tile."""
    num_segments = tiles_per_segment.shape[0]
    ends = jnp.cumsum(tiles_per_segment)
    b = jnp.arange(num_tiles, dtype=jnp.int32)
    # compare_all: one fusion; the default binary search is a loop the GPU runs op by op, launched from the host
    segment = jnp.searchsorted(ends, b, side="right", method="compare_all").astype(jnp.int32)
    valid = segment < num_segments
    seg = jnp.minimum(segment, num_segments - 1)
    local = b - (ends[seg] - tiles_per_segment[seg])
    tiles = jnp.stack([jnp.where(valid, segment, -1), jnp.where(valid, local, 0)], 1)
    return tiles, (ends - tiles_per_segment).astype(jnp.int32)


def row_segments(seq_info, num_rows: int):
    """i32[num_rows]: 1 + the segment that covers each query row, 0 where none does."""
    q_start, q_len = seq_info[:, 0], seq_info[:, 1]
    # A running sum of +(s+1) / -(s+1) at each segment's edges names each row's segment.
    mark = jnp.where(q_len > 0, jnp.arange(1, seq_info.shape[0] + 1, dtype=jnp.int32), 0)
    edges = jnp.zeros((num_rows + 1,), jnp.int32)
    edges = edges.at[jnp.clip(q_start, 0, num_rows)].add(mark)
    edges = edges.at[jnp.clip(q_start + q_len, 0, num_rows)].add(-mark)
    return jnp.cumsum(edges)[:num_rows]
