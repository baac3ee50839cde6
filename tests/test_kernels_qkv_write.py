"""qkv_write (Pallas interpret mode on the CPU, compiled under GLINT_TEST_GPU) against the model's unfused path:
QKVPrep.split (per-head RMSNorm, RoPE) then ring_write_reference."""

import zlib

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import INTERPRET

from glint.model.config import RopeConfig
from glint.model.transformer import QKVPrep, rope_table
from glint.pallas_kernels import qkv_write, ring_write_reference


def _rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_dim, dtype, num_rows, qk_norm, rotate",
    [
        (4, 2, 64, "float32", 13, "none", True),
        (32, 8, 128, "bfloat16", 5, "none", True),  # llama3-8b's heads
        (6, 2, 32, "bfloat16", 17, "rms", True),  # heads not a power of two
        (4, 4, 48, "float32", 9, "rms_scaleless", True),  # D / 2 = 24: not a power of two
        (8, 2, 64, "bfloat16", 7, "none", False),  # a layer without RoPE
        (2, 1, 256, "bfloat16", 3, "rms", False),
    ],
)
def test_qkv_write_matches_the_model_path(num_q_heads, num_kv_heads, head_dim, dtype, num_rows, qk_norm, rotate,
                                          request):
    rng = _rng(request)
    num_pages, page_size = 9, 8
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_pages, v_pages = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))
    # distinct slots past the scratch page, one padding row on it and one out of range (dropped)
    slots = rng.choice(np.arange(page_size, num_pages * page_size), num_rows, replace=False)
    slots[0], slots[-1] = 3, num_pages * page_size + 5
    slots = jnp.asarray(slots, jnp.int32)
    qkv = jnp.asarray(rng.standard_normal((num_rows, num_q_heads + 2 * num_kv_heads, head_dim)) * 3, dtype)
    positions = jnp.asarray(rng.integers(0, 5000, num_rows), jnp.int32)
    rope = rope_table(RopeConfig(5e5, "llama3", factor=8.0), head_dim, positions) if rotate else None
    weights = [jnp.asarray(rng.uniform(0.5, 1.5, head_dim), jnp.float32) for _ in range(2)]
    if qk_norm != "rms":
        weights = [None, None]
    prep = QKVPrep(num_q_heads, rope, qk_norm, *weights, 1e-6)

    q_ref, k_ref, v_ref = prep.split(qkv)
    k_want, v_want = ring_write_reference(k_pages, v_pages, k_ref, v_ref, slots)
    before_k = np.asarray(k_pages)
    flat_rope = None if rope is None else tuple(x[:, 0, :] for x in rope)
    q, k_out, v_out = qkv_write(k_pages, v_pages, qkv, slots, flat_rope, *weights, qk_norm=qk_norm, eps=1e-6,
                                interpret=INTERPRET)

    # the kernel rounds where the model rounds: at most one unit in the last place of the activation dtype apart
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == "float32" else dict(rtol=2 ** -7, atol=2 ** -7)
    assert q.shape == q_ref.shape and q.dtype == q_ref.dtype
    np.testing.assert_allclose(np.asarray(q, np.float32), np.asarray(q_ref, np.float32), **tol)
    # page 0 is scratch; the rest: the written rows and every untouched row as before
    for got, want in ((k_out, k_want), (v_out, v_want)):
        np.testing.assert_allclose(np.asarray(got, np.float32)[1:], np.asarray(want, np.float32)[1:], **tol)
    written = np.asarray(slots)[1:-1]
    untouched = np.setdiff1d(np.arange(page_size, num_pages * page_size), written)
    flat = (-1, num_kv_heads, head_dim)
    np.testing.assert_array_equal(np.asarray(k_out).reshape(flat)[untouched], before_k.reshape(flat)[untouched])
    assert not np.allclose(np.asarray(k_out, np.float32).reshape(flat)[written],
                           before_k.astype(np.float32).reshape(flat)[written])


def test_qkv_write_rejects_bad_arguments():
    pools = jnp.zeros((4, 8, 2, 64), jnp.bfloat16)
    qkv = jnp.zeros((3, 8, 64), jnp.bfloat16)
    slots = jnp.zeros(3, jnp.int32)
    with pytest.raises(ValueError, match="qkv must be"):
        qkv_write(pools, pools, jnp.zeros((3, 4, 64), jnp.bfloat16), slots, interpret=True)
    with pytest.raises(ValueError, match="in qkv's dtype"):
        qkv_write(pools, pools, qkv.astype(jnp.float32), slots, interpret=True)
    with pytest.raises(ValueError, match="rope must be"):
        qkv_write(pools, pools, qkv, slots, (jnp.zeros((3, 64), jnp.float32),) * 2, interpret=True)
    with pytest.raises(ValueError, match="go with qk_norm='rms'"):
        qkv_write(pools, pools, qkv, slots, qk_norm="rms", interpret=True)
    with pytest.raises(ValueError, match="slots must be"):
        qkv_write(pools, pools, qkv, jnp.zeros(2, jnp.int32), interpret=True)
