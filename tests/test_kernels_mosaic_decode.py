"""The Mosaic GPU decode kernel (decode_attention_mgpu.py) on a CPU machine.

Pallas' GPU interpreter runs the kernel itself here (TMA copies, barriers, wgmma, shared memory) against the
jnp reference; the H200 runs the same cases compiled (tools/gpu_kernels.py sweep, variant "mosaic_decode") and
times it (tools/gpu_decode_mgpu.py). Also: the static tile count, the dispatch rules, and that the kernel
lowers for CUDA at the engine's sizes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from glint.pallas_kernels import decode_attention_mgpu as dm
from glint.pallas_kernels import tuning, varlen_attention
from glint.pallas_kernels.reference import varlen_attention_reference
from glint.pallas_kernels.testing import AttentionCase as C
from glint.pallas_kernels.testing import make_attention_inputs
from glint.pallas_kernels.varlen_attention import mosaic_decode_splits

TOL = {"bfloat16": 2e-2, "float16": 1e-2}
DECODE = tuple((1, n) for n in (1, 17, 300, 1024, 513, 64))
CASES = {
    # decode rows of every context length class, gaps and padding segments between them
    "decode-g4-d128": C(DECODE, group=4, head_dim=128, dtype="bfloat16", num_kv_heads=2, gaps=3, num_padding_segments=2),
    # speculative-sized chunks and a prefill chunk that takes several 64-row tiles, among decode rows
    "mixed-g4": C(((1, 900), (5, 5), (0, 0), (7, 260), (16, 80), (40, 400)), group=4, head_dim=128,
                  dtype="bfloat16", num_kv_heads=2, gaps=9, num_padding_segments=1),
    "noncausal-g2-f16": C(((3, 70), (1, 200), (12, 12)), group=2, head_dim=64, dtype="float16", causal=False),
    "g8-p32-d64": C(DECODE, group=8, page_size=32, head_dim=64, dtype="bfloat16", num_kv_heads=1),
    "g1-p128": C(((1, 300), (2, 129)), group=1, page_size=128, head_dim=64, dtype="bfloat16", num_kv_heads=2),
}


def _inputs(case, seed=0):
    inputs = make_attention_inputs(case, np.random.default_rng(seed))
    return {k: jnp.asarray(v, case.dtype) if v.dtype == np.float32 else jnp.asarray(v) for k, v in inputs.items()}


def _check(got, want, seq_info, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    covered = np.zeros(got.shape[0], bool)
    for q_start, q_len, _, _ in np.asarray(seq_info):
        covered[q_start:q_start + q_len] = True
    assert np.isfinite(got).all()
    assert not got[~covered].any()  # rows of no segment are zero
    tol = TOL[dtype]
    np.testing.assert_array_less(np.abs(got - want), tol + tol * np.abs(want))


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreted_kernel_matches_reference(name):
    """Through varlen_attention with the split count it picks, against the reference; poisoned pools and query
    gaps (NaN) must not show."""
    case = CASES[name]
    args = _inputs(case)
    want = varlen_attention_reference(**args, scale=case.scale, causal=case.causal)
    got = varlen_attention(**args, scale=case.scale, causal=case.causal, backend="mosaic_decode", interpret=True)
    _check(got, want, args["seq_info"], case.dtype)


@pytest.mark.parametrize("num_splits,block_kv,num_stages", [(1, 64, 1), (3, 128, 2), (8, 64, 3)])
def test_splits_and_tiles(num_splits, block_kv, num_stages):
    """Split-K with more splits than some segments have key blocks (empty splits merge as nothing), one stage
    (each block loaded after the last was read) and wider blocks than a page."""
    case = CASES["mixed-g4"]
    args = _inputs(case, seed=1)
    want = varlen_attention_reference(**args, scale=case.scale)
    got = dm.decode_attention_mgpu(**args, scale=case.scale, num_splits=num_splits, block_kv=block_kv,
                                   num_stages=num_stages, interpret=True)
    _check(got, want, args["seq_info"], case.dtype)


def test_num_tiles_covers_every_layout():
    """The static tile count is enough for random layouts, including ones where every segment's packed start
    sits at 7 mod 8 (one more tile each)."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        group = int(rng.choice([1, 2, 4, 8]))
        num_segments = int(rng.integers(1, 65))
        lengths = rng.integers(0, 40, num_segments) if trial % 2 else np.full(num_segments, 1)
        gaps = rng.integers(0, 5, num_segments)
        starts, row = [], int(rng.integers(0, 8))
        for q_len, gap in zip(lengths, gaps):
            starts.append(row)
            row += int(q_len) + int(gap)
        info = np.stack([starts, lengths, np.zeros_like(lengths), lengths + 1], 1).astype(np.int32)
        start, rows = np.asarray(info[:, 0]) * group, lengths * group
        needed = int(np.where(rows > 0, -(-(rows + start % 8) // 64), 0).sum())
        assert needed <= dm.num_tiles_for(max(row, 1), num_segments, group), (trial, group, needed)


def test_supports_and_refusals():
    ok = dict(dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, head_dim=128, page_size=16, block_kv=64, ring_rows=None,
              window=0, softcap=0.0)
    assert dm.supports(**ok)
    assert dm.supports(**{**ok, "dtype": jnp.float16, "kv_dtype": jnp.float16, "head_dim": 64, "page_size": 256})
    for bad in ({"kv_dtype": jnp.float8_e4m3fn}, {"dtype": jnp.float32, "kv_dtype": jnp.float32}, {"head_dim": 256},
                {"head_dim": 80}, {"page_size": 8}, {"block_kv": 32}, {"ring_rows": 96}, {"window": 64},
                {"softcap": 30.0}):
        assert not dm.supports(**{**ok, **bad}), bad
    args = _inputs(CASES["g1-p128"])
    with pytest.raises(ValueError, match="backend='mosaic_decode' needs.*window=8"):
        varlen_attention(**args, scale=0.1, backend="mosaic_decode", window=8, interpret=True)
    with pytest.raises(ValueError, match="backend='mosaic_decode' needs a Hopper GPU"):
        varlen_attention(**args, scale=0.1, backend="mosaic_decode")  # compiled, on a CPU machine
    with pytest.raises(ValueError, match="num_stages=0"):
        dm.decode_attention_mgpu(**args, scale=0.1, num_stages=0)


def test_auto_keeps_triton_off_hopper(monkeypatch):
    """With the decode backend set to Mosaic, "auto" still runs Triton where no Hopper GPU is (here)."""
    monkeypatch.setattr(tuning, "DECODE_BACKEND", "mosaic")
    case = CASES["g8-p32-d64"]
    args = _inputs(case)
    auto = varlen_attention.__wrapped__(**args, scale=case.scale, interpret=True)
    triton = varlen_attention(**args, scale=case.scale, backend="triton", interpret=True)
    np.testing.assert_array_equal(np.asarray(auto, np.float32), np.asarray(triton, np.float32))


def test_split_count():
    # Few CTAs (one sequence): as many splits as the key blocks allow, at most MAX_SPLITS.
    assert mosaic_decode_splits(1, 1, 32, 8, tuning.MOSAIC_DECODE["block_kv"] * 3) == 3
    assert mosaic_decode_splits(1, 1, 32, 8, 1 << 20) == tuning.MAX_SPLITS
    # Enough CTAs already (256 sequences x 8 kv heads): one.
    assert mosaic_decode_splits(256, 256, 32, 8, 4096) == 1


@pytest.mark.parametrize("num_rows,hq,hkv,d,page_size,num_splits", [
    (256, 32, 8, 128, 16, 1),  # llama3-8b decode at batch 256
    (1, 32, 8, 128, 16, 16),  # batch 1, split-K
    (64, 64, 8, 128, 64, 4),  # group 8, page 64
    (37, 16, 16, 64, 16, 2),  # group 1, d64
])
def test_lowers_for_cuda(num_rows, hq, hkv, d, page_size, num_splits):
    """Layout inference, TMA tiling and shared-memory checks run at lowering, at the engine's sizes."""
    args = (
        jax.ShapeDtypeStruct((num_rows, hq, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((512, page_size, hkv, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((512, page_size, hkv, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((num_rows + 2, 64), jnp.int32),
        jax.ShapeDtypeStruct((num_rows, 4), jnp.int32),
    )
    fn = jax.jit(lambda *a: dm.decode_attention_mgpu(*a, scale=d**-0.5, num_splits=num_splits,
                                                     **tuning.MOSAIC_DECODE))
    assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
