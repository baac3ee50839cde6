"""KVState: a donated pytree of page pools, and page copies per layer group."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glint.kvcache import BatchControl, CacheConfig, KVState, apply_copies, default_num_pages, pad_copies
from glint.kvcache import state
from glint.kvcache.state import CPU_FALLBACK_BYTES, free_device_bytes


def make_config(**overrides) -> CacheConfig:
    fields = dict(
        page_size=4, num_pages=12, max_seqs=3, max_write=4, capacity=32,
        windows=(0, 6, 0), kv_heads=(2, 1, 2), head_dim=(8, 16, 8), dtype="float32",
    )
    fields.update(overrides)
    return CacheConfig(**fields)


def random_state(cfg: CacheConfig, seed: int) -> KVState:
    empty = KVState.create(cfg)
    keys = jax.random.split(jax.random.key(seed), len(jax.tree.leaves(empty)))
    leaves = [jax.random.normal(key, leaf.shape).astype(leaf.dtype) for key, leaf in zip(keys, jax.tree.leaves(empty))]
    return jax.tree.unflatten(jax.tree.structure(empty), leaves)


def test_create_shapes_and_pytree():
    cfg = make_config(dtype="bfloat16")
    state = KVState.create(cfg)
    assert state.num_layers == 3
    assert len(jax.tree.leaves(state)) == 2 * cfg.num_layers
    for layer in range(cfg.num_layers):
        for pool in (state.k[layer], state.v[layer]):
            assert pool.shape == (12, 4, cfg.kv_heads[layer], cfg.head_dim[layer])
            assert pool.dtype == jnp.bfloat16
            assert not pool.any()
    doubled = jax.tree.map(lambda x: x + 1, state)
    assert isinstance(doubled, KVState) and float(doubled.v[1][3, 2, 0, 5]) == 1.0


def test_a_scaled_fp8_state_carries_a_float32_scale_per_row_and_head():
    """float8_e4m3fn pools come with k_scale / v_scale [num_pages, kv_heads, page_size] in float32, counted in the
    page bytes (1 byte per element + 4 per row and head, K and V); parts / layers / from_layers round-trip."""
    cfg = make_config(dtype="float8_e4m3fn")
    state = KVState.create(cfg)
    assert cfg.scaled and not make_config(dtype="bfloat16").scaled
    assert len(jax.tree.leaves(state)) == 4 * cfg.num_layers and len(state.parts()) == 4
    for layer in range(cfg.num_layers):
        assert state.k[layer].dtype == jnp.float8_e4m3fn
        for scale in (state.k_scale[layer], state.v_scale[layer]):
            assert scale.shape == (12, cfg.kv_heads[layer], 4) and scale.dtype == jnp.float32
        assert cfg.page_bytes(layer) == 2 * 4 * cfg.kv_heads[layer] * (cfg.head_dim[layer] + 4)
    layers = state.layers()
    assert [len(parts) for parts in layers] == [4] * cfg.num_layers
    again = KVState.from_layers(layers)
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(state)))
    assert KVState(*state.parts()) == state
    plain = KVState.create(make_config())
    assert len(plain.parts()) == 2 and plain.k_scale == () and [len(p) for p in plain.layers()] == [2] * 3


def test_roundtrip_through_jit_with_donation():
    cfg = make_config()
    state = random_state(cfg, 0)
    expected = jax.tree.map(np.array, state)  # copies: a view would pin the buffer
    slots = jnp.array([5, 9, 17], jnp.int32)
    rows = jax.random.normal(jax.random.key(1), (3, 2, 8))

    def write_layer0(state: KVState, slots: jax.Array, rows: jax.Array) -> KVState:
        k0 = state.k[0].reshape(-1, *state.k[0].shape[2:]).at[slots].set(rows).reshape(state.k[0].shape)
        return dataclasses.replace(state, k=(k0,) + state.k[1:])

    donating = jax.jit(write_layer0, donate_argnums=0)
    out = donating(state, slots, rows)
    assert isinstance(out, KVState)
    assert state.k[0].is_deleted(), "the input state was not donated"
    out = donating(out, slots, rows)  # the returned state feeds the next call
    want = expected.k[0].reshape(-1, 2, 8).copy()
    want[np.asarray(slots)] = np.asarray(rows)
    np.testing.assert_array_equal(np.asarray(out.k[0]).reshape(-1, 2, 8), want)
    np.testing.assert_array_equal(np.asarray(out.v[2]), expected.v[2])
    np.testing.assert_array_equal(np.asarray(out.k[1]), expected.k[1])


def test_pad_copies_power_of_two():
    padded = pad_copies([np.array([[3, 7], [4, 8], [5, 9]], np.int32), np.zeros((0, 2), np.int32)])
    assert [p.shape for p in padded] == [(4, 2), (4, 2)]
    assert padded[0].tolist() == [[3, 7], [4, 8], [5, 9], [0, 0]]
    assert not padded[1].any()
    assert pad_copies([np.zeros((0, 2), np.int32)])[0].shape == (1, 2)
    assert pad_copies([np.ones((5, 2), np.int32)])[0].shape == (8, 2)


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn"])
@pytest.mark.parametrize("jit", [False, True])
def test_apply_copies_copies_whole_pages_per_group(jit, dtype):
    """Pages are copied whole in every layer of each group: pools and, in a scaled fp8 cache, their scales."""
    cfg = make_config(dtype=dtype)  # layers 0, 2 in flat group 0; layer 1 in ring group 1
    state = random_state(cfg, 2)
    before = jax.tree.map(np.asarray, state)
    copies = pad_copies([np.array([[2, 5], [3, 6], [2, 7]], np.int32), np.array([[4, 1]], np.int32)])
    fn = jax.jit(apply_copies, static_argnums=1, donate_argnums=0) if jit else apply_copies
    out = jax.tree.map(np.asarray, fn(state, cfg, copies))
    for layer in range(cfg.num_layers):
        pairs = [(2, 5), (3, 6), (2, 7)] if cfg.layer_group[layer] == 0 else [(4, 1)]
        for name in ("k", "v", "k_scale", "v_scale") if cfg.scaled else ("k", "v"):
            want = getattr(before, name)[layer].copy()
            for src, dst in pairs:
                want[dst] = getattr(before, name)[layer][src]
            np.testing.assert_array_equal(getattr(out, name)[layer], want, err_msg=f"{name}[{layer}]")


def test_apply_copies_validates_groups():
    cfg = make_config()
    with pytest.raises(ValueError, match="copies has 1 groups, cfg has 2"):
        apply_copies(KVState.create(cfg), cfg, [np.zeros((1, 2), np.int32)])


def test_control_and_state_end_to_end():
    """Steps through BatchControl + jitted apply_copies/writes read back per sequence."""
    cfg = make_config(num_pages=16)
    control = BatchControl(cfg)
    rng = np.random.default_rng(3)

    def run_step(state: KVState, copies, slots, values):
        state = apply_copies(state, cfg, copies)
        k = tuple(
            pool.reshape(-1, *pool.shape[2:]).at[slots[cfg.layer_group[layer]]]
            .set(values[:, None, None].astype(pool.dtype)).reshape(pool.shape)
            for layer, pool in enumerate(state.k)
        )
        return dataclasses.replace(state, k=k)

    run_step = jax.jit(run_step, donate_argnums=0)
    state = KVState.create(cfg)
    history: dict[int, list[float]] = {}
    a = control.seq_new()
    history[a] = []
    for step in range(14):
        if step == 5:
            b = control.seq_clone(a, upto=7)
            history[b] = history[a][:7]
        seqs = sorted(history)
        q = {s: int(rng.integers(1, 3)) for s in seqs}
        ids = [s for s in seqs for _ in range(q[s])]
        assert control.declare_step(ids)
        meta = control.prepare_step(width=8)
        values = rng.normal(size=8).astype(np.float32)
        state = run_step(state, pad_copies(meta.copies), meta.slots, values)
        control.commit_step()
        for s, v in zip(ids, values):
            history[s].append(float(v))
    k = [np.asarray(pool)[..., 0, 0] for pool in state.k]  # [num_pages, page_size]
    for s, values in history.items():
        pos = control.pos(s)
        assert pos == len(values)
        for layer in range(cfg.num_layers):
            g = cfg.layer_group[layer]
            ring_rows = cfg.group_ring_rows(g)
            first = 0 if ring_rows is None else pos - ring_rows
            table = control.page_table(g)[s]
            for p in range(max(0, first), pos):
                row = p if ring_rows is None else p % ring_rows
                got = k[layer][table[row // cfg.page_size], row % cfg.page_size]
                assert got == np.float32(values[p]), f"seq {s} layer {layer} position {p}"


def test_default_num_pages_reads_memory_stats():
    cfg = make_config(max_seqs=1000, capacity=1 << 14)

    class FakeDevice:
        def memory_stats(self):
            return {"bytes_limit": 100 * cfg.bytes_per_page_id, "bytes_in_use": 30 * cfg.bytes_per_page_id}

    assert free_device_bytes(0.5, FakeDevice()) == 20 * cfg.bytes_per_page_id
    assert default_num_pages(cfg, 0.5, FakeDevice()) == 20
    cpu = jax.devices("cpu")[0]
    if not cpu.memory_stats():
        assert default_num_pages(cfg, 0.9, cpu) == min(
            int(0.9 * CPU_FALLBACK_BYTES) // cfg.bytes_per_page_id, cfg.max_useful_pages
        )
    with pytest.raises(ValueError, match="fraction = 1.5"):
        free_device_bytes(1.5, FakeDevice())


class GpuWithoutStats:
    """A GPU whose allocator reports no memory stats (XLA's VMM allocator)."""

    platform, local_hardware_id = "gpu", 3

    def memory_stats(self):
        return None


def test_free_device_bytes_asks_the_driver_where_the_allocator_reports_no_pool(monkeypatch):
    """A GPU whose allocator has no memory stats (XLA's VMM allocator): fraction of XLA's share of the total less
    what is taken."""
    total, taken = 80 << 30, 17 << 30
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    asked = []
    monkeypatch.setattr(state, "cuda_memory_info", lambda ordinal: asked.append(ordinal) or (total - taken, total))
    assert free_device_bytes(1.0, GpuWithoutStats()) == (40 << 30) - (17 << 30)
    assert free_device_bytes(0.25, GpuWithoutStats()) == 0  # less than is taken already
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")  # XLA's default share: 0.75
    assert free_device_bytes(0.5, GpuWithoutStats()) == (30 << 30) - (17 << 30)
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.25")
    assert free_device_bytes(1.0, GpuWithoutStats()) == (20 << 30) - (17 << 30)
    assert asked == [3, 3, 3, 3]


def test_free_device_bytes_without_a_cuda_driver_falls_back(monkeypatch, caplog):
    """A "gpu" the CUDA driver cannot answer for (ROCm, no libcuda): the fallback budget and a warning, not an
    error out of pool sizing."""

    def no_driver(ordinal):
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(state, "cuda_memory_info", no_driver)
    assert free_device_bytes(0.5, GpuWithoutStats()) == int(0.5 * CPU_FALLBACK_BYTES)
    assert "--num-pages" in caplog.text
