"""The model over the paged state: prefill in random chunks, then decode == the full-sequence forward."""
import zlib

import jax
import numpy as np
import pytest
from conftest import PALLAS

from glint.export.checkpoint import load_checkpoint
from glint.kvcache import BatchControl, CacheConfig, KVState
from glint.model import transformer
from glint.runtime.programs import apply_table_changes
from glint.runtime.step import DeviceMeta, PagedAttention, run_model, zero_tables


def device_meta(meta, tables) -> DeviceMeta:
    """A step's metadata as the program sees it: the device's tables, this step's changes applied."""
    return DeviceMeta(meta.positions, tuple(meta.slots), meta.seq_info, tuple(tables))


def full_logits(graphdef, params, tokens):
    return np.asarray(transformer.full_sequence_logits(graphdef, params, tokens))


@pytest.mark.parametrize("impl", ["reference", PALLAS])  # the Pallas kernels: interpreted, or on the GPU
def test_chunked_prefill_then_decode_matches_full_forward(hf_fixture, impl):
    cfg, params = load_checkpoint(hf_fixture, dtype="float32")
    graphdef = transformer.split(transformer.abstract_model(cfg))[0]
    rng = np.random.default_rng(zlib.crc32(hf_fixture.name.encode()))  # the same case every run
    tokens = rng.integers(0, cfg.vocab_size, 70).tolist()
    expected = full_logits(graphdef, params, tokens)
    max_write = 16
    cache = CacheConfig(page_size=4, num_pages=64, max_seqs=2, max_write=max_write, capacity=96,
                        windows=cfg.layer_windows, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype="float32")
    control, kv, tables = BatchControl(cache), KVState.create(cache), zero_tables(cache, cache.max_seqs)
    backend = PagedAttention(cache, impl)
    step = jax.jit(lambda params, kv, toks, meta, rows: run_model(graphdef, backend, params, kv, toks, meta, rows))
    seq = control.seq_new()
    done, got = 0, []
    while done < len(tokens):
        n = int(rng.integers(1, max_write + 1)) if done < 50 else 1  # random prefill chunks, then decode
        n = min(n, len(tokens) - done)
        assert control.declare_step([seq] * n)
        meta = control.prepare_step(width=max_write, num_segments=2)
        tables = apply_table_changes(tables, meta.table_changes)
        logits, kv = step(params, kv, np.asarray(tokens[done:done + n] + [0] * (max_write - n), np.int32),
                          device_meta(meta, tables), np.arange(max_write, dtype=np.int32))
        control.commit_step()
        got.append(np.asarray(logits)[:n])
        done += n
    np.testing.assert_allclose(np.concatenate(got), expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("impl", ["reference", PALLAS])
def test_glimmer_layout_paged_equals_dense(impl):
    """Glimmer's blocks (scaleless q/k norm, output gate, embedding norm, no-RoPE global layers, soft-cap) take
    the same values through the paged cache as through the full-sequence path."""
    from glint.model.presets import preset

    cfg = preset("muse-glimmer-30b", dtype="float32").replace(
        num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=256,
        layer_windows=(16, 16, 16, 0))
    assert cfg.layer_rope[3] is None and cfg.attn_output_gate and cfg.embed_norm
    graphdef, params = transformer.split(transformer.init_model(cfg, seed=4))
    tokens = np.random.default_rng(4).integers(0, 256, 40).tolist()
    expected = full_logits(graphdef, params, tokens)
    cache = CacheConfig(page_size=4, num_pages=64, max_seqs=1, max_write=8, capacity=64, windows=cfg.layer_windows,
                        kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype="float32")
    control, kv, tables = BatchControl(cache), KVState.create(cache), zero_tables(cache, cache.max_seqs)
    backend = PagedAttention(cache, impl)
    step = jax.jit(lambda params, kv, toks, meta, rows: run_model(graphdef, backend, params, kv, toks, meta, rows))
    seq, got = control.seq_new(), []
    for start in range(0, len(tokens), 8):
        assert control.declare_step([seq] * 8)
        meta = control.prepare_step(width=8, num_segments=1)
        tables = apply_table_changes(tables, meta.table_changes)
        logits, kv = step(params, kv, np.asarray(tokens[start:start + 8], np.int32), device_meta(meta, tables),
                          np.arange(8, dtype=np.int32))
        control.commit_step()
        got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got), expected, rtol=1e-4, atol=1e-4)
    assert np.abs(expected).max() <= 20.0  # the final soft-cap


@pytest.mark.parametrize("kv_dtype, is_fused", [("float32", True), ("float8_e4m3fn", False)])
def test_the_kernels_fuse_the_qkv_write_for_plain_pools(monkeypatch, kv_dtype, is_fused):
    """Through the kernels each layer's norms, RoPE and cache write are one qkv_write when the pools are in the
    activations' dtype, and the unfused path otherwise (a scaled fp8 cache); either way the logits are the
    reference backend's."""
    from glint.model.presets import preset
    from glint.runtime import step as step_module

    cfg = preset("qwen3-8b", dtype="float32").replace(
        num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=256)
    assert cfg.qk_norm == "rms"
    graphdef, params = transformer.split(transformer.init_model(cfg, seed=5))
    calls = []
    fused = step_module.qkv_write
    monkeypatch.setattr(step_module, "qkv_write", lambda *a, **k: calls.append(k["qk_norm"]) or fused(*a, **k))
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, 8).astype(np.int32)
    logits = {}
    for impl in ("reference", PALLAS):
        cache = CacheConfig(page_size=4, num_pages=16, max_seqs=1, max_write=8, capacity=32, windows=cfg.layer_windows,
                            kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=kv_dtype)
        control, kv, tables = BatchControl(cache), KVState.create(cache), zero_tables(cache, cache.max_seqs)
        assert control.declare_step([control.seq_new()] * 8)
        meta = control.prepare_step(width=8, num_segments=1)
        out, _ = run_model(graphdef, PagedAttention(cache, impl), params, kv, tokens,
                           device_meta(meta, apply_table_changes(tables, meta.table_changes)), np.arange(8))
        logits[impl] = np.asarray(out)
    assert calls == (["rms"] * cfg.num_layers if is_fused else [])
    np.testing.assert_allclose(logits[PALLAS], logits["reference"], rtol=1e-4, atol=1e-4)


def test_rope_is_computed_once_per_step_not_per_layer(hf_fixture):
    """Each distinct RoPE of the model becomes one cos/sin table per step, shared by all layers using it."""
    from glint.model.attention import DenseMeta, dense_attention

    cfg, params = load_checkpoint(hf_fixture, dtype="float32")
    graphdef = transformer.split(transformer.abstract_model(cfg))[0]
    n = 8
    forward = jax.jit(lambda p, t, pos: transformer.forward(graphdef, p, t, pos, dense_attention, None,
                                                            DenseMeta.single(n))[0])
    text = forward.lower(params, np.zeros(n, np.int32), np.arange(n, dtype=np.int32)).as_text()
    distinct = len({rope for rope in cfg.layer_rope if rope is not None})
    assert cfg.num_layers > distinct >= 1
    assert text.count("stablehlo.cosine") == distinct and text.count("stablehlo.sine") == distinct
