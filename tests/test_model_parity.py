"""Every HF fixture: convert, load, full-sequence forward in float32 == transformers' logits."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import STORIES

from glint.export.checkpoint import load_checkpoint
from glint.model import transformer
from glint.model.attention import DenseMeta, dense_attention


def prompt_logits(cfg, params, tokens):
    graphdef = transformer.split(transformer.abstract_model(cfg))[0]
    return np.asarray(transformer.full_sequence_logits(graphdef, params, tokens))


def test_fixture_logits_match_transformers(hf_fixture, converted):
    cfg, params = load_checkpoint(converted(hf_fixture))
    assert cfg.dtype == "float32"
    ref = json.loads((hf_fixture / "reference.json").read_text())
    expected = np.load(hf_fixture / "reference_logits.npz")
    for i, case in enumerate(ref["cases"]):
        logits = prompt_logits(cfg, params, case["prompt"])
        np.testing.assert_allclose(logits, expected[f"prompt{i}"], rtol=1e-3, atol=1e-3)
        assert logits.argmax(-1).tolist() == case["prompt_argmax"]


def test_hf_folder_and_orbax_folder_load_the_same(hf_fixture, converted):
    cfg_a, a = load_checkpoint(hf_fixture, dtype="float32")
    cfg_b, b = load_checkpoint(converted(hf_fixture))
    assert cfg_a == cfg_b
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_bfloat16_load_is_close_to_float32(hf_fixture):
    cfg, params = load_checkpoint(hf_fixture, dtype="bfloat16")
    assert params["embed"].dtype == jnp.bfloat16
    assert params["norm"]["weight"].dtype == jnp.float32  # norms stay float32
    prompt = json.loads((hf_fixture / "reference.json").read_text())["cases"][0]["prompt"]
    logits = prompt_logits(cfg, params, prompt)
    expected = np.load(hf_fixture / "reference_logits.npz")["prompt0"]
    scale = np.abs(expected).max()
    assert np.abs(logits - expected).max() < 0.1 * scale


def test_stories260k_greedy_by_full_forwards():
    """Greedy decoding by repeated full forwards (one compiled width, padding masked) from [1]."""
    ref = json.loads((STORIES / "reference.json").read_text())["cases"][0]
    cfg, params = load_checkpoint(STORIES, dtype="float32")
    graphdef = transformer.split(transformer.abstract_model(cfg))[0]
    width, steps = 64, 40

    @jax.jit
    def next_token(params, tokens, length):
        idx = jnp.arange(width, dtype=jnp.int32)
        meta = DenseMeta(idx, jnp.where(idx < length, 0, -1))
        hidden, _ = transformer.forward(graphdef, params, tokens, idx, dense_attention, None, meta)
        return jnp.argmax(transformer.compute_logits(graphdef, params, hidden[length - 1][None])[0])

    tokens = np.zeros(width, np.int32)
    tokens[: len(ref["prompt"])] = ref["prompt"]
    length, out = len(ref["prompt"]), []
    for _ in range(steps):
        tok = int(next_token(params, jnp.asarray(tokens), length))
        out.append(tok)
        tokens[length] = tok
        length += 1
    assert out == ref["greedy"][:steps]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padding_rows_do_not_change_real_rows(dtype):
    """Dense path: tokens of another segment and padding rows do not leak into a sequence."""
    from glint.model.presets import preset

    cfg = preset("tiny", dtype=dtype)
    model = transformer.init_model(cfg, seed=3)
    graphdef, params = transformer.split(model)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, cfg.vocab_size, 7), rng.integers(0, cfg.vocab_size, 5)
    alone, _ = transformer.forward(graphdef, params, jnp.asarray(a), jnp.arange(7), dense_attention, None,
                                   DenseMeta.single(7))
    tokens = jnp.asarray(np.concatenate([b, a, [0, 0]]))
    pos = jnp.asarray(np.concatenate([np.arange(5), np.arange(7), [0, 0]]))
    seg = jnp.asarray([1] * 5 + [0] * 7 + [-1, -1])
    packed, _ = transformer.forward(graphdef, params, tokens, pos, dense_attention, None, DenseMeta(pos, seg))
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(packed[5:12], np.float32), np.asarray(alone, np.float32), atol=tol, rtol=tol)
