"""Tuned block sizes for the Pallas kernels: data only, read by the kernel files.

Keys are (path, padded head_dim); values are `BlockSizes` fields. "decode" is
the tile used when the step averages at most `DECODE_ROWS_PER_SEGMENT` query
rows per segment (split-K capable); "prefill" is everything else.
Provenance: starting points from JAX's pallas/ops/gpu attention kernels,
timed on one H200 with tools/gpu_kernels.py (2026-11-30; Hq 32 / Hkv 8, D 128,
bf16, page 16). Decode: block_m 16 / block_k 128 / 2 stages ran 2-8% faster
than the table's block_k 64 / 3 stages on 8x32k, 64x16k and 256x4k but was not
value-checked on the GPU, so the table keeps the checked entry. Prefill:
block_m 128 with 8 warps ran 5-13% slower than block_m 64 with 4 warps.
2026-12-01 (tools/gpu_prefill_probe.py): prefill head_dim 128 block_m 128 with
4 warps / 3 stages ran 0-11% faster than block_m 64 on causal 16x512 .. 2x4096
and passed the GPU sweep, so it replaced it. Open question: on Hopper the
Mosaic kernel now takes the long segments, and Triton mostly runs short ones,
where block_m 64 (16 query rows per tile at GQA 4) pads less; re-measure the
bench's 2048/4096-wide buckets with both.
"""

ATTENTION_BLOCKS = {
    ("prefill", 16): dict(block_m=64, block_k=64, num_warps=4, num_stages=2),
    ("prefill", 32): dict(block_m=64, block_k=64, num_warps=4, num_stages=2),
    ("prefill", 64): dict(block_m=64, block_k=64, num_warps=4, num_stages=3),
    ("prefill", 128): dict(block_m=128, block_k=64, num_warps=4, num_stages=3),
    ("prefill", 256): dict(block_m=64, block_k=32, num_warps=8, num_stages=2),
    ("decode", 16): dict(block_m=16, block_k=64, num_warps=4, num_stages=2),
    ("decode", 32): dict(block_m=16, block_k=64, num_warps=4, num_stages=2),
    ("decode", 64): dict(block_m=16, block_k=64, num_warps=4, num_stages=3),
    ("decode", 128): dict(block_m=16, block_k=64, num_warps=4, num_stages=3),
    ("decode", 256): dict(block_m=16, block_k=32, num_warps=4, num_stages=2),
    # fp8 (scaled) pools: keys of 128 bytes a head, so twice the keys per block for the same bytes in flight.
    # 2026-12-03 (tenth session, tools/gpu_fp8_kv.py --sweep, float16 dots, chained): 64 x 4096 keys 293 us against
    # 358 with the decode tile (bf16 pools' best 336); 256 x 640 244 against 295 (bf16 pools' best 259).
    ("decode-fp8", 128): dict(block_m=16, block_k=128, num_warps=4, num_stages=3),
}

# A step is "decode" when T <= DECODE_ROWS_PER_SEGMENT * S.
DECODE_ROWS_PER_SEGMENT = 4

# Split-K aims for this many programs (about eight per H200 multiprocessor),
# never more than MAX_SPLITS splits, nor fewer than MIN_BLOCKS_PER_SPLIT key
# blocks per split. MAX_SPLITS 32 (was 16), 2026-12-01 (tools/gpu_decode_splits.py): one sequence at 32k
# keys ran 67.8 us at 32 splits against 96.0 at 16 (cuDNN 72.2), chained. MIN_BLOCKS_PER_SPLIT 1 (was 4),
# 2026-12-02 (tools/gpu_decode_profile.py, llama3-8b batch 1 at 512 keys in a 768-key table): 12 splits
# (8 of one block, 4 empty) against 3 of 3/3/2 blocks took the attention and its merge from 303 to 256 us per
# token by the trace's kernel sums (6 splits: 292.5), about 1 % of the token; a step that few sequences decode
# wants its programs more than fewer merges. Since then up to 32 splits is reachable below 2k keys, where the
# microbenchmarks are mixed (docs/perf.md).
TARGET_PROGRAMS = 1024
MAX_SPLITS = 32
MIN_BLOCKS_PER_SPLIT = 1

