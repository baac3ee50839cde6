"""The Mosaic GPU prefill kernel (varlen_attention_mgpu.py).

On a CPU machine Pallas' GPU interpreter runs the kernel itself (three warpgroups, TMA copies, barriers, wgmma;
P @ V takes P through shared memory, as the interpreter needs) against the jnp reference, on flat and ring
layers, windows and soft-caps; `make test-gpu` runs the same value tests compiled on a Hopper GPU, and the
kernel sweep runs its cases at GPU sizes (tools/gpu_kernels.py, variant "mosaic"). Also: the
host-side tile map and row gather against NumPy, the dispatch rules, and that the kernel lowers to a
Mosaic GPU custom call for CUDA (layout inference, TMA tiling and shared-memory checks run at
lowering) across the shapes it claims.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import INTERPRET, ON_GPU
from glint.pallas_kernels import BlockSizes, segments, tuning, varlen_attention
from glint.pallas_kernels import varlen_attention_mgpu as mg
from glint.pallas_kernels.reference import varlen_attention_reference
from glint.pallas_kernels.testing import AttentionCase as C
from jax.experimental.pallas import mosaic_gpu as plgpu
from mosaic_cases import CASES, check_kernel, check_rows, device_inputs

PREFILL_CASES = {
    # prefill chunks over several 128-row tiles among decode rows and short chunks, gaps and padding segments
    "prefill-g4-d128": C(((300, 300), (1, 700), (7, 40), (130, 500), (1, 90)), group=4, num_kv_heads=2,
                         head_dim=128, dtype="bfloat16", gaps=4, num_padding_segments=2),
    # the same kinds of segment, shorter, over half the query heads (still two kv heads, so a persistent CTA's walk
    # crosses from one to the other): for the tests that run the kernel in other ways (persistent grids, the race
    # detector, rows written into `out`) at a fraction of the interpreter's time
    "prefill-g2-d128-short": C(((150, 150), (1, 300), (7, 40), (130, 260), (1, 90)), group=2, num_kv_heads=2,
                               head_dim=128, dtype="bfloat16", gaps=4, num_padding_segments=2),
    # a window narrower than a tile: the second warpgroup's rows start a block later than the first's, and the
    # first's end a block earlier (each releases the other's blocks); keys before the window are poisoned
    "window-warpgroups": C(((256, 700), (200, 200), (3, 90)), group=2, num_kv_heads=1, head_dim=64,
                           dtype="bfloat16", window=100),
    # ring layers sized as the engine sizes them (window + chunk - 1 rows and some), chunks that wrap, soft-cap
    "ring-prefill-softcap": C(((128, 500), (100, 100), (64, 1000), (1, 300)), group=2, num_kv_heads=1,
                              head_dim=128, dtype="bfloat16", ring_rows=80 + 128 - 1 + 9, window=80, softcap=2.0,
                              gaps=2),
    # head_dim 256 (64-key blocks), pages of 64, non-causal f16
    "d256-p64-noncausal-f16": C(((150, 150), (40, 300)), group=2, num_kv_heads=1, head_dim=256, page_size=64,
                                dtype="float16", causal=False),
}
# The decode kernel's cases with windows and rings: decode rows and short chunks, which take one tile each.
SHARED_CASES = ("window-flat-g4", "ring-chunks-softcap", "ring-g8-p32", "ring-wide-wraps", "underflow-tiles",
                "window-noncausal-softcap-f16")


def test_tiles_and_gather_put_every_row_back():
    seq_info = jnp.array([[5, 300, 0, 400], [0, 0, 1, 3], [305, 1, 2, 50], [310, 129, 1, 129]], jnp.int32)
    tiles, _ = mg._tiles(seq_info, 128, 12)
    tiles = np.asarray(tiles)
    # Tiles start 8-aligned in the packed rows: segment 0 (q_start 5) needs ceil((300 + 5) / 128) = 3.
    assert tiles[:6].tolist() == [[0, 0], [0, 1], [0, 2], [2, 0], [3, 0], [3, 1]]
    assert (tiles[6:, 0] == -1).all()
    rng = np.random.default_rng(3)
    num_segments = 8
    for trial in range(30):  # random layouts: gaps, empty segments, starts at every residue mod 8
        tile_rows, used = int(rng.choice([16, 64, 128])), int(rng.integers(1, num_segments + 1))
        lengths = rng.integers(0, 3 * tile_rows, num_segments) * (rng.random(num_segments) > 0.2)
        lengths[used:] = 0  # segments past `used` are empty
        starts = np.cumsum(rng.integers(0, 9, num_segments)) + np.concatenate([[0], np.cumsum(lengths)[:-1]])
        # One row count per tile size (the longest layout's), so each tile size compiles once; the rows past
        # the last segment belong to none.
        num_rows = num_segments * (3 * tile_rows + 9) + 5
        info = np.stack([starts, lengths, np.zeros_like(lengths), lengths], 1).astype(np.int32)
        num_tiles = mg.max_tiles(num_rows, num_segments, tile_rows)
        tiles, first = (np.asarray(x) for x in mg._tiles(jnp.asarray(info), tile_rows, num_tiles))
        # What a tile holds, by the kernel's contract: tile k of segment s is the tile_rows packed rows from
        # s's start rounded down to 8, plus k * tile_rows. Label each row of the padded output with its row.
        labels = np.full((num_tiles, tile_rows), -1.0, np.float32)
        for i, (s, k) in enumerate(tiles):
            if s >= 0:
                labels[i] = starts[s] - starts[s] % 8 + k * tile_rows + np.arange(tile_rows)
        pad = jnp.asarray(labels.reshape(-1))[:, None, None] * jnp.ones((1, 2, 3))
        got = np.asarray(mg._gather_rows(pad, jnp.asarray(info), jnp.asarray(first), tile_rows, num_rows))[:, 1, 2]
        own = np.zeros(num_rows, bool)
        for start, q_len in zip(starts, lengths):
            own[start:start + q_len] = True
        np.testing.assert_array_equal(got[own], np.flatnonzero(own), err_msg=f"trial {trial}")  # every row itself
        assert (got[~own] == 0).all()  # rows of no segment come back zero


def test_max_tiles_covers_every_layout():
    """The static tile count is enough for random layouts and for ones where the 8-row alignment costs
    every segment an extra tile (122 rows starting at q_start % 8 == 7: 129 aligned rows, two tiles)."""
    rng = np.random.default_rng(0)
    tile_rows = 128
    padded_rows = jax.jit(lambda info: mg.padded_rows(info, tile_rows))
    for trial in range(400):
        num_segments = int(rng.integers(1, 301))
        if trial % 2:
            lengths = np.full(num_segments, tile_rows - 6)
            gaps = np.full(num_segments, 6)  # keeps every q_start % 8 at 7
        else:
            lengths = rng.integers(0, 300, num_segments)
            gaps = rng.integers(0, 9, num_segments)
        starts, row = [], 7
        for q_len, gap in zip(lengths, gaps):
            starts.append(row)
            row += int(q_len) + int(gap)
        info = np.zeros((300, 4), np.int32)  # one shape for every trial; q_len 0 rows take no tiles
        info[:num_segments] = np.stack([starts, lengths, np.zeros_like(lengths), lengths], 1)
        needed = int(np.asarray(padded_rows(jnp.asarray(info))).sum()) // tile_rows
        assert needed <= mg.max_tiles(row, num_segments, tile_rows), (num_segments, row, needed)


@pytest.mark.parametrize("name", [*(n for n in PREFILL_CASES if n != "prefill-g2-d128-short"), *SHARED_CASES])
def test_kernel_matches_reference(name):
    """Through varlen_attention's "mosaic" backend, against the reference; poisoned pools and query gaps (NaN)
    must not show."""
    check_kernel(PREFILL_CASES.get(name) or CASES[name],
                 functools.partial(varlen_attention, backend="mosaic", interpret=INTERPRET))


@pytest.mark.parametrize("name,block_kv,num_stages,shift", [
    ("window-warpgroups", 64, 3, 0), ("ring-prefill-softcap", 64, 2, 0), ("window-warpgroups", 128, 3, 7),
])
def test_tiles_and_unaligned_starts(name, block_kv, num_stages, shift):
    """Other key blocks and stage counts (more blocks than stages, so slots are refilled while in use
    elsewhere), and every segment shifted `shift` rows (a tile then starts before its segment)."""
    kernel = functools.partial(mg.varlen_attention_mgpu, block_kv=block_kv, num_stages=num_stages,
                               interpret=INTERPRET)
    check_kernel(PREFILL_CASES[name], kernel, seed=1, shift=shift)


@pytest.mark.parametrize("name,max_ctas,num_stages", [
    ("prefill-g2-d128-short", 3, 2), ("ring-prefill-softcap", 5, 3), ("window-warpgroups", 1, 2),
    ("d256-p64-noncausal-f16", 2, 2),
])
def test_persistent_grid(name, max_ctas, num_stages):
    """Fewer CTAs than work items: each CTA walks items cta, cta + max_ctas, ... (padding tiles among them), its
    K/V slots and their barriers' phases carried from one item to the next (one CTA for all of them, too)."""
    kernel = functools.partial(mg.varlen_attention_mgpu, max_ctas=max_ctas, num_stages=num_stages,
                               interpret=INTERPRET)
    check_kernel(PREFILL_CASES[name], kernel, seed=3, shift=5)


