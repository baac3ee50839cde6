"""Weight-only int8 matmul for decode widths (Pallas, Triton backend): y = (x @ q) * scale.

x [M, K] (few rows: a decode step's tokens) against q i8[K, N] with per-output-channel scales f32[N]. Decode
is bound by reading q, so the kernel streams int8 tiles [block_k, block_n] and widens them in registers; XLA's
own dequantize-then-dot reads int8 at 30-41 % of the bandwidth on the H200 (docs/perf.md). Programs tile N
and split K (so that a narrow N still fills the GPU); the splits' float32 partial sums are added after.
Two ways to load the tiles: "gather" (index arrays and masks, any shape) and "block" (BlockSpecs over the
program's K range and N tile, contiguous loads; pads shapes that are not multiples of the tiles).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["Int8Blocks", "int8_matmul", "int8_matmul_reference"]


@dataclasses.dataclass(frozen=True)
class Int8Blocks:
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    min_programs: int = 264  # split K until the grid has this many programs (2 per H200 SM)
    loads: str = "gather"  # or "block"


def _precision(dtype):
    """float32 at full precision (IEEE, not TF32) on the GPU, as the model's own matmuls."""
    return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _int8_matmul_kernel(
    x_ref,  # [block_m, K] x dtype (rows padded)
    q_ref,  # i8[K, N]
    scale_ref,  # f32[N]
    out_ref,  # f32[splits, block_m, N]
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    steps: int,
):
    tile, split = pl.program_id(0), pl.program_id(1)
    num_k, num_n = q_ref.shape
    n = tile * block_n + jnp.arange(block_n, dtype=jnp.int32)
    m = jnp.arange(block_m, dtype=jnp.int32)
    n_ok = n < num_n

    def body(i, acc):
        k = (split * steps + i) * block_k + jnp.arange(block_k, dtype=jnp.int32)
        k_ok = k < num_k
        x = plgpu.load(x_ref.at[m[:, None], k[None, :]], mask=k_ok[None, :], other=0)  # [bm, bk]
        w = plgpu.load(q_ref.at[k[:, None], n[None, :]], mask=k_ok[:, None] & n_ok[None, :], other=0)  # i8[bk, bn]
        return acc + jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32,
                         precision=_precision(x.dtype))

    acc = lax.fori_loop(0, steps, body, jnp.zeros((block_m, block_n), jnp.float32))
    scale = plgpu.load(scale_ref.at[n], mask=n_ok, other=0.0)
    plgpu.store(out_ref.at[split, m[:, None], n[None, :]], acc * scale[None, :], mask=n_ok[None, :])


def _int8_matmul_block_kernel(
    x_ref,  # [block_m, steps * block_k]: this program's K range
    q_ref,  # i8[steps * block_k, block_n]
    scale_ref,  # f32[block_n]
    out_ref,  # f32[1, block_m, block_n]
    *,
    block_k: int,
    steps: int,
):
    def body(i, acc):
        x = x_ref[:, pl.ds(i * block_k, block_k)]  # [bm, bk]
        w = q_ref[pl.ds(i * block_k, block_k), :]  # i8[bk, bn]
        return acc + jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32,
                         precision=_precision(x.dtype))

    acc = lax.fori_loop(0, steps, body, jnp.zeros(out_ref.shape[1:], jnp.float32))
    out_ref[0] = acc * scale_ref[...][None, :]