RING_WRITE_NUM_WARPS = 4
# qkv_write (one program per row, a row's q heads as two f32 [Hq, D / 2] halves): 4 warps, as measured in the
# llama3-8b decode profile of 2026-12-02 (1.9-2.7 us per layer at batch 1); other counts not yet timed.
QKV_WRITE_NUM_WARPS = 4

# Prefill steps on Hopper: "mosaic" runs varlen_attention_mgpu (TMA + wgmma) where it covers the call,
# "triton" keeps the Triton kernel. MOSAIC_PREFILL: that kernel's tile (rows per compute warpgroup,
# keys per block, shared-memory stages).
PREFILL_BACKEND = "mosaic"
MOSAIC_PREFILL = dict(block_q=64, block_kv=128, num_stages=2)
# MOSAIC_PREFILL_MAX_CTAS: 0 launches a CTA per work item (tile, query head); N > 0 a persistent grid of at most N
# CTAs, each over every N-th item, its memory warpgroup streaming the next item's key blocks while this one's are
# computed. On an H100 (2026-12-06, tools/gpu_prefill_probe.py --mosaic, causal, 132 CTAs) it ran 0.83-1.02x the
# CTA-per-item grid from 16 x 512 to 4 x 2048 and 0.60 / 0.72x at 2 x 4096 / 1 x 8192: off. Not for an uneven
# split: CTA c's items c, c + N, ... hold 1.08-1.21x the mean CTA's key blocks there (docs/perf.md); cause unknown.
MOSAIC_PREFILL_MAX_CTAS = 0
# Ring layers, sliding windows and soft-caps stay on Triton under "auto" while this is set: the Mosaic prefill
# kernel covers them (2026-12-04, seventeenth session) but has so far run them only in the GPU interpreter.
MOSAIC_PREFILL_PLAIN_ONLY = True
# Decode steps on Hopper: "mosaic" runs decode_attention_mgpu (a kv head's query group packed into one wgmma tile,
# TMA page copies, split-K) where it covers the call, "triton" keeps the Triton kernel. MOSAIC_DECODE: its keys
# per block, shared-memory stages and P @ V from registers; split-K aims at MOSAIC_DECODE_CTAS CTAs (one wave, each
# CTA of 128-key blocks holding most of a multiprocessor's shared memory), rounded down (num_splits_for).
# 2026-12-04 (sixteenth session, tools/gpu_decode_mgpu.py, GQA 32/8, D 128, bf16, page 16, chained, docs/perf.md):
# P in registers ran 1.01-1.22x P through shared memory from batch 8 up (three runs; 0.88-1.16x at batch 1), so it
# is the default. Chained against Triton: 1.01-1.03x at 4k+ keys from batch 64, 0.98x at 256 x 640, 0.68-1.21x at
# batch 1 and 8; against cuDNN 0.87-0.97x from batch 64, 0.70-1.02x at batch 1 and 8. Not ahead of Triton where
# the engine spends its decode time (batch 1 with short contexts, 256 x 640), so Triton stays the default.
DECODE_BACKEND = "triton"
# widen_warpgroup (fp8 pools): a third warpgroup widens each fp8 block while the compute warpgroup runs the one
# before, where its tiles fit. 2026-12-06 (H100, 256 x 640, .gpu/ab_widen.py, chained us, Triton 158.7 / 160.7 in the
# same processes): unscaled fp8 in pages of 16 230.9 without, 214.5 with float16 dots, 203.0 widened apart, 188.1
# both, **151.6 / 151.1** both on a persistent grid of 132 CTAs (1.05-1.06x Triton; separate calls 0.99-1.00x); a
# scaled cache in pages of 32 248.1 without, 219.5 with (Triton 174.9), 210.5 at 64 keys on 132 CTAs.
MOSAIC_DECODE = dict(block_kv=128, num_stages=2, p_in_registers=True, widen_warpgroup=True)
# Under DECODE_BACKEND "mosaic", decode steps of fewer query rows (the step's width) than this keep Triton: the
# Mosaic kernel can take the wide steps (batch 64-256) where it leads without the narrow ones where it trails.
MOSAIC_DECODE_MIN_ROWS = 0
MOSAIC_DECODE_CTAS = 132
# MOSAIC_DECODE_MAX_CTAS: 0 launches a CTA per work item (tile, kv head, split); N > 0 a persistent grid of at most
# N CTAs, each over every N-th item, loading the next item while computing this one. 2026-12-06, H100, bf16, pages
# of 16: 1.00-1.03x chained / 0.98-1.02x separate at 256 x 640, 0.98 / 0.99x at 64 x 4096; it stays off.
MOSAIC_DECODE_MAX_CTAS = 0
# Both Mosaic kernels copy a key block page chunk by page chunk (TMA, 8 copies per pool for 128 keys in pages of
# 16). Not what bounds them (2026-12-06, H100): one copy per block where the pages lie back to back ran 0.96-1.02x
# (prefill 16 x 512 .. 1 x 8192, decode 256 x 640 and 64 x 4096), and pages of 64 left the decode kernel's time at
# 256 x 640 where it was over bf16 pools (over fp8 ones 255 us against 269 the session before, far from the halved
# bytes' time).
# "auto" sends a segment to Mosaic when its padded rows there x MOSAIC_ROW_COST < its padded rows on
# Triton. 2026-12-01, H200, causal prefill 16x512 .. 2x4096 (GQA 32/8, D 128, bf16, page 16): Mosaic
# ran 1.5-1.7x Triton's TFLOP/s on whole tiles, so a Mosaic row costs about 0.6 of a Triton row.
MOSAIC_ROW_COST = 0.6

