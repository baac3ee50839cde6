"""DFlash draft (z-lab layout) against z-lab's own dflash_generate on the reference fixture, and its validators.

The generate loop below is a plain transcription of the reference's greedy semantics: the target runs full
causal forwards over the committed sequence plus the block (no KV cache), the draft keeps a dense context
cache that it extends with the new committed rows each step and never with the block.
"""
import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SHARED
from safetensors.numpy import load_file, save_file

from glint.export.checkpoint import load_checkpoint
from glint.model import dflash, transformer
from glint.model.attention import DenseMeta, dense_attention

FIXTURE = pathlib.Path(os.environ.get("GLINT_DFLASH_FIXTURES", SHARED / "fixtures" / "dflash"))
REF = json.loads((FIXTURE / "reference.json").read_text())
TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(scope="module")
def models():
    target_cfg, target_params = load_checkpoint(FIXTURE / "target", dtype="float32")
    graphdef = transformer.split(transformer.abstract_model(target_cfg))[0]
    draft_cfg, draft_params = dflash.load_draft(FIXTURE / "draft", target_cfg)
    return target_cfg, graphdef, target_params, draft_cfg, draft_params


def target_runner(graphdef, params, taps, width):
    """tokens (a list) -> (logits [n, V], tapped features [n, len(taps) * hidden]) of a full causal forward,
    compiled once at `width` rows: the padding rows come after the real ones, so causality hides them."""
    @jax.jit
    def run(tokens):
        pos = jnp.arange(width, dtype=jnp.int32)
        hidden, _, feats = transformer.forward(graphdef, params, tokens, pos, dense_attention, None,
                                               DenseMeta.single(width), taps=taps)
        return transformer.compute_logits(graphdef, params, hidden), feats

    def call(tokens):
        padded = np.zeros(width, np.int32)
        padded[:len(tokens)] = tokens
        logits, feats = run(jnp.asarray(padded))
        return np.asarray(logits)[:len(tokens)], np.asarray(feats)[:len(tokens)]

    return call


def draft_runner(models, max_new_rows, capacity):
    """(empty cache, step) for the draft over a dense per-layer context cache of `capacity` rows, compiled once.

    step(cache, tapped rows padded to `max_new_rows`, how many are real, how many are cached, block) writes the
    new rows' K/V at the positions after the cached ones and drafts the block at the next position ->
    (cache, final hidden [block_size, hidden], draft logits of rows 1..). The padding rows land past the
    context, where `dense_draft` ignores them and the next step overwrites them."""
    _, graphdef, tparams, cfg, params = models

    @jax.jit
    def step(cache, tapped, num_new, cached, block):
        feats = dflash.context_features(params, cfg, tapped)
        pos = cached + jnp.arange(max_new_rows, dtype=jnp.int32)
        kv = [dflash.context_kv(params, cfg, i, feats, pos) for i in range(cfg.num_layers)]
        cache = [[jax.lax.dynamic_update_slice(c, x, (cached, 0, 0)) for c, x in zip(cs, xs, strict=True)]
                 for cs, xs in zip(cache, zip(*kv, strict=True), strict=True)]
        start = cached + num_new  # the block sits right after the committed rows
        hidden = dflash.dense_draft(params, cfg, *cache, start, tparams["embed"][block],
                                    start + jnp.arange(cfg.block_size, dtype=jnp.int32))
        return cache, hidden, transformer.compute_logits(graphdef, tparams, hidden[1:])

    empty = [[jnp.zeros((capacity, cfg.num_kv_heads, cfg.head_dim), jnp.float32)] * cfg.num_layers] * 2
    return empty, step


