"""Quantized linears: weight-only int8 and int4, and fp8 weights with fp8 activations (W8A8).

A kernel w [in, out] is stored output-major, each output channel's weights contiguous, in one of three formats
(each with the matmul that reads it):
- int8: q = round(w / scale) in int8 [out, in], scale = max |w[:, j]| / 127 in float32 [out] (symmetric per
  output channel); y = (x @ q.T) * scale.
- int4: symmetric per output channel and group of `group` (even) input rows: scale = max |w[g, j]| / 7 in bfloat16
  [ceil(in / group), out] (group-major: a kernel reads a group's scales as one row), q = round(w / scale) in
  [-7, 7], packed two per byte along the input dimension (input row 2i in the low nibble, 2i + 1 in the high one;
  uint8 [out, ceil(in / group) * group / 2], zero past `in`).
- fp8: q = w / scale in float8_e4m3fn [out, in] (the K-major operand layout of Hopper's FP8 GEMM), scale =
  max |w[:, j]| / 448 in float32 [out]; each step's activations are quantized per token the same way (dynamic
  scales), the dot runs fp8 x fp8 with float32 accumulation and both scales multiply its result.
Decode is bound by reading the weights, so fewer bytes per weight is the lever. Each weight-only format runs the
formulation measured fastest per token count on the H200 (docs/perf.md, "Output-major int8 and int4" and "A
Mosaic GPU int4 kernel in the model"): int8 widens q inside XLA's dot over rows padded to 8; int4 runs the Mosaic
GPU kernel (pallas_kernels/quant_matmul_mgpu.py, nibbles widened in registers) on Hopper for steps of up to
`tuning.INT4_MOSAIC_MAX_ROWS` rows where it covers the shapes, and otherwise XLA: a reduction of each output
channel's row of nibbles for up to 3 tokens, two dots (even and odd input rows) over dequantized halves for
more. Embedding and LM head stay in the model dtype unless `quantize_head` (int8 per vocab entry,
model/transformer.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from glint.pallas_kernels import gated_fp8, quant_matmul_mgpu, tuning
from glint.pallas_kernels.varlen_attention_mgpu import is_hopper

INT8_MAX = 127
INT4_MAX = 7
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
DEFAULT_GROUP = 128
_CONTRACT_IN = (((1,), (1,)), ((), ()))  # x [T, in] . q [out, in] -> [T, out]


def _highest(dtype):
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _absmax_scale(w, axis, top: float, keepdims: bool = False):
    """max |w| along `axis` / top, 1 where that max is 0 (an all-zero channel or group)."""
    amax = jnp.max(jnp.abs(w), axis=axis, keepdims=keepdims)
    return jnp.where(amax > 0, amax / top, 1.0)


def _dot_t(x, w):
    """x [T, in] @ w.T for w [out, in] in x's dtype, float32 result."""
    return jax.lax.dot_general(x, w.astype(x.dtype), _CONTRACT_IN, preferred_element_type=jnp.float32,
                               precision=_highest(x.dtype))


# int8 -------------------------------------------------------------------------------------------------------------

