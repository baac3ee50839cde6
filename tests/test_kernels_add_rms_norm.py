"""add_rms_norm (Pallas interpret mode on the CPU, compiled under GLINT_TEST_GPU) against add_rms_norm_reference,
and the reference against the model's unfused path (the add, then glint.model.transformer.rms_norm)."""

import zlib

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import INTERPRET
from glint.model.transformer import rms_norm
from glint.pallas_kernels import add_rms_norm
from glint.pallas_kernels.add_rms_norm import add_rms_norm_reference

CASES = [  # num_rows, dim, dtype, h_dtype
    (1, 4096, "bfloat16", "bfloat16"),  # llama3-8b's decode row
    (7, 96, "bfloat16", "bfloat16"),  # D not a power of two
    (5, 320, "bfloat16", "float32"),  # h rounded to x's dtype before the add
    (2, 128, "float16", "float16"),
    (9, 100, "float32", "float32"),
    (300, 256, "bfloat16", "bfloat16"),  # a prefill-wide step
    (4, 192, "float32", "float32"),  # rows of ~1e-3 (below): eps is a third of the mean square
]


def _case(request, num_rows, dim, dtype, h_dtype):
    rng = np.random.default_rng(zlib.crc32(request.node.name.encode()))
    scale = 1e-3 if dim == 192 else 1.0
    x = jnp.asarray(rng.standard_normal((num_rows, dim)) * 4 * scale, dtype)
    h = jnp.asarray(rng.standard_normal((num_rows, dim)) * scale, h_dtype)
    weight = jnp.asarray(rng.uniform(0.5, 1.5, dim), jnp.float32)
    return x, h, weight


@pytest.mark.parametrize("num_rows, dim, dtype, h_dtype", CASES)
def test_add_rms_norm_matches_reference(num_rows, dim, dtype, h_dtype, request):
    x, h, weight = _case(request, num_rows, dim, dtype, h_dtype)
    want = [np.asarray(v, np.float32) for v in add_rms_norm_reference(x, h, weight, eps=1e-5)]
    got = add_rms_norm(x, h, weight, eps=1e-5, interpret=INTERPRET)
    assert [(v.shape, v.dtype) for v in got] == [(x.shape, x.dtype)] * 2
    got = [np.asarray(v, np.float32) for v in got]
    # the sum rounds once in both, so it is equal; the norm's float32 reduction runs in another order: one unit
    # in the last place of the dtype at most
    np.testing.assert_array_equal(got[0], want[0])
    unit = {"float32": 1e-6, "float16": 2 ** -10, "bfloat16": 2 ** -7}[dtype]
    np.testing.assert_allclose(got[1], want[1], rtol=unit, atol=unit)
    if dtype != "float32":  # a missing rounding step (h, or the sum before the norm) leaves many elements off
        assert np.mean(got[1] == want[1]) > 0.95, np.mean(got[1] == want[1])


@pytest.mark.parametrize("num_rows, dim, dtype, h_dtype", CASES)
def test_add_rms_norm_reference_is_the_model_path(num_rows, dim, dtype, h_dtype, request):
    x, h, weight = _case(request, num_rows, dim, dtype, h_dtype)
    s = x + h.astype(x.dtype)  # the model's linears return x's dtype
    for got, want in zip(add_rms_norm_reference(x, h, weight, eps=1e-5), (s, rms_norm(s, weight, 1e-5))):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_add_rms_norm_with_no_rows():
    s, normed = add_rms_norm(jnp.zeros((0, 64), jnp.bfloat16), jnp.zeros((0, 64), jnp.bfloat16),
                             jnp.ones(64), interpret=True)
    assert s.shape == normed.shape == (0, 64)


def test_add_rms_norm_rejects_bad_arguments():
    x = jnp.zeros((3, 64), jnp.bfloat16)
    bad = [
        ({"h": jnp.zeros((3, 32), jnp.bfloat16)}, r"h bfloat16\[3, 32\]"),
        ({"h": jnp.zeros((1, 3, 64), jnp.bfloat16)}, r"h bfloat16\[1, 3, 64\]"),
        ({"h": jnp.zeros((3, 64), jnp.int8)}, r"h int8\[3, 64\]"),
        ({"weight": jnp.ones(32)}, r"weight float32\[32\]"),
        ({"x": jnp.zeros((3, 64), jnp.int32)}, r"x int32\[3, 64\]"),
        ({"x": jnp.zeros((3, 64), jnp.float8_e4m3fn)}, r"x float8_e4m3fn\[3, 64\]"),
    ]
    for change, message in bad:
        kw = {"x": x, "h": x, "weight": jnp.ones(64)} | change
        with pytest.raises(ValueError, match=message):
            add_rms_norm(**kw, interpret=True)
