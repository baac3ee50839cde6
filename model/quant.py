"""Quantized linears: weight-only int8 and int4, and fp8 weights with fp8 activations (W8A8).

A kernel w [in, out] is stored in one of three formats (each with the matmul that reads it):
- int8: q = round(w / scale) in int8 [in, out], scale = max |w[:, j]| / 127 in float32 [out] (symmetric per
  output channel); y = (x @ q) * scale.
- int4: symmetric per group of `group` input rows and per output column: scale = max |w[g, j]| / 7 in bfloat16
  [ceil(in / group), out], q = round(w / scale) in [-7, 7], packed two per byte along the output dimension (column
  2c in the low nibble, 2c + 1 in the high one; uint8 [in, ceil(out / 2)]). The last group may be short.
- fp8: q = w / scale in float8_e4m3fn, stored transposed [out, in] (the K-major operand layout of Hopper's FP8
  GEMM), scale = max |w[:, j]| / 448 in float32 [out]; each step's activations are quantized per token the same
  way (dynamic scales), the dot runs fp8 x fp8 with float32 accumulation and both scales multiply its result.
Decode is bound by reading the weights, so fewer bytes per weight is the lever; the weight-only formats widen
q inside the dot and leave the fusion to XLA (on the H200 it fuses int8's widening into the GEMM, not int4's
unpacking: docs/perf.md). Embedding and LM head stay in the model dtype unless `quantize_head` (int8 per vocab
entry, model/transformer.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

INT8_MAX = 127
INT4_MAX = 7
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
DEFAULT_GROUP = 128


def _highest(dtype):
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _absmax_scale(w, axis, top: float, keepdims: bool = False):
    """max |w| along `axis` / top, 1 where that max is 0 (an all-zero channel or group)."""
    amax = jnp.max(jnp.abs(w), axis=axis, keepdims=keepdims)
    return jnp.where(amax > 0, amax / top, 1.0)


# int8 -------------------------------------------------------------------------------------------------------------

def quantize_int8(w) -> tuple[jax.Array, jax.Array]:
    """w [in, out] (any float dtype) -> (q i8[in, out], scale f32[out]); an all-zero column gets scale 1."""
    w = jnp.asarray(w, jnp.float32)
    scale = _absmax_scale(w, 0, INT8_MAX)
    q = jnp.clip(jnp.round(w / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def quantize_int8_rows(table) -> tuple[jax.Array, jax.Array]:
    """A table [V, H] used as a head (logits = x @ table.T) -> (q i8[V, H], scale f32[V]): one scale per row."""
    q, scale = quantize_int8(jnp.asarray(table).T)
    return q.T, scale


def dequantize_int8(q, scale, dtype=jnp.float32) -> jax.Array:
    return (q.astype(jnp.float32) * scale).astype(dtype)


INT8_MIN_ROWS = 8  # fewer rows are padded to this many (below)


def int8_matmul(x, q, scale):
    """x [T, in] @ dequant(q, scale) [in, out] in x's dtype: the int8 weights are widened inside the dot and the
    per-channel scale applied to its float32 result. Fewer than INT8_MIN_ROWS rows are padded to that many: on
    the H200 XLA's fused GEMM then streams the int8 weights 1.4-1.5x faster than for one row (llama3-8b's
    gate_up at one row 83.7 us, padded to 8 55.6 us; docs/perf.md)."""
    t = x.shape[0]
    if t < INT8_MIN_ROWS:
        x = jnp.pad(x, ((0, INT8_MIN_ROWS - t), (0, 0)))
    y = jnp.dot(x, q.astype(x.dtype), preferred_element_type=jnp.float32, precision=_highest(x.dtype))
    return (y[:t] * scale).astype(x.dtype)


# int4 -------------------------------------------------------------------------------------------------------------

def quantize_int4(w, group: int = DEFAULT_GROUP) -> tuple[jax.Array, jax.Array]:
    """w [in, out] -> (packed u8[in, ceil(out / 2)], scale bf16[ceil(in / group), out]); q is rounded against the
    stored (bfloat16) scale, so dequantizing is exactly q * scale."""
    w = jnp.asarray(w, jnp.float32)
    k, n = w.shape
    groups = -(-k // group)
    padded = jnp.pad(w, ((0, groups * group - k), (0, 0))).reshape(groups, group, n)
    scale = _absmax_scale(padded, 1, INT4_MAX).astype(jnp.bfloat16)
    q = jnp.round(w / _per_row(scale.astype(jnp.float32), group, k))
    q = jnp.clip(q, -INT4_MAX, INT4_MAX).astype(jnp.int8)
    q = jnp.pad(q, ((0, 0), (0, n % 2)))
    packed = (q[:, 0::2] & 0xF) | (q[:, 1::2] << 4)
    return packed.astype(jnp.uint8), scale


def _per_row(scale, group: int, k: int):
    """Group scales [groups, out] -> one row per input row [k, out]."""
    return jnp.repeat(scale, group, axis=0, total_repeat_length=scale.shape[0] * group)[:k]


def unpack_int4(packed, n: int) -> jax.Array:
    """u8[in, ceil(n / 2)] -> the signed values int8[in, n] (low nibble first)."""
    nibbles = jax.lax.bitcast_convert_type(packed, jnp.int4)  # [in, ceil(n / 2), 2], low nibble first
    return nibbles.reshape(packed.shape[0], -1)[:, :n].astype(jnp.int8)


def dequantize_int4(packed, scale, group: int, dtype=jnp.float32) -> jax.Array:
    k, n = packed.shape[0], scale.shape[1]
    return (unpack_int4(packed, n).astype(jnp.float32) * _per_row(scale.astype(jnp.float32), group, k)).astype(dtype)


def int4_matmul(x, packed, scale, group: int):
    """x [T, in] @ dequant(packed, scale) in x's dtype: the nibbles are widened and scaled per group inside the dot's
    operand, which XLA fuses into the GEMM."""
    w = dequantize_int4(packed, scale, group, x.dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32, precision=_highest(x.dtype)).astype(x.dtype)


# fp8 (W8A8) -------------------------------------------------------------------------------------------------------

def _to_fp8(x, scale):
    return jnp.clip(x / scale, -FP8_MAX, FP8_MAX).astype(FP8)  # out-of-range casts would be NaN


def quantize_fp8(w) -> tuple[jax.Array, jax.Array]:
    """w [in, out] -> (q f8e4m3fn[out, in], scale f32[out])."""
    w = jnp.asarray(w, jnp.float32)
    scale = _absmax_scale(w, 0, FP8_MAX)
    return _to_fp8(w, scale).T, scale


def dequantize_fp8(q, scale, dtype=jnp.float32) -> jax.Array:
    """q [out, in] -> w [in, out]."""
    return (q.astype(jnp.float32).T * scale).astype(dtype)


def quantize_activations_fp8(x, axis: str | None = None) -> tuple[jax.Array, jax.Array]:
    """x [T, in] -> (f8e4m3fn[T, in], float32 per-token scale [T, 1]). `axis`: x is this device's slice of the
    input features (a row-split linear under tensor parallelism): the scale spans the whole row, as on one device."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    if axis is not None:
        amax = jax.lax.pmax(amax, axis)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return _to_fp8(x32, scale), scale


