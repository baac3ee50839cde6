"""The Mosaic GPU decode kernel (decode_attention_mgpu.py).

On a CPU machine Pallas' GPU interpreter runs the kernel itself (TMA copies, barriers, wgmma, shared memory)
against the jnp reference; `make test-gpu` runs the same value tests compiled on a Hopper GPU, the kernel sweep
runs its cases at GPU sizes (tools/gpu_kernels.py, variant "mosaic_decode") and tools/gpu_decode_mgpu.py times
it. Also: the static tile count, the dispatch rules, and that the kernel
lowers for CUDA at the engine's sizes.
"""

import dataclasses
import functools
import importlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import INTERPRET, ON_GPU
from glint.pallas_kernels import BlockSizes, tuning, varlen_attention, varlen_attention_mgpu
from glint.pallas_kernels import decode_attention_mgpu as dm
from glint.pallas_kernels.reference import scale_pool_shape
from glint.pallas_kernels.testing import AttentionCase as C
from glint.pallas_kernels.testing import as_fp8, make_attention_inputs
from jax.experimental.pallas import mosaic_gpu as plgpu
from mosaic_cases import CASES, check_kernel, device_inputs


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_reference(name):
    """Through varlen_attention with the split count it picks, against the reference; poisoned pools and query
    gaps (NaN) must not show."""
    check_kernel(CASES[name], functools.partial(varlen_attention, backend="mosaic_decode", interpret=INTERPRET))


@pytest.mark.parametrize("name,num_splits,block_kv,num_stages", [
    ("mixed-g4", 1, 64, 1), ("mixed-g4", 3, 128, 2), ("mixed-g4", 8, 64, 3),
    ("window-flat-g4", 3, 64, 2), ("ring-chunks-softcap", 2, 64, 2), ("ring-g8-p32", 3, 64, 2),
    ("ring-wide-wraps", 2, 64, 2),
])
def test_splits_and_tiles(name, num_splits, block_kv, num_stages):
    """Split-K with more splits than some segments have key blocks (empty splits merge as nothing), one stage
    (each block loaded after the last was read) and wider blocks than a page; windows and rings split too."""
    kernel = functools.partial(dm.decode_attention_mgpu, num_splits=num_splits, block_kv=block_kv,
                               num_stages=num_stages, interpret=INTERPRET)
    check_kernel(CASES[name], kernel, seed=1)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_unaligned_start_over_several_tiles(num_splits):
    """Group 1, a 130-row segment starting at row 7 (packed start 7 mod 8): its first tile starts 7 rows before
    it, and its first and last 8-row output groups are partly its own."""
    case = C(((130, 200), (1, 90)), group=1, head_dim=64, dtype="bfloat16", num_kv_heads=2)
    [start] = [q_start for q_start, q_len, _, _ in make_attention_inputs(case, np.random.default_rng(0))["seq_info"]
               if q_len == 130]
    kernel = functools.partial(dm.decode_attention_mgpu, num_splits=num_splits, interpret=INTERPRET)
    args = check_kernel(case, kernel, shift=(7 - start) % 8)
    assert [int(i[0]) % 8 for i in args["seq_info"] if i[1] == 130] == [7]  # the layout the docstring says