def generate(cfg, target, drafter, prompt, max_new_tokens, max_new_rows):
    """Greedy DFlash of one prompt -> what the reference records, plus per-step draft logits, draft hiddens
    and the context rows each step fed."""
    cache, step = drafter
    n, bs = len(prompt), cfg.block_size
    logits, feats = target(prompt)
    tokens, start, cached, new_rows = list(prompt) + [int(logits[-1].argmax())], n, 0, feats
    out = {k: [] for k in ("acceptance_lengths", "proposed_blocks", "draft_ctx_lens", "draft_logits",
                           "draft_hidden", "context_features")}
    while start < n + max_new_tokens:
        # the draft cache holds the committed rows only (the block's K/V are never kept): it catches up with
        # the rows committed since the last step, at their own positions, then drafts the block after them
        assert cached + len(new_rows) == start
        block = [tokens[start]] + [cfg.mask_token_id] * (bs - 1)
        padded = np.zeros((max_new_rows, new_rows.shape[1]), np.float32)
        padded[:len(new_rows)] = new_rows
        cache, hidden, draft_logits = step(cache, padded, len(new_rows), cached, jnp.asarray(block))
        cached, draft_logits = start, np.asarray(draft_logits)
        block[1:] = draft_logits.argmax(-1).tolist()
        logits, feats = target(tokens[:start] + block)
        posterior = logits[start:].argmax(-1)
        accepted = 0
        while accepted < bs - 1 and block[accepted + 1] == posterior[accepted]:
            accepted += 1
        for key, value in (("acceptance_lengths", accepted + 1), ("proposed_blocks", block),
                           ("draft_ctx_lens", len(new_rows)), ("draft_logits", draft_logits),
                           ("draft_hidden", np.asarray(hidden)), ("context_features", new_rows)):
            out[key].append(value)
        tokens = tokens[:start + 1] + block[1:accepted + 1] + [int(posterior[accepted])]
        new_rows = feats[start:start + accepted + 1]
        start += accepted + 1
    out["output_ids"] = tokens[n:n + max_new_tokens]  # the last step may commit past the limit
    return out


@pytest.fixture(scope="module")
def runs(models):
    _, graphdef, tparams, cfg, _ = models
    max_prompt = max(len(c["prompt"]) for c in REF["cases"])
    width = max_prompt + REF["max_new_tokens"] + cfg.block_size
    target = target_runner(graphdef, tparams, cfg.target_layer_ids, width)
    max_new_rows = max(max_prompt, cfg.block_size)  # the prompt at step 0, at most a block after
    drafter = draft_runner(models, max_new_rows, width + max_new_rows)
    return [generate(cfg, target, drafter, c["prompt"], REF["max_new_tokens"], max_new_rows) for c in REF["cases"]]


def test_config_matches_reference(models):
    cfg = models[3]
    assert (cfg.block_size, cfg.mask_token_id, list(cfg.target_layer_ids), cfg.num_layers, cfg.vocab_size,
            cfg.hidden_size) == (REF["block_size"], REF["mask_token_id"], REF["target_layer_ids"],
                                 REF["num_draft_layers"], REF["vocab_size"], REF["hidden_size"])


@pytest.mark.parametrize("case", range(len(REF["cases"])))
def test_greedy_dflash_matches_reference(runs, case):
    ref, got = REF["cases"][case], runs[case]
    assert got["output_ids"] == ref["output_ids"] == ref["target_greedy"]
    assert got["acceptance_lengths"] == ref["acceptance_lengths"]
    assert got["proposed_blocks"] == ref["proposed_blocks"]
    assert got["draft_ctx_lens"] == ref["draft_ctx_lens"]


def test_features_and_logits_match_reference(runs):
    expected = np.load(FIXTURE / "reference_logits.npz")
    for i, got in enumerate(runs):
        np.testing.assert_allclose(got["context_features"][0], expected[f"case{i}_context_features"], **TOL)
        np.testing.assert_allclose(got["draft_logits"][0], expected[f"case{i}_draft_logits_step0"], **TOL)
    np.testing.assert_allclose(np.stack(runs[0]["draft_logits"]), expected["case0_draft_logits"], **TOL)
    np.testing.assert_allclose(runs[0]["draft_hidden"][0], expected["case0_draft_hidden_step0"], **TOL)


def test_taps_read_the_residual_stream(models):
    """Taps come in the order given; a tap on the last layer is the final-normed output (HF's
    hidden_states[-1]). That the others are HF's hidden_states[id + 1] the fixture features check."""
    cfg = models[0].replace(num_layers=2)  # the fixture target's first layers: compiles in a fraction
    params = {**models[2], "layers": {i: models[2]["layers"][i] for i in range(cfg.num_layers)}}
    graphdef = transformer.split(transformer.abstract_model(cfg))[0]
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, 9), jnp.int32)
    pos, meta = jnp.arange(9, dtype=jnp.int32), DenseMeta.single(9)
    forward = jax.jit(lambda taps: transformer.forward(graphdef, params, tokens, pos, dense_attention, None, meta,
                                                       taps=taps), static_argnums=0)
    hidden, _, feats = forward((1, 0))
    _, _, first = forward((0,))
    d = cfg.hidden_size
    np.testing.assert_array_equal(np.asarray(feats[:, :d]), np.asarray(hidden))
    np.testing.assert_array_equal(np.asarray(feats[:, d:]), np.asarray(first))
    assert not np.allclose(np.asarray(first), np.asarray(hidden))
    with pytest.raises(ValueError, match=f"taps \\[{cfg.num_layers}\\]"):
        forward((cfg.num_layers,))