def fp8_matmul(x, q, scale, axis: str | None = None):
    """x [T, in] @ w: x quantized per token to fp8, an fp8 x fp8 dot (q [out, in]) with float32 accumulation, then
    the token and channel scales (`axis`: see `quantize_activations_fp8`)."""
    xq, xscale = quantize_activations_fp8(x, axis)
    y = jax.lax.dot_general(xq, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * xscale * scale).astype(x.dtype)


# modules ----------------------------------------------------------------------------------------------------------

def _random_kernel(rngs: nnx.Rngs, d_in: int, d_out: int, dtype):
    w = jax.random.normal(rngs.params(), (d_in, d_out), jnp.float32) * d_in ** -0.5
    return w.astype(dtype)


class Int8Linear(nnx.Module):
    """y = x @ kernel with the kernel stored as int8 `qweight` [in, out] and float32 `scale` [out]."""

    def __init__(self, d_in: int, d_out: int, *, dtype, rngs: nnx.Rngs, group: int = DEFAULT_GROUP):
        q, scale = quantize_int8(_random_kernel(rngs, d_in, d_out, dtype))
        self.qweight, self.scale = nnx.Param(q), nnx.Param(scale)

    def __call__(self, x, axis: str | None = None):
        return int8_matmul(x, self.qweight[...], self.scale[...])


