"""qkv_write (Pallas interpret mode on the CPU, compiled under GLINT_TEST_GPU) against qkv_write_reference, and
the reference against the model's unfused path (QKVPrep.split, then ring_write_reference)."""

import zlib

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import INTERPRET

from glint.model.config import RopeConfig
from glint.model.transformer import QKVPrep, rope_table
from glint.pallas_kernels import qkv_write, ring_write_reference
from glint.pallas_kernels.qkv_write import qkv_write_reference

NUM_PAGES, PAGE_SIZE = 9, 8
CASES = [  # num_q_heads, num_kv_heads, head_dim, dtype, num_rows, qk_norm, is_rotated
    (4, 2, 64, "float32", 13, "none", True),
    (32, 8, 128, "bfloat16", 5, "none", True),  # llama3-8b's heads
    (6, 2, 32, "bfloat16", 17, "rms", True),  # q heads not a power of two
    (12, 3, 64, "bfloat16", 6, "rms_scaleless", True),  # kv heads not a power of two
    (4, 4, 48, "float32", 9, "rms_scaleless", True),  # D / 2 = 24: not a power of two
    (4, 2, 32, "float32", 8, "rms", True),
    (8, 2, 64, "bfloat16", 7, "none", False),  # a layer without RoPE
    (2, 1, 256, "bfloat16", 4, "rms", False),
]


def _case(request, num_q_heads, num_kv_heads, head_dim, dtype, num_rows, qk_norm, is_rotated):
    """Pools, qkv, slots and the layer's RoPE table / norm weights: (args, keywords, model-shaped rope)."""
    rng = np.random.default_rng(zlib.crc32(request.node.name.encode()))
    shape = (NUM_PAGES, PAGE_SIZE, num_kv_heads, head_dim)
    k_pages, v_pages = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))
    # distinct slots past the scratch page; the first row on the scratch page, the last two out of the pool
    slots = rng.choice(np.arange(PAGE_SIZE, NUM_PAGES * PAGE_SIZE), num_rows, replace=False)
    slots[0], slots[-2], slots[-1] = 3, -1, NUM_PAGES * PAGE_SIZE + 5
    qkv = jnp.asarray(rng.standard_normal((num_rows, num_q_heads + 2 * num_kv_heads, head_dim)) * 3, dtype)
    positions = jnp.asarray(rng.integers(0, 5000, num_rows), jnp.int32)
    rope = rope_table(RopeConfig(5e5, "llama3", factor=8.0), head_dim, positions) if is_rotated else None
    weights = [jnp.asarray(rng.uniform(0.5, 1.5, head_dim), jnp.float32) for _ in range(2)]
    if qk_norm != "rms":
        weights = [None, None]
    flat_rope = None if rope is None else tuple(x[:, 0, :] for x in rope)
    return (k_pages, v_pages, qkv, jnp.asarray(slots, jnp.int32), flat_rope, *weights), {"qk_norm": qk_norm}, rope


@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim, dtype, num_rows, qk_norm, is_rotated", CASES)
def test_qkv_write_matches_reference(num_q_heads, num_kv_heads, head_dim, dtype, num_rows, qk_norm, is_rotated,
                                     request):
    args, kw, _ = _case(request, num_q_heads, num_kv_heads, head_dim, dtype, num_rows, qk_norm, is_rotated)
    want = [np.asarray(x, np.float32) for x in qkv_write_reference(*args, **kw)]
    before_k = np.asarray(args[0], np.float32)
    got = qkv_write(*args, **kw, interpret=INTERPRET)
    assert [(x.shape, x.dtype) for x in got] == [(args[2][:, :num_q_heads].shape, args[2].dtype)] + [
        (p.shape, p.dtype) for p in args[:2]]
    got = [np.asarray(x, np.float32) for x in got]
    # float32 math in another order (the compiler's fused multiply-adds, the halves' sums): one unit in the last
    # place of the activation dtype at most; in bf16 the interpreter rounds where the reference does, so almost
    # every element is equal (a missing rounding step leaves about a third of them one unit off)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == "float32" else {"rtol": 2 ** -7, "atol": 2 ** -7}
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **tol)
        if INTERPRET and dtype == "bfloat16":
            assert np.mean(g == w) > 0.999, np.mean(g == w)
    # the rows written moved, every other row (the ones the dropped slots would wrap to included) did not
    flat = (-1, num_kv_heads, head_dim)
    written = np.asarray(args[3])[:-2]
    untouched = np.setdiff1d(np.arange(NUM_PAGES * PAGE_SIZE), written)
    np.testing.assert_array_equal(got[1].reshape(flat)[untouched], before_k.reshape(flat)[untouched])
    assert not np.allclose(got[1].reshape(flat)[written], before_k.reshape(flat)[written])


