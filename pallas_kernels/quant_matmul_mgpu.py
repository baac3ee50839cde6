"""Weight-only int8 matmul for decode widths on Hopper (Pallas, Mosaic GPU: TMA + wgmma with A in registers).

y [T, N] = (x [T, K] @ q.T) * scale for a few rows T (a decode step's tokens) against q i8[N, K] (the weight
stored output-major, K contiguous) with per-output-channel scales f32[N]. Decode reads q once per step and
does almost no arithmetic, so the kernel is built to stream q: it computes y.T = q @ x.T, with the weight as
wgmma's A operand - loaded from shared memory into registers and widened there to x's dtype - and the
handful of token rows, padded to a multiple of 8, as the B operand (wgmma's N can be as small as 8). Each CTA
owns `2 * block_m` weight rows (two compute warpgroups of block_m) and one of `splits` ranges of K; a memory
warpgroup streams [2 * block_m, block_k] int8 tiles and the matching x tiles into `stages` shared-memory slots
with TMA. Splitting K keeps every SM busy when N is narrow; the splits' float32 partial sums are added (and
the scales applied) after the kernel, by XLA.

Measured on the H200 (docs/perf.md, 2026-12-02): correct, but it streams int8 at 41-56 % of 4.3 TB/s at
llama3-8b's shapes (bf16 through XLA: 69-86 %), about XLA's own int8 (43-49 %); with `probe` (no multiply)
the same pipeline moves 53-72 %. Not wired into the model. Tried and dropped (no faster): weights pre-tiled
so each step's tile is one contiguous run, one warpgroup doing both TMA and math (plgpu.emit_pipeline), 6-8
stages, 256-wide K steps; keeping one wgmma in flight (wgmma_wait(1), slots released a step late) gave wrong
results.

Scope: bf16/f16 activations, N a multiple of 2 * block_m, K a multiple of block_k (llama-style shapes);
`supports` says whether a call is covered.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = ["QuantBlocks", "int8_matmul_t", "int8_matmul_t_reference", "supports"]

_COMPUTE_WGS = 2
MAX_ROWS = 64  # decode widths (wider steps are compute-bound: a plain GEMM's job)


@dataclasses.dataclass(frozen=True)
class QuantBlocks:
    block_m: int = 64  # weight rows per compute warpgroup (a multiple of 64)
    block_k: int = 128  # K per pipeline step (a multiple of 128: one 128-byte swizzle of int8)
    stages: int = 4  # shared-memory slots in flight per CTA
    min_ctas: int = 264  # split K until the grid has this many CTAs (2 per H200 SM)
    probe: bool = False  # stream the tiles without multiplying: a bandwidth probe (its output is not the product)

    def __post_init__(self):
        if self.block_m <= 0 or self.block_m % 64 or self.block_k <= 0 or self.block_k % 128:
            raise ValueError(f"QuantBlocks: block_m {self.block_m} must be a multiple of 64 (wgmma's M) and block_k "
                             f"{self.block_k} a multiple of 128 (one 128-byte swizzle of int8)")
        if self.stages < 1 or self.min_ctas < 1:
            raise ValueError(f"QuantBlocks: stages {self.stages} and min_ctas {self.min_ctas} must be >= 1")

    @property
    def cta_m(self) -> int:
        return _COMPUTE_WGS * self.block_m


def _rows_tile(rows: int) -> int:
    """Token rows padded for wgmma's N: a multiple of 8, a power of two."""
    return max(8, 1 << (rows - 1).bit_length())


def _swizzle(minor_bytes: int) -> int:
    return plgpu.find_swizzle(8 * minor_bytes)


