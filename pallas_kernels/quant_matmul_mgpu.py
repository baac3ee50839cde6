"""Weight-only int8 and int4 matmuls on Hopper (Pallas, Mosaic GPU: TMA + wgmma, A in registers).

y [T, N] = x [T, K] @ w.T for a step's token rows T (a few in decode) against weights stored output-major (K
contiguous): int8 [N, K] with per-output-channel scales f32[N], or int4 [N, K] (glint.model.quant's packed
bytes, read as XLA's int4 type: the same bits) with bf16 scales [K / group, N], a row per group. Decode reads
the weights once per step and does almost no arithmetic, so the kernel is built to stream them: it computes
y.T = w @ x.T, with the weight as wgmma's A operand - loaded from shared memory into registers and widened there
to x's dtype (int4 in place, x's columns permuted to match: `_widen_int4`; its group scales multiply the widened
tile) - and the handful of token rows as the B operand (wgmma's N: a tile of 8 to 256 rows, a power of two, those
past T zero; wider x runs as several token tiles of MAX_ROWS rows in the same call, each streaming the weights
again, and the stages shrink to fit a wide x tile). A work unit is `2 * block_m` weight rows (two compute
warpgroups of block_m), one of `splits` ranges of K and one token tile; a persistent grid of `ctas` CTAs (one per
SM) takes the units in turn, a memory warpgroup streaming [2 * block_m, block_k] weight tiles, the matching x
tiles and int4's scale rows into `stages` shared-memory slots with TMA, one pipeline through all of a CTA's units.
`plan` picks the splits (more when N is narrow) and the depth per shape, and `resolved` the K step when block_k is 0
(int4 rows of 128 bytes stream faster than rows of 64); the splits' float32 partial sums are added (and int8's
scales applied) after the kernel, by XLA; an int4 call in one split stores its result in the asked dtype (x's by
default) itself. A compute warpgroup's output tile is transposed in registers and leaves through shared memory
OUT_COLS tokens at a time, so y comes out [T, N].

Measured on the H200 (docs/perf.md): int8 streamed at 41-56 % of 4.3 TB/s at llama3-8b's shapes (2026-12-02, then in
Warpgroup semantics; 45-54 % on gate_up and down after the move to the shared Lane-semantics body on 2026-12-03), below
XLA's own int8 (60-66 %), so the model's int8 stays on XLA; with `probe` (no multiply) the same pipeline moves 53-72 %.
int4, one token, kernel time alone: gate_up 31.3 us (45 %), down 17.5 us (40 %) on the persistent grid, from 33.2 / 18.7
us with one CTA per unit in two waves; widened in place (2026-12-03, sixth session, GPU time per call of the model's
dispatch, x's permutation included) 27.9 / 16.2 us against 32.6 / 19.0 through Mosaic's layout_cast and astype in the
same call (2.0 / 1.9x the bf16 dot; Nsight Compute: 21 % fewer instructions, 56 % of the issue slots used before; the
TMA pipeline alone, `probe`, 24.5 / 13.2 us); at block_k 256 (seventh session) 23.1 / 16.0 against 29.4 / 16.4 in the
same call (the pipeline alone 19.6 / 11.6). Tried and no faster: for int4 8 stages, 448 units chained through the
pipeline (gate_up in 4 splits), scaling each group's product instead of the widened weights (within 2 % per kernel, 2.5
% faster in the engine at batch 1 and 8 % slower at 8; again after the in-place widening, with the weights' bias left in
and taken off each chunk's float32 dot with x's chunk sums: 30.6 / 17.8 us, slower, and off the model's bf16-rounded
weights); for int8 weights pre-tiled so each step's tile is one contiguous run, one warpgroup doing both TMA and math
(plgpu.emit_pipeline), 6-8 stages, 256-wide K steps; keeping one wgmma in flight (wgmma_wait(1), slots released a step
late) gave wrong results. Wide steps (2026-12-03, fourth session, chained, against the bf16 dot's time in the same
call): int4 gate_up / down at 128 rows 1.12 / 1.32x, at 256 0.98 / 1.05x, at 512 0.83 / 0.88x, 540-570 TFLOP/s from 256
rows on; before the plan counted the partial sums (gate_up then in 4 splits from 256 rows) 0.72 / 0.80x at 1024 rows
(XLA's int4 two dots 0.73 / 0.75x) and 0.76 / 0.82x at 4096 (XLA's 0.92 / 0.84x). The model's int4 linears run this
kernel on Hopper for steps of up to `tuning.INT4_MOSAIC_MAX_ROWS` rows (model/quant.py).

Scope: bf16/f16 activations, N a multiple of 2 * block_m, K a multiple of block_k (or of one of BLOCK_K_CHOICES when
block_k is 0; int4: also whole groups of a multiple of 64 - a half-width tile needs the 32-byte swizzle - a group
dividing block_k or the other way round), a compute warpgroup's accumulator in ACC_REGISTERS registers a thread
(block_m 128 takes up to 128 rows) (llama-style shapes); `supports` and `int4_supports` say whether a call is
covered.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm

__all__ = ["QuantBlocks", "int4_matmul_t", "int4_supports", "int8_matmul_t", "int8_matmul_t_reference", "supports"]

_COMPUTE_WGS = 2
MAX_ROWS = 256  # token rows per tile: wgmma's largest N (wider x runs as several tiles, in one call)
OUT_COLS = 64  # token columns of the output tile a compute warpgroup stages in shared memory at a time


@dataclasses.dataclass(frozen=True)
class QuantBlocks:
    block_m: int = 64  # weight rows per compute warpgroup (a multiple of 64)
    block_k: int = 128  # K per pipeline step (a multiple of 128: one 128-byte swizzle of int8); 0: planned from
    #                     the shapes, one of BLOCK_K_CHOICES (`resolved`)
    stages: int = 4  # shared-memory slots per CTA (at most: as many as fit beside x's tile, `fitted`, and divide
    #                  a work unit's steps, `plan`)
    ctas: int = 132  # the persistent grid (one CTA per SM: an H200 has 132), each looping over work units
    splits: int = 0  # K ranges per weight tile; 0: planned from the shapes (`plan`)
    probe: bool = False  # stream the tiles without multiplying: a bandwidth probe (its output is not the product)

    def __post_init__(self):
        if self.block_m <= 0 or self.block_m % 64 or self.block_k < 0 or self.block_k % 128:
            raise ValueError(f"QuantBlocks: block_m {self.block_m} must be a multiple of 64 (wgmma's M) and block_k "
                             f"{self.block_k} a multiple of 128 (one 128-byte swizzle of int8), or 0 (planned)")
        if self.stages < 1 or self.ctas < 1 or self.splits < 0:
            raise ValueError(f"QuantBlocks: stages {self.stages} and ctas {self.ctas} must be >= 1, splits "
                             f"{self.splits} >= 0")

    @property
    def cta_m(self) -> int:
        return _COMPUTE_WGS * self.block_m


def _rows_tile(rows: int) -> int:
    """Token rows padded for wgmma's N: a multiple of 8, a power of two (so up to 256: one of 6 tiles)."""
    return max(8, 1 << (rows - 1).bit_length())


