"""Weight-only int8 matmul for decode widths (Pallas, Triton backend): y = (x @ q) * scale.

x [M, K] (few rows: a decode step's tokens) against q i8[K, N] with per-output-channel scales f32[N]. Decode
is bound by reading q, so the kernel streams int8 tiles [block_k, block_n] and widens them in registers; XLA's
own dequantize-then-dot reads int8 at 30-41 % of the bandwidth on the H200 (docs/perf.md). Programs tile N
and split K (so that a narrow N still fills the GPU); the splits' float32 partial sums are added after.
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
        return acc + jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, steps, body, jnp.zeros((block_m, block_n), jnp.float32))
    scale = plgpu.load(scale_ref.at[n], mask=n_ok, other=0.0)
    plgpu.store(out_ref.at[split, m[:, None], n[None, :]], acc * scale[None, :], mask=n_ok[None, :])


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
    if not 1 <= x.shape[0] <= 64:
        raise ValueError(f"int8_matmul: {x.shape[0]} rows; the kernel serves decode widths of 1..64 rows")
    return _int8_matmul_call(x, q, scale, blocks=blocks, interpret=interpret)


def int8_matmul_reference(x, q, scale):
    """The same in plain jnp (what glint.model.quant.int8_matmul computes)."""
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    y = jnp.dot(x, q.astype(x.dtype), preferred_element_type=jnp.float32, precision=precision)
    return (y * scale).astype(x.dtype)
