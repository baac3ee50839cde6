"""Random paged-attention cases and an obviously-correct NumPy loop, shared by
the CPU tests and tools/gpu_kernels.py. NumPy only at import (as_fp8 imports jax when called)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """Shape of one random case. `segments` lists (q_len, kv_end) in q order;
    `gaps` rows no segment covers are spread between them."""

    segments: tuple[tuple[int, int], ...]
    page_size: int = 16
    num_kv_heads: int = 2
    group: int = 1
    head_dim: int = 64
    dtype: str = "float32"
    ring_rows: int | None = None
    window: int = 0
    causal: bool = True
    softcap: float = 0.0
    gaps: int = 0
    num_padding_segments: int = 0
    poison: bool = True

    @property
    def scale(self) -> float:
        return float(self.head_dim) ** -0.5


def visible_keys(pos: int, kv_end: int, *, window: int, causal: bool) -> range:
    """Keys a query at position `pos` sees."""
    lo = max(0, pos - window + 1) if window > 0 else 0
    hi = min(kv_end, pos + 1) if causal else kv_end
    return range(lo, max(lo, hi))


def make_attention_inputs(case: AttentionCase, rng: np.random.Generator):
    """Returns dict(q, k_pages, v_pages, page_table, seq_info) as NumPy arrays
    (float32 data; cast to case.dtype at the call site). Pool rows that hold no
    visible key, and query rows that no segment covers, are NaN when
    case.poison, so a kernel that reads them shows it. Page-table entries no
    sequence owns name random pages, other sequences' too (the engine's device
    tables keep stale entries there): a kernel must mask what they point at."""
    segs = list(case.segments)
    num_segments = len(segs) + case.num_padding_segments
    ps = case.page_size
    num_kv_heads, head_dim = case.num_kv_heads, case.head_dim
    num_q_heads = num_kv_heads * case.group

    # Row layout: segments in order, uncovered gap rows scattered between them.
    gap_after = np.bincount(rng.integers(0, len(segs) + 1, case.gaps), minlength=len(segs) + 1)
    starts, row = [], int(gap_after[0])
    for s, (q_len, _) in enumerate(segs):
        starts.append(row)
        row += q_len + int(gap_after[s + 1])
    num_rows = max(row, 1)

    phys_rows = [case.ring_rows if case.ring_rows else kv_end for _, kv_end in segs]
    pages_per_seq = [-(-max(r, 1) // ps) for r in phys_rows]
    max_pages = max(pages_per_seq) + 1  # one unused column at least
    num_pages = 1 + sum(pages_per_seq) + 3  # scratch page 0, a few unowned pages
    owned = rng.permutation(np.arange(1, num_pages))
    num_table_rows = num_segments + 2
    slots = rng.permutation(num_table_rows)[:num_segments]
    page_table = np.zeros((num_table_rows, max_pages), np.int32)
    seq_info = np.zeros((num_segments, 4), np.int32)
    used = 0
    for s, (q_len, kv_end) in enumerate(segs):
        n = pages_per_seq[s]
        page_table[slots[s], :n] = owned[used : used + n]
        used += n
        seq_info[s] = (starts[s], q_len, slots[s], kv_end)
    for s in range(len(segs), num_segments):
        # Padding segments: q_len 0, anything else arbitrary.
        seq_info[s] = (rng.integers(0, num_rows), 0, slots[s], rng.integers(0, 50))
    owned_entry = np.zeros(page_table.shape, bool)
    for s in range(len(segs)):
        owned_entry[slots[s], :pages_per_seq[s]] = True
    page_table[~owned_entry] = rng.integers(0, num_pages, int((~owned_entry).sum()))
    order = rng.permutation(num_segments)  # segment order is free
    seq_info = seq_info[order]

    q = rng.standard_normal((num_rows, num_q_heads, head_dim)).astype(np.float32)
    shape = (num_pages, ps, num_kv_heads, head_dim)
    k_pages = rng.standard_normal(shape).astype(np.float32)
    v_pages = rng.standard_normal(shape).astype(np.float32)
    if case.poison:
        keep = np.zeros((num_pages, ps), bool)
        covered = np.zeros(num_rows, bool)
        for q_start, q_len, slot, kv_end in seq_info:
            covered[q_start : q_start + q_len] = True
            mod = case.ring_rows or max_pages * ps
            for i in range(q_len):
                for j in visible_keys(kv_end - q_len + i, kv_end, window=case.window, causal=case.causal):
                    r = j % mod
                    keep[page_table[slot, r // ps], r % ps] = True
        k_pages[~keep] = np.nan
        v_pages[~keep] = np.nan
        q[~covered] = np.nan
    return dict(q=q, k_pages=k_pages, v_pages=v_pages, page_table=page_table, seq_info=seq_info)


def attention_numpy_loop(
    q, k_pages, v_pages, page_table, seq_info, *, ring_rows=None, window=0, causal=True, softcap=0.0, scale
):
    """The spec, one query row and one head at a time, in float64."""
    num_rows, num_q_heads, head_dim = q.shape
    _, ps, num_kv_heads, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    mod = ring_rows or page_table.shape[1] * ps
    out = np.zeros((num_rows, num_q_heads, head_dim), np.float64)
    for q_start, q_len, slot, kv_end in np.asarray(seq_info):
        for i in range(q_len):
            keys = visible_keys(kv_end - q_len + i, kv_end, window=window, causal=causal)
            if not keys:
                continue
            rows = [j % mod for j in keys]
            pages = [page_table[slot, r // ps] for r in rows]
            for h in range(num_q_heads):
                k = np.stack([k_pages[p, r % ps, h // group] for p, r in zip(pages, rows)])
                v = np.stack([v_pages[p, r % ps, h // group] for p, r in zip(pages, rows)])
                s = k.astype(np.float64) @ q[q_start + i, h].astype(np.float64) * scale
                if softcap > 0:
                    s = softcap * np.tanh(s / softcap)
                w = np.exp(s - s.max())
                out[q_start + i, h] = (w / w.sum()) @ v.astype(np.float64)
    return out


def as_fp8(args, *, scaled: bool):
    """Attention inputs as device arrays (varlen_attention's keywords) with their pools as an fp8 cache: scaled
    (reference.quantize_rows, a float32 scale per row and head in scale pools; poisoned rows keep a NaN scale, so
    a kernel that used one would show it) or plain e4m3 casts (clipped to +-448). Imports jax when called."""
    import jax.numpy as jnp
    from glint.pallas_kernels.reference import quantize_rows, scale_pool, to_pool_dtype

    k, v = args["k_pages"], args["v_pages"]
    if not scaled:
        return dict(args, k_pages=to_pool_dtype(k, jnp.float8_e4m3fn), v_pages=to_pool_dtype(v, jnp.float8_e4m3fn))
    out = dict(args)
    for name, pages in (("k", k), ("v", v)):
        rows, rows_scale = quantize_rows(pages.reshape(-1, *pages.shape[2:]))
        rows_scale = jnp.where(jnp.isnan(pages.reshape(rows.shape).astype(jnp.float32)).any(-1), jnp.nan, rows_scale)
        out[f"{name}_pages"] = rows.reshape(pages.shape)
        out[f"{name}_scale"] = scale_pool(rows_scale.reshape(pages.shape[:3]))
    return out
