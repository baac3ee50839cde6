"""Attention cases and checks shared by the Mosaic GPU kernels' interpreted tests (test_kernels_mosaic*.py):
decode rows, speculative chunks and prefill chunks over flat and ring layers, windows and soft-caps."""

import jax.numpy as jnp
import numpy as np
from glint.pallas_kernels.reference import varlen_attention_reference
from glint.pallas_kernels.testing import AttentionCase as C
from glint.pallas_kernels.testing import as_fp8, make_attention_inputs

TOL = {"bfloat16": 2e-2, "float16": 1e-2}
DECODE = tuple((1, n) for n in (1, 17, 300, 1024, 513, 64))
CASES = {
    # decode rows of every context length class, gaps and padding segments between them
    "decode-g4-d128": C(DECODE, group=4, head_dim=128, dtype="bfloat16", num_kv_heads=2, gaps=3,
                        num_padding_segments=2),
    # speculative-sized chunks and a prefill chunk that takes several 64-row tiles, among decode rows
    "mixed-g4": C(((1, 900), (5, 5), (0, 0), (7, 260), (16, 80), (40, 400)), group=4, head_dim=128,
                  dtype="bfloat16", num_kv_heads=2, gaps=9, num_padding_segments=1),
    # a group that does not divide 64: one query row's heads span two tiles
    "g6-d64": C(((1, 300), (11, 40), (3, 3)), group=6, head_dim=64, dtype="bfloat16", num_kv_heads=1, gaps=2),
    # non-causal, one segment over three tiles
    "noncausal-f16": C(((40, 100), (1, 50), (3, 70)), group=4, head_dim=64, dtype="float16", causal=False),
    "g8-p32-d64": C(DECODE, group=8, page_size=32, head_dim=64, dtype="bfloat16", num_kv_heads=1),
    # pages wider than a key block: a block starts inside a page
    "g4-p256": C(((1, 600), (2, 300)), group=4, page_size=256, head_dim=64, dtype="bfloat16", num_kv_heads=1),
    # batch-1 decode: 4 packed query rows, the tile's TMA read runs past them (filled with zeros)
    "one-row": C(((1, 77),), group=4, head_dim=64, dtype="bfloat16", num_kv_heads=2),
    # a sliding window on a flat layer, starting inside a key block; the rows before it are poisoned
    "window-flat-g4": C(((1, 300), (5, 120), (16, 80), (1, 40)), group=4, head_dim=64, dtype="bfloat16", window=70,
                        gaps=2),
    # ring layers: decode rows whose window wraps a ring of 3.5 pages, and one that has not filled it
    "ring-decode-wraps": C(DECODE[:3] + ((1, 203), (1, 130)), group=4, head_dim=64, dtype="bfloat16", ring_rows=56,
                           window=50),
    # ring chunks (each within ring_rows - window + 1 rows) with a soft-cap, head_dim 128
    "ring-chunks-softcap": C(((1, 150), (9, 97), (4, 64), (6, 200), (3, 20)), group=4, head_dim=128,
                             dtype="bfloat16", ring_rows=72, window=60, softcap=2.0, gaps=3),
    # a ring chunk over two 64-row tiles, in a ring just wide enough, and a sequence that has just filled it
    "ring-chunk-tiles": C(((20, 300), (1, 59), (2, 133)), group=4, head_dim=64, dtype="bfloat16", num_kv_heads=1,
                          ring_rows=59, window=40),
    # a window wider than two key blocks: masked, whole and masked blocks in one tile; the 4-row chunk's first
    # and last rows see from either side of a key-block boundary (382, 385)
    "window-long-flat": C(((1, 700), (4, 685), (1, 200)), group=4, head_dim=64, dtype="bfloat16", window=300),
    # a ring wider than a key block, group 8, pages of 32; at kv_end 595 the rows older than the window wrap from
    # the last block (195-199) into the first (0-4)
    "ring-g8-p32": C(((1, 1000), (1, 150), (2, 450), (1, 595)), group=8, page_size=32, head_dim=64,
                     dtype="bfloat16", num_kv_heads=1, ring_rows=200, window=190),
    # a ring much wider than its window: a tile walks only the blocks holding its keys, from mid-ring, wrapping
    # past the last (partial) block to the first; and one sequence that has not filled the ring
    "ring-wide-wraps": C(((1, 990), (1, 1020), (4, 2003), (20, 1513), (1, 40)), group=4, head_dim=64,
                         dtype="bfloat16", num_kv_heads=1, ring_rows=500, window=60, gaps=2),
    # more query rows than keys: the first tile's rows sit before key 0 and see nothing (zero rows out)
    "underflow-tiles": C(((40, 10), (1, 30)), group=4, head_dim=64, dtype="bfloat16", num_kv_heads=1, window=8),
    # non-causal with a window and a soft-cap, f16
    "window-noncausal-softcap-f16": C(((20, 90), (1, 65), (16, 120)), group=2, head_dim=64, dtype="float16",
                                      window=24, causal=False, softcap=1.5),
}


def layer_args(case):
    """The case's layer arguments, for the kernel and the reference alike."""
    return {k: getattr(case, k) for k in ("ring_rows", "window", "causal", "softcap")}


def device_inputs(case, seed=0, shift=0):
    """The case's inputs as device arrays; `shift` more query rows (NaN, of no segment) go before the first."""
    inputs = make_attention_inputs(case, np.random.default_rng(seed))
    inputs["q"] = np.concatenate([np.full((shift, *inputs["q"].shape[1:]), np.nan, np.float32), inputs["q"]])
    inputs["seq_info"][:, 0] += shift
    return {k: jnp.asarray(v, case.dtype) if v.dtype == np.float32 else jnp.asarray(v) for k, v in inputs.items()}


def check_rows(got, want, seq_info, dtype):
    """`got` within TOL of `want`, finite, and zero in rows of no segment."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    covered = np.zeros(got.shape[0], bool)
    for q_start, q_len, _, _ in np.asarray(seq_info):
        covered[q_start:q_start + q_len] = True
    assert np.isfinite(got).all()
    assert not got[~covered].any()  # rows of no segment are zero
    tol = TOL[dtype]
    np.testing.assert_array_less(np.abs(got - want), tol + tol * np.abs(want))


def check_kernel(case, kernel, *, seed=0, shift=0, fp8=None):
    """`kernel(**inputs, scale=..., **layer_args(case))` on the case's device inputs against the reference on the
    same inputs (check_rows); returns the inputs. fp8: "scaled" or "plain" pools (as_fp8)."""
    args = device_inputs(case, seed=seed, shift=shift)
    if fp8:
        args = as_fp8(args, scaled=fp8 == "scaled")
    layer = layer_args(case)
    want = varlen_attention_reference(**args, scale=case.scale, **layer)
    check_rows(kernel(**args, scale=case.scale, **layer), want, args["seq_info"], case.dtype)
    return args
