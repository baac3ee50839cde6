"""Both Mosaic GPU attention kernels on random steps against the reference (hypothesis): decode-heavy steps on
decode_attention_mgpu, prefill steps on varlen_attention_mgpu. Interpreted on a CPU machine (GLINT_FUZZ_EXAMPLES
sets how many of each; 10 and 6 in the suite); compiled under `make test-gpu` where hypothesis is installed."""

import functools
import os

from conftest import INTERPRET
from glint.pallas_kernels import decode_attention_mgpu as dm
from glint.pallas_kernels import varlen_attention_mgpu as mg
from glint.pallas_kernels.testing import AttentionCase as C
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mosaic_cases import check_kernel


def _layer_and_lengths(draw, windows, max_rows: int, max_segments: int):
    """A layer's window (one of `windows`), a ring or not (ring_rows, or None) and its step's query rows per
    segment (1 to max_segments of 0 to max_rows)."""
    window = draw(st.sampled_from(windows))
    ring = window > 0 and draw(st.booleans())
    lengths = draw(st.lists(st.integers(0, max_rows), min_size=1, max_size=max_segments))
    # the engine's ring holds a step's writes beside the window (kvcache.config.group_ring_rows)
    ring_rows = window + max(*lengths, 1) - 1 + draw(st.integers(0, 40)) if ring else None
    return window, ring_rows, lengths


@st.composite
def _decode_steps(draw):
    """A random decode-heavy step: segments of 0-12 query rows (some with fewer keys than rows), any group,
    flat or ring layers, with or without window, soft-cap and causality, pools of q's dtype or fp8 (plain, or a
    scaled cache in pages of 32), and the kernel's split and tile."""
    fp8 = draw(st.sampled_from([None, None, "plain", "scaled"]))
    window, ring_rows, lengths = _layer_and_lengths(draw, [0, 0, 9, 40, 130], 12, 4)
    segs = tuple((q_len, draw(st.integers(max(q_len - 3, 0), 300))) for q_len in lengths)
    page_size = draw(st.sampled_from([32] if fp8 == "scaled" else [16, 32]))
    case = C(segs, group=draw(st.sampled_from([1, 2, 4, 6, 8])), page_size=page_size,
             num_kv_heads=draw(st.sampled_from([1, 2])), head_dim=64, dtype="bfloat16",
             ring_rows=ring_rows, window=window, causal=draw(st.booleans()),
             softcap=draw(st.sampled_from([0.0, 2.0])), gaps=draw(st.integers(0, 3)))
    tile = dict(num_splits=draw(st.sampled_from([1, 2, 3])), block_kv=draw(st.sampled_from([64, 128])),
                num_stages=draw(st.sampled_from([1, 2])))
    return case, tile, fp8, draw(st.integers(0, 2**16))


@settings(max_examples=int(os.environ.get("GLINT_FUZZ_EXAMPLES", "10")), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(_decode_steps())
def test_decode_kernel_on_random_steps(layout):
    """Random decode-heavy steps against the reference."""
    case, tile, fp8, seed = layout
    check_kernel(case, functools.partial(dm.decode_attention_mgpu, **tile, interpret=INTERPRET), seed=seed, fp8=fp8)


@st.composite
def _prefill_steps(draw):
    """A random prefill step: up to three segments of 0-300 query rows (some with fewer keys than rows), any
    group, flat or ring layers, with or without window, soft-cap and causality, and the kernel's tile."""
    window, ring_rows, lengths = _layer_and_lengths(draw, [0, 0, 30, 100, 200], 300, 3)
    segs = tuple((q_len, draw(st.integers(max(q_len - 40, 0), 600))) for q_len in lengths)
    case = C(segs, group=draw(st.sampled_from([1, 2, 3])), page_size=draw(st.sampled_from([16, 64])),
             head_dim=64, dtype="bfloat16", num_kv_heads=1, ring_rows=ring_rows, window=window,
             causal=draw(st.booleans()), softcap=draw(st.sampled_from([0.0, 2.0])), gaps=draw(st.integers(0, 9)))
    tile = dict(block_kv=draw(st.sampled_from([64, 128])), num_stages=draw(st.sampled_from([2, 3])))
    return case, tile, draw(st.integers(0, 2**16))


@settings(max_examples=int(os.environ.get("GLINT_FUZZ_EXAMPLES", "6")), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(_prefill_steps())
def test_prefill_kernel_on_random_steps(layout):
    """Random prefill steps against the reference."""
    case, tile, seed = layout
    check_kernel(case, functools.partial(mg.varlen_attention_mgpu, **tile, interpret=INTERPRET), seed=seed)