@pytest.mark.parametrize("name,num_splits,max_ctas,fp8,page_size", [
    ("mixed-g4", 1, 3, None, 16), ("mixed-g4", 3, 5, None, 16), ("ring-wide-wraps", 2, 2, None, 16),
    ("window-flat-g4", 1, 4, None, 16), ("g4-p256", 2, 1, "scaled", 256), ("one-row", 1, 1, None, 16),
])
def test_persistent_grid(name, num_splits, max_ctas, fp8, page_size):
    """A persistent grid: fewer CTAs than work items, each CTA's memory warpgroup loading the next item's query tile
    and key blocks while its compute warpgroup finishes the last (K/V and query slots counted across items), rows
    out through the query tile (one split) or the float32 tile (several)."""
    case = dataclasses.replace(CASES[name], page_size=page_size)
    kernel = functools.partial(dm.decode_attention_mgpu, num_splits=num_splits, block_kv=64, max_ctas=max_ctas,
                               interpret=INTERPRET)
    args = check_kernel(case, kernel, seed=3, **({"fp8": fp8} if fp8 else {}))
    num_rows, num_q_heads, _ = args["q"].shape
    num_kv_heads = args["k_pages"].shape[2]
    items = dm.num_tiles_for(num_rows, args["seq_info"].shape[0], num_q_heads // num_kv_heads) * num_kv_heads
    assert items * num_splits > max_ctas  # some CTA took several items


@pytest.mark.skipif(not INTERPRET, reason="the GPU interpreter's race detector; compiled, the tests above run")
@pytest.mark.parametrize("name,num_splits,fp8,page_size,opts", [
    ("mixed-g4", 1, None, 16, {}), ("mixed-g4", 2, None, 16, {}), ("g4-p256", 2, "scaled", 256, {}),
    ("mixed-g4", 1, "plain", 16, {"widen_warpgroup": True, "f16_dots": True, "block_kv": 64}),
])
def test_persistent_grid_has_no_races(monkeypatch, name, num_splits, fp8, page_size, opts):
    """The interpreter's race detector over a persistent grid: a query slot refilled while the last item's rows
    still leave through it (one split), or the float32 output tile rewritten while its rows leave (two splits),
    or a scaled cache's scales refilled while read, or a wide tile rewritten by the widening warpgroup while a dot
    reads it, would be a race between the warpgroups' shared-memory accesses."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    params = plgpu.InterpretGPUParams
    monkeypatch.setattr(plgpu, "InterpretGPUParams", lambda **kw: params(detect_races=True, **kw))
    kernel = functools.partial(dm.decode_attention_mgpu, num_splits=num_splits, max_ctas=2, interpret=True,
                               **{"block_kv": 128, **opts})
    check_kernel(dataclasses.replace(CASES[name], page_size=page_size), kernel, seed=4, **({"fp8": fp8} if fp8 else {}))
    assert interpret_pallas_call.get_races().races_found is False


_F16, _WIDEN_WG = {"f16_dots": True}, {"widen_warpgroup": True}


@pytest.mark.parametrize("name,fp8,page_size,num_splits,opts", [
    ("mixed-g4", "scaled", 32, 1, {}), ("window-flat-g4", "scaled", 32, 3, {}),
    ("ring-chunks-softcap", "scaled", 32, 2, {}), ("ring-g8-p32", "scaled", 32, 3, _F16),
    ("g4-p256", "scaled", 256, 2, {}), ("decode-g4-d128", "scaled", 128, 2, _F16),
    ("decode-g4-d128", "plain", 16, 1, _F16), ("ring-wide-wraps", "plain", 16, 2, {}),
    ("ring-wide-wraps", "plain", 16, 2, _F16 | _WIDEN_WG), ("window-noncausal-softcap-f16", "plain", 16, 1, {}),
    ("mixed-g4", "scaled", 32, 1, _WIDEN_WG), ("window-flat-g4", "scaled", 32, 3, _WIDEN_WG | {"max_ctas": 3}),
])
def test_fp8_pools(name, fp8, page_size, num_splits, opts):
    """fp8 pools, a scaled cache (a float32 scale per row and head; its pages a multiple of 32 keys, see supports())
    or plain e4m3, against the reference over the same pools: each block widened to q's dtype (f16_dots: to
    float16, the dots in float16; widen_warpgroup: by a third warpgroup, into two tiles each, a persistent grid's
    CTA counting them over its items) in shared memory, scales applied to its rows, V rows of unseen keys zeroed as
    they widen (poisoned rows and scales are NaN). P from registers, the default tile's, where compiled (the
    interpreter takes P through shared memory)."""
    case = dataclasses.replace(CASES[name], page_size=page_size)
    kernel = functools.partial(dm.decode_attention_mgpu, num_splits=num_splits, block_kv=64, p_in_registers=True,
                               interpret=INTERPRET, **opts)
    check_kernel(case, kernel, seed=2, fp8=fp8)


def test_fp8_through_varlen_attention():
    """varlen_attention hands a scaled cache's scale pools to the kernel (backend "mosaic_decode")."""
    case = dataclasses.replace(CASES["g6-d64"], page_size=32)
    check_kernel(case, functools.partial(varlen_attention, backend="mosaic_decode", interpret=INTERPRET), fp8="scaled")


