"""varlen_attention (Pallas interpret mode) against the jnp reference, and the
reference against a plain NumPy loop of the spec."""

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import INTERPRET

from glint.pallas_kernels import (
    BlockSizes,
    default_num_splits,
    tuning,
    varlen_attention,
    varlen_attention_reference,
)
from glint.pallas_kernels.reference import scale_pool, scale_pool_shape
from glint.pallas_kernels.testing import (
    AttentionCase,
    attention_numpy_loop,
    make_attention_inputs,
)

TOLERANCE = {"float32": dict(atol=2e-5, rtol=2e-5), "bfloat16": dict(atol=3e-2, rtol=2e-2)}

DECODE = ((1, 37), (1, 5), (1, 80), (1, 1), (1, 64))
PREFILL = ((23, 23), (9, 9), (40, 40))
CHUNKED = ((17, 50), (8, 120))
MIXED = ((1, 40), (13, 13), (4, 60), (1, 9), (6, 100))
# kv_end < q_len: the first rows sit before position 0 and see no key at all.
UNDERFLOW = ((5, 3), (1, 20))

C = AttentionCase
CASES = {
    "decode-g4-p16-bf16": C(DECODE, group=4, dtype="bfloat16", num_padding_segments=2),
    "decode-g8-p8-f32-d128": C(DECODE, group=8, page_size=8, head_dim=128, num_kv_heads=1),
    "decode-g1-p32-softcap": C(DECODE, group=1, page_size=32, softcap=20.0, gaps=3),
    "prefill-g1-p16-f32": C(PREFILL, group=1, gaps=4),
    "prefill-g4-p8-bf16-d128": C(PREFILL, group=4, page_size=8, head_dim=128, dtype="bfloat16"),
    "prefill-noncausal-g4": C(PREFILL, group=4, causal=False, page_size=32),
    "chunked-g8-p32-bf16": C(CHUNKED, group=8, page_size=32, dtype="bfloat16", num_kv_heads=1),
    "mixed-g4-p16-gaps-padding": C(MIXED, group=4, gaps=5, num_padding_segments=3),
    "mixed-g1-p8-bf16-softcap": C(MIXED, group=1, page_size=8, dtype="bfloat16", softcap=10.0),
    "mixed-g6-nonpow2-group": C(MIXED, group=6, num_kv_heads=1, page_size=16),
    "mixed-d80-nonpow2-headdim": C(MIXED, group=2, head_dim=80),
    "underflow-fully-masked-rows": C(UNDERFLOW, group=4, gaps=2),
    "window-flat-g4": C(MIXED, group=4, window=16),
    # One tile spans 16 rows; (16, 65) puts its last row's window start at 49,
    # one past a 16-key block boundary.
    "window-noncausal-g1-tiles": C(((20, 90), (33, 120), (16, 65)), group=1, window=16, causal=False, page_size=8),
    "ring-window-decode-wraps": C(DECODE[:3] + ((1, 203), (1, 130)), group=4, ring_rows=24, window=24, page_size=8),
    "ring-window-mixed-wraps-bf16": C(
        ((1, 150), (9, 97), (4, 64), (6, 200)), group=4, ring_rows=32, window=24, page_size=8, dtype="bfloat16"
    ),
    "ring-window-noncausal-softcap": C(
        ((4, 130), (7, 77), (1, 90)),
        group=8,
        num_kv_heads=1,
        ring_rows=48,
        window=32,
        causal=False,
        softcap=30.0,
        page_size=16,
    ),
    "ring-window-p32-d128": C(
        ((1, 300), (12, 180), (3, 99)), group=4, ring_rows=64, window=40, page_size=32, head_dim=128
    ),
    "ring-window-prefill-chunk": C(((30, 160), (16, 16)), group=1, ring_rows=48, window=16, page_size=16, gaps=2),
}
SPLITS = {"flash": 1, "splitk": 3}


def _seed(request) -> int:
    return zlib.crc32(request.node.name.encode())


def _to_jax(inputs, dtype):
    return {k: jnp.asarray(v, dtype) if v.dtype == np.float32 else jnp.asarray(v) for k, v in inputs.items()}


def _options(case):
    return dict(
        ring_rows=case.ring_rows, window=case.window, causal=case.causal, softcap=case.softcap, scale=case.scale
    )


def _covered(seq_info, num_rows):
    covered = np.zeros(num_rows, bool)
    for q_start, q_len, _, _ in seq_info:
        covered[q_start : q_start + q_len] = True
    return covered