class Int4Linear(nnx.Module):
    """y = x @ kernel with the kernel stored as packed int4 `qweight` u8[in, ceil(out / 2)] and bfloat16 group
    scales `scale` [ceil(in / group), out]."""

    def __init__(self, d_in: int, d_out: int, *, dtype, rngs: nnx.Rngs, group: int = DEFAULT_GROUP):
        self.group = group
        q, scale = quantize_int4(_random_kernel(rngs, d_in, d_out, dtype), group)
        self.qweight, self.scale = nnx.Param(q), nnx.Param(scale)

    def __call__(self, x, axis: str | None = None):
        return int4_matmul(x, self.qweight[...], self.scale[...], self.group)


class Fp8Linear(nnx.Module):
    """y = x @ kernel with the kernel stored as float8_e4m3fn `qweight` [out, in] and float32 `scale` [out]; the
    activations are quantized per token to fp8 each call."""

    def __init__(self, d_in: int, d_out: int, *, dtype, rngs: nnx.Rngs, group: int = DEFAULT_GROUP):
        q, scale = quantize_fp8(_random_kernel(rngs, d_in, d_out, dtype))
        self.qweight, self.scale = nnx.Param(q), nnx.Param(scale)

    def __call__(self, x, axis: str | None = None):
        """`axis`: a row-split linear's tensor-parallel axis, which its activation scales span (model/tp.py)."""
        return fp8_matmul(x, self.qweight[...], self.scale[...], axis)


LINEARS = {"int8": Int8Linear, "int4": Int4Linear, "fp8": Fp8Linear}


def quantize_kernel(fmt: str, w, group: int = DEFAULT_GROUP) -> tuple[jax.Array, jax.Array]:
    """(qweight, scale) of a kernel w [in, out] in format `fmt`."""
    if fmt == "int4":
        return quantize_int4(w, group)
    return {"int8": quantize_int8, "fp8": quantize_fp8}[fmt](w)


def quantize_params(flat: dict, like: dict, fmt: str, group: int = DEFAULT_GROUP) -> dict:
    """Flat full-precision parameters ({"...wqkv.kernel": w}) -> those of the quantized tree `like` (flat):
    each "<linear>.qweight" / "<linear>.scale" pair from "<linear>.kernel" (the head in int8 whatever `fmt`),
    "embed_q" / "embed_scale" (a tied int8 head) from "embed"; every other array as it is."""
    out = {}
    for name in like:
        base = name.rsplit(".", 1)[0]
        if name in ("embed_q", "embed_scale"):
            if "embed_q" not in out:
                out["embed_q"], out["embed_scale"] = quantize_int8_rows(flat["embed"])
        elif base + ".qweight" in like and name in (base + ".qweight", base + ".scale"):
            if base + ".qweight" not in out:
                out[base + ".qweight"], out[base + ".scale"] = quantize_kernel(
                    "int8" if base == "head" else fmt, flat[base + ".kernel"], group)
        else:
            out[name] = flat[name]
    return out