def _transforms(minor: int, dtype) -> tuple:
    """Tiling + swizzle of a shared-memory tile whose last dimension holds `minor` elements of `dtype`."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = _swizzle(minor * itemsize)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def supports(rows: int, n: int, k: int, dtype, blocks: QuantBlocks = QuantBlocks()) -> bool:
    """Whether `int8_matmul_t` covers x dtype[rows, k] against q [n, k] with these blocks."""
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and 1 <= rows <= MAX_ROWS and n > 0 and k > 0 and n % blocks.cta_m == 0 and k % blocks.block_k == 0)


def num_splits(n: int, k: int, blocks: QuantBlocks) -> int:
    """K ranges per weight tile: the fewest that give min_ctas CTAs, each a whole number of block_k steps."""
    tiles, steps = n // blocks.cta_m, k // blocks.block_k
    want = max(1, min(steps, -(-blocks.min_ctas // tiles)))
    return min(d for d in range(want, steps + 1) if steps % d == 0)


@functools.partial(jax.jit, static_argnames=("blocks",))
def int8_matmul_t(x, q, scale, *, blocks: QuantBlocks = QuantBlocks()):
    """(x @ q.T) * scale in x's dtype. x [T, K] bf16/f16 with 1 <= T <= 64; q int8 [N, K]; scale f32 [N]."""
    if x.ndim != 2 or q.ndim != 2 or x.shape[1] != q.shape[1] or scale.shape != q.shape[:1] or q.dtype != jnp.int8:
        raise ValueError(f"int8_matmul_t: x [T, K], q int8 [N, K], scale [N] expected, got x {x.shape}, "
                         f"q {q.dtype}{list(q.shape)}, scale {scale.shape}")
    (rows, k), n = x.shape, q.shape[0]
    if not supports(rows, n, k, x.dtype, blocks):
        raise ValueError(f"int8_matmul_t: x {x.dtype}{list(x.shape)} against q [{n}, {k}] is not covered by "
                         f"{blocks} (1..{MAX_ROWS} bf16/f16 rows, N % {blocks.cta_m}, "
                         f"K % {blocks.block_k})")
    bm, bk = blocks.block_m, blocks.block_k
    cta_m = blocks.cta_m
    tn = _rows_tile(rows)
    splits = num_splits(n, k, blocks)
    span = k // splits
    dtype = x.dtype

    def kernel(x_ref, q_ref, out_ref, out_smem):
        tile, split, wg = lax.axis_index("tiles"), lax.axis_index("splits"), lax.axis_index("wg")
        ks = pl.ds(split * span, span)

        def body(_, q_smem, x_smem, acc_ref):
            if blocks.probe:
                return acc_ref
            a = q_smem[pl.ds(wg * bm, bm)].astype(dtype)  # widened in registers
            plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(x_smem, (1, 0)))
            plgpu.wgmma_wait(0)
            return acc_ref

        def compute_context(eval_pipeline):
            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, tn), jnp.float32))
            def _(acc_ref):
                eval_pipeline(acc_ref)
                out_smem[wg] = acc_ref[...]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[wg], out_ref.at[split, pl.ds(tile * cta_m + wg * bm, bm)])
                plgpu.wait_smem_to_gmem(0)

        pipeline = plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(span // bk,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((cta_m, bk), lambda s: (0, s), transforms=_transforms(bk, jnp.int8),
                                memory_space=plgpu.SMEM),
                plgpu.BlockSpec((tn, bk), lambda s: (0, s), transforms=_transforms(bk, dtype),
                                memory_space=plgpu.SMEM),
            ],
            wg_axis="wg",
            num_compute_wgs=_COMPUTE_WGS,
            max_concurrent_steps=blocks.stages,
            compute_context=compute_context,
        )
        pipeline(q_ref.at[pl.ds(tile * cta_m, cta_m), ks], x_ref.at[:, ks])

    x_pad = jnp.pad(x, ((0, tn - rows), (0, 0)))
    partial = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, n, tn), jnp.float32),
        grid=(n // cta_m, splits),
        grid_names=("tiles", "splits"),
        num_threads=_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types={"out_smem": plgpu.SMEM((_COMPUTE_WGS, bm, tn), jnp.float32,
                                                  transforms=_transforms(tn, jnp.float32))},
        kernel_name=f"int8_matmul_t_m{bm}_k{bk}_n{tn}_s{splits}",
    )(x_pad, q)
    return (partial.sum(axis=0)[:, :rows] * scale[:, None]).T.astype(dtype)


def int8_matmul_t_reference(x, q, scale):
    """The same in plain jnp: (x @ q.T) * scale, float32 accumulation, in x's dtype."""
    y = jnp.dot(x, q.T.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * scale).astype(x.dtype)