@pytest.mark.parametrize("path", SPLITS)
@pytest.mark.parametrize("name", CASES)
def test_kernel_matches_reference(name, path, request):
    case = CASES[name]
    rng = np.random.default_rng(_seed(request))
    inputs = make_attention_inputs(case, rng)
    args = _to_jax(inputs, case.dtype)
    want = np.asarray(varlen_attention_reference(**args, **_options(case)), np.float32)
    got = varlen_attention(
        **args,
        **_options(case),
        num_splits=SPLITS[path],
        block_sizes=BlockSizes(block_m=16, block_k=16),
        interpret=INTERPRET,
    )
    assert got.shape == args["q"].shape and got.dtype == args["q"].dtype
    got = np.asarray(got, np.float32)
    # Pools hold NaN wherever no visible key lives, uncovered q rows too.
    assert np.isfinite(want).all() and np.isfinite(got).all()
    uncovered = ~_covered(inputs["seq_info"], got.shape[0])
    assert not got[uncovered].any()
    np.testing.assert_allclose(got, want, **TOLERANCE[case.dtype])


FP8_CASES = ["decode-g4-p16-bf16", "mixed-g4-p16-gaps-padding", "ring-window-mixed-wraps-bf16",
             "decode-g1-p32-softcap"]


@pytest.mark.parametrize("path", ["flash"])  # split-K over fp8 pools: the scaled test below
@pytest.mark.parametrize("name", FP8_CASES)
def test_kernel_reads_fp8_pools(name, path, request):
    """Unscaled fp8 pools (the kernel serves them; the engine's fp8 cache is scaled, below): the kernel widens
    float8_e4m3fn tiles to q's dtype and matches the reference over the same fp8 pools; against the
    full-precision pools the output moves by what e4m3 storage costs (stated)."""
    from glint.pallas_kernels.reference import to_pool_dtype

    case = CASES[name]
    inputs = make_attention_inputs(case, np.random.default_rng(_seed(request)))
    args = _to_jax(inputs, case.dtype)
    fp8 = dict(args, k_pages=to_pool_dtype(args["k_pages"], jnp.float8_e4m3fn),
               v_pages=to_pool_dtype(args["v_pages"], jnp.float8_e4m3fn))
    want = np.asarray(varlen_attention_reference(**fp8, **_options(case)), np.float32)
    got = varlen_attention(**fp8, **_options(case), num_splits=SPLITS[path], block_sizes=BlockSizes(16, 16),
                           interpret=INTERPRET)
    assert got.dtype == args["q"].dtype
    got = np.asarray(got, np.float32)
    assert np.isfinite(got).all() and not got[~_covered(inputs["seq_info"], got.shape[0])].any()
    np.testing.assert_allclose(got, want, **TOLERANCE[case.dtype])
    full = np.asarray(varlen_attention_reference(**args, **_options(case)), np.float32)
    error = np.abs(want - full).max() / np.abs(full).max()
    print(f"{name}: fp8 KV moves the attention output by {error:.4f} of its largest value")
    assert error < 0.08  # e4m3 keeps 3 mantissa bits: each K/V element within 1/16 of itself


def _numpy_row_quantized(pages: np.ndarray):
    """A scaled fp8 pool by the definition, in NumPy: per row and head, scale = max |x| / 448 (1 for a zero row),
    the row divided by it and rounded to e4m3 (ml_dtypes). NaN rows (no visible key lives there) keep a NaN
    scale, so a kernel that read their scales unmasked would return NaN."""
    import ml_dtypes

    amax = np.abs(pages.astype(np.float32)).max(-1)
    scale = np.where(amax > 0, amax / 448.0, np.where(np.isnan(amax), np.nan, 1.0)).astype(np.float32)
    return (pages / scale[..., None]).astype(ml_dtypes.float8_e4m3fn), scale


@pytest.mark.parametrize("f16_dots", [1, 0])
@pytest.mark.parametrize("name,path,magnitude,dtype",
                         [(name, path, 0.003, None) for name in FP8_CASES for path in SPLITS]
                         + [(FP8_CASES[0], "flash", 1.0, None), (FP8_CASES[0], "splitk", 1e-4, "float16")])
