"""ring_write (Pallas interpret mode) against its reference, and ring storage
written by ring_write then read by varlen_attention."""

import warnings
import zlib

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import INTERPRET

from glint.pallas_kernels import (
    BlockSizes,
    ring_write,
    ring_write_reference,
    varlen_attention,
)


def _rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def _pools(rng, num_pages, page_size, num_kv_heads, head_dim, dtype):
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    return (jnp.asarray(rng.standard_normal(shape), dtype), jnp.asarray(rng.standard_normal(shape), dtype))


@pytest.mark.parametrize(
    "page_size, num_kv_heads, head_dim, dtype, num_rows",
    [
        (8, 2, 64, "float32", 13),
        (16, 4, 128, "bfloat16", 40),
        (32, 1, 256, "bfloat16", 7),
        (16, 3, 64, "float32", 21),  # row width 192: not a power of two
    ],
)
def test_ring_write_matches_reference(page_size, num_kv_heads, head_dim, dtype, num_rows, request):
    rng = _rng(request)
    num_pages = 12
    k_pages, v_pages = _pools(rng, num_pages, page_size, num_kv_heads, head_dim, dtype)
    # Distinct real slots outside the scratch page; padding rows all hit slot 0..3.
    num_padding = 3
    real = rng.choice(np.arange(page_size, num_pages * page_size), num_rows - num_padding, replace=False)
    slots = np.concatenate([real, rng.integers(0, 4, num_padding)])
    order = rng.permutation(num_rows)
    slots = jnp.asarray(slots[order], jnp.int32)
    new_shape = (num_rows, num_kv_heads, head_dim)
    k_new = jnp.asarray(rng.standard_normal(new_shape), dtype)
    v_new = jnp.asarray(rng.standard_normal(new_shape), dtype)

    k_ref, v_ref = ring_write_reference(k_pages, v_pages, k_new, v_new, slots)
    before_k, before_v = np.asarray(k_pages), np.asarray(v_pages)
    k_out, v_out = ring_write(k_pages, v_pages, k_new, v_new, slots, interpret=INTERPRET)
    assert k_out.shape == before_k.shape and k_out.dtype == before_k.dtype

    # Page 0 is scratch: padding rows land there in unspecified order.
    for got, want, before, new in ((k_out, k_ref, before_k, k_new), (v_out, v_ref, before_v, v_new)):
        got, want = np.asarray(got)[1:], np.asarray(want)[1:]
        np.testing.assert_array_equal(got, want)
        flat = got.reshape(-1, num_kv_heads, head_dim)
        written = np.asarray(slots) - page_size
        keep = np.ones(len(flat), bool)
        keep[written[written >= 0]] = False
        np.testing.assert_array_equal(flat[keep], before[1:].reshape(-1, num_kv_heads, head_dim)[keep])
        real_rows = np.asarray(slots) >= page_size
        np.testing.assert_array_equal(flat[written[real_rows]], np.asarray(new)[real_rows])


def test_ring_write_donates_pools(request):
    rng = _rng(request)
    k_pages, v_pages = _pools(rng, 4, 8, 2, 64, "float32")
    slots = jnp.asarray([9, 17, 30], jnp.int32)
    k_new = jnp.asarray(rng.standard_normal((3, 2, 64)), jnp.float32)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "Some donated buffers were not usable")
        k_out, _ = ring_write(k_pages, v_pages, k_new, k_new + 1, slots, interpret=INTERPRET)
    assert k_pages.is_deleted() and v_pages.is_deleted()
    np.testing.assert_array_equal(np.asarray(k_out)[1, 1], np.asarray(k_new)[0])


def test_ring_write_drops_out_of_range_slots(request):
    rng = _rng(request)
    k_pages, v_pages = _pools(rng, 4, 8, 1, 64, "float32")
    before = np.asarray(k_pages)
    slots = jnp.asarray([5, 32, -1, 100], jnp.int32)
    k_new = jnp.asarray(rng.standard_normal((4, 1, 64)), jnp.float32)
    k_out, _ = ring_write(k_pages, v_pages, k_new, k_new, slots, interpret=INTERPRET)
    expected = before.copy()
    expected[0, 5] = np.asarray(k_new)[0]
    np.testing.assert_array_equal(np.asarray(k_out), expected)