@pytest.mark.skipif(not INTERPRET, reason="the GPU interpreter's race detector; compiled, the tests above run")
@pytest.mark.parametrize("name,max_ctas", [("window-warpgroups", 2), ("prefill-g2-d128-short", 3)])
def test_persistent_grid_has_no_races(monkeypatch, name, max_ctas):
    """The interpreter's race detector over a persistent grid: the next item's query landing in the tile whose rows
    still leave through it, or the stage rewritten while its rows leave, would be a race."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    params = plgpu.InterpretGPUParams
    monkeypatch.setattr(plgpu, "InterpretGPUParams", lambda **kw: params(detect_races=True, **kw))
    check_kernel(PREFILL_CASES[name], functools.partial(mg.varlen_attention_mgpu, max_ctas=max_ctas, interpret=True),
                 seed=3, shift=5)
    assert interpret_pallas_call.get_races().races_found is False


@pytest.mark.parametrize("name,shift", [("prefill-g2-d128-short", 3), ("d256-p64-noncausal-f16", 5)])
def test_rows_written_into_out(name, shift):
    """With `out`, the kernel's rows are its segments' and every other row is out's, bit for bit: through its
    output stage (head_dim 128: neighbouring segments share 8-row chunks, written row by row) and through the
    padded buffer where no stage fits (head_dim 256)."""
    case = PREFILL_CASES[name]
    direct = mg.stage_fits(head_dim=case.head_dim, **tuning.MOSAIC_PREFILL)
    assert direct == (case.head_dim != 256)
    args = device_inputs(case, seed=2, shift=shift)
    rng = np.random.default_rng(4)
    out = jnp.asarray(rng.standard_normal(args["q"].shape), args["q"].dtype).at[::7].set(jnp.nan)
    kernel = functools.partial(mg.varlen_attention_mgpu, **args, scale=case.scale, causal=case.causal,
                               interpret=INTERPRET)
    want, got = np.asarray(kernel(), np.float32), np.asarray(kernel(out=out), np.float32)
    covered = np.asarray(segments.row_segments(args["seq_info"], out.shape[0]) > 0)
    assert 0 < covered.sum() < covered.size
    np.testing.assert_array_equal(got[covered], want[covered])
    np.testing.assert_array_equal(got[~covered], np.asarray(out, np.float32)[~covered])


@pytest.mark.parametrize("head_dim", [64, 192])
def test_rows_of_neighbours_sharing_chunks(head_dim):
    """Segments packed back to back at every residue mod 8, several inside one 8-row chunk, tails cut two or more
    chunks into a block, a row count that is not a multiple of 8 (head_dim 192: the stage beside 64-key blocks):
    every covered row matches the reference and every other row is out's."""
    segs = [(3, 20), (23, 1), (24, 65), (89, 3), (92, 4), (96, 7), (103, 138), (244, 5), (250, 6), (256, 129),
            (385, 2), (388, 2), (10, 0), (50, -3)]  # (q_start, q_len); the last two are padding
    num_rows, page_size, rng = 390, 16, np.random.default_rng(0)
    kv_end = [max(n, 0) + 9 * i for i, (_, n) in enumerate(segs)]
    pages = [-(-max(k, 1) // page_size) for k in kv_end]
    table = np.zeros((len(segs), max(pages) + 1), np.int32)
    for i, n in enumerate(pages):
        table[i, :n] = 1 + sum(pages[:i]) + np.arange(n)
    info = np.array([(s, n, i, k) for i, ((s, n), k) in enumerate(zip(segs, kv_end))], np.int32)
    assert mg.stage_fits(head_dim=head_dim, **tuning.MOSAIC_PREFILL)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)

    pools = (1 + sum(pages), page_size, 1, head_dim)
    args = (normal(num_rows, 2, head_dim), normal(*pools), normal(*pools), jnp.asarray(table),
            jnp.asarray(info[rng.permutation(len(segs))]))
    out = normal(num_rows, 2, head_dim).at[::5].set(jnp.nan)
    kernel = functools.partial(mg.varlen_attention_mgpu, *args, scale=head_dim**-0.5, interpret=INTERPRET)
    got = np.asarray(kernel(out=out), np.float32)
    check_rows(kernel(), varlen_attention_reference(*args, scale=head_dim**-0.5), args[4], "bfloat16")
    covered = np.asarray(segments.row_segments(args[4], num_rows) > 0)
    np.testing.assert_array_equal(got[covered], np.asarray(kernel(), np.float32)[covered])
    np.testing.assert_array_equal(got[~covered], np.asarray(out, np.float32)[~covered])


def test_supports():
    ok = dict(dtype=jnp.bfloat16, head_dim=128, page_size=16, block_kv=128, ring_rows=None, window=0)
    assert mg.supports(**ok)
    assert mg.supports(**{**ok, "page_size": 256, "dtype": jnp.float16, "head_dim": 256})
    assert mg.supports(**{**ok, "window": 64}) and mg.supports(**{**ok, "ring_rows": 96, "window": 96})
    for bad in (
        {"dtype": jnp.float32},
        {"head_dim": 80},
        {"page_size": 12},
        {"page_size": 8},  # allowed by TMA, not checked on the GPU
        {"ring_rows": 96},  # a ring without a window: a row would stand for several keys
        {"ring_rows": 96, "window": 97},  # a window wider than its ring, likewise
    ):
        assert not mg.supports(**{**ok, **bad}), bad


def test_mosaic_backend_refuses_what_it_cannot_run():
    keys = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(keys[0], (32, 4, 128), jnp.bfloat16)
    k_pages = jax.random.normal(keys[1], (4, 16, 1, 128), jnp.bfloat16)
    v_pages = jax.random.normal(keys[2], (4, 16, 1, 128), jnp.bfloat16)
    page_table = jnp.array([[2, 1, 3, 0]], jnp.int32)
    args = (q, k_pages, v_pages, page_table, jnp.array([[0, 32, 0, 32]], jnp.int32))
    if not ON_GPU:
        with pytest.raises(ValueError, match="backend='mosaic' needs a Hopper GPU"):
            varlen_attention(*args, scale=0.1, backend="mosaic")  # compiled, on a CPU machine
    with pytest.raises(ValueError, match="backend='mosaic' needs.*ring_rows=32, window=0"):
        varlen_attention(*args, scale=0.1, backend="mosaic", ring_rows=32, interpret=True)
    with pytest.raises(ValueError, match="backend='mosaic' needs.*num_splits=2"):
        varlen_attention(*args, scale=0.1, backend="mosaic", num_splits=2, interpret=True)
    with pytest.raises(ValueError, match="backend='mosaic' needs.*pools float8_e4m3fn"):
        varlen_attention(q, k_pages.astype(jnp.float8_e4m3fn), v_pages.astype(jnp.float8_e4m3fn), *args[3:],
                         scale=0.1, backend="mosaic", interpret=True)
    with pytest.raises(ValueError, match="backend='mosaic' needs"):
        varlen_attention(*args, scale=0.1, backend="mosaic", block_sizes=BlockSizes(), interpret=True)
    with pytest.raises(ValueError, match=r"varlen_attention_mgpu: ring_rows=100 must be in \[1, 64\]"):
        mg.varlen_attention_mgpu(*args, scale=0.1, ring_rows=100, window=8)
    with pytest.raises(ValueError, match="a ring a window in .*ring_rows=32, window=40"):
        mg.varlen_attention_mgpu(*args, scale=0.1, ring_rows=32, window=40)
    with pytest.raises(ValueError, match="backend='cudnn'"):
        varlen_attention(*args, scale=0.1, backend="cudnn")
    # On a CPU machine "auto" never picks Mosaic: it is the Triton kernel (interpreted), exactly.
    auto = varlen_attention(*args, scale=0.1, interpret=True)
    triton = varlen_attention(*args, scale=0.1, backend="triton", interpret=True)
    np.testing.assert_array_equal(np.asarray(auto, np.float32), np.asarray(triton, np.float32))
    assert np.abs(np.asarray(auto, np.float32)).max() > 0


@pytest.mark.parametrize(
    "num_rows,hq,hkv,d,page_size,dtype,causal,layer",
    [
        (461, 8, 2, 128, 16, jnp.bfloat16, True, {}),
        (10, 4, 1, 64, 16, jnp.bfloat16, True, {}),
        (197, 16, 2, 256, 32, jnp.bfloat16, True, {}),
        (300, 8, 2, 128, 64, jnp.float16, False, {}),
        (256, 2, 2, 64, 256, jnp.bfloat16, True, {}),
        (512, 8, 4, 256, 16, jnp.bfloat16, True, dict(ring_rows=240, window=200, softcap=50.0)),  # gemma-like
        (300, 8, 2, 128, 16, jnp.bfloat16, True, dict(window=128)),
        (300, 8, 2, 128, 16, jnp.float16, False, dict(window=64, softcap=30.0)),
        (461, 8, 2, 128, 16, jnp.bfloat16, True, {"max_ctas": 132}),
        (197, 16, 2, 256, 32, jnp.bfloat16, True, {"max_ctas": 132}),
        (300, 8, 2, 192, 16, jnp.bfloat16, True, {}),
    ],
)
def test_lowers_for_cuda(num_rows, hq, hkv, d, page_size, dtype, causal, layer):
    num_pages, pages_per_seq = 64, 16
    args = (
        jax.ShapeDtypeStruct((num_rows, hq, d), dtype),
        jax.ShapeDtypeStruct((num_pages, page_size, hkv, d), dtype),
        jax.ShapeDtypeStruct((num_pages, page_size, hkv, d), dtype),
        jax.ShapeDtypeStruct((5, pages_per_seq), jnp.int32),
        jax.ShapeDtypeStruct((3, 4), jnp.int32),
    )
    fn = jax.jit(lambda *a: mg.varlen_attention_mgpu(*a, causal=causal, scale=d**-0.5, **layer))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_one_stage_is_refused():
    q = jax.ShapeDtypeStruct((64, 4, 64), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((8, 16, 1, 64), jnp.bfloat16)
    table, info = jax.ShapeDtypeStruct((2, 4), jnp.int32), jax.ShapeDtypeStruct((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="num_stages=1 must be >= 2"):
        jax.eval_shape(lambda *a: mg.varlen_attention_mgpu(*a, scale=0.1, num_stages=1), q, pages, pages, table, info)


def test_auto_dispatch(monkeypatch):
    """On a Hopper GPU (stubbed), "auto" takes the kernel for prefill steps it covers; rings, windows and soft-caps
    only without tuning.MOSAIC_PREFILL_PLAIN_ONLY."""
    import importlib

    va = importlib.import_module("glint.pallas_kernels.varlen_attention")
    monkeypatch.setattr(mg, "is_hopper", lambda: True)
    q = jnp.zeros((512, 8, 128), jnp.bfloat16)

    def use(num_segments=2, **kw):
        args = dict(q=q, k_pages=jnp.zeros((4, 16, 2, 128), jnp.bfloat16),
                    seq_info=jnp.zeros((num_segments, 4), jnp.int32), ring_rows=None, window=0, softcap=0.0,
                    num_splits=None, block_sizes=None, interpret=False)
        return va._use_mosaic("auto", **{**args, **kw})

    layers = (dict(window=128), dict(softcap=30.0), dict(ring_rows=200, window=128))
    monkeypatch.setattr(tuning, "MOSAIC_PREFILL_PLAIN_ONLY", True)
    assert use() and not any(use(**layer) for layer in layers)
    monkeypatch.setattr(tuning, "MOSAIC_PREFILL_PLAIN_ONLY", False)
    assert all(use(**layer) for layer in layers)
    assert not use(ring_rows=200)  # a ring without a window
    assert not use(num_segments=512)  # a decode step
    assert not use(interpret=True)
    monkeypatch.setattr(mg, "is_hopper", lambda: False)
    assert not use()


def test_auto_splits_segments_between_the_kernels(monkeypatch):
    """On Hopper, "auto" sends long segments to Mosaic and short ones to Triton, and the Mosaic kernel writes its
    segments' rows into the Triton kernel's output. Here a stand-in for the Mosaic kernel (the Triton one in
    interpret mode, on the segments it is handed, written into the `out` it is handed) checks the split: every row
    is answered once, as by Triton alone, and what Triton writes in Mosaic's rows (NaN here) never shows."""
    import importlib

    from glint.pallas_kernels.testing import AttentionCase, make_attention_inputs

    case = AttentionCase(((300, 300), (1, 700), (7, 40), (130, 500), (1, 90)), group=4, num_kv_heads=2,
                         head_dim=64, dtype="bfloat16", num_padding_segments=2, gaps=4, poison=False)
    inputs = {k: jnp.asarray(v, jnp.bfloat16) if v.dtype == np.float32 else jnp.asarray(v)
              for k, v in make_attention_inputs(case, np.random.default_rng(3)).items()}
    va = importlib.import_module("glint.pallas_kernels.varlen_attention")
    triton, handed, triton_calls = va._triton_attention, [], []
    segment_rows = segments.row_segments(inputs["seq_info"], inputs["q"].shape[0]) > 0

    def poisoned(out, info, rows):  # NaN in `rows` outside the segments this kernel was handed
        foreign = rows & ~(segments.row_segments(info, out.shape[0]) > 0)
        return jnp.where(foreign[:, None, None], jnp.nan, out)

    def fake_triton(q, k_pages, v_pages, page_table, info, **kwargs):  # rows of no segment stay its zeros
        triton_calls.append(info)
        return poisoned(triton(q, k_pages, v_pages, page_table, info, **kwargs), info, segment_rows)

    def fake_mosaic(q, k_pages, v_pages, page_table, info, *, out, causal, scale, **_):  # its rows into `out`
        handed.append(info)
        rows = triton(q, k_pages, v_pages, page_table, info, scales=(None, None), ring_rows=None, window=0,
                      causal=causal, softcap=0.0, scale=scale, num_splits=None, block_sizes=None, interpret=True)
        return jnp.where((segments.row_segments(info, out.shape[0]) > 0)[:, None, None], rows, out)

    want = va.varlen_attention(**inputs, scale=case.scale, backend="triton", interpret=True)
    monkeypatch.setattr(va, "_use_mosaic", lambda backend, **_: backend == "auto")  # as on a Hopper GPU
    monkeypatch.setattr(mg, "varlen_attention_mgpu", fake_mosaic)
    monkeypatch.setattr(va, "_triton_attention", fake_triton)
    got = va.varlen_attention.__wrapped__(**inputs, scale=case.scale, interpret=True)  # "auto", unjitted
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    [info] = handed
    assert len(triton_calls) == 1
    q_len = {int(s[2]): int(s[1]) for s in np.asarray(inputs["seq_info"])}
    mosaic_len = {int(s[2]): int(s[1]) for s in np.asarray(info)}
    to_mosaic = {slot for slot, n in mosaic_len.items() if n > 0}
    assert {slot for slot, n in q_len.items() if n >= 300} <= to_mosaic  # whole 128-row tiles
    assert not {slot for slot, n in q_len.items() if 0 < n <= 7} & to_mosaic  # decode rows, tiny chunks