def _int8_matmul_block_call(x_pad, q, scale, *, blocks: Int8Blocks, interpret: bool):
    """The "block" way: K split into `splits` ranges of `steps` tiles dividing it exactly (padded otherwise)."""
    block_m, num_k = x_pad.shape
    num_n = q.shape[1]
    bn, bk = blocks.block_n, blocks.block_k
    tiles, k_blocks = pl.cdiv(num_n, bn), pl.cdiv(num_k, bk)
    want = max(1, min(k_blocks, pl.cdiv(blocks.min_programs, tiles)))
    splits = max(d for d in range(1, want + 1) if k_blocks % d == 0)
    steps = k_blocks // splits
    pad_k, pad_n = k_blocks * bk - num_k, tiles * bn - num_n
    if pad_k or pad_n:  # the model's shapes are multiples of the tiles; this copies q
        x_pad = jnp.pad(x_pad, ((0, 0), (0, pad_k)))
        q, scale = jnp.pad(q, ((0, pad_k), (0, pad_n))), jnp.pad(scale, (0, pad_n))
    span = steps * bk
    partial = pl.pallas_call(
        functools.partial(_int8_matmul_block_kernel, block_k=bk, steps=steps),
        grid=(tiles, splits),
        in_specs=[pl.BlockSpec((block_m, span), lambda t, s: (0, s)),
                  pl.BlockSpec((span, bn), lambda t, s: (s, t)),
                  pl.BlockSpec((bn,), lambda t, s: (t,))],
        out_specs=pl.BlockSpec((1, block_m, bn), lambda t, s: (s, 0, t)),
        out_shape=jax.ShapeDtypeStruct((splits, block_m, tiles * bn), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name=f"int8_matmul_block_m{block_m}_n{bn}_k{bk}_s{splits}",
    )(x_pad, q, scale)
    return partial[:, :, :num_n]


def _int8_matmul_call(x, q, scale, *, blocks: Int8Blocks, interpret: bool):
    num_rows, num_k = x.shape
    num_n = q.shape[1]
    block_m = max(16, 1 << (num_rows - 1).bit_length())  # tl.dot needs 16 rows
    tiles = pl.cdiv(num_n, blocks.block_n)
    k_blocks = pl.cdiv(num_k, blocks.block_k)
    splits = max(1, min(k_blocks, pl.cdiv(blocks.min_programs, tiles)))
    steps = pl.cdiv(k_blocks, splits)
    splits = pl.cdiv(k_blocks, steps)
    x_pad = jnp.zeros((block_m, num_k), x.dtype).at[:num_rows].set(x)
    if blocks.loads == "block":
        partial = _int8_matmul_block_call(x_pad, q, scale, blocks=blocks, interpret=interpret)
        return partial.sum(axis=0)[:num_rows].astype(x.dtype)
    partial = pl.pallas_call(
        functools.partial(_int8_matmul_kernel, block_m=block_m, block_n=blocks.block_n, block_k=blocks.block_k,
                          steps=steps),
        grid=(tiles, splits),
        out_shape=jax.ShapeDtypeStruct((splits, block_m, num_n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name=f"int8_matmul_m{block_m}_n{blocks.block_n}_k{blocks.block_k}_s{splits}",
    )(x_pad, q, scale)
    return partial.sum(axis=0)[:num_rows].astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def int8_matmul(x, q, scale, *, blocks: Int8Blocks = Int8Blocks(), interpret: bool = False):
    """(x @ q) * scale in x's dtype.

    x: [M, K] bfloat16/float16/float32, M <= 64 (decode widths); q: int8[K, N]; scale: float32[N].
    """
    if x.ndim != 2 or q.ndim != 2 or scale.ndim != 1 or x.shape[1] != q.shape[0] or scale.shape[0] != q.shape[1]:
        raise ValueError(f"int8_matmul: x [M, K], q [K, N], scale [N] expected, got x {x.shape}, q {q.shape}, "
                         f"scale {scale.shape}")
    if q.dtype != jnp.int8 or scale.dtype != jnp.float32:
        raise ValueError(f"int8_matmul: q must be int8 and scale float32, got {q.dtype} and {scale.dtype}")
    if blocks.loads not in ("gather", "block"):
        raise ValueError(f"int8_matmul: loads={blocks.loads!r} must be 'gather' or 'block'")
    if not 1 <= x.shape[0] <= 64:
        raise ValueError(f"int8_matmul: {x.shape[0]} rows; the kernel serves decode widths of 1..64 rows")
    return _int8_matmul_call(x, q, scale, blocks=blocks, interpret=interpret)


def int8_matmul_reference(x, q, scale):
    """The same in plain jnp (glint.model.quant.int8_matmul computes it from q.T: the model stores [N, K])."""
    y = jnp.dot(x, q.astype(x.dtype), preferred_element_type=jnp.float32, precision=_precision(x.dtype))
    return (y * scale).astype(x.dtype)