def test_kernel_reads_scaled_fp8_pools(name, path, magnitude, dtype, f16_dots, request, monkeypatch):
    """A scaled fp8 cache (a float32 scale per row and head): the kernel matches the reference over the same
    pools, the reference matches the spec's NumPy loop over the dequantized pools, and the output stays within
    e4m3's precision of the full-precision pools whatever the values' `magnitude` (V's; K's stays, or the
    softmax would go flat and hide K's error). Unscaled e4m3 loses small values to its subnormals (below
    2^-6): at values ~0.003 its error is several times the scaled one (both stated). In float16 (q's dtype)
    the kernel must not round the value-scaled softmax weights into float16's subnormals (V ~1e-4). Both ways of
    widening the tiles of 16-bit models (tuning.FP8_KV_F16_DOTS: float16 dots, or q's dtype)."""
    from glint.pallas_kernels.reference import to_pool_dtype

    monkeypatch.setattr(tuning, "FP8_KV_F16_DOTS", f16_dots)
    case = CASES[name] if dtype is None else dataclasses.replace(CASES[name], dtype=dtype)
    tolerance = TOLERANCE.get(case.dtype, TOLERANCE["bfloat16"])
    inputs = make_attention_inputs(case, np.random.default_rng(_seed(request)))
    inputs["v_pages"] *= np.float32(magnitude)
    args = _to_jax(inputs, case.dtype)
    (k8, ks), (v8, vs) = (_numpy_row_quantized(np.asarray(args[n], np.float32)) for n in ("k_pages", "v_pages"))
    scaled = dict(args, k_pages=jnp.asarray(k8), v_pages=jnp.asarray(v8), k_scale=scale_pool(jnp.asarray(ks)),
                  v_scale=scale_pool(jnp.asarray(vs)))
    want = np.asarray(varlen_attention_reference(**scaled, **_options(case)), np.float32)
    got = varlen_attention(**scaled, **_options(case), num_splits=SPLITS[path], block_sizes=BlockSizes(16, 16),
                           interpret=INTERPRET)
    assert got.dtype == args["q"].dtype
    got = np.asarray(got, np.float32)
    assert np.isfinite(got).all() and not got[~_covered(inputs["seq_info"], got.shape[0])].any()
    np.testing.assert_allclose(got, want, rtol=tolerance["rtol"],
                               atol=tolerance["atol"] * magnitude)
    covered = _covered(inputs["seq_info"], got.shape[0])
    dequantized = {n: p.astype(np.float32) * sc[..., None] for n, p, sc in (("k", k8, ks), ("v", v8, vs))}
    loop = attention_numpy_loop(np.asarray(args["q"], np.float32), dequantized["k"], dequantized["v"],
                                inputs["page_table"], inputs["seq_info"], **_options(case))
    np.testing.assert_allclose(want[covered], loop[covered], rtol=tolerance["rtol"],
                               atol=tolerance["atol"] * magnitude)

    full = np.asarray(varlen_attention_reference(**args, **_options(case)), np.float32)
    unscaled = dict(args, k_pages=to_pool_dtype(args["k_pages"], jnp.float8_e4m3fn),
                    v_pages=to_pool_dtype(args["v_pages"], jnp.float8_e4m3fn))
    plain = np.asarray(varlen_attention_reference(**unscaled, **_options(case)), np.float32)
    covered_full = full[covered]
    error, plain_error = (np.sqrt(np.mean((out[covered] - covered_full) ** 2) / np.mean(covered_full ** 2))
                          for out in (want, plain))
    print(f"{name}, V x{magnitude}: relative RMS error of the attention output against full-precision pools: "
          f"scaled fp8 {error:.4f}, unscaled fp8 {plain_error:.4f}")
    assert error < 0.05  # e4m3 keeps 3 mantissa bits (each element within 1/16) at every magnitude
    if magnitude < 0.1:
        assert plain_error > 3 * error