@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim, dtype, num_rows, qk_norm, is_rotated", CASES)
def test_qkv_write_reference_is_the_model_path(num_q_heads, num_kv_heads, head_dim, dtype, num_rows, qk_norm,
                                               is_rotated, request):
    """The reference rounds as the model's unfused path: QKVPrep.split, then the ring write."""
    args, kw, rope = _case(request, num_q_heads, num_kv_heads, head_dim, dtype, num_rows, qk_norm, is_rotated)
    k_pages, v_pages, qkv, slots, _, q_norm, k_norm = args
    q, k, v = QKVPrep(num_q_heads, rope, qk_norm, q_norm, k_norm, 1e-6).split(qkv)
    want = (q, *ring_write_reference(k_pages, v_pages, k, v, slots))
    for got, w in zip(qkv_write_reference(*args, **kw), want):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(w, np.float32))


def test_qkv_write_with_no_rows_leaves_the_pools():
    before = np.random.default_rng(0).standard_normal((4, 8, 2, 64)).astype(np.float32)
    q, k, v = qkv_write(jnp.asarray(before), jnp.asarray(before + 1), jnp.zeros((0, 8, 64), jnp.float32),
                        jnp.zeros(0, jnp.int32), interpret=True)
    assert q.shape == (0, 4, 64)
    np.testing.assert_array_equal(np.asarray(k), before)
    np.testing.assert_array_equal(np.asarray(v), before + 1)


def test_qkv_write_rejects_bad_arguments():
    pools = jnp.zeros((4, 8, 2, 64), jnp.bfloat16)
    qkv = jnp.zeros((3, 8, 64), jnp.bfloat16)
    slots = jnp.zeros(3, jnp.int32)
    norm = jnp.ones(64, jnp.float32)
    bad = [
        ({"qkv": jnp.zeros((3, 4, 64), jnp.bfloat16)}, "qkv must be"),
        ({"qkv": jnp.zeros((3, 7, 64), jnp.bfloat16)}, "multiple of Hkv"),
        ({"qkv": qkv.astype(jnp.float32)}, "in qkv's dtype"),
        ({"rope": (jnp.zeros((3, 64), jnp.float32),) * 2}, "rope must be"),
        ({"rope": (jnp.zeros((3, 32), jnp.float32),)}, "rope must be"),
        ({"qk_norm": "rms"}, "go with qk_norm='rms'"),
        ({"q_norm": norm, "k_norm": norm}, "go with qk_norm='rms'"),
        ({"q_norm": norm[:32], "k_norm": norm, "qk_norm": "rms"}, "must be \\[D\\]"),
        ({"qk_norm": "layer"}, "qk_norm must be one of"),
        ({"slots": jnp.zeros(2, jnp.int32)}, "slots must be"),
    ]
    for change, message in bad:
        kw = {"k_pages": pools, "v_pages": pools, "qkv": qkv, "slots": slots} | change
        with pytest.raises(ValueError, match=message):
            qkv_write(**kw, interpret=True)
    odd = jnp.zeros((4, 8, 2, 63), jnp.bfloat16)
    with pytest.raises(ValueError, match="head_dim must be even"):
        qkv_write(odd, odd, jnp.zeros((3, 8, 63), jnp.bfloat16), slots, interpret=True)