def quantize_int8(w) -> tuple[jax.Array, jax.Array]:
    """w [in, out] (any float dtype) -> (q i8[out, in], scale f32[out]); an all-zero column gets scale 1."""
    w = jnp.asarray(w, jnp.float32)
    scale = _absmax_scale(w, 0, INT8_MAX)
    q = jnp.clip(jnp.round(w / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q.T, scale


def quantize_int8_rows(table) -> tuple[jax.Array, jax.Array]:
    """A table [V, H] used as a head (logits = x @ table.T) -> (q i8[V, H], scale f32[V]): one scale per row, the
    head's output channel."""
    return quantize_int8(jnp.asarray(table).T)


def dequantize_int8(q, scale, dtype=jnp.float32) -> jax.Array:
    """q [out, in] -> w [in, out]."""
    return (q.astype(jnp.float32).T * scale).astype(dtype)


INT8_MIN_ROWS = 8  # fewer rows are padded to this many (below)


def int8_matmul(x, q, scale, dtype=None):
    """x [T, in] @ dequant(q, scale) in `dtype` (x's by default): the int8 weights q [out, in] are widened inside
    the dot and the per-channel scale applied to its float32 result. Fewer than INT8_MIN_ROWS rows are padded to
    that many: on the H200 XLA's fused GEMM then streams the int8 weights faster than for one row (docs/perf.md)."""
    t = x.shape[0]
    if t < INT8_MIN_ROWS:
        x = jnp.pad(x, ((0, INT8_MIN_ROWS - t), (0, 0)))
    return (_dot_t(x, q)[:t] * scale).astype(dtype or x.dtype)


# int4 -------------------------------------------------------------------------------------------------------------

def quantize_int4(w, group: int = DEFAULT_GROUP) -> tuple[jax.Array, jax.Array]:
    """w [in, out] -> (packed u8[out, ceil(in / group) * group / 2], scale bf16[ceil(in / group), out]); q is
    rounded against the stored (bfloat16) scale, so dequantizing is exactly q * scale."""
    if group < 2 or group % 2:
        raise ValueError(f"int4 group {group} must be even and >= 2 (two input rows per byte, whole bytes per group)")
    w = jnp.asarray(w, jnp.float32)
    k, n = w.shape
    groups = -(-k // group)
    wt = jnp.pad(w.T, ((0, 0), (0, groups * group - k))).reshape(n, groups, group)
    scale = _absmax_scale(wt, 2, INT4_MAX).astype(jnp.bfloat16)
    q = jnp.clip(jnp.round(wt / scale.astype(jnp.float32)[..., None]), -INT4_MAX, INT4_MAX)
    q = q.astype(jnp.int8).reshape(n, groups * group)
    packed = (q[:, 0::2] & 0xF) | (q[:, 1::2] << 4)
    return packed.astype(jnp.uint8), scale.T


def _nibbles(packed):
    """u8[out, K / 2] -> the signed values of the low (even input rows) and high (odd rows) nibbles, int8 each."""
    signed = jax.lax.bitcast_convert_type(packed, jnp.int8)
    return jnp.left_shift(signed, 4) >> 4, signed >> 4


def _dequantized_halves(packed, scale, dtype):
    """The weights of the even and of the odd input rows, each [out, K / 2]: q * scale in float32, then `dtype`."""
    groups, n = scale.shape
    s = scale.T.astype(jnp.float32)[..., None]
    return tuple((v.astype(jnp.float32).reshape(n, groups, -1) * s).reshape(n, -1).astype(dtype)
                 for v in _nibbles(packed))


def dequantize_int4(packed, scale, k: int | None = None, dtype=jnp.float32) -> jax.Array:
    """-> w [k, out] (k: the kernel's input rows; all of the packed ones, zero past the kernel's, by default)."""
    w = jnp.stack(_dequantized_halves(packed, scale, dtype), axis=-1).reshape(packed.shape[0], -1).T
    return w if k is None else w[:k]


# Up to this many rows reduce over the packed weights, more dequantize them inside dots (below): per llama3-8b
# layer on the H200 the reductions take 100 / 173 / 323 us at 1 / 2 / 4 rows, the dots 297 at 4 (docs/perf.md).
INT4_ROW_MAX = 3


def _int4_rows(x, packed, scale):
    """x [T, K] . the weights of each output channel in float32, one pass over the packed weights per row of x:
    the low nibbles meet x's even columns, the high ones its odd columns. The weights are dequantized to x's dtype
    first, as `_int4_dot` does, so both ways multiply by the same weights whatever the step's width."""
    groups, n = scale.shape
    lo, hi = (v.astype(jnp.float32).reshape(n, groups, -1) for v in _dequantized_halves(packed, scale, x.dtype))
    x32 = x.astype(jnp.float32)
    xe, xo = (v.reshape(x.shape[0], 1, groups, -1) for v in (x32[:, 0::2], x32[:, 1::2]))
    return jnp.sum(lo * xe + hi * xo, axis=(2, 3))


def _int4_dot(x, packed, scale):
    """x [T, K] @ the dequantized weights as two dots, x's even columns against the low nibbles and its odd ones
    against the high: each half dequantizes element-wise. (Interleaving the nibbles back into one [out, K] operand
    ran at 4 % of the H200's bandwidth, these at 6-9 %; writing the halves to memory first was no faster.)"""
    lo, hi = _dequantized_halves(packed, scale, x.dtype)
    return _dot_t(x[:, 0::2], lo) + _dot_t(x[:, 1::2], hi)


def int4_matmul(x, packed, scale, dtype=None):
    """x [T, in] @ dequant(packed, scale) in `dtype` (x's by default): the Mosaic GPU kernel where it runs (Hopper,
    steps of up to tuning.INT4_MOSAIC_MAX_ROWS rows, shapes it covers); else up to INT4_ROW_MAX rows each row is
    reduced against the packed weights (read once per row) and wider steps dequantize the weights inside two dots
    (`_int4_dot`; docs/perf.md). All three multiply by the same bf16-rounded weights."""
    pad = 2 * packed.shape[1] - x.shape[1]
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)))
    if _int4_on_mosaic(x, packed, scale):
        y = quant_matmul_mgpu.int4_matmul_t(x, packed, scale, blocks=_int4_blocks(x.shape[0]),
                                            out_dtype=dtype or x.dtype)
    elif x.shape[0] <= INT4_ROW_MAX:
        y = _int4_rows(x, packed, scale)
    else:
        y = _int4_dot(x, packed, scale)
    return y.astype(dtype or x.dtype)


_INT4_BLOCKS = {rows: quant_matmul_mgpu.QuantBlocks(**b) for rows, b in tuning.INT4_MOSAIC_BLOCKS.items()}


def _int4_blocks(rows: int) -> quant_matmul_mgpu.QuantBlocks:
    """The kernel's blocks for a step of `rows` token rows: those of the smallest bound that holds it (the widest
    bound's past it, whose calls run quant_matmul_mgpu.MAX_ROWS-row token tiles one after another)."""
    return _INT4_BLOCKS[min((b for b in _INT4_BLOCKS if b >= rows), default=max(_INT4_BLOCKS))]


