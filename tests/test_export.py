"""`glint export` and `Engine.from_export`: the artifact serves the live engine's tokens, without the model code,
and damaged or mismatched artifacts get clear errors."""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from conftest import HF_FIXTURES, STORIES, covering_fixtures

from glint.export import export_engine
from glint.runtime.cli import main
from glint.runtime.artifact import PROGRAM_ABI
from glint.runtime.engine import Engine
from glint.runtime.params import SamplingParams
from glint.runtime.sampling import history_widths

SMALL = dict(max_seqs=4, page_size=8, max_step_tokens=32, forward_sizes=(1, 8), num_pages=96, capacity=128,
             min_prefill_chunk=4)


def workload(vocab: int, prompts: list[list[int]]):
    """Greedy requests (every fourth with penalties) and seeded ones (top-k/top-p, logprobs, n > 1) over the
    given prompts."""
    params = []
    for i, _ in enumerate(prompts):
        if i % 4 == 2:
            params.append(SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, presence_penalty=0.5,
                                         frequency_penalty=0.5, repetition_penalty=1.3))
        elif i % 2 == 0:
            params.append(SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        else:
            params.append(SamplingParams(max_tokens=12, temperature=0.8, top_k=40, top_p=0.9, seed=100 + i,
                                         ignore_eos=True, logprobs=2, n=2))
    return prompts, params


def outputs(engine: Engine, prompts, params):
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def llama_artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "llama"
    export_engine(str(HF_FIXTURES / "llama"), out, dtype="float32", show_progress=False, **SMALL)
    return out


@pytest.mark.parametrize("source", covering_fixtures(), ids=lambda p: p.name)
def test_exported_artifact_gives_the_live_engines_tokens(source, tmp_path):
    """On a fixture with ring layers and one without (the programs are the live engine's own, so the
    architectures' differences are tested on the live engine; trained weights go through export in the
    quantized-artifact test below)."""
    out = tmp_path / "artifact"
    meta = export_engine(str(source), out, dtype="float32", show_progress=False, **SMALL)
    live = Engine.from_pretrained(str(source), dtype="float32", **SMALL)
    served = Engine.from_pretrained(str(out))  # recognised as an artifact
    assert served.graphdef is None and served.cache == live.cache
    ref = source / "reference.json"
    cases = json.loads(ref.read_text())["cases"]
    rng = np.random.default_rng(5)
    prompts = [c["prompt"] for c in cases] + [rng.integers(0, live.model.vocab_size, 40).tolist()]
    prompts, params = workload(live.model.vocab_size, prompts)
    want = outputs(live, prompts, params)
    assert outputs(served, prompts, params) == want
    assert all(len(c[0]) == 12 for o in want for c in o)
    assert meta["widths"] == [1, 8, 16, 32] and meta["vocab_size"] == live.model.vocab_size
    assert set(meta["programs"]) == {"forward_1", "forward_8", "forward_16", "forward_32", "sample", "sample_argmax",
                                     "kv_init", "logprobs", "copy", "tables"} | {
        f"penalize_{w}" for w in history_widths(meta["engine"]["capacity"])}


def test_a_quantized_artifact_with_an_fp8_cache_gives_the_live_engines_tokens(tmp_path):
    """int4 linears, an int8 tied head and an fp8 KV cache, exported and served without the model code."""
    quant = dict(quantize="int4", quantize_head=True, kv_cache_dtype="fp8")
    out = tmp_path / "artifact"
    meta = export_engine(str(STORIES), out, dtype="float32", show_progress=False, **SMALL, **quant)
    assert meta["cache"]["dtype"] == "float8_e4m3fn" and meta["model"]["quantize"] == "int4"
    live = Engine.from_pretrained(str(STORIES), dtype="float32", **SMALL, **quant)
    served = Engine.from_pretrained(str(out))
    assert served.cache == live.cache and served.model.linears_label == "int4 weight-only, group 128, head int8"
    prompts, params = workload(live.model.vocab_size, [[1], [1, 2, 3, 4, 5, 6, 7]])
    assert outputs(served, prompts, params) == outputs(live, prompts, params)


def test_info_reads_an_artifacts_config(llama_artifact, capsys):
    assert main(["info", str(llama_artifact)]) == 0
    hf = json.loads((HF_FIXTURES / "llama" / "config.json").read_text())
    out = capsys.readouterr().out
    assert out.startswith("llama: ") and "float32" in out and f"vocab {hf['vocab_size']}," in out
    assert "a decode step reads" in out


def test_an_artifact_keeps_its_kv_cache_dtype(llama_artifact):
    with pytest.raises(ValueError, match=r"exported with a float32 KV cache; asked kv_cache_dtype='fp8'"):
        Engine.from_export(str(llama_artifact), kv_cache_dtype="fp8")


def test_metadata_describes_the_build(llama_artifact):
    meta = json.loads((llama_artifact / "metadata.json").read_text())
    hf = json.loads((HF_FIXTURES / "llama" / "config.json").read_text())
    assert meta["model"]["vocab_size"] == hf["vocab_size"] and meta["native_context"] == hf["max_position_embeddings"]
    assert meta["cache"]["num_pages"] == SMALL["num_pages"] and meta["cache"]["page_size"] == SMALL["page_size"]
    assert meta["engine"]["max_seqs"] == SMALL["max_seqs"] and meta["selected_logit_rows"] == SMALL["max_seqs"]
    assert meta["engine"]["min_prefill_chunk"] == SMALL["min_prefill_chunk"]
    assert meta["cache"]["kv_heads"] == [hf["num_key_value_heads"]] * hf["num_hidden_layers"]
    assert meta["decode_widths"] == [1, 8] and meta["platform"] == "cpu" and meta["engine"]["attention"] == "reference"
    assert set(meta["signatures"]) == {"forward_W", "sample", "sample_argmax", "logprobs", "penalize_H", "copy",
                                       "tables", "kv_init"}
    import jax

    assert meta["jax"] == jax.__version__ and meta["created"].startswith("20")
    for entry in meta["programs"].values():
        assert (llama_artifact / entry["file"]).stat().st_size > 0


BLOCK_MODEL = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "glint.model" or name.startswith(("glint.model.", "glint.export")):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import json
from glint.runtime import Engine, SamplingParams
engine = Engine.from_export(sys.argv[1])
prompts, params = json.loads(sys.argv[2]), [SamplingParams(**p) for p in json.loads(sys.argv[3])]
print(json.dumps([o.token_ids for o in engine.generate(prompts, params)]))
print(json.dumps(sorted(m for m in sys.modules if m.startswith("glint"))))
"""


def test_artifact_serves_without_the_model_code(llama_artifact):
    live = Engine.from_pretrained(str(HF_FIXTURES / "llama"), dtype="float32", **SMALL)
    prompts = [[1, 5, 9, 13], list(range(3, 30))]
    params = [dict(max_tokens=10, temperature=0.0, ignore_eos=True),
              dict(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)]
    want = [o.token_ids for o in live.generate(prompts, [SamplingParams(**p) for p in params])]
    proc = subprocess.run([sys.executable, "-c", BLOCK_MODEL, str(llama_artifact), json.dumps(prompts),
                           json.dumps(params)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokens, modules = (json.loads(line) for line in proc.stdout.strip().splitlines()[-2:])
    assert tokens == want
    assert not [m for m in modules if m.startswith(("glint.model", "glint.export"))]


def copy_artifact(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_damaged_artifacts_are_clear_errors(llama_artifact, tmp_path):
    art = copy_artifact(llama_artifact, tmp_path / "a")
    program = art / "programs" / "forward_8.jax"
    program.write_bytes(program.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"forward_8.jax is not a readable jax.export program"):
        Engine.from_export(art)
    program.unlink()
    with pytest.raises(ValueError, match=r"forward_8.jax is missing; the artifact is incomplete"):
        Engine.from_export(art)

    art = copy_artifact(llama_artifact, tmp_path / "b")
    (art / "metadata.json").write_text((art / "metadata.json").read_text()[:50])
    with pytest.raises(ValueError, match=r"metadata.json is not valid JSON"):
        Engine.from_export(art)
    (art / "metadata.json").unlink()
    with pytest.raises(ValueError, match=r"is not a glint export: metadata.json is missing"):
        Engine.from_export(art)

    art = copy_artifact(llama_artifact, tmp_path / "c")
    import shutil

    shutil.rmtree(art / "params")
    with pytest.raises(ValueError, match=r"params is missing; the artifact has no weights"):
        Engine.from_export(art)

    art = copy_artifact(llama_artifact, tmp_path / "d")
    for f in (art / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 1000:
            f.write_bytes(f.read_bytes()[:64])
    with pytest.raises(ValueError, match=r"params: the weights could not be read"):
        Engine.from_export(art)


def test_incomplete_or_foreign_program_tables_are_refused(llama_artifact, tmp_path):
    art = copy_artifact(llama_artifact, tmp_path / "a")
    meta = json.loads((art / "metadata.json").read_text())
    programs = {k: v for k, v in meta["programs"].items() if k not in ("forward_16", "sample")}
    (art / "metadata.json").write_text(json.dumps(dict(meta, programs=programs)))
    with pytest.raises(ValueError, match=r"programs missing \['forward_16', 'sample'\], unknown \[\]"):
        Engine.from_export(art)
    (art / "metadata.json").write_text(json.dumps(dict(meta, program_abi=0)))
    with pytest.raises(ValueError, match=rf"programs of calling convention 0, this glint runs {PROGRAM_ABI}"):
        Engine.from_export(art)
    assert Engine.from_export(llama_artifact, forward_sizes=(8, 1)).config.forward_sizes == (1, 8)


def test_exported_sample_argmax_is_the_argmax(llama_artifact):
    import jax

    engine = Engine.from_export(llama_artifact)
    logits = np.random.default_rng(0).standard_normal((SMALL["max_seqs"], engine.model.vocab_size)).astype(np.float32)
    logits[0, 3] = logits[0, 5] = logits[0].max() + 1  # a tie goes to the lower id
    tokens = np.asarray(jax.device_get(engine.programs["sample_argmax"](logits)))
    assert tokens.tolist() == [3] + np.argmax(logits[1:], axis=-1).tolist()


def test_foreign_versions_and_geometry_are_refused(llama_artifact, tmp_path):
    import jax

    art = copy_artifact(llama_artifact, tmp_path / "a")
    meta = json.loads((art / "metadata.json").read_text())
    (art / "metadata.json").write_text(json.dumps(dict(meta, jax="0.4.30")))
    with pytest.raises(ValueError, match=rf"exported with jax 0.4.30, this process runs jax {jax.__version__}"):
        Engine.from_export(art)
    (art / "metadata.json").write_text(json.dumps(dict(meta, platform="cuda")))
    with pytest.raises(ValueError, match=r"exported for cuda, this process runs on cpu"):
        Engine.from_export(art)

    with pytest.raises(ValueError, match=r"exported with max_seqs=4; asked max_seqs=16"):
        Engine.from_export(llama_artifact, max_seqs=16)
    with pytest.raises(ValueError, match=r"exported with capacity=128; asked capacity=4096"):
        Engine.from_export(llama_artifact, capacity=4096)
    with pytest.raises(ValueError, match=r"exported with dtype float32; asked bfloat16"):
        Engine.from_pretrained(str(llama_artifact), dtype="bfloat16")
    same = Engine.from_export(llama_artifact, max_seqs=4, min_prefill_chunk=8)  # host-only settings may change
    assert same.config.min_prefill_chunk == 8

    art = copy_artifact(llama_artifact, tmp_path / "b")  # metadata that lies about the programs' geometry
    (art / "metadata.json").write_text(json.dumps(dict(meta, cache=dict(meta["cache"], num_pages=50),
                                                       engine=dict(meta["engine"], num_pages=50))))
    with pytest.raises(ValueError, match=r"arguments do not match the geometry in metadata.json"):
        Engine.from_export(art)


def test_export_refuses_a_used_output_folder_before_loading(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match=r"out already exists and is not an empty folder"):
        export_engine("no-such-checkpoint", tmp_path / "out")
    with pytest.raises(ValueError, match=r"compiled executables are stored for GPUs only"):
        export_engine(str(HF_FIXTURES / "llama"), tmp_path / "new", compiled=True, **SMALL)


def test_cli_export_then_generate(tmp_path, capsys):
    case = json.loads((HF_FIXTURES / "llama" / "reference.json").read_text())["cases"][0]
    out = tmp_path / "art"
    geometry = dict(SMALL, max_step_tokens=64)
    args = [f"--{k.replace('_', '-')}={v}" for k, v in geometry.items() if k not in ("forward_sizes", "min_prefill_chunk")]
    assert main(["export", str(HF_FIXTURES / "llama"), str(out), "--dtype", "float32", *args]) == 0
    assert "14 programs (widths [1, 2, 4, 8, 16, 32, 64])" in capsys.readouterr().out
    assert main(["generate", str(out), "--prompt-ids", " ".join(map(str, case["prompt"])), "--max-tokens", "8",
                 "--temperature", "0", "--ignore-eos", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["outputs"][0]["token_ids"] == case["greedy"][:8]
    assert main(["generate", str(out), "--prompt-ids", "1 2", "--max-seqs", "64"]) == 2
    assert "exported with max_seqs=4; asked max_seqs=64" in capsys.readouterr().err