@pytest.mark.parametrize("q_slots,scaled,num_splits,block_kv,fits", [
    (1, False, 1, 128, True),
    (2, False, 1, 128, True),  # a persistent grid: 231,568 bytes on an H100 with the barriers (2026-12-06)
    (2, True, 1, 128, False),  # ... and a scaled cache's scales: 233,616, over the 232,448 a CTA may take
    (1, False, 4, 128, False),  # the float32 output tile of split keys: 32 KB more
    (2, True, 4, 64, True),
])
def test_widen_warpgroup_fits(q_slots, scaled, num_splits, block_kv, fits):
    """Where the widening warpgroup's second K and V tiles fit (head_dim 128, 2 stages, P in registers); the
    lowering test above compiles the tightest case that does and two that do not."""
    assert dm.widen_wg_fits(q_slots=q_slots, head_dim=128, block_kv=block_kv, num_stages=2, scaled=scaled,
                            num_splits=num_splits, p_in_registers=True) is fits


def test_fp8_support_rules():
    """A scaled cache's scales arrive by TMA a page chunk at a time at 128-byte boundaries: pages of 16 keys (64
    bytes of scales) stay on Triton, pages of 32 or more go to Mosaic; plain fp8 pools at any supported page."""
    rule = functools.partial(dm.supports, dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn, head_dim=128, block_kv=64,
                             ring_rows=None, window=0)
    assert not rule(page_size=16, scaled=True) and rule(page_size=32, scaled=True) and rule(page_size=128, scaled=True)
    assert rule(page_size=16, scaled=False)
    args = as_fp8(device_inputs(CASES["one-row"]), scaled=True)  # pages of 16
    with pytest.raises(ValueError, match="scaled: pages and key blocks of multiples of 32 keys.*scaled=True"):
        dm.decode_attention_mgpu(**args, scale=0.1, block_kv=64, interpret=True)
    assert not dm.supports(dtype=jnp.float32, kv_dtype=jnp.float8_e4m3fn, head_dim=128, page_size=32, block_kv=64,
                           ring_rows=None, window=0, scaled=True)
    assert not dm.supports(dtype=jnp.bfloat16, kv_dtype=jnp.float16, head_dim=128, page_size=32, block_kv=64,
                           ring_rows=None, window=0)


@functools.cache
def _tiles_fn(group):
    return jax.jit(lambda info: dm._tiles(info, group, _MAX_SEGMENTS * 40 * 8))  # one per packed row: never short


_MAX_SEGMENTS = 32


def _covering(info, group):
    """The tiles `_tiles` gives each segment, checked to cover its packed rows; returns how many it used. `info`
    is padded to _MAX_SEGMENTS segments of q_len 0 (one compile per group)."""
    info = np.concatenate([info, np.zeros((_MAX_SEGMENTS - len(info), 4), np.int32)]).astype(np.int32)
    tiles, first = (np.asarray(x) for x in _tiles_fn(group)(jnp.asarray(info)))
    for s, (q_start, q_len, _, _) in enumerate(info):
        if q_len <= 0:
            continue
        start, rows = q_start * group, q_len * group
        ks = tiles[tiles[:, 0] == s, 1]
        assert first[s] == np.flatnonzero(tiles[:, 0] == s)[0]
        covered = np.zeros(start + rows + 64, bool)
        for k in ks:  # tile k of a segment: 64 packed rows from its start rounded down to 8
            covered[start - start % 8 + 64 * k:][:64] = True
        assert covered[start:start + rows].all()
    return int((tiles[:, 0] >= 0).sum())


def test_num_tiles_covers_every_layout():
    """The static tile count holds the tiles every layout needs: random layouts, and the tight one where every
    segment of 58 rows starts at 7 mod 8 (group 1) and so takes two tiles."""
    rng = np.random.default_rng(0)
    for trial in range(200):
        group = int(rng.choice([1, 2, 4, 6, 8]))
        num_segments = int(rng.integers(1, 33))
        lengths = rng.integers(0, 40, num_segments) if trial % 2 else np.full(num_segments, 1)
        starts, row = [], int(rng.integers(0, 8))
        for q_len in lengths:
            starts.append(row)
            row += int(q_len) + int(rng.integers(0, 5))
        info = np.stack([starts, lengths, np.zeros_like(lengths), lengths + 1], 1).astype(np.int32)
        assert _covering(info, group) <= dm.num_tiles_for(max(row, 1), num_segments, group), trial
    num_segments = 12
    starts = 7 + 64 * np.arange(num_segments)
    info = np.stack([starts, np.full(num_segments, 58), np.zeros(num_segments, int), np.full(num_segments, 58)], 1)
    used = _covering(info.astype(np.int32), 1)
    assert used == 2 * num_segments == dm.num_tiles_for(7 + 64 * num_segments, num_segments, 1)


