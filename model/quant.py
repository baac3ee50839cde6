"""Weight-only quantized linears: int8, symmetric per output channel.

A kernel w [in, out] is stored as q = round(w / scale) in int8 [in, out] with scale = max |w[:, j]| / 127 in
float32 [out]; y = (x @ q) * scale. Decode is bound by reading the weights, so halving their bytes is the lever;
the matmul dequantizes q to x's dtype inside the dot, which XLA fuses into the GEMM on the GPU (the int8 bytes
are what is read). Embedding and LM head stay in the model dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

INT8_MAX = 127


def quantize_int8(w) -> tuple[jax.Array, jax.Array]:
    """w [in, out] (any float dtype) -> (q i8[in, out], scale f32[out]); an all-zero column gets scale 1."""
    w = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=0)
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    q = jnp.clip(jnp.round(w / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def dequantize_int8(q, scale, dtype=jnp.float32) -> jax.Array:
    return (q.astype(jnp.float32) * scale).astype(dtype)


def int8_matmul(x, q, scale):
    """x [T, in] @ dequant(q, scale) [in, out] in x's dtype: the int8 weights are widened inside the dot and the
    per-channel scale applied to its float32 result."""
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    y = jnp.dot(x, q.astype(x.dtype), preferred_element_type=jnp.float32, precision=precision)
    return (y * scale).astype(x.dtype)


class Int8Linear(nnx.Module):
    """y = x @ kernel with the kernel stored as int8 `qweight` [in, out] and float32 `scale` [out]."""

    def __init__(self, d_in: int, d_out: int, *, dtype, rngs: nnx.Rngs):
        w = jax.random.normal(rngs.params(), (d_in, d_out), jnp.float32) * d_in ** -0.5
        q, scale = quantize_int8(w.astype(dtype))
        self.qweight, self.scale = nnx.Param(q), nnx.Param(scale)

    def __call__(self, x):
        return int8_matmul(x, self.qweight[...], self.scale[...])


def quantize_params(flat: dict, like: dict) -> dict:
    """Flat full-precision parameters ({"...wqkv.kernel": w}) -> those of the quantized tree `like` (flat):
    each "<linear>.qweight" / "<linear>.scale" pair from "<linear>.kernel"; every other array as it is."""
    out = {}
    for name in like:
        base = name.rsplit(".", 1)[0]
        if base + ".qweight" in like and name in (base + ".qweight", base + ".scale"):
            if base + ".qweight" not in out:
                out[base + ".qweight"], out[base + ".scale"] = quantize_int8(flat[base + ".kernel"])
        else:
            out[name] = flat[name]
    return out