def _token_tiles(rows: int) -> tuple[int, int]:
    """(tile, count): x's rows as `count` token tiles of `tile` rows (`_rows_tile`, at most MAX_ROWS), one after
    another in each work unit's place, each streaming the weights again."""
    tile = _rows_tile(min(rows, MAX_ROWS))
    return tile, -(-rows // tile)


def _swizzle(minor_bytes: int) -> int:
    return plgpu.find_swizzle(8 * minor_bytes)


def _transforms(minor: int, dtype) -> tuple:
    """Tiling + swizzle of a shared-memory tile whose last dimension holds `minor` elements of `dtype`."""
    bits = jnp.iinfo(dtype).bits if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo(dtype).bits
    swizzle = _swizzle(minor * bits // 8)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


SMEM_BYTES = 232448 - 1024  # an H100/H200 CTA's shared memory, less room for the pipeline's barriers
ACC_REGISTERS = 128  # of a compute thread's ~230 (the widened weight tile and addresses take the rest)


def _scale_rows(block_k: int, group: int) -> int:
    """Rows of int4 group scales a K step of block_k reads (one when a group spans the step); group 0: int8, none."""
    return max(1, block_k // group) if group else 0


def smem_bytes(rows: int, blocks: QuantBlocks, weight_bits: int = 8, scale_rows: int = 0) -> int:
    """Shared memory the kernel takes: `stages` slots of a weight tile, an x tile and int4's scale rows, and the
    output tiles (OUT_COLS token columns at a time), counted as float32 (a bound for a call that stores bf16)."""
    tn = _rows_tile(rows)
    slot = blocks.cta_m * blocks.block_k * weight_bits // 8 + tn * blocks.block_k * 2 + scale_rows * blocks.cta_m * 2
    return blocks.stages * slot + _COMPUTE_WGS * blocks.block_m * min(tn, OUT_COLS) * 4


def fitted(rows: int, blocks: QuantBlocks, weight_bits: int = 8, scale_rows: int = 0) -> QuantBlocks:
    """`blocks` with as many of its stages as fit in shared memory beside a call's x tile (a 256-row tile takes
    64 KiB a slot at block_k 128), at least one."""
    stages = blocks.stages
    while stages > 1 and smem_bytes(rows, dataclasses.replace(blocks, stages=stages), weight_bits,
                                    scale_rows) > SMEM_BYTES:
        stages -= 1
    return dataclasses.replace(blocks, stages=stages)


def supports(rows: int, n: int, k: int, dtype, blocks: QuantBlocks = QuantBlocks(), weight_bits: int = 8,
             scale_rows: int = 0) -> bool:
    """Whether the kernel covers x dtype[rows, k] against weights [n, k] with these blocks (at least one stage in
    shared memory: a call runs as many as fit, `fitted`), with weights of `weight_bits` (int8: 8; int4: 4, via
    `int4_supports`) and `scale_rows` rows of scales per step, and a compute warpgroup's float32 accumulator
    [block_m, token tile] in at most ACC_REGISTERS registers a thread. Rows past MAX_ROWS run as further token
    tiles of the same call. With block_k 0, whether one of BLOCK_K_CHOICES covers it."""
    if not blocks.block_k:
        return any(supports(rows, n, k, dtype, dataclasses.replace(blocks, block_k=bk), weight_bits, scale_rows)
                   for bk in BLOCK_K_CHOICES)
    rows = min(rows, MAX_ROWS)
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and rows >= 1 and n > 0 and k > 0 and n % blocks.cta_m == 0 and k % blocks.block_k == 0
            and (k // blocks.block_k) % max(1, blocks.splits) == 0
            and blocks.block_m * _rows_tile(rows) <= ACC_REGISTERS * 128
            and smem_bytes(rows, dataclasses.replace(blocks, stages=1), weight_bits, scale_rows) <= SMEM_BYTES)


# The plan's cost model (H200, 2026-12-03): a CTA's pipeline step takes STEP_US per 256 weight rows of 64 bytes
# while it streams (one token: gate_up's 33 steps of [256, 128] int4 in 31.3 us, 112 units on as many CTAs),
# each byte of rows of 128 bytes or more taking WIDE_ROW_COST as long (gate_up at block_k 256: 17 steps in 23.1 us
# against 33 in 29.4, kernel time in one call; the pipeline alone 19.6 against 24.6), or its wgmmas at
# MMA_TFLOPS over the grid (the kernel's rate from 256 token rows on); XLA reads the splits' float32 partials and
# writes their sum at SUM_BYTES_PER_US.
STEP_US = 0.95
WIDE_ROW_COST = 0.75
MMA_TFLOPS = 540
SUM_BYTES_PER_US = 3.0e6
BLOCK_K_CHOICES = (128, 256)  # the K steps a block_k of 0 is planned among (`resolved`)


def _plans(n: int, k: int, blocks: QuantBlocks, rows: int, weight_bits: int,
           full_depth: int) -> list[tuple[float, int, int]]:
    """[(cost in us, splits, depth)] of each K split `blocks` allows (see `plan`); `full_depth`: the stages a
    pipeline at full speed has (fewer run proportionally slower)."""
    tiles, steps, (tn, chunks) = n // blocks.cta_m, k // blocks.block_k, _token_tiles(rows)
    row_bytes = blocks.block_k * weight_bits // 8
    stream_us = STEP_US * blocks.cta_m / 256 * row_bytes / 64 * (WIDE_ROW_COST if row_bytes >= 128 else 1.0)
    flops = 2 * blocks.cta_m * blocks.block_k * tn
    step_us = max(stream_us, flops * blocks.ctas / (MMA_TFLOPS * 1e6))

    def depth(splits: int) -> int:
        return max(d for d in range(1, min(blocks.stages, steps // splits) + 1) if steps // splits % d == 0)

    def cost(splits: int) -> float:
        units_per_cta = -(-tiles * splits * chunks // blocks.ctas)
        sums = (splits + 1) * n * chunks * tn * 4 / SUM_BYTES_PER_US if splits > 1 else 0.0
        return units_per_cta * (steps // splits + 1) * full_depth / depth(splits) * step_us + sums

    choices = [blocks.splits] if blocks.splits else [d for d in range(1, steps + 1) if steps % d == 0]
    return [(cost(d), d, depth(d)) for d in choices]


def plan(n: int, k: int, blocks: QuantBlocks, rows: int, weight_bits: int) -> tuple[int, int]:
    """(splits, stages): the K ranges per weight tile (`blocks.splits`, or planned) and the pipeline depth, the
    most slots up to `blocks.stages` that divide a work unit's steps, for `rows` token rows against weights of
    `weight_bits` (a step costs by its weight rows' bytes). A work unit is one weight tile's K range; the
    persistent grid's CTAs take them in turn, so the plan minimizes the time of the busiest CTA - counting a unit's
    epilogue as one more step and a shallower pipeline as proportionally slower - plus that of adding the splits'
    partial sums, which a wide token tile makes large (gate_up at 256 rows in 4 splits: 117 MB of them); ties go
    to fewer splits."""
    _, splits, depth = min(_plans(n, k, blocks, rows, weight_bits, blocks.stages))
    return splits, depth


def resolved(rows: int, n: int, k: int, dtype, blocks: QuantBlocks, group: int = 0) -> QuantBlocks:
    """`blocks` with a block_k of 0 replaced by the K step of BLOCK_K_CHOICES whose plan costs least for this
    call (int4 weights in groups of `group`; 0: int8), among those that cover it (ties: the smaller): 256 streams
    128-byte int4 rows but takes half the steps, so a weight tile's K splits into fewer units than there are CTAs
    sooner (llama3-8b's wo 4096 x 4096: 128 units at 128, 64 at 256). Each choice is costed against the stages
    asked for, so one that fits fewer in shared memory counts as a shallower pipeline. Blocks with a block_k, or
    none covering the call: as given."""
    if blocks.block_k:
        return blocks
    options, bits = [], 4 if group else 8
    for bk in BLOCK_K_CHOICES:
        b = dataclasses.replace(blocks, block_k=bk)
        if int4_supports(rows, n, k, group, dtype, b) if group else supports(rows, n, k, dtype, b):
            cost = min(_plans(n, k, fitted(_token_tiles(rows)[0], b, bits, _scale_rows(bk, group)), rows, bits,
                              blocks.stages))[0]
            options.append((cost, bk, b))
    return min(options)[2] if options else blocks


def _block_k_text(blocks: QuantBlocks) -> str:
    return f"block_k {blocks.block_k}" if blocks.block_k else f"block_k one of {BLOCK_K_CHOICES}"


@functools.partial(jax.jit, static_argnames=("blocks",))
def int8_matmul_t(x, q, scale, *, blocks: QuantBlocks = QuantBlocks()):
    """(x @ q.T) * scale in x's dtype. x [T, K] bf16/f16 (MAX_ROWS rows a token tile); q int8 [N, K]; scale f32 [N]."""
    if x.ndim != 2 or q.ndim != 2 or x.shape[1] != q.shape[1] or scale.shape != q.shape[:1] or q.dtype != jnp.int8:
        raise ValueError(f"int8_matmul_t: x [T, K], q int8 [N, K], scale [N] expected, got x {x.shape}, "
                         f"q {q.dtype}{list(q.shape)}, scale {scale.shape}")
    (rows, k), n = x.shape, q.shape[0]
    blocks = resolved(rows, n, k, x.dtype, blocks)
    if not supports(rows, n, k, x.dtype, blocks):
        raise ValueError(f"int8_matmul_t: x {x.dtype}{list(x.shape)} against q [{n}, {k}] is not covered by "
                         f"{blocks} (bf16/f16 rows, N % {blocks.cta_m}, K a multiple of {_block_k_text(blocks)}, "
                         f"{SMEM_BYTES} bytes of shared memory)")
    return (_partial_sums(x, q, None, blocks) * scale).astype(x.dtype)


_WGMMA = plgpu.Layout.WGMMA
_WGMMA_ROW = plgpu.Layout.WGMMA.reduce(1)
_UPCAST = {jnp.dtype(jnp.int8): plgpu.Layout.WGMMA_UPCAST_2X, jnp.dtype(jnp.int4): plgpu.Layout.WGMMA_UPCAST_4X}


def _int4_lanes(x):
    """x's columns in the order `_widen_int4` leaves each thread's weights in: within every 32 columns, column
    8p + 2t + e (wgmma's place for lane t's pair p, element e) takes x's column 8t + 4e + p (nibble p + 4e of the
    32 bits lane t loads). A transpose XLA fuses into x's producer or runs as one small copy."""
    rows, k = x.shape
    return x.reshape(rows, k // 32, 4, 2, 4).transpose(0, 1, 4, 2, 3).reshape(rows, k)


def _widen_int4(w, dtype):
    """int4 weights loaded [rows, K] in the WGMMA_UPCAST_4X layout (each thread 8 neighbouring columns of a row in
    32 bits), widened to `dtype` in place as wgmma's A operand, with no exchange between threads: each 32-bit word
    gives 4 pairs of nibbles (p, p + 4), taken to be the thread's wgmma pairs p - so the product is with x's
    columns in `_int4_lanes` order. Each pair costs a shift, a lop3 that puts the two nibbles (sign bit flipped)
    under a float exponent worth 128 (bf16) or 1024 (f16), and a packed subtract of 136 or 1032 - exact, q as the
    float. Mosaic's own astype after layout_cast spends two shuffles and six byte permutes more per word."""
    magic = {jnp.dtype(jnp.bfloat16): 0x43084308, jnp.dtype(jnp.float16): 0x64086408}[jnp.dtype(dtype)]
    op = "sub.bf16x2" if jnp.dtype(dtype) == jnp.bfloat16 else "sub.f16x2"

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
                       return_type=plgpu.ShapeDtypeStruct(w.shape, dtype, layout=plgpu.Layout.WGMMA))
    def widen(_, w):
        i32 = ir.IntegerType.get_signless(32)
        pair = ir.VectorType.get((2,), mgpu.utils.dtype_to_ir_type(dtype))
        registers = np.empty(mgpu.WGMMA_LAYOUT.registers_shape(w.shape), dtype=object)
        for index, reg in np.ndenumerate(w.registers):  # index[1]: the 32-column block
            word = mgpu.utils.bitcast(reg, i32)
            for p in range(4):
                nibbles = arith.shrui(word, arith.constant(i32, 4 * p)) if p else word
                out = llvm.inline_asm(
                    i32, [nibbles],
                    f"{{ .reg .b32 t0, t1; lop3.b32 t0, $1, 0x000F000F, {magic:#x}, 0x6a; mov.b32 t1, {magic:#x}; "
                    f"{op} $0, t0, t1; }}", "=r,r")
                registers[(index[0], 4 * index[1] + p, *index[2:])] = mgpu.utils.bitcast(out, pair)
        return mgpu.FragmentedArray(_registers=registers, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return widen(w)


def _partial_sums(x, q, group_scale, blocks: QuantBlocks, out_dtype=jnp.float32):
    """[T, N] = x @ q.T in `out_dtype`, the kernel both formats share: stored so by the kernel when K is not split, else
    from the splits' float32 partial sums, added here by XLA. q int8 or
    int4 [N, K]; group_scale None (int8: its per-channel scale is applied after) or [K / group, N] in x's dtype (int4:
    each widened tile is multiplied by its group's scales before the wgmma). A persistent grid of `blocks.ctas` CTAs
    takes the work units (a weight tile, one of `splits` ranges of K and a token tile) in turn; one pipeline runs
    through all of a CTA's units, its memory warpgroup fetching the next unit's first tiles while the compute warpgroups
    finish the last one. x's rows are read as tiles of `_token_tiles(T)` rows: one tile TMA fills past x's rows with
    zeros (x of up to 8 rows read as it is, more padded to a multiple of 8, TMA's tiling); several are read from x
    padded to whole tiles. Each compute warpgroup's [block_m, tile] result is transposed in registers (the
    WGMMA_TRANSPOSED layout) and leaves [tokens, outputs] through shared memory, OUT_COLS tokens at a time."""
    (rows, k), n = x.shape, q.shape[0]
    group = k if group_scale is None else k // group_scale.shape[0]
    bm, bk, cta_m = blocks.block_m, blocks.block_k, blocks.cta_m
    tn, chunks = _token_tiles(rows)
    bits, scale_rows = jnp.iinfo(q.dtype).bits, _scale_rows(bk, 0 if group_scale is None else group)
    blocks = fitted(tn, blocks, bits, scale_rows)
    oc = min(tn, OUT_COLS)
    splits, stages = plan(n, k, blocks, rows, bits)
    span = k // splits
    units = n // cta_m * splits * chunks
    dtype = x.dtype
    chunk = min(bk, group)  # K per wgmma: int4 applies one row of scales to each
    stored = out_dtype if splits == 1 else jnp.float32  # a split's partial sums stay float32 for XLA to add
    padded = chunks * tn if chunks > 1 else -(-rows // 8) * 8  # x's rows for TMA (up to 8 it fills them itself)
    phase = plgpu.PipelinePipeline

    def body(_, q_smem, *smem):
        *s_smem, x_smem, acc = smem
        if blocks.probe:
            return acc
        rows_wg = pl.ds(lax.axis_index("wg") * bm, bm)
        for c in range(bk // chunk):  # int4: one wgmma per group in the step, after its scales
            ck = pl.ds(c * chunk, chunk)
            w = plgpu.load(q_smem.at[rows_wg, ck], layout=_UPCAST[q.dtype])
            if s_smem:  # int4: widened in its own order (x's columns permuted to match), then its group's scales
                w = _widen_int4(w, dtype)
                s = plgpu.load(s_smem[0].at[c * chunk // group, rows_wg], layout=_WGMMA_ROW)
                w = w * lax.broadcast_in_dim(s, w.shape, [0])
            else:
                w = plgpu.layout_cast(w, _WGMMA).astype(dtype)
            plgpu.wgmma(acc, w, x_smem.at[:, ck].T)
        plgpu.wgmma_wait(0)
        return acc

    def pipeline(split, compute_context=None, state=None):
        specs = [plgpu.BlockSpec((cta_m, bk), lambda s: (0, s), transforms=_transforms(chunk, q.dtype),
                                 memory_space=plgpu.SMEM)]
        if group_scale is not None:  # the rows of scales of the groups this K step covers (or is inside)
            first = split * (span // bk)
            index = (lambda s: (first + s, 0)) if bk >= group else (lambda s: ((first + s) // (group // bk), 0))
            specs.append(plgpu.BlockSpec((scale_rows, cta_m), index, memory_space=plgpu.SMEM))
        specs.append(plgpu.BlockSpec((tn, bk), lambda s: (0, s), transforms=_transforms(bk, dtype),
                                     memory_space=plgpu.SMEM))
        return plgpu.emit_pipeline_warp_specialized(
            body if compute_context else (lambda *a: None), grid=(span // bk,), memory_registers=40, in_specs=specs,
            wg_axis="wg", num_compute_wgs=_COMPUTE_WGS, max_concurrent_steps=stages,
            compute_context=compute_context or (lambda *a: None), pipeline_state=state)

    def kernel(x_ref, q_ref, *refs, out_smem):
        *s_ref, out_ref = refs
        wg = lax.axis_index("wg")

        def operands(tile, split, token_tile):
            ks, cols = pl.ds(split * span, span), pl.ds(tile * cta_m, cta_m)
            x_rows = x_ref.at[pl.ds(token_tile * tn, tn)] if chunks > 1 else x_ref  # one tile: TMA fills past x
            return q_ref.at[cols, ks], *(r.at[:, cols] for r in s_ref), x_rows.at[:, ks]

        @functools.partial(pl.run_scoped, allocations=pipeline(0).get_allocations(*operands(0, 0, 0)),
                           collective_axes="wg")
        def _(allocations):
            @plgpu.nd_loop((units,), collective_axes="ctas")
            def _unit(info):
                # a weight tile's token tiles are neighbours, taken at once by neighbouring CTAs (one weight read
                # from memory serves them through L2)
                unit = info.index[0]
                token_tile, split, tile = unit % chunks, unit // chunks % splits, unit // (chunks * splits)

                def store(acc):  # OUT_COLS token columns at a time through shared memory
                    for c in range(0, tn, oc):
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile has left
                        out_smem.at[wg].T[...] = plgpu.layout_cast(
                            acc[:, c:c + oc].astype(stored), plgpu.Layout.WGMMA_TRANSPOSED)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(out_smem.at[wg],
                                                out_ref.at[split, pl.ds(token_tile * tn + c, oc),
                                                           pl.ds(tile * cta_m + wg * bm, bm)])

                def compute_context(eval_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, tn), jnp.float32))
                    def _(acc_ref):
                        eval_pipeline(acc_ref)
                        store(acc_ref[...])

                # a CTA's first unit fills the pipeline, its last drains it (a lone unit is both: it fills, and
                # the kernel's end needs no drain), the ones between run on from the last
                i, last = info.local_index, info.num_local_steps - 1
                state = jnp.where(i == 0, phase.START, jnp.where(i == last, phase.STOP, phase.STEADY))
                pipeline(split, compute_context, state)(*operands(tile, split, token_tile), allocations=allocations)

        plgpu.wait_smem_to_gmem(0)

    fmt = "int4" if group_scale is not None else "int8"
    partial = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, chunks * tn, n), stored),
        grid=(min(blocks.ctas, units),),
        grid_names=("ctas",),
        num_threads=_COMPUTE_WGS + 1,
        thread_name="wg",
        scratch_types={"out_smem": plgpu.SMEM((_COMPUTE_WGS, oc, bm), stored,
                                                  transforms=_transforms(bm, stored))},
        kernel_name=f"{fmt}_matmul_t_m{bm}_k{bk}_n{tn}_s{splits}_st{stages}_c{blocks.ctas}",
    )(x if rows <= 8 else jnp.pad(x, ((0, padded - rows), (0, 0))), q, *([] if group_scale is None else [group_scale]))
    return partial[0, :rows] if splits == 1 else partial[:, :rows].sum(axis=0).astype(out_dtype)


def int8_matmul_t_reference(x, q, scale):
    """The same in plain jnp: (x @ q.T) * scale, float32 accumulation, in x's dtype."""
    y = jnp.dot(x, q.T.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * scale).astype(x.dtype)


# int4 ---------------------------------------------------------------------------------------------------------------

def int4_supports(rows: int, n: int, k: int, group: int, dtype, blocks: QuantBlocks = QuantBlocks()) -> bool:
    """Whether `int4_matmul_t` covers x dtype[rows, k] against int4 weights [n, k] in groups of `group` (with
    block_k 0: with one of BLOCK_K_CHOICES)."""
    if not blocks.block_k:
        return any(int4_supports(rows, n, k, group, dtype, dataclasses.replace(blocks, block_k=bk))
                   for bk in BLOCK_K_CHOICES)
    bk = blocks.block_k
    return (group > 0 and k % group == 0 and group % 64 == 0 and (group % bk == 0 or bk % group == 0)
            and supports(rows, n, k, dtype, blocks, 4, _scale_rows(bk, group)))


@functools.partial(jax.jit, static_argnames=("blocks", "out_dtype"))
def int4_matmul_t(x, packed, scale, *, blocks: QuantBlocks = QuantBlocks(), out_dtype=None):
    """x [T, K] @ the int4 weights in `out_dtype` (x's by default): packed u8[N, K / 2] (input row 2i in byte i's
    low nibble, 2i + 1 in its high one; glint.model.quant's int4 format), scale bf16[K / group, N]. Each weight
    is q * scale rounded to x's dtype, as the model's XLA ways multiply by."""
    if x.ndim != 2 or packed.ndim != 2 or packed.dtype != jnp.uint8 or scale.ndim != 2 or \
            scale.shape[1] != packed.shape[0] or x.shape[1] != 2 * packed.shape[1]:
        raise ValueError(f"int4_matmul_t: x [T, K], packed u8[N, K / 2], scale [groups, N] expected, got x "
                         f"{x.shape}, packed {packed.dtype}{list(packed.shape)}, scale {scale.shape}")
    (rows, k), (groups, n) = x.shape, scale.shape
    if k % groups == 0:
        blocks = resolved(rows, n, k, x.dtype, blocks, k // groups)
    if k % groups or not int4_supports(rows, n, k, k // groups, x.dtype, blocks):
        raise ValueError(f"int4_matmul_t: x {x.dtype}{list(x.shape)} against int4 [{n}, {k}] in {groups} groups "
                         f"is not covered by {blocks} (bf16/f16 rows, N % {blocks.cta_m}, "
                         f"group a multiple of 64 that divides or is divided by {_block_k_text(blocks)}, "
                         f"{SMEM_BYTES} bytes of shared memory)")
    q = lax.bitcast_convert_type(packed, jnp.int4).reshape(n, k)  # the same bits, two per byte, low nibble first
    scale = scale.astype(x.dtype)
    return _partial_sums(_int4_lanes(x), q, scale, blocks, out_dtype or x.dtype)
