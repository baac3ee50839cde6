"""HF -> orbax conversion: loud failures on broken checkpoints, sharded folders, dtypes."""
import json
import shutil

import numpy as np
import pytest
from conftest import HF_FIXTURES
from safetensors.numpy import load_file, save_file

from glint.export.checkpoint import convert, load_checkpoint

LLAMA = HF_FIXTURES / "llama"
CONFIG = json.loads((LLAMA / "config.json").read_text())
LAST = CONFIG["num_hidden_layers"] - 1


@pytest.fixture
def broken(tmp_path):
    """Copy the llama fixture and let the test edit its tensors."""
    def make(edit):
        d = tmp_path / "hf"
        d.mkdir()
        shutil.copy(LLAMA / "config.json", d / "config.json")
        tensors = load_file(LLAMA / "model.safetensors")
        edit(tensors)
        save_file(tensors, d / "model.safetensors")
        return d
    return make


def test_missing_tensor(broken):
    d = broken(lambda t: t.pop(f"model.layers.{LAST}.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=rf"missing \['model.layers.{LAST}.mlp.up_proj.weight'\]"):
        load_checkpoint(d)


def test_extra_tensor(broken):
    bias = np.ones(CONFIG["num_attention_heads"] * CONFIG["head_dim"], np.float32)
    d = broken(lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": bias}))
    with pytest.raises(ValueError, match=r"unknown \['model.layers.0.self_attn.q_proj.bias'\]"):
        convert(d, d.parent / "out", show_progress=False)


def test_wrong_shape(broken):
    name = f"model.layers.{LAST}.self_attn.k_proj.weight"
    rows, cols = load_file(LLAMA / "model.safetensors")[name].shape
    d = broken(lambda t: t.update({name: np.ones((rows // 2, cols), np.float32)}))
    expected = rf"k_proj.weight: stored \({rows // 2}, {cols}\), expected \({rows}, {cols}\)"
    with pytest.raises(ValueError, match=expected):
        load_checkpoint(d)


def test_unsupported_rope_type(broken, tmp_path):
    d = broken(lambda t: None)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        convert(d, tmp_path / "out", show_progress=False)


def test_sharded_checkpoint_and_duplicates(tmp_path):
    tensors = load_file(LLAMA / "model.safetensors")
    names = sorted(tensors)
    d = tmp_path / "sharded"
    d.mkdir()
    shutil.copy(LLAMA / "config.json", d / "config.json")
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, d / file)
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    _, params = load_checkpoint(d, dtype="float32")
    np.testing.assert_array_equal(np.asarray(params["embed"]), tensors["model.embed_tokens.weight"])
    save_file({names[0]: tensors[names[0]], **{k: tensors[k] for k in shards["b.safetensors"]}}, d / "b.safetensors")
    with pytest.raises(ValueError, match=f"tensor '{names[0]}' appears twice"):
        load_checkpoint(d)


def test_convert_bfloat16_and_refuse_overwrite(tmp_path):
    out = tmp_path / "out"
    cfg = convert(LLAMA, out, dtype="bfloat16", show_progress=False)
    assert cfg.dtype == "bfloat16" and (out / "config.json").exists()
    cfg2, params = load_checkpoint(out)
    assert cfg2 == cfg and str(params["layers"][0]["attn"]["wqkv"]["kernel"].dtype) == "bfloat16"
    with pytest.raises(ValueError, match="already exists"):
        convert(LLAMA, out, show_progress=False)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="neither a glint"):
        load_checkpoint(tmp_path)