# How the sampler cuts a row's ranking for top-k / top-p (runtime/sampling.py): "keys" sorts each row's logits'
# sort keys alone, 4 bytes an entry (XLA sorts them with CUB's radix sort); "sort" sorts its (logit, id) pairs, 12
# bytes an entry: the same tokens. Measured on an H100 (2026-12-06, llama3-8b, batch 256, vocabulary 128,256,
# tools/gpu_sampling_cost.py): the sample program alone 1.72 ms against 3.82 (chained); the engine's decode step
# with top_k 50 / top_p 0.9 on every row 17.06 ms against 19.10 (greedy 15.07), so a filtered step costs half as
# much over greedy. A radix select without a sort (13 passes a cut) took 4.93 ms and 20.82 and was removed.
SAMPLING_FILTER = "keys"

# int4 weight-only linears on Hopper: steps of up to INT4_MOSAIC_MAX_ROWS token rows run the Mosaic GPU kernel
# (quant_matmul_mgpu.int4_matmul_t) with the blocks below where it covers the shapes; wider steps and other GPUs
# keep XLA's formulations (model/quant.py). 2026-12-03 (tools/gpu_quant_kernels.py, llama3-8b's four linears,
# chained, M = 1 and 8 summed): block_m 128 / block_k 128 / 4 stages 180.9 us, within 2 % of the best (block_k
# 256: 177.9, whose 4 stages overflow shared memory from 17 rows, padded to 32); block_m 64 211.4. Later that day
# the grid became persistent, one CTA per SM (`ctas`: an H200 has 132); kernel time alone at one token, gate_up /
# down: 31.3 / 17.5 us, 8 stages 31.7 on gate_up, 4 splits chained through the pipeline 31.6 (docs/perf.md).
# Wide steps, 2026-12-03 fourth session (gpu_quant_kernels.py --shapes gate_up,down --rows 128..4096, chained /
# separate us, gate_up + down): at 128 rows block_m 128 102.8 / 122.7, block_m 64 102.3 / 134.9 (block_m 128
# takes at most 128 rows: its accumulator); the kernel ahead of XLA's int4 two dots up to 512 rows (first version
# 336.9 / 418.6, final 326.5 / 344.8, against 413.9 / 446.0), even at 1024 chained and behind as separate calls
# (666 / 829 against 673 / 730, first version), behind at 4096 (2718 against 2381 chained): so up to 512 rows.
# 2026-12-03, seventh session (--rows 1,16 --profile, GPU time per call, block_k 128 / 256): wqkv 9.4 / 9.0 us,
# wo 7.4 / 8.5 (at 256 its 16 steps split into 64 units for 132 CTAs), gate_up 29.4 / 23.1, down 16.4 / 16.0 at
# one token (16 rows: 11.0 / 10.5, 8.5 / 10.1, 30.4 / 25.2, 17.2 / 16.0): so up to 16 rows block_k is planned per
# shape (0: quant_matmul_mgpu.resolved).
INT4_MOSAIC_MAX_ROWS = 512
# Keyed by the widest step (token rows) each entry serves; past the last key its blocks run tiles of 256 rows.
INT4_MOSAIC_BLOCKS = {16: {"block_m": 128, "block_k": 0, "stages": 4, "ctas": 132},
                      128: {"block_m": 128, "block_k": 128, "stages": 4, "ctas": 132},
                      512: {"block_m": 64, "block_k": 128, "stages": 4, "ctas": 132}}

