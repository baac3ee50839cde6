"""Tensor parallelism (model/tp.py) over the CPU's forced devices (conftest: four): TP 2 and 4 give TP 1's tokens;
the parameter and KV shardings hold what they claim; splits that cannot work are refused."""
import json
import math
import pathlib

import jax
import numpy as np
import pytest
from conftest import PALLAS, covering_fixtures
from safetensors.numpy import load_file

from glint.runtime.engine import Engine
from glint.runtime.params import SamplingParams

# Small pools (page 4, 20 pages) make the long prompt's sequences preempt one another (where no ring shrinks them);
# one step width, so each engine compiles one forward program.
SMALL = dict(max_seqs=4, page_size=4, max_step_tokens=16, forward_sizes=(16,), num_pages=20, capacity=64,
             min_prefill_chunk=4)


@pytest.fixture(autouse=True)
def _four_devices():
    assert len(jax.devices()) >= 4, "the tensor-parallel tests need 4 devices (XLA_FLAGS=" \
        "--xla_force_host_platform_device_count=4, which tests/conftest.py sets)"


def workload(vocab: int):
    """Greedy, seeded sampling with n = 2 (a clone), top-k / top-p: prompts long enough to wrap a ring layer."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, vocab, n).tolist() for n in (5, 40, 9)]
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=2, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.8, top_k=5, top_p=0.9, seed=4, ignore_eos=True)]
    return prompts, params


def run(path, n: int, **kw):
    engine = Engine.from_pretrained(str(path), dtype="float32", tensor_parallel=n, **(SMALL | kw))
    prompts, params = workload(engine.model.vocab_size)
    outs = engine.generate(prompts, params)
    return engine, [[c.token_ids for c in o.outputs] for o in outs]


_alone: dict = {}


def tp1(path) -> tuple[list, int]:
    """(tokens, preemptions) of the workload on one device."""
    if path not in _alone:
        engine, tokens = run(path, 1, attention="reference")
        _alone[path] = tokens, engine.stats.preemptions
    return _alone[path]


def test_tensor_parallel_gives_transformers_greedy_tokens(hf_fixture):
    """Over 4 devices (KV heads replicated where the fixture has fewer): transformers' greedy continuations (where
    no near-tie makes float order matter). Seeded sampling against TP 1: the tests below."""
    cases = json.loads((hf_fixture / "reference.json").read_text())["cases"]
    engine = Engine.from_pretrained(str(hf_fixture), dtype="float32", tensor_parallel=4, attention="reference",
                                    **(SMALL | dict(num_pages=96, capacity=128)))
    greedy = SamplingParams(max_tokens=max(len(c["greedy"]) for c in cases), temperature=0.0, ignore_eos=True)
    outs = engine.generate([c["prompt"] for c in cases], greedy)
    checked = [o.token_ids == c["greedy"] for o, c in zip(outs, cases) if c["greedy_min_gap"] >= 1e-3]
    assert checked and all(checked)


@pytest.mark.parametrize("path", covering_fixtures()[:1], ids=lambda p: p.name)  # one with ring layers
def test_tensor_parallel_through_the_pallas_kernels(path):
    """The qkv-write and attention kernels under shard_map, on each device's heads: TP 1's tokens (greedy, seeded
    n = 2, top-k / top-p) at TP 4."""
    _, tokens = run(path, 4, attention=PALLAS)
    assert tokens == tp1(path)[0]


def test_tensor_parallel_from_an_orbax_folder(converted):
    """Over 2 devices (KV heads split), a converted checkpoint loaded straight into its shards: TP 1's tokens and
    preemptions."""
    path = covering_fixtures()[-1]
    engine, tokens = run(converted(path), 2, attention="reference")
    assert tp1(path)[1] > 0  # the workload preempts here (no ring layers)
    assert (tokens, engine.stats.preemptions) == tp1(path)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_quantized_linears_split(fmt):
    """int8 [out, in] with an int8 head (split by vocabulary), int4 (row-split linears in whole groups) and fp8
    (activation scales over the whole row, and an fp8 KV cache whose scales split by KV head with the pools) with
    an int8 head, over 2 devices: their own format's TP 1 tokens."""
    path = covering_fixtures()[-1]
    cfg = json.loads((path / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    group = math.gcd(cfg["num_attention_heads"] * head_dim // 2, cfg["intermediate_size"] // 2, 16)
    quant = {"int8": {"quantize": "int8", "quantize_head": True}, "int4": {"quantize": "int4", "quant_group": group},
             "fp8": {"quantize": "fp8", "quantize_head": True, "kv_cache_dtype": "fp8"}}[fmt]
    assert run(path, 2, attention="reference", **quant)[1] == run(path, 1, attention="reference", **quant)[1]


def _hf(path):
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("n", [2, 4])
def test_shards_hold_their_heads_columns_and_vocabulary(n):
    """Every parameter's shard on device d, against the HF tensors read here: d's query heads, its KV head
    (replicated when n exceeds the KV heads), its MLP columns and rows, its vocabulary rows (zero padding past
    the vocabulary); norms whole on every device; the KV pools split by KV head."""
    path = covering_fixtures()[-1]
    hf, cfg = _hf(path), json.loads((path / "config.json").read_text())
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg.get("head_dim") or \
        cfg["hidden_size"] // cfg["num_attention_heads"]
    inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    engine = Engine.from_pretrained(str(path), dtype="float32", tensor_parallel=n, attention="reference", **SMALL)
    p, mesh_devices = engine.params, jax.devices()[:n]

    def shard(name, d):
        [s] = [s for s in p[name].addressable_shards if s.device == mesh_devices[d]]
        return np.asarray(s.data)

    pre = "model.layers.0."
    q_w, k_w = hf[pre + "self_attn.q_proj.weight"].T, hf[pre + "self_attn.k_proj.weight"].T  # [in, out]
    v_w, o_w = hf[pre + "self_attn.v_proj.weight"].T, hf[pre + "self_attn.o_proj.weight"].T
    gate, up = hf[pre + "mlp.gate_proj.weight"].T, hf[pre + "mlp.up_proj.weight"].T
    down = hf[pre + "mlp.down_proj.weight"].T
    embed = hf["model.embed_tokens.weight"]
    local_q, local_kv = heads // n, max(kv, n) // n
    rows = -(-vocab // n)
    for d in range(n):
        qs = slice(d * local_q * hd, (d + 1) * local_q * hd)
        kv_head = d * local_kv if kv >= n else d // (n // kv)
        ks = slice(kv_head * hd, (kv_head + local_kv) * hd)
        wqkv = shard("layers.0.attn.wqkv.kernel", d)
        np.testing.assert_array_equal(wqkv, np.concatenate([q_w[:, qs], k_w[:, ks], v_w[:, ks]], axis=1))
        np.testing.assert_array_equal(shard("layers.0.attn.wo.kernel", d), o_w[qs])
        cols = slice(d * inter // n, (d + 1) * inter // n)
        np.testing.assert_array_equal(shard("layers.0.mlp.gate_up.kernel", d),
                                      np.concatenate([gate[:, cols], up[:, cols]], axis=1))
        np.testing.assert_array_equal(shard("layers.0.mlp.down.kernel", d), down[cols])
        want = np.zeros((rows, embed.shape[1]), np.float32)
        mine = embed[d * rows:(d + 1) * rows]
        want[:len(mine)] = mine
        np.testing.assert_array_equal(shard("embed", d), want)
        np.testing.assert_array_equal(shard("layers.0.attn_norm.weight", d), np.asarray(p["layers.0.attn_norm.weight"]))
        for pool in engine.kv.k + engine.kv.v:
            [s] = [s for s in pool.addressable_shards if s.device == mesh_devices[d]]
            assert s.data.shape == (engine.cache.num_pages, engine.cache.page_size, local_kv, hd)
    # the collectives the step claims: one all-reduce after each layer's attention output and MLP down projection,
    # one for the embedding lookup, one all-gather of the logits
    text = engine.programs.lower("forward_16").as_text()
    assert text.count("stablehlo.all_reduce") == 2 * cfg["num_hidden_layers"] + 1
    assert text.count("stablehlo.all_gather") == 1
    # every leaf: column-split linears (q/k/v, gate, gate_up) along their output axis, row-split ones (wo, down)
    # along their input axis, the embedding along the vocabulary, everything else (norms) whole on every device
    split_axis = {"wqkv": 1, "wg": 1, "gate_up": 1, "wo": 0, "down": 0}
    for name, x in p.items():
        assert x.sharding.device_set == set(mesh_devices), name
        linear = name.split(".")[-2] if name.startswith("layers.") else None
        axis = 0 if name == "embed" else 1 if name == "head.kernel" else split_axis.get(linear)
        shapes = {s.data.shape for s in x.addressable_shards}
        if axis is None:
            assert x.sharding.is_fully_replicated and shapes == {x.shape}, name
        else:
            want = list(x.shape)
            want[axis] //= n
            assert shapes == {tuple(want)} and not x.sharding.is_fully_replicated, name


def test_a_preset_is_the_same_random_model_split():
    """A preset's random weights at TP 4 (KV heads replicated) are its TP 1 weights, split: the same tokens."""
    engine = Engine.from_pretrained("tiny", dtype="float32", tensor_parallel=4, attention="reference", **SMALL)
    wqkv, cfg = engine.params["layers.0.attn.wqkv.kernel"], engine.model
    assert {s.data.shape for s in wqkv.addressable_shards} == \
        {(cfg.hidden_size, (cfg.num_heads + 2 * max(cfg.num_kv_heads, 4)) * cfg.head_dim // 4)}
    prompts, params = workload(cfg.vocab_size)
    tokens = [[c.token_ids for c in o.outputs] for o in engine.generate(prompts, params)]
    one = Engine.from_pretrained("tiny", dtype="float32", attention="reference", **SMALL)
    assert tokens == [[c.token_ids for c in o.outputs] for o in one.generate(prompts, params)]


def test_splits_that_cannot_work_are_refused(monkeypatch):
    path = covering_fixtures()[-1]
    heads = json.loads((path / "config.json").read_text())["num_attention_heads"]
    bad = next(k for k in range(2, 5) if heads % k)  # a device count that does not divide the heads
    with pytest.raises(ValueError, match=f"tensor_parallel {bad} must divide num_heads {heads}"):
        Engine.from_pretrained(str(path), tensor_parallel=bad, **SMALL)
    with pytest.raises(ValueError, match=f"tensor_parallel 64 exceeds the {len(jax.devices())} cpu device"):
        Engine.from_pretrained(str(path), tensor_parallel=64, **SMALL)
    with pytest.raises(ValueError, match="tensor_parallel must be a positive int, got 0"):
        Engine.from_pretrained(str(path), tensor_parallel=0, **SMALL)
    with pytest.raises(ValueError, match="each device's 32 input rows .* whole int4 groups of 64"):
        Engine.from_pretrained("tiny", tensor_parallel=2, quantize="int4", quant_group=64, **SMALL)
    from glint.runtime.config import EngineConfig
    from glint.runtime.loading import load_model

    cfg, graphdef, params, _ = load_model(str(path), dtype="float32", tensor_parallel=2)  # blocks for 2 devices
    with pytest.raises(ValueError, match="is split over 2 devices in another layout than tensor_parallel=4's"):
        Engine(cfg, graphdef, params, EngineConfig(tensor_parallel=4, **SMALL))
    from glint.runtime import engine as engine_module

    with monkeypatch.context() as m:  # as if run under jax.distributed: unseeded draws would differ per process
        m.setattr(engine_module.jax, "process_count", lambda: 2)
        with pytest.raises(ValueError, match="runs in 2 processes .* give it seed="):
            Engine.from_pretrained("tiny", **SMALL)


def test_two_processes_give_the_tokens_of_one(tmp_path):
    """jax.distributed over localhost: 2 processes x 2 CPU devices each run the same engine loop over a 4-device
    mesh and give the tokens of one process on one device (seed=, which several processes need, draws alike)."""
    import socket
    import subprocess
    import sys

    path = covering_fixtures()[-1]
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    worker = pathlib.Path(__file__).with_name("tp_process.py")
    procs = [subprocess.Popen([sys.executable, str(worker), str(i), "2", "2", str(port), str(path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    want = tp1(path)[0]  # the workload's requests carry their seeds: the engine's seed= changes none of them
    assert [json.loads(out.strip().splitlines()[-1]) for out, _ in results] == [want, want]


def test_an_artifact_exported_over_two_devices(tmp_path):
    """The artifact records the mesh: its programs (StableHLO) and weights come back split over 2 devices and give
    TP 1's tokens; another device count is refused."""
    from glint.export.exporter import export_engine

    path = covering_fixtures()[-1]
    meta = export_engine(str(path), tmp_path / "art", dtype="float32", show_progress=False, tensor_parallel=2,
                         attention="reference", **SMALL)
    assert meta["engine"]["tensor_parallel"] == 2
    engine = Engine.from_pretrained(str(tmp_path / "art"))
    assert engine.config.tensor_parallel == 2
    assert [s.data.shape[2] for s in engine.kv.k[0].addressable_shards] == [engine.cache.kv_heads[0] // 2] * 2
    prompts, params = workload(engine.model.vocab_size)
    assert [[c.token_ids for c in o.outputs] for o in engine.generate(prompts, params)] == tp1(path)[0]
    with pytest.raises(ValueError, match="exported with tensor_parallel=2; asked tensor_parallel=4"):
        Engine.from_pretrained(str(tmp_path / "art"), tensor_parallel=4)