def test_ring_storage_round_trip(request):
    """Decode a sequence token by token through a ring of 3 pages past several
    wraps; windowed attention over the ring equals attention over the last
    `window` keys kept contiguously."""
    rng = _rng(request)
    page_size, ring_pages, window, num_kv_heads, group, head_dim = 8, 3, 20, 2, 2, 64
    ring_rows = page_size * ring_pages
    num_pages = 6
    k_pages, v_pages = _pools(rng, num_pages, page_size, num_kv_heads, head_dim, "float32")
    page_table = jnp.asarray([[0, 0, 0, 0], [4, 1, 5, 0]], jnp.int32)  # seq in slot 1
    total = 3 * ring_rows + 5
    keys = rng.standard_normal((total, num_kv_heads, head_dim)).astype(np.float32)
    values = rng.standard_normal((total, num_kv_heads, head_dim)).astype(np.float32)
    table = np.asarray(page_table)[1]
    for start in range(0, total, 7):  # chunks of 7 new rows, 1 padding row
        j = np.arange(start, min(start + 7, total))
        r = j % ring_rows
        slots = np.append(table[r // page_size] * page_size + r % page_size, 0)
        pad = np.zeros((1, num_kv_heads, head_dim), np.float32)
        k_pages, v_pages = ring_write(
            k_pages,
            v_pages,
            jnp.asarray(np.concatenate([keys[j], pad])),
            jnp.asarray(np.concatenate([values[j], pad])),
            jnp.asarray(slots, jnp.int32),
            interpret=INTERPRET,
        )
    q = rng.standard_normal((1, num_kv_heads * group, head_dim)).astype(np.float32)
    seq_info = jnp.asarray([[0, 1, 1, total]], jnp.int32)
    scale = head_dim**-0.5
    got = varlen_attention(
        jnp.asarray(q),
        k_pages,
        v_pages,
        page_table,
        seq_info,
        ring_rows=ring_rows,
        window=window,
        scale=scale,
        num_splits=2,
        block_sizes=BlockSizes(block_m=16, block_k=16),
        interpret=INTERPRET,
    )
    k_win = np.repeat(keys[total - window :], group, axis=1)  # [W, Hq, D]
    v_win = np.repeat(values[total - window :], group, axis=1)
    s = np.einsum("hd,whd->hw", q[0], k_win) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("hw,whd->hd", p / p.sum(-1, keepdims=True), v_win)
    np.testing.assert_allclose(np.asarray(got)[0], want, atol=2e-5, rtol=2e-5)


def _valid_args():
    pages = jnp.ones((4, 8, 2, 64), jnp.float32)
    new = jnp.ones((3, 2, 64), jnp.float32)
    return dict(k_pages=pages, v_pages=pages + 0, k_new=new, v_new=new, slots=jnp.zeros((3,), jnp.int32))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(k_pages=jnp.ones((4, 8, 128), jnp.float32)), r"k_pages \(4, 8, 128\)"),
        (dict(v_pages=jnp.ones((4, 8, 2, 64), jnp.bfloat16)), r"share one dtype.*bfloat16"),
        (dict(v_new=jnp.ones((2, 2, 64), jnp.float32)), r"k_new and v_new.*\(2, 2, 64\)"),
        (
            dict(k_new=jnp.ones((3, 2, 32), jnp.float32), v_new=jnp.ones((3, 2, 32), jnp.float32)),
            r"\[Hkv, D\] must match.*\(3, 2, 32\)",
        ),
        (dict(slots=jnp.zeros((4,), jnp.int32)), r"slots must be i32\[T\].*\(4,\)"),
        (dict(slots=jnp.zeros((3,), jnp.float32)), r"slots must be i32\[T\].*float32"),
    ],
)
def test_ring_write_validation_errors(change, match):
    with pytest.raises(ValueError, match=match):
        ring_write(**(_valid_args() | change), interpret=INTERPRET)


def test_ring_write_into_fp8_pools_saturates_and_matches_reference(request):
    """float8_e4m3fn pools: rows are rounded to e4m3 and values beyond +-448 saturate (a plain cast gives NaN)."""
    rng = _rng(request)
    page_size, num_kv_heads, head_dim, num_pages = 8, 2, 64, 6
    k_pages, v_pages = (p.astype(jnp.float8_e4m3fn) for p in _pools(rng, num_pages, page_size, num_kv_heads,
                                                                      head_dim, "float32"))
    slots = jnp.asarray(rng.choice(np.arange(page_size, num_pages * page_size), 9, replace=False), jnp.int32)
    k_new = rng.standard_normal((9, num_kv_heads, head_dim)).astype(np.float32) * 3
    k_new[0, 0, :4] = [1e4, -1e4, 448.0, 500.0]
    v_new = rng.standard_normal((9, num_kv_heads, head_dim)).astype(np.float32)
    new = (jnp.asarray(k_new, jnp.bfloat16), jnp.asarray(v_new, jnp.bfloat16))
    k_ref, v_ref = ring_write_reference(k_pages, v_pages, *new, slots)
    k_out, v_out = ring_write(k_pages, v_pages, *new, slots, interpret=INTERPRET)
    assert k_out.dtype == jnp.float8_e4m3fn
    for got, want, rows in ((k_out, k_ref, new[0]), (v_out, v_ref, new[1])):
        got = np.asarray(got, np.float32).reshape(-1, num_kv_heads, head_dim)
        np.testing.assert_array_equal(got, np.asarray(want, np.float32).reshape(got.shape))
        written, rows = got[np.asarray(slots)], np.asarray(rows, np.float32)
        assert np.isfinite(written).all()
        np.testing.assert_allclose(written, np.clip(rows, -448, 448), rtol=2 ** -4, atol=2 ** -10)  # e4m3 steps
    assert list(np.asarray(k_out, np.float32).reshape(-1, num_kv_heads, head_dim)[int(slots[0]), 0, :4]) == [
        448.0, -448.0, 448.0, 448.0]