# fp8 (W8A8) linears: the dtype the fp8 x fp8 GEMM writes before the token and channel scales are applied (in float32)
# and the result is rounded to the activations' dtype. "float32" rounds once; "bfloat16" halves the bytes the GEMM
# writes and its scaling reads back (a width-4096 step's gate_up writes 470 MB of float32), at one more rounding.
# 2026-12-06 (H100, llama3-8b fp8 + fp8 KV, 256 x 512 -> 128, two runs each, order reversed): bfloat16 8,522 and
# 8,563 tok/s against float32 8,335 and 8,340; width-4096 steps 78.64 / 78.22 ms against 81.22 / 81.12, width-256
# steps 11.16 / 11.18 against 11.29 / 11.28 (docs/perf.md, twenty-ninth session). It applies to bfloat16
# activations only: a float32 model's GEMMs keep float32 (rounded to bfloat16, a float32 model run over 2 devices
# parted from itself on one at bfloat16's resolution: tests/test_tp.py::test_quantized_linears_split).
FP8_GEMM_OUT = "bfloat16"
# fp8 KV pools in varlen_attention (Triton): widen the K/V tiles to float16 and run both dots in float16 (1), or
# widen to q's dtype (0). 2026-12-03 (tenth session, tools/gpu_fp8_kv.py 64 4096, H200, the decode tile, chained):
# unscaled fp8 323 us against 370, scaled 363 against 375; the output's error against the reference halves.
# The Mosaic decode kernel takes it over unscaled pools only: 2026-12-06 (H100, gpu_fp8_kv.py 256 640 --mosaic
# --page=32, chained) it ran unscaled fp8 in 259.5 us against 269.1, a scaled cache in 344.8 against 295.6 (its
# float32 product clipped and rounded to float16); Triton 180.2 against 217.4 and 197.1 against 235.8 (perf.md).
FP8_KV_F16_DOTS = 1
# fp8 MLPs on Hopper: gate_up's product to down's fp8 input in one Triton kernel (gated_fp8.py) when
# FP8_GATED_KERNEL, one program per GATED_FP8_ROWS token rows, GATED_FP8_BLOCK hidden columns at a time (a row that
# fits one block is read once). Off: 2026-12-03 (tenth session, tools/gpu_gated_fp8.py, 4096 x 14336, H200) the
# best tiles ran 177-187 us a call against XLA's two kernels' 199 (reading y alone takes 74), and in
# llama3-8b's width-4096 step 2 x 16384 (16 warps) took 207 us a layer against XLA's 254, but the step alone was
# no faster (59.2 ms against 58.4, one process each) (docs/perf.md).
FP8_GATED_KERNEL = 0
GATED_FP8_ROWS = 1
GATED_FP8_BLOCK = 2048
GATED_FP8_NUM_WARPS = 16
GATED_FP8_STAGES = 1
