"""Compile once, never while serving: warm-up covers every program; the persistent cache is on, survives damage,
and its keys stay stable; `glint bench --cold-start` times the three ways to a first token."""
import contextlib
import json
import os

import jax
import numpy as np
import pytest
from conftest import HF_FIXTURES

from glint.kvcache import CacheConfig
from glint.kvcache.state import POOL_GRANULE_BYTES, stable_budget
from glint.runtime import compile_cache
from glint.runtime.cli import main
from glint.runtime.engine import Engine
from glint.runtime.params import SamplingParams
from glint.runtime.sampling import history_widths

TIGHT = dict(max_seqs=4, page_size=8, max_step_tokens=32, forward_sizes=(1, 2, 4, 8), num_pages=14, capacity=64,
             min_prefill_chunk=4)
EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")


@contextlib.contextmanager
def counting_compiles():
    """Counts JAX traces and XLA compilations (persistent-cache hits included: they trace first)."""
    counts = dict.fromkeys(EVENTS, 0)

    def listener(event, duration, **kwargs):
        if event in counts:
            counts[event] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def mixed_workload(vocab: int, stop_token: int, penalties: bool = True):
    """Greedy, top-k/top-p, logprobs (with `penalties`, the three penalties, logit biases and min_tokens on that
    request), n > 1, a stop token."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, vocab, int(n)).tolist() for n in (5, 30, 12, 44, 9, 21)]
    penalized = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
                 "logit_bias": {1: 2.0, vocab - 1: -5.0}, "min_tokens": 3} if penalties else {}
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.9, top_k=20, top_p=0.8, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True, **penalized),
              SamplingParams(max_tokens=10, temperature=1.0, seed=2, n=3, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(stop_token,), ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.7, top_p=0.95, seed=3, logprobs=1, ignore_eos=True)]
    return prompts, params


@pytest.mark.parametrize("source", ["live", "exported", "speculative"])
def test_serving_never_compiles_after_warmup(source, tmp_path):
    llama = str(HF_FIXTURES / "llama")
    spec = dict(draft="ngram", num_speculative_tokens=3) if source == "speculative" else {}
    if source == "exported":
        from glint.export import export_engine

        export_engine(llama, tmp_path / "art", dtype="float32", show_progress=False, **TIGHT)
        engine = Engine.from_export(tmp_path / "art")
    else:
        engine = Engine.from_pretrained(llama, dtype="float32", **TIGHT, **spec)
    live = Engine.from_pretrained(llama, dtype="float32", **TIGHT, **spec)
    times = engine.warmup(progress=False)
    # a penalize program per history width (a speculative engine refuses penalties: none)
    penalize = {f"penalize_{w}" for w in history_widths(engine.capacity)}
    assert set(times) == {f"forward_{w}" for w in (1, 2, 4, 8, 16, 32)} | {"sample", "logprobs", "copy", "tables"} | (
        set() if spec else penalize)
    # A stop token the greedy request really meets: its 5th token when run alone.
    probe = Engine.from_pretrained(llama, dtype="float32", **TIGHT)
    prompts, params = mixed_workload(engine.model.vocab_size, 0)
    alone = probe.generate([prompts[4]], params[0])[0].token_ids
    prompts, params = mixed_workload(engine.model.vocab_size, alone[4], penalties=not spec)  # spec: refused
    with counting_compiles() as counts:
        outs = engine.generate(prompts, params)
    assert counts == dict.fromkeys(EVENTS, 0), counts
    assert [[c.token_ids for c in o.outputs] for o in outs] == [
        [c.token_ids for c in o.outputs] for o in live.generate(prompts, params)]
    assert engine.stats.preemptions > 0
    if spec:  # blocks were verified (and rewound); this workload then copies no page
        assert engine.stats.spec_steps > 0 and engine.stats.spec_tokens > engine.stats.spec_steps
    else:
        assert engine.stats.page_copies > 0
    assert outs[4].finish_reason == "stop" and outs[4].token_ids == alone[:alone.index(alone[4]) + 1]
    assert len(outs[3].outputs) == 3 and outs[2].outputs[0].logprobs is not None


def test_warmup_compiles_each_program_once_and_a_second_engine_loads_them(tmp_path, monkeypatch):
    monkeypatch.setenv("GLINT_CACHE_DIR", str(tmp_path / "cache"))
    llama = str(HF_FIXTURES / "llama")
    jax.clear_caches()  # what earlier tests compiled in this process
    first = Engine.from_pretrained(llama, dtype="float32", **TIGHT)
    with counting_compiles() as counts:
        names = first.warmup(progress=False)
    # six widths, sample, logprobs, copy, tables and the penalize programs: once each
    assert counts[EVENTS[1]] == len(names) == 10 + len(history_widths(first.capacity))
    assert len(list((tmp_path / "cache").glob("*-cache"))) >= len(names)
    jax.clear_caches()  # as a fresh process would be
    second = Engine.from_pretrained(llama, dtype="float32", **TIGHT)
    hits = []

    def listener(event, **kwargs):
        hits.append(event)

    jax.monitoring.register_event_listener(listener)
    try:
        second.warmup(progress=False)
    finally:
        jax.monitoring.unregister_event_listener(listener)
    assert hits.count("/jax/compilation_cache/cache_hits") == len(names)
    prompts, params = mixed_workload(first.model.vocab_size, 0)
    assert [o.token_ids for o in second.generate(prompts, params)] == [o.token_ids for o in first.generate(prompts, params)]


def test_a_damaged_cache_falls_back_to_compiling(tmp_path, monkeypatch):
    monkeypatch.setenv("GLINT_CACHE_DIR", str(tmp_path / "cache"))
    llama = str(HF_FIXTURES / "llama")
    jax.clear_caches()
    first = Engine.from_pretrained(llama, dtype="float32", **TIGHT)
    prompts, params = mixed_workload(first.model.vocab_size, 0)
    want = [o.token_ids for o in first.generate(prompts, params)]
    entries = list((tmp_path / "cache").glob("*-cache"))
    assert entries
    for i, f in enumerate(entries):  # garbage, truncated and empty entries
        f.write_bytes([b"\x00garbage" * 10, f.read_bytes()[:40], b""][i % 3])
    jax.clear_caches()
    with pytest.warns(UserWarning, match="persistent compilation cache"):
        second = Engine.from_pretrained(llama, dtype="float32", **TIGHT)
        got = [o.token_ids for o in second.generate(prompts, params)]
    assert got == want


def test_compile_cache_on_by_default_and_off_on_request(tmp_path, monkeypatch):
    monkeypatch.setenv("GLINT_CACHE_DIR", str(tmp_path / "glint-cache"))
    Engine.from_pretrained(str(HF_FIXTURES / "llama"), dtype="float32", **TIGHT)
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "glint-cache")
    Engine.from_pretrained(str(HF_FIXTURES / "llama"), dtype="float32", compile_cache=False, **TIGHT)
    assert jax.config.jax_compilation_cache_dir is None
    (tmp_path / "file").write_text("not a folder")
    assert compile_cache.configure(True, tmp_path / "file" / "cache") is None  # unusable: compile without it
    with pytest.raises(ValueError, match="compile_cache must be a bool"):
        Engine.from_pretrained(str(HF_FIXTURES / "llama"), compile_cache="yes", **TIGHT)
    compile_cache.configure(True)


def test_default_pool_size_is_stable_across_small_changes_in_free_memory():
    cfg = CacheConfig(page_size=16, num_pages=2, max_seqs=256, max_write=4096, capacity=8192, windows=(0,) * 32,
                      kv_heads=8, head_dim=128)
    gib = POOL_GRANULE_BYTES
    budgets = [int(80.02 * gib), int(80.5 * gib), int(80.97 * gib)]  # what free memory did across three runs
    assert len({cfg.num_pages_for_budget(stable_budget(b)) for b in budgets}) == 1
    assert stable_budget(int(1.5 * gib)) == int(1.5 * gib)  # small budgets are not rounded away


def test_bench_cold_start_three_ways(tmp_path, capsys):
    out = tmp_path / "cold.json"
    assert main(["bench", "tiny", "--cold-start", "--batch", "2", "--prompt-len", "300", "--gen-len", "16",
                 "--max-step-tokens", "16", "--workdir", str(tmp_path), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["cold_start"]
    assert [r["way"] for r in rows] == ["no cache", "warm cache", "exported artifact"]
    assert len({tuple(r["token_ids"]) for r in rows}) == 1 and len(rows[0]["token_ids"]) == 16
    assert all(0 < r["first_token_s"] <= r["process_s"] for r in rows) and rows[2]["export_s"] > 0
    cold, warm, artifact = rows
    assert cold["compiles"] >= 9 and cold["cache_hits"] == 0  # every width, sample, logprobs, copy
    assert warm["compiles"] == 0 and warm["cache_hits"] >= 9
    assert artifact["compiles"] >= 9  # on a CPU the artifact's StableHLO compiles (into an empty cache)
    assert "first tokens agree" in capsys.readouterr().out


def test_page_copies_in_chunks_give_the_same_tokens(monkeypatch):
    """A step with more copy-on-write copies than one `copy` call takes runs it several times."""
    from glint.runtime import programs

    llama = str(HF_FIXTURES / "llama")
    want = Engine.from_pretrained(llama, dtype="float32", **TIGHT)
    prompts, params = mixed_workload(want.model.vocab_size, 0)
    expected = [[c.token_ids for c in o.outputs] for o in want.generate(prompts, params)]
    monkeypatch.setattr(programs, "COPY_ROWS", 1)
    chunked = Engine.from_pretrained(llama, dtype="float32", **TIGHT)
    calls = []
    copy = chunked.programs["copy"]
    chunked.programs._compiled["copy"] = lambda *args: calls.append(1) or copy(*args)
    assert [[c.token_ids for c in o.outputs] for o in chunked.generate(prompts, params)] == expected
    assert len(calls) == chunked.stats.page_copies > 1  # one call per copy: the chunks ran


def test_kept_executables_keys_and_damaged_entries(tmp_path, monkeypatch, caplog):
    """The executable cache (GPU only; stubbed serialization here): keys follow what the program depends on,
    entries round-trip, and a damaged entry is logged and compiled again."""
    from glint.runtime import executables

    base = executables.key("model A", "forward_8")
    assert executables.key("model B", "forward_8") != base and executables.key("model A", "forward_16") != base
    with jax.default_matmul_precision("highest"):
        assert executables.key("model A", "forward_8") != base
    with monkeypatch.context() as m:  # XLA_FLAGS changed, then as it was (the test run sets some: conftest)
        m.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0")
        assert executables.key("model A", "forward_8") != base
    assert executables.key("model A", "forward_8") == base
    from glint.pallas_kernels import tuning

    with monkeypatch.context() as m:  # a tuning value set in the process (an A/B arm), then as it was
        m.setattr(tuning, "TARGET_PROGRAMS", tuning.TARGET_PROGRAMS // 2)
        assert executables.key("model A", "forward_8") != base
    assert executables.key("model A", "forward_8") == base

    import jax.experimental.serialize_executable as se

    monkeypatch.setattr(executables, "folder", lambda: tmp_path)
    monkeypatch.setattr(se, "serialize", lambda compiled: (compiled, None, None))
    monkeypatch.setattr(se, "deserialize_and_load", lambda payload, in_tree, out_tree: payload)
    executables.store("model A", "forward_8", "an executable")
    assert executables.load("model A", "forward_8") == "an executable"
    assert executables.load("model A", "forward_16") is None
    (tmp_path / f"{base}.bin").write_bytes(b"garbage")
    assert executables.load("model A", "forward_8") is None
    assert "could not be loaded" in caplog.text
    for i in range(3):
        (tmp_path / f"old{i}.bin").write_bytes(b"x" * 100)
    executables.prune(tmp_path, max_bytes=250)
    assert len(list(tmp_path.glob("*.bin"))) == 2