def test_supports_and_refusals():
    ok = dict(dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, head_dim=128, page_size=16, block_kv=64, ring_rows=None,
              window=0)
    assert dm.supports(**ok)
    assert dm.supports(**{**ok, "dtype": jnp.float16, "kv_dtype": jnp.float16, "head_dim": 64, "page_size": 256})
    for bad in ({"kv_dtype": jnp.float16}, {"dtype": jnp.float32, "kv_dtype": jnp.float32}, {"head_dim": 256},
                {"head_dim": 80}, {"page_size": 8}, {"page_size": 48}, {"block_kv": 32},
                {"ring_rows": 96},  # a ring without a window: a row would stand for several keys
                {"ring_rows": 96, "window": 97}):  # a window wider than its ring, likewise
        assert not dm.supports(**{**ok, **bad}), bad
    assert dm.supports(**{**ok, "ring_rows": 96, "window": 96}) and dm.supports(**{**ok, "window": 5000})
    args = device_inputs(CASES["g4-p256"])
    with pytest.raises(ValueError, match="backend='mosaic_decode' needs.*block_sizes=BlockSizes"):
        varlen_attention(**args, scale=0.1, backend="mosaic_decode", block_sizes=BlockSizes(16, 16), interpret=True)
    with pytest.raises(ValueError, match=r"decode_attention_mgpu: ring_rows=4096 must be in \[1, 1024\]"):
        dm.decode_attention_mgpu(**args, scale=0.1, ring_rows=4096, interpret=True)
    with pytest.raises(ValueError, match="a ring a window in .*ring_rows=64, window=0"):
        dm.decode_attention_mgpu(**args, scale=0.1, ring_rows=64, interpret=True)
    with pytest.raises(ValueError, match="backend='mosaic_decode' needs.*ring_rows=64, window=65"):
        varlen_attention(**args, scale=0.1, backend="mosaic_decode", ring_rows=64, window=65, interpret=True)
    if not ON_GPU:
        with pytest.raises(ValueError, match="backend='mosaic_decode' needs a Hopper GPU"):
            varlen_attention(**args, scale=0.1, backend="mosaic_decode")  # compiled, on a CPU machine
    with pytest.raises(ValueError, match="num_stages=0"):
        dm.decode_attention_mgpu(**args, scale=0.1, num_stages=0)
    with pytest.raises(ValueError, match="block_kv=32"):
        dm.decode_attention_mgpu(**args, scale=0.1, block_kv=32)


def test_auto_dispatch(monkeypatch):
    """On a Hopper GPU (stubbed) with DECODE_BACKEND "mosaic", "auto" takes the kernel for decode steps only (of at
    least MOSAIC_DECODE_MIN_ROWS rows), and never for what it does not cover; elsewhere it never does."""
    va = importlib.import_module("glint.pallas_kernels.varlen_attention")
    monkeypatch.setattr(tuning, "DECODE_BACKEND", "mosaic")
    monkeypatch.setattr(varlen_attention_mgpu, "is_hopper", lambda: True)
    q = jnp.zeros((8, 32, 128), jnp.bfloat16)
    pages = jnp.zeros((4, 16, 8, 128), jnp.bfloat16)

    def use(num_segments=8, backend="auto", **kw):
        args = dict(q=q, k_pages=pages, scaled=False, seq_info=jnp.zeros((num_segments, 4), jnp.int32), ring_rows=None,
                    window=0, block_sizes=None, interpret=False)
        return va._use_mosaic_decode(backend, **{**args, **kw})

    assert use()  # 8 rows in 8 segments: a decode step
    assert not use(num_segments=1)  # 8 rows in one segment: prefill
    assert not use(backend="triton")
    assert not use(block_sizes=va.BlockSizes())
    assert use(k_pages=pages.astype(jnp.float8_e4m3fn))  # plain fp8 pools
    assert not use(k_pages=pages.astype(jnp.float8_e4m3fn), scaled=True)  # a scaled cache in pages of 16 keys
    assert use(k_pages=jnp.zeros((4, 32, 8, 128), jnp.float8_e4m3fn), scaled=True)  # ... in pages of 32
    assert not use(k_pages=pages.astype(jnp.float16))
    assert not use(q=q.astype(jnp.float32))  # pools of another dtype
    assert use(ring_rows=40, window=33) and not use(ring_rows=40, window=0)
    assert not use(interpret=True)
    monkeypatch.setattr(tuning, "MOSAIC_DECODE_MIN_ROWS", 8)  # steps of 8 rows and more
    assert use() and not use(q=q[:7], num_segments=7)
    monkeypatch.setattr(tuning, "MOSAIC_DECODE_MIN_ROWS", 0)
    monkeypatch.setattr(varlen_attention_mgpu, "is_hopper", lambda: False)
    assert not use()
    monkeypatch.setattr(varlen_attention_mgpu, "is_hopper", lambda: True)
    monkeypatch.setattr(tuning, "DECODE_BACKEND", "triton")
    assert not use()