def _int4_on_mosaic(x, packed, scale) -> bool:
    """Whether this call runs the Mosaic GPU kernel: a Hopper GPU, a step of up to tuning.INT4_MOSAIC_MAX_ROWS
    rows, shapes it covers."""
    (rows, k), (groups, n) = x.shape, scale.shape
    return (rows <= tuning.INT4_MOSAIC_MAX_ROWS and k % groups == 0 and is_hopper()
            and quant_matmul_mgpu.int4_supports(rows, n, k, k // groups, x.dtype, _int4_blocks(rows)))


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


def _fp8_product(xq, q, dtype):
    """fp8 x fp8 (q [out, in]) accumulated in float32, written as tuning.FP8_GEMM_OUT for activations of `dtype`
    bfloat16 and in float32 for others: never coarser than the activations (a float32 model rounded to bfloat16
    here would part from itself over 2 devices at bfloat16's resolution, tests/test_tp.py)."""
    out = tuning.FP8_GEMM_OUT if jnp.dtype(dtype) == jnp.bfloat16 else "float32"
    return jax.lax.dot_general(xq, q, _CONTRACT_IN, preferred_element_type=jnp.dtype(out))


def _fp8_scaled_product(xq, xscale, q, scale, dtype):
    """The fp8 product of per-token quantized xq (xscale [T, 1]) and q [out, in] (scale [out]), scaled, in dtype."""
    return (_fp8_product(xq, q, dtype).astype(jnp.float32) * xscale * scale).astype(dtype)


def fp8_matmul(x, q, scale, axis: str | None = None):
    """x [T, in] @ w: x quantized per token to fp8, an fp8 x fp8 dot (q [out, in]) with float32 accumulation, then
    the token and channel scales (`axis`: see `quantize_activations_fp8`)."""
    xq, xscale = quantize_activations_fp8(x, axis)
    return _fp8_scaled_product(xq, xscale, q, scale, x.dtype)


def fuses_fp8_mlp(gate_up, down, activation: str, axis: str | None) -> bool:
    """Whether an MLP runs `fp8_gated_mlp`: tuning.FP8_GATED_KERNEL on (off by default: not yet faster), fp8
    linears, SiLU, one device (under tensor parallelism down's activation scales span the devices), a Hopper GPU
    (the Triton kernel's fp8 casts need sm_89+)."""
    return (isinstance(gate_up, Fp8Linear) and isinstance(down, Fp8Linear) and activation == "silu"
            and axis is None and bool(tuning.FP8_GATED_KERNEL) and is_hopper())


def fp8_gated_mlp(x, gate_up, down, *, interpret: bool = False):
    """down(SiLU(g) * u) with (g, u) = gate_up(x), both Fp8Linear, as the two fp8_matmul calls with XLA's SiLU
    between them compute it, but gate_up's raw product goes straight to down's fp8 input in one kernel
    (pallas_kernels/gated_fp8.py) instead of XLA's two passes over it. The kernel keeps SiLU(g) * u in float32
    where the unfused path rounds it to the activations' dtype op by op, so the fp8 hidden may differ by an e4m3
    step where the two roundings disagree."""
    xq, xscale = quantize_activations_fp8(x)
    hq, hscale = gated_fp8.gated_quantize_fp8(_fp8_product(xq, gate_up.qweight[...], x.dtype), xscale,
                                              gate_up.scale[...], interpret=interpret)
    return _fp8_scaled_product(hq, hscale, down.qweight[...], down.scale[...], x.dtype)


# modules ----------------------------------------------------------------------------------------------------------

def _random_kernel(rngs: nnx.Rngs, d_in: int, d_out: int, dtype):
    w = jax.random.normal(rngs.params(), (d_in, d_out), jnp.float32) * d_in ** -0.5
    return w.astype(dtype)


class Int8Linear(nnx.Module):
    """y = x @ kernel with the kernel stored as int8 `qweight` [out, in] and float32 `scale` [out]."""

    def __init__(self, d_in: int, d_out: int, *, dtype, rngs: nnx.Rngs, group: int = DEFAULT_GROUP):
        q, scale = quantize_int8(_random_kernel(rngs, d_in, d_out, dtype))
        self.qweight, self.scale = nnx.Param(q), nnx.Param(scale)

    def __call__(self, x, axis: str | None = None):
        return int8_matmul(x, self.qweight[...], self.scale[...])


class Int4Linear(nnx.Module):
    """y = x @ kernel with the kernel stored as packed int4 `qweight` u8[out, ceil(in / group) * group / 2] and
    bfloat16 group scales `scale` [ceil(in / group), out]."""

    def __init__(self, d_in: int, d_out: int, *, dtype, rngs: nnx.Rngs, group: int = DEFAULT_GROUP):
        q, scale = quantize_int4(_random_kernel(rngs, d_in, d_out, dtype), group)
        self.qweight, self.scale = nnx.Param(q), nnx.Param(scale)

    def __call__(self, x, axis: str | None = None):
        return int4_matmul(x, self.qweight[...], self.scale[...])


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