def draft_copy(tmp_path, config_changes=None, drop=(), add=None, reshape=()):
    """A copy of the fixture draft with config.json keys changed ({"dflash_config": {...}} merges) and
    tensors dropped, added or transposed."""
    out = tmp_path / "draft"
    shutil.copytree(FIXTURE / "draft", out)
    config = json.loads((out / "config.json").read_text())
    for key, value in (config_changes or {}).items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    config = {k: v for k, v in config.items() if v is not None}
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(out / "model.safetensors")
    tensors = {k: (np.ascontiguousarray(v.T) if k in reshape else v) for k, v in tensors.items() if k not in drop}
    save_file({**tensors, **(add or {})}, out / "model.safetensors")
    return out


def load(models, folder):
    return dflash.load_draft(folder, models[0])


def test_block_size_inside_dflash_config_loads_the_same(models, tmp_path):
    cfg = models[3]
    moved = draft_copy(tmp_path, {"block_size": None, "dflash_config": {"block_size": cfg.block_size}})
    assert load(models, moved)[0] == cfg


@pytest.mark.parametrize("change, message", [
    (lambda c: {"architectures": ["Qwen3ForCausalLM"]}, "architectures \\['Qwen3ForCausalLM'\\]"),
    (lambda c: {"block_size": None}, "lacks \\['block_size'\\]"),
    (lambda c: {"dflash_config": {"mask_token_id": None}}, "lacks \\['dflash_config.mask_token_id'\\]"),
    (lambda c: {"block_size": 1}, "block_size must be an int >= 2.*got 1"),
    (lambda c: {"dflash_config": {"block_size": c.block_size + 1}},
     lambda c: f"block_size {c.block_size} and dflash_config.block_size {c.block_size + 1} differ"),
    (lambda c: {"dflash_config": {"mask_token_id": c.vocab_size}},
     lambda c: f"mask_token_id {c.vocab_size} is not a token id of vocab_size {c.vocab_size}"),
    (lambda c: {"dflash_config": {"target_layer_ids": [0, c.num_target_layers]}},
     lambda c: f"target_layer_ids \\[{c.num_target_layers}\\] are out of range for num_target_layers "
               f"{c.num_target_layers}"),
    (lambda c: {"hidden_size": 2 * c.hidden_size},
     lambda c: f"draft hidden_size {2 * c.hidden_size} != target hidden_size {c.hidden_size}"),
    (lambda c: {"vocab_size": c.vocab_size + 7},
     lambda c: f"draft vocab_size {c.vocab_size + 7} != target vocab_size {c.vocab_size}"),
    (lambda c: {"num_target_layers": c.num_target_layers + 1},
     lambda c: f"draft num_target_layers {c.num_target_layers + 1} != target num_layers {c.num_target_layers}"),
])
def test_bad_config_is_named(models, tmp_path, change, message):
    cfg = models[3]
    folder = draft_copy(tmp_path, change(cfg))
    with pytest.raises(ValueError, match=message if isinstance(message, str) else message(cfg)):
        load(models, folder)


def test_missing_unknown_and_misshaped_tensors_are_named(models, tmp_path):
    cfg = models[3]
    gone, extra = f"layers.{cfg.num_layers - 1}.mlp.down_proj.weight", "embed_tokens.weight"
    fc = (cfg.hidden_size, len(cfg.target_layer_ids) * cfg.hidden_size)
    folder = draft_copy(tmp_path, drop=(gone,), reshape=("fc.weight",),
                        add={extra: np.ones((cfg.vocab_size, cfg.hidden_size), np.float32)})
    with pytest.raises(ValueError) as e:
        load(models, folder)
    assert f"missing ['{gone}']" in str(e.value)
    assert f"unknown ['{extra}']" in str(e.value)
    assert f"fc.weight: expected {fc}, got {fc[::-1]}" in str(e.value)