def test_scaled_fp8_pools_are_checked():
    case = CASES["decode-g4-p16-bf16"]
    args = _to_jax(make_attention_inputs(case, np.random.default_rng(0)), case.dtype)
    scales = jnp.ones(scale_pool_shape(*args["k_pages"].shape[:3]), jnp.float32)
    with pytest.raises(ValueError, match=r"k_scale and v_scale go with float8_e4m3fn pools.*bfloat16"):
        varlen_attention(**args, k_scale=scales, v_scale=scales, scale=1.0, interpret=INTERPRET)
    fp8 = dict(args, k_pages=args["k_pages"].astype(jnp.float8_e4m3fn), v_pages=args["v_pages"].astype(
        jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"both k_scale and v_scale or neither"):
        varlen_attention(**fp8, k_scale=scales, scale=1.0, interpret=INTERPRET)
    with pytest.raises(ValueError, match=r"v_scale \(3,\) float32 must be f32\[num_pages, Hkv, page_size\]"):
        varlen_attention(**fp8, k_scale=scales, v_scale=jnp.ones(3), scale=1.0, interpret=INTERPRET)
    # the pools' rows-then-heads order is refused (unless page_size == Hkv, where the shapes cannot tell)
    by_row = jnp.ones(args["k_pages"].shape[:3], jnp.float32)
    assert by_row.shape[1] != by_row.shape[2]
    with pytest.raises(ValueError, match=r"must be f32\[num_pages, Hkv, page_size\]"):
        varlen_attention(**fp8, k_scale=by_row, v_scale=by_row, scale=1.0, interpret=INTERPRET)


@pytest.mark.parametrize("name", ["decode-g4-p16-bf16", "mixed-g4-p16-gaps-padding", "ring-window-p32-d128"])
def test_default_blocks_and_splits(name, request):
    """The tuned table's tiles (larger than the sweep's) and the default split."""
    case = CASES[name]
    inputs = make_attention_inputs(case, np.random.default_rng(_seed(request)))
    args = _to_jax(inputs, case.dtype)
    want = np.asarray(varlen_attention_reference(**args, **_options(case)), np.float32)
    got = np.asarray(varlen_attention(**args, **_options(case), interpret=INTERPRET), np.float32)
    np.testing.assert_allclose(got, want, **TOLERANCE[case.dtype])


def test_fully_masked_rows_are_zero(request):
    case = CASES["underflow-fully-masked-rows"]
    inputs = make_attention_inputs(case, np.random.default_rng(_seed(request)))
    args = _to_jax(inputs, case.dtype)
    for seg in inputs["seq_info"]:
        if seg[1] == 5:
            rows = slice(seg[0], seg[0] + 2)  # positions -2 and -1
    for num_splits in (1, 2):
        got = np.asarray(varlen_attention(**args, **_options(case), num_splits=num_splits, interpret=INTERPRET))
        assert np.isfinite(got).all() and not got[rows].any() and got[rows.stop].any()
    ref = np.asarray(varlen_attention_reference(**args, **_options(case)))
    assert not ref[rows].any()


TINY = {
    "flat-causal": C(((3, 7), (1, 12), (2, 2)), group=2, page_size=4, head_dim=16, gaps=2),
    "flat-noncausal-softcap": C(((3, 7), (1, 12)), group=1, page_size=4, head_dim=16, causal=False, softcap=3.0),
    "ring-window": C(((2, 30), (1, 19), (3, 11)), group=2, page_size=4, head_dim=16, ring_rows=8, window=6),
    # window + q_len > ring_rows: visible keys alias ring rows, counted once each.
    "ring-aliasing": C(((3, 30), (1, 19)), group=2, page_size=4, head_dim=16, ring_rows=8, window=12, poison=False),
    "underflow": C(((4, 2),), group=1, page_size=4, head_dim=16),
}


@pytest.mark.parametrize("name", TINY)
def test_reference_matches_numpy_loop(name, request):
    case = TINY[name]
    inputs = make_attention_inputs(case, np.random.default_rng(_seed(request)))
    want = attention_numpy_loop(**inputs, **_options(case))
    args = _to_jax(inputs, jnp.float32)
    for block_q in (1, 2, 5):
        got = varlen_attention_reference(**args, **_options(case), block_q=block_q)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def test_kernel_matches_numpy_loop_when_ring_aliases(request):
    case = TINY["ring-aliasing"]
    inputs = make_attention_inputs(case, np.random.default_rng(_seed(request)))
    want = attention_numpy_loop(**inputs, **_options(case))
    got = varlen_attention(
        **_to_jax(inputs, jnp.float32),
        **_options(case),
        num_splits=2,
        block_sizes=BlockSizes(block_m=16, block_k=16),
        interpret=INTERPRET,
    )
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def test_one_compilation_serves_every_length_mix(request):
    rng = np.random.default_rng(_seed(request))
    base = C(((4, 30), (1, 9), (6, 6)), group=2, gaps=1)
    other = dataclasses.replace(base, segments=((1, 33), (9, 40), (1, 2)))
    first = make_attention_inputs(base, rng)
    second = make_attention_inputs(other, rng)
    # Same shapes, different lengths and tables: pad page tables/pools to match.
    for key in ("k_pages", "v_pages", "page_table", "q"):
        rows = max(first[key].shape[0], second[key].shape[0])
        cols = max(first[key].shape[1], second[key].shape[1])
        for inputs in (first, second):
            a = inputs[key]
            pad = [(0, rows - a.shape[0]), (0, cols - a.shape[1])] + [(0, 0)] * (a.ndim - 2)
            inputs[key] = np.pad(a, pad, constant_values=0 if key == "page_table" else 1.0)
    fn = jax.jit(lambda *a: varlen_attention(*a, scale=base.scale, num_splits=1, interpret=INTERPRET))
    for inputs in (first, second):
        args = _to_jax(inputs, jnp.float32)
        got = fn(args["q"], args["k_pages"], args["v_pages"], args["page_table"], args["seq_info"])
        want = varlen_attention_reference(**args, scale=base.scale)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert fn._cache_size() == 1


def test_default_num_splits_heuristic():
    blocks = BlockSizes(block_m=16, block_k=64)
    # Decode with few sequences and long contexts: split the keys.
    assert default_num_splits(8, 8, 32, 8, 32768, blocks) > 1
    # Many sequences already fill the GPU; prefill never splits.
    assert default_num_splits(256, 256, 32, 8, 32768, blocks) == 1
    assert default_num_splits(4096, 2, 32, 8, 32768, blocks) == 1
    # A context of one key block has nothing to split; a short one splits no further than its blocks.
    assert default_num_splits(8, 8, 32, 8, 64, blocks) == 1
    assert default_num_splits(1, 1, 32, 8, 768, blocks) == 768 // 64
    # One sequence at 32k keys: as many splits as allowed; 64 sequences fill half the target programs: two.
    assert default_num_splits(1, 1, 32, 8, 33024, blocks) == tuning.MAX_SPLITS
    assert default_num_splits(64, 64, 32, 8, 1024, blocks) == 2


def _valid_args():
    q = jnp.ones((8, 4, 64), jnp.float32)
    pages = jnp.ones((10, 16, 2, 64), jnp.float32)
    page_table = jnp.zeros((3, 4), jnp.int32)
    seq_info = jnp.zeros((2, 4), jnp.int32)
    return dict(q=q, k_pages=pages, v_pages=pages, page_table=page_table, seq_info=seq_info)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q=jnp.ones((8, 4), jnp.float32)), r"q must be \[T, Hq, D\].*\(8, 4\)"),
        (dict(q=jnp.ones((8, 3, 64), jnp.float32)), r"Hq=3 must be a multiple of Hkv=2"),
        (dict(q=jnp.ones((8, 4, 32), jnp.float32)), r"head_dim 32 != pool head_dim 64"),
        (dict(q=jnp.ones((8, 4, 64), jnp.bfloat16)), r"share q's dtype or be float8_e4m3fn.*bfloat16"),
        (dict(v_pages=jnp.ones((10, 8, 2, 64), jnp.float32)), r"v_pages \(10, 8, 2, 64\)"),
        (dict(page_table=jnp.zeros((3, 4), jnp.float32)), r"page_table must be i32"),
        (dict(seq_info=jnp.zeros((2, 3), jnp.int32)), r"seq_info must be i32\[S, 4\].*\(2, 3\)"),
        (
            dict(seq_info=jnp.zeros((2, 4), jnp.int64) if jax.config.x64_enabled else jnp.zeros((2, 4), jnp.int16)),
            r"seq_info must be i32",
        ),
        (dict(ring_rows=65), r"ring_rows=65 must be in \[1, 64\] \(the page table's rows, P \* page_size\)"),
        (dict(window=-1), r"window=-1"),
        (dict(softcap=-1.0), r"softcap=-1.0"),
        (dict(num_splits=0), r"num_splits=0"),
    ],
)
def test_validation_errors(change, match):
    kwargs = dict(_valid_args(), scale=0.125) | change
    with pytest.raises(ValueError, match=match):
        varlen_attention(**kwargs, interpret=INTERPRET)


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(block_m=24), r"block_m must be a power of two >= 16, got 24"),
        (dict(block_k=8), r"block_k must be a power of two >= 16, got 8"),
        (dict(num_warps=0), r"num_warps"),
    ],
)
def test_block_sizes_validation(fields, match):
    with pytest.raises(ValueError, match=match):
        BlockSizes(**fields)


def test_fp8_pools_decode_with_their_own_tile():
    """Decode over fp8 pools takes the table's "decode-fp8" tile (twice the keys per block: an fp8 key row is half
    the bytes); bf16 pools and prefill steps keep theirs; a head_dim without an fp8 entry falls back to decode's."""
    from glint.pallas_kernels.varlen_attention import default_block_sizes

    fp8 = jnp.float8_e4m3fn
    assert default_block_sizes(8, 8, 128, fp8) == BlockSizes(**tuning.ATTENTION_BLOCKS["decode-fp8", 128])
    assert default_block_sizes(8, 8, 128, jnp.bfloat16) == BlockSizes(**tuning.ATTENTION_BLOCKS["decode", 128])
    assert default_block_sizes(64, 1, 128, fp8) == BlockSizes(**tuning.ATTENTION_BLOCKS["prefill", 128])
    assert default_block_sizes(8, 8, 64, fp8) == BlockSizes(**tuning.ATTENTION_BLOCKS["decode", 64])