def test_ring_write_into_scaled_fp8_pools_quantizes_each_row_and_head(request):
    """A scaled fp8 cache: each row and head is stored as x / scale in e4m3 with scale = max |x| / 448 (NumPy,
    below), so nothing saturates; the scales land at the rows' slots, out-of-range slots are dropped, the other
    rows keep theirs; the kernel writes what the reference writes."""
    import ml_dtypes

    rng = _rng(request)
    page_size, num_kv_heads, head_dim, num_pages = 8, 3, 64, 6
    k_pages, v_pages = (p.astype(jnp.float8_e4m3fn) for p in _pools(rng, num_pages, page_size, num_kv_heads,
                                                                      head_dim, "float32"))
    # scale pools [num_pages, Hkv, page_size]: slot s of head h at [s // page_size, h, s % page_size]
    k_scale, v_scale = (jnp.asarray(rng.uniform(0.5, 2.0, (num_pages, num_kv_heads, page_size)), jnp.float32)
                        for _ in range(2))
    real = rng.choice(np.arange(page_size, num_pages * page_size), 9, replace=False)
    slots = np.concatenate([real, [-1, num_pages * page_size]]).astype(np.int32)  # two rows dropped
    k_new = rng.standard_normal((len(slots), num_kv_heads, head_dim)).astype(np.float32) * 3
    k_new[0, 0, :2] = [1e4, -2e3]  # beyond e4m3's 448: scaled, not clipped
    k_new[1, 1] = 0.0  # an all-zero row
    v_new = rng.standard_normal((len(slots), num_kv_heads, head_dim)).astype(np.float32) * 1e-3  # subnormal range
    before = [np.asarray(x) for x in (k_scale, v_scale)]
    args = (*(jnp.asarray(x) for x in (k_new, v_new)), jnp.asarray(slots))
    want = ring_write_reference(k_pages, v_pages, *args, k_scale, v_scale)
    got = ring_write(k_pages, v_pages, *args, k_scale, v_scale, interpret=INTERPRET)
    assert [x.dtype for x in got] == [jnp.float8_e4m3fn] * 2 + [jnp.float32] * 2
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    rows = np.arange(len(real))
    for pool, scales, new, old in ((got[0], got[2], k_new, before[0]), (got[1], got[3], v_new, before[1])):
        amax = np.abs(new[rows]).max(-1)
        want_scale = np.where(amax > 0, amax / np.float32(448), 1).astype(np.float32)
        scales = np.asarray(scales)
        np.testing.assert_allclose(scales[real // page_size, :, real % page_size], want_scale, rtol=1e-6)
        untouched = np.ones(scales.shape, bool)
        untouched[real // page_size, :, real % page_size] = False
        np.testing.assert_array_equal(scales[untouched], old[untouched])
        stored = np.asarray(pool, np.float32).reshape(-1, num_kv_heads, head_dim)[real]
        by_definition = (new[rows] / want_scale[..., None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        # a value on a rounding boundary may land one e4m3 step away (x / s computed as x * (1 / s))
        np.testing.assert_allclose(stored, by_definition, rtol=2 ** -3, atol=2 ** -9)
        assert np.abs(stored).max() <= 448 and np.isfinite(stored).all()
        np.testing.assert_allclose(stored * want_scale[..., None], new[rows], rtol=2 ** -4,
                                   atol=1e-6 * np.abs(new).max())


def test_ring_write_checks_scale_pools():
    pages = jnp.zeros((4, 8, 2, 64), jnp.float8_e4m3fn)
    new, slots = jnp.ones((3, 2, 64), jnp.float32), jnp.arange(3, dtype=jnp.int32) + 8
    scales = jnp.ones((4, 2, 8), jnp.float32)  # [num_pages, Hkv, page_size]
    with pytest.raises(ValueError, match=r"k_scale \(4, 2, 8\) bfloat16 and v_scale \(4, 2, 8\) float32 must be f32"):
        ring_write(pages, pages, new, new, slots, scales.astype(jnp.bfloat16), scales, interpret=INTERPRET)
    by_row = jnp.ones((4, 8, 2), jnp.float32)  # the pools' [num_pages, page_size, Hkv] order
    with pytest.raises(ValueError, match=r"must be f32\[num_pages, Hkv, page_size\] = f32\[4, 2, 8\]"):
        ring_write(pages, pages, new, new, slots, by_row, by_row, interpret=INTERPRET)
    with pytest.raises(ValueError, match=r"both k_scale and v_scale or neither"):
        ring_write(pages, pages, new, new, slots, scales, interpret=INTERPRET)
    with pytest.raises(ValueError, match=r"go with float8_e4m3fn pools.*float32"):
        ring_write(pages.astype(jnp.float32), pages.astype(jnp.float32), new, new, slots, scales, scales,
                   interpret=INTERPRET)