def test_split_count():
    block_kv = tuning.MOSAIC_DECODE["block_kv"]
    # Few keys (one sequence, 8 kv heads: 8 CTAs a split): no more splits than key blocks.
    assert dm.num_splits_for(1, 1, 32, 8, block_kv * 3, block_kv) == 3
    # Many keys: as many splits as one wave of the CTA target holds, at most MAX_SPLITS.
    s = dm.num_splits_for(1, 1, 32, 8, 1 << 20, block_kv)
    assert s * 8 <= max(tuning.MOSAIC_DECODE_CTAS, 8)
    assert s == tuning.MAX_SPLITS or (s + 1) * 8 > tuning.MOSAIC_DECODE_CTAS
    # Enough CTAs already (256 sequences x 8 kv heads): one.
    assert dm.num_splits_for(256, 256, 32, 8, 4096, block_kv) == 1


@pytest.mark.parametrize("num_rows,hq,hkv,d,page_size,num_splits,tile", [
    (256, 32, 8, 128, 16, 1, dict(p_in_registers=False)),  # llama3-8b decode at batch 256
    (256, 32, 8, 128, 16, 1, dict(p_in_registers=True)),
    (256, 32, 8, 128, 16, 1, dict(max_ctas=132)),  # a persistent grid
    (1, 32, 8, 128, 16, 16, dict(max_ctas=64)),
    (1, 32, 8, 128, 16, 16, dict(p_in_registers=False)),  # batch 1, split-K
    (1, 32, 8, 128, 16, 16, dict(p_in_registers=True)),
    (1, 32, 8, 128, 16, 16, dict(block_kv=64, num_stages=4, p_in_registers=True)),
    (1, 32, 8, 128, 16, 1, dict(p_in_registers=False)),  # batch 1, one split: final rows through the query tile
    (4, 32, 8, 128, 16, 4, dict(ring_rows=1000, window=990)),  # a ring layer
    (1, 32, 8, 128, 16, 16, dict(window=512, softcap=50.0)),  # a windowed flat layer with a soft-cap
    (1, 16, 4, 64, 16, 1, dict(p_in_registers=True)),
    (64, 64, 8, 128, 64, 4, {}),  # group 8, page 64
    (37, 16, 16, 64, 16, 2, {}),  # group 1, d64
])
def test_lowers_for_cuda(num_rows, hq, hkv, d, page_size, num_splits, tile):
    """Layout inference, TMA tiling and shared-memory checks run at lowering, at the engine's sizes (the default
    tile, tuning.MOSAIC_DECODE, with `tile`'s fields changed)."""
    args = (
        jax.ShapeDtypeStruct((num_rows, hq, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((512, page_size, hkv, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((512, page_size, hkv, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((num_rows + 2, 64), jnp.int32),
        jax.ShapeDtypeStruct((num_rows, 4), jnp.int32),
    )
    fn = jax.jit(lambda *a: dm.decode_attention_mgpu(*a, scale=d**-0.5, num_splits=num_splits,
                                                     **{**tuning.MOSAIC_DECODE, **tile}))
    assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("num_rows,hkv,d,page_size,num_splits,scaled,tile", [
    (64, 8, 128, 32, 1, True, dict(p_in_registers=True)),  # llama3-8b's heads, a scaled fp8 cache in pages of 32
    (64, 8, 128, 32, 1, True, dict(p_in_registers=False)),
    (64, 8, 128, 32, 4, True, dict(max_ctas=132)),  # a persistent grid
    (1, 8, 128, 128, 16, True, {}),  # batch 1, split-K, a page per key block
    (4, 8, 128, 64, 4, True, dict(ring_rows=1000, window=990)),  # a ring layer
    (1, 8, 128, 32, 16, True, dict(window=512, softcap=50.0)),
    (64, 8, 128, 16, 2, False, {}),  # unscaled fp8 in pages of 16
    (16, 2, 64, 16, 1, False, dict(block_kv=64)),  # d64: 64-byte fp8 rows, 64-byte swizzle
    (16, 2, 64, 32, 2, True, dict(block_kv=64)),
    (64, 8, 128, 16, 2, False, dict(f16_dots=True)),  # the dots in float16
    (64, 8, 128, 32, 1, True, dict(f16_dots=True)),
    (4, 8, 128, 64, 4, True, dict(ring_rows=1000, window=990, f16_dots=True)),
    (256, 8, 128, 16, 1, False, dict(f16_dots=True, widen_warpgroup=True)),  # a warpgroup widening the blocks
    (64, 8, 128, 32, 1, True, dict(widen_warpgroup=True)),
    (64, 8, 128, 32, 4, True, dict(f16_dots=True, widen_warpgroup=True, max_ctas=132, block_kv=64)),
    # two query tiles and a scaled cache's scales at 128 keys: no room for the second wide tiles, so the compute
    # warpgroup widens (233,616 bytes of shared memory on an H100 with them, over its 232,448)
    (64, 8, 128, 32, 1, True, dict(widen_warpgroup=True, max_ctas=132)),
    (64, 8, 128, 32, 4, True, dict(widen_warpgroup=True)),  # the float32 output tile of split keys
    (256, 8, 128, 16, 1, False, dict(f16_dots=True, widen_warpgroup=True, max_ctas=132)),  # the tightest that fits
])
def test_fp8_lowers_for_cuda(num_rows, hkv, d, page_size, num_splits, scaled, tile):
    """fp8 pools (scaled or not): the fp8 K/V tiles' layouts, their widening into q's dtype (or float16) and the
    scale copies lower for CUDA (layout inference and TMA checks run at lowering)."""
    fp8, f32 = jnp.float8_e4m3fn, jnp.float32
    args = (
        jax.ShapeDtypeStruct((num_rows, 4 * hkv, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((512, page_size, hkv, d), fp8),
        jax.ShapeDtypeStruct((512, page_size, hkv, d), fp8),
        jax.ShapeDtypeStruct((num_rows + 2, 8192 // page_size), jnp.int32),
        jax.ShapeDtypeStruct((num_rows, 4), jnp.int32),
        *(jax.ShapeDtypeStruct(scale_pool_shape(512, page_size, hkv), f32) for _ in range(2 * scaled)),
    )
    fn = jax.jit(lambda q, k, v, table, info, *scales: dm.decode_attention_mgpu(
        q, k, v, table, info, **dict(zip(("k_scale", "v_scale"), scales)), scale=d**-0.5, num_splits=num_splits,
        **{**tuning.MOSAIC_DECODE, **tile}))
    assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_trace_summary(tmp_path):
    """tools/mosaic_trace.py on a hand-written profiler trace (two CTAs on one SM, two warpgroups each): scope
    times a CTA, lifetimes and the gap between the CTAs."""
    import json
    import sys
    sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
    import mosaic_trace

    def rng(name, b, e, pid, tid):
        return [dict(name=name, ph="B", ts=b, pid=pid, tid=tid), dict(name=name, ph="E", ts=e, pid=pid, tid=tid)]

    events = (rng("k", 0, 2, 1, 1) + rng("qk", 2, 3, 1, 1) + rng("copy", 0, 4, 1, 2)
              + rng("k", 5, 6, 1, 3) + rng("qk", 6, 9, 1, 3) + rng("copy", 5, 6, 1, 4))
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    text = mosaic_trace.summarize(str(path))
    assert "2 CTAs on 1 SMs" in text
    assert "warpgroup 0: lifetime 3.50 us" in text  # (3 + 4) / 2
    assert "k                1.50 us a CTA" in text and "qk               2.00 us a CTA" in text
    assert "warpgroup 1: lifetime 2.50 us" in text and "copy             2.50 us a CTA (100.0 %)" in text
    assert "mean 2.00 us" in text  # CTA 1 starts at 5, CTA 0 ended at 3
    # A third (widening) warpgroup a CTA: its scope names tell the tool so.
    events = (rng("k", 0, 2, 1, 1) + rng("copy", 0, 4, 1, 2) + rng("widen_k", 0, 1, 1, 3)
              + rng("k", 5, 6, 1, 4) + rng("copy", 5, 6, 1, 5) + rng("widen_k", 5, 8, 1, 6))
    path.write_text(json.dumps({"traceEvents": events}))
    text = mosaic_trace.summarize(str(path))
    assert "2 CTAs on 1 SMs" in text and "widen_k          2.00 us a CTA" in text and "warpgroup 3" not in text
