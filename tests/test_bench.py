"""`glint bench demo` runs on the CPU (the numbers are only printed; the structure is checked)."""
import json

import pytest

from glint.runtime.cli import main


def test_bench_demo_runs(tmp_path, capsys):
    out = tmp_path / "bench.json"
    # No size flags: on a CPU the bench picks sizes that finish quickly (1,4 x 32 -> 8, 8 requests, widths to 128).
    assert main(["bench", "demo", "--length-spread", "0.5", "--num-pages", "512", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kv_pages"] == 512
    assert [b["width"] for b in result["buckets"]] == [1, 2, 4, 8, 16, 32, 64, 128]
    assert [(d["batch"], d["context"]) for d in result["decode"]] == [(1, 36), (4, 36)]
    assert all(d["device_ms"] > 0 and d["roofline_pct"] > 0 and d["engine_ms"] > 0 for d in result["decode"])
    e2e = result["end_to_end"]
    for host in [d["engine_host_ms"] for d in result["decode"]] + [e2e["host_ms"]]:
        # the phases are most of the host's busy time, never more; the forward's launch runs on the launch thread
        phases = host["schedule"] + host["dispatch"] + host["postprocess"]
        assert 0.5 * host["busy"] < phases <= host["busy"] * (1 + 1e-9) and 0 < host["launch"] and host["async_launch"]
    assert e2e["requests"] == 8 and e2e["length_spread"] == 0.5 and e2e["output_tokens_per_s"] > 0 and 0 < e2e["fraction_of_ceiling"]
    # each width's time in the loop: the step() calls that read its steps, which together are nearly all of the
    # host's busy and waiting time (the first call reads nothing), within the run's wall time
    looped = sum(ms * e2e["steps_per_bucket"][w] for w, ms in e2e["ms_per_bucket"].items())
    stepped = (e2e["host_ms_per_step"] + e2e["wait_ms_per_step"]) * e2e["steps"]
    assert min(e2e["ms_per_bucket"].values()) > 0 and 0.5 * stepped < looped <= 1e3 * e2e["wall_s"]
    # of it, waiting on the device: per width within its time, in all the run's waiting (the widths' steps)
    assert all(0 <= e2e["wait_ms_per_bucket"][w] < ms for w, ms in e2e["ms_per_bucket"].items())
    waited = sum(ms * e2e["steps_per_bucket"][w] for w, ms in e2e["wait_ms_per_bucket"].items())
    assert abs(waited - e2e["wait_ms_per_step"] * e2e["steps"]) < 1e-6 * max(1.0, waited)
    assert set(result["compile_s"]) == {str(w) for w in [1, 2, 4, 8, 16, 32, 64, 128]}
    assert "decode (one token per sequence)" in capsys.readouterr().out


def test_bench_shared_prefix_runs(tmp_path):
    """`--shared-prefix`: the cache on and off on one engine; on, the shared prompts are mostly found in the
    cache and fewer tokens are fed; unshared prompts find nothing; every run gives the same tokens."""
    out = tmp_path / "prefix.json"
    assert main(["bench", "demo", "--shared-prefix", "40", "--prompt-len", "8", "--gen-len", "4", "--requests", "6",
                 "--batch", "4", "--dtype", "float32", "--max-step-tokens", "64", "--json", str(out)]) == 0
    rows = {(r["workload"], r["prefix_cache"]): r for r in json.loads(out.read_text())["prefix_cache"]["rows"]}
    assert set(rows) == {("shared", False), ("shared", True), ("unique", False), ("unique", True)}
    assert rows["shared", True]["hit_rate"] > 0.4 and rows["shared", False]["hit_rate"] == 0
    assert rows["shared", True]["fed_tokens"] < rows["shared", False]["fed_tokens"]
    assert rows["unique", True]["hit_rate"] == 0
    assert all(r["same_as_off"] == 6 and r["output_tokens_per_s"] > 0 and r["ttft_p90_s"] > 0 for r in rows.values())


def test_bench_speculative_runs(tmp_path):
    """`--draft oracle`: plain and speculative engines on one set of weights; in float32 the oracle (the plain
    run's tokens) is accepted whole, the output is the plain run's, and host and wait time per step are reported.
    The timed pass prefills every prompt (no prefix cache left over from the passes before it)."""
    out = tmp_path / "spec.json"
    k, gen, prompt = 3, 12, 40  # prompts of whole pages, which a prefix cache would hold after a pass
    assert main(["bench", "tiny", "--draft", "oracle", "--num-speculative-tokens", str(k), "--batch", "2",
                 "--prompt-len", str(prompt), "--gen-len", str(gen), "--dtype", "float32", "--max-step-tokens", "64",
                 "--page-size", "8", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["speculative"]["rows"]
    assert row["batch"] == 2 and row["same_as_plain"] == 2
    # every prompt token, then each sequence's gen - 1 decoded tokens at least (a prefix cache would feed 70 < 102)
    assert len(row["acceptance_per_pass"]) >= 1 and row["fed_tokens"] >= 2 * prompt + 2 * (gen - 1)
    assert 0 < row["prefill_s"]["plain"] and 0 < row["prefill_s"]["speculative"]
    assert row["decode_speedup"] is None or row["decode_speedup"] > 0
    # every block but the first token's step commits k + 1 tokens until the last, shorter one
    assert row["spec_steps"] == 2 * -(-(gen - 1) // (k + 1)) and row["mean_acceptance_length"] > k
    assert row["host_ms_per_step"] > 0 and row["wait_ms_per_step"] >= 0 and row["ms_per_step"] > 0
    # the host's time split by phase: each of them spent, together no more than all of it
    phases = row["host_ms_per_step_by_phase"]
    assert sorted(phases) == ["dispatch", "postprocess", "schedule"] and min(phases.values()) > 0
    assert sum(phases.values()) <= row["host_ms_per_step"] * (1 + 1e-9)


def test_quoting_prompt_repeats_one_passage():
    """`--quote N`: a prompt of the asked length whose tokens repeat with the passage's period, each passage fresh
    (tokens drawn from the whole vocabulary); N = 1 is random tokens; N < 1 is refused by name."""
    import numpy as np
    import pytest

    from glint.runtime.bench import quoting_prompt

    rng = np.random.default_rng(3)
    for length, times in [(64, 4), (50, 3), (7, 7), (10, 1)]:
        prompt = quoting_prompt(rng, 1000, length, times)
        period = -(-length // times)
        assert len(prompt) == length and all(0 <= t < 1000 for t in prompt)
        assert all(prompt[i] == prompt[i - period] for i in range(period, length))
        assert len(set(prompt[:period])) > period // 2  # the passage itself is random, not a constant
    a, b = quoting_prompt(rng, 1000, 32, 2), quoting_prompt(rng, 1000, 32, 2)
    assert a != b
    with pytest.raises(ValueError, match="quote=0"):
        quoting_prompt(rng, 1000, 32, 0)


def test_a_failing_timed_step_raises_its_own_error_and_leaves_the_engine_clean(monkeypatch):
    """The step bench's cleanup aborts the step it declared before freeing its sequences, so the step's own
    error is what reaches the caller (not the control's complaint about a pending step)."""
    import pytest

    from glint.runtime.bench import StepBench
    from glint.runtime.engine import Engine

    engine = Engine.from_pretrained("tiny", max_seqs=2, max_step_tokens=16, forward_sizes=(1, 2, 4, 8, 16),
                                    capacity=64)

    def fail(*args):
        raise RuntimeError("the device refused the step")

    monkeypatch.setattr(engine.runner, "forward", fail)
    with pytest.raises(RuntimeError, match="the device refused the step"):
        StepBench(engine, bandwidth=1e12).time_step(batch=2, context=8, q_len=1, repeats=1)
    assert not engine.control.has_pending_step and engine.control.active_seqs() == []


def test_decoding_keeps_every_request_decoding():
    """bench.decoding: the whole batch decodes through the steps it is asked for, though a step's budget takes
    the prompts one at a time (run plainly, the first requests would have finished before the last began); a
    capacity too small for that is a clear error."""
    from glint.runtime.bench import decoding
    from glint.runtime.engine import Engine

    batch, context, steps = 6, 24, 8
    engine = Engine.from_pretrained("tiny", dtype="float32", max_seqs=batch, max_step_tokens=32, page_size=8,
                                    capacity=context + 24)
    with decoding(engine, batch, context, steps) as rids:
        start = [len(engine.output(rid, text=False).token_ids) for rid in rids]
        assert min(start) >= 2
        for _ in range(steps):
            engine.step()
            assert len(engine.scheduler.running) == batch
        assert all(len(engine.output(rid, text=False).token_ids) > n for rid, n in zip(rids, start))
    assert not engine.has_unfinished()
    for ctx, more in ((context, 24), (context + 23, 0)):  # one position left: not enough for `started` tokens
        with pytest.raises(ValueError, match="capacity 48: requests of"), decoding(engine, batch, ctx, more):
            pass
    assert not engine.has_unfinished()
    # a step with no room for a prompt chunk beside the decode rows: the last prompt cannot start in time
    narrow = Engine.from_pretrained("tiny", dtype="float32", max_seqs=16, max_step_tokens=16, page_size=8,
                                    capacity=context + 24)
    with pytest.raises(ValueError, match="finished before every one of the 16 had started"), \
            decoding(narrow, 16, context, steps):
        pass
    assert not narrow.has_unfinished()
