"""The checkpoint's own settings (EOS ids, dtype, context), unseeded sampling, loud loaders and the CLI's feedback."""
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import HF_FIXTURES, STORIES

from glint.export.checkpoint import convert, load_checkpoint
from glint.model.config import ModelConfig
from glint.runtime.cli import main
from glint.runtime.engine import Engine
from glint.runtime.params import SamplingParams

SMALL = dict(max_seqs=4, page_size=8, max_step_tokens=32, forward_sizes=(1, 8), num_pages=96, capacity=128)
LLAMA = HF_FIXTURES / "llama"


def fixture_copy(tmp_path, src=LLAMA):
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def test_generation_config_eos_ids_stop_generation(tmp_path):
    folder = fixture_copy(tmp_path)
    base = Engine.from_pretrained(str(folder), dtype="float32", **SMALL)
    case = json.loads((folder / "reference.json").read_text())["cases"][0]
    greedy = base.generate([case["prompt"]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    stop_at = greedy.token_ids[5]
    config_eos = json.loads((folder / "config.json").read_text())["eos_token_id"]
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(dict(gen, eos_token_id=[config_eos, stop_at])))
    engine = Engine.from_pretrained(str(folder), dtype="float32", **SMALL)
    assert stop_at in engine.model.eos_token_ids and config_eos in engine.model.eos_token_ids
    out = engine.generate([case["prompt"]], SamplingParams(max_tokens=12, temperature=0.0))[0]
    first = greedy.token_ids.index(stop_at)
    assert out.finish_reason == "stop" and out.token_ids == greedy.token_ids[:first + 1]


def test_a_multimodal_wrappers_eos_ids_are_kept():
    text = json.loads((HF_FIXTURES / "gemma3" / "config.json").read_text())
    text = {k: v for k, v in text.items() if k != "eos_token_id"} | {"eos_token_id": 1}
    wrapper = {"model_type": "gemma3", "eos_token_id": [1, 106], "text_config": text}
    assert ModelConfig.from_hf(wrapper).eos_token_ids == (1, 106)


def test_the_checkpoints_dtype_is_the_default():
    stored = json.loads((STORIES / "config.json").read_text())["torch_dtype"]
    engine = Engine.from_pretrained(str(STORIES), **SMALL)
    assert engine.model.dtype == stored and engine.cache.dtype == stored
    ref = json.loads((STORIES / "reference.json").read_text())["cases"][0]
    out = engine.generate([ref["prompt"]], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == ref["greedy"][:60]
    assert Engine.from_pretrained("tiny", **SMALL).model.dtype == "bfloat16"  # presets


def test_capacity_beyond_the_models_context_needs_force():
    context = json.loads((STORIES / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(ValueError, match=rf"capacity {2 * context} exceeds the model's context "
                                         rf"\(max_position_embeddings {context}\); pass allow_long_context=True"):
        Engine.from_pretrained(str(STORIES), **(SMALL | dict(capacity=2 * context)))
    forced = Engine.from_pretrained(str(STORIES), **(SMALL | dict(capacity=2 * context, num_pages=400)),
                                    allow_long_context=True)
    assert forced.capacity == 2 * context


def test_unseeded_sampling_differs_between_engines_unless_the_engine_is_seeded():
    prompt, params = [[1, 2, 3]], SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)
    draws = [Engine.from_pretrained(str(LLAMA), dtype="float32", **SMALL).generate(prompt, params)[0].token_ids
             for _ in range(2)]
    assert draws[0] != draws[1]
    seeded = [Engine.from_pretrained(str(LLAMA), dtype="float32", seed=5, **SMALL).generate(prompt, params)[0].token_ids
              for _ in range(2)]
    assert seeded[0] == seeded[1]


@pytest.mark.parametrize("content, message", [
    ("null", r"config.json holds null, not a JSON object"),
    ("[1, 2]", r"config.json holds list, not a JSON object"),
    ("{not json", r"config.json is not valid JSON"),
])
def test_broken_config_json_names_the_file(tmp_path, content, message):
    folder = fixture_copy(tmp_path)
    (folder / "config.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        Engine.from_pretrained(str(folder), **SMALL)


def test_a_config_without_hidden_size_names_the_file_and_key(tmp_path):
    folder = fixture_copy(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["hidden_size"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: llama config lacks \['hidden_size'\]"):
        Engine.from_pretrained(str(folder), **SMALL)


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
def test_broken_safetensors_name_the_file(tmp_path, damage):
    folder = fixture_copy(tmp_path)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"empty": b"", "truncated": data[: len(data) // 2], "garbage": b"\x07" * 4096}[damage])
    with pytest.raises(ValueError, match=r"model.safetensors"):
        load_checkpoint(folder)


def test_a_bad_tokenizer_json_names_the_file(tmp_path):
    folder = fixture_copy(tmp_path)
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": 7}')
    with pytest.raises(ValueError, match=r"tokenizer.json: not a valid tokenizer.json"):
        Engine.from_pretrained(str(folder), **SMALL)


def test_non_finite_weights_are_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = fixture_copy(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].copy()
    tensors[name][1, 2] = np.nan
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"non-finite values \(NaN or inf\) in layers.0.mlp.down.kernel"):
        Engine.from_pretrained(str(folder), **SMALL)


def test_orbax_folders_missing_a_part_name_it(tmp_path):
    out = tmp_path / "orbax"
    convert(LLAMA, out, show_progress=False)
    shutil.rmtree(out / "params")
    with pytest.raises(ValueError, match=r"params is missing"):
        load_checkpoint(out)
    out2 = tmp_path / "orbax2"
    convert(LLAMA, out2, show_progress=False)
    (out2 / "glint.json").unlink()
    (out2 / "config.json").unlink()
    with pytest.raises(ValueError, match=r"has params/ but no glint.json"):
        load_checkpoint(out2)


def test_convert_refuses_an_existing_output_before_reading_weights(tmp_path):
    folder = fixture_copy(tmp_path)
    (folder / "model.safetensors").write_bytes(b"")  # reading it would fail with another message
    (tmp_path / "out" / "params").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"out/params already exists"):
        convert(folder, tmp_path / "out", show_progress=False)


def test_shape_errors_print_the_shape_as_stored(tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = fixture_copy(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    stored = tensors[name].shape
    tensors[name] = np.zeros((stored[0], stored[1] + 1), tensors[name].dtype)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{name}: stored \({stored[0]}, {stored[1] + 1}\), expected "
                                         rf"\({stored[0]}, {stored[1]}\)"):
        load_checkpoint(folder)


def test_cli_help_is_light_and_says_defaults(capsys):
    code = ("import sys; from glint.runtime.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('jax', 'numpy', 'flax') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "(default: 64)" in capsys.readouterr().out


def test_cli_info_is_a_summary_and_demo_refuses_no_requests(capsys):
    assert main(["info", "llama3-8b"]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) <= 8 and "32 layers" in out and "8,030,261,248 parameters" in out
    assert main(["info", "llama3-8b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_layers"] == 32
    assert main(["demo", "--requests", "0"]) == 2
    assert "--requests must be >= 1, got 0" in capsys.readouterr().err
