"""The engine end to end on CPU: HF parity through the paged path, batched == solo, pressure, bad input."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import PALLAS, STORIES
from test_sampling import penalized_reference

from glint.export.checkpoint import load_checkpoint
from glint.model import transformer
from glint.model.presets import preset
from glint.runtime.engine import Engine
from glint.runtime.params import SamplingParams
from glint.runtime.sampling import SamplerInputs, sample

SMALL = dict(max_seqs=8, page_size=8, max_step_tokens=64, forward_sizes=(1, 2, 4, 8, 16, 32), num_pages=160,
             capacity=256, min_prefill_chunk=4)
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def tiny_engine(dtype="float32", seed=0, **overrides) -> Engine:
    cfg = preset("tiny", dtype=dtype)
    graphdef, params = transformer.split(transformer.init_model(cfg, seed))
    from glint.runtime.config import EngineConfig

    return Engine(cfg, graphdef, params, EngineConfig(**{**SMALL, **overrides}))


def test_fixture_greedy_matches_transformers(hf_fixture):
    ref = json.loads((hf_fixture / "reference.json").read_text())["cases"]
    engine = Engine.from_pretrained(str(hf_fixture), dtype="float32", **SMALL)
    outs = engine.generate([c["prompt"] for c in ref], GREEDY)
    checked = 0
    for case, out in zip(ref, outs):
        assert out.finish_reason == "length" and len(out.token_ids) == 40
        if case["greedy_min_gap"] >= 1e-3:
            assert out.token_ids == case["greedy"]
            checked += 1
    assert checked >= 1
    assert all(engine.control.pages_in_use(g) == 0 for g in range(engine.cache.num_groups))


def test_prefill_in_small_chunks_keeps_transformers_tokens(hf_fixture):
    """A per-sequence chunk limit shrinks the sliding-window rings to window + chunk - 1 rows; prompts then
    prefill over many steps (control refuses any step that writes more of one sequence) and still give
    transformers' tokens."""
    ref = json.loads((hf_fixture / "reference.json").read_text())["cases"]
    chunk = 5
    engine = Engine.from_pretrained(str(hf_fixture), dtype="float32", **dict(SMALL, min_prefill_chunk=2,
                                                                                 max_prefill_chunk=chunk))
    cache = engine.cache
    assert cache.max_seq_write == chunk and cache.max_write == SMALL["max_step_tokens"]
    for g, window in enumerate(cache.group_windows):
        assert cache.group_ring_rows(g) == (min(cache.capacity, window + chunk - 1) if window else None)
    outs = engine.generate([c["prompt"] for c in ref], GREEDY)
    checked = 0
    for case, out in zip(ref, outs):
        if case["greedy_min_gap"] >= 1e-3:
            assert out.token_ids == case["greedy"]
            checked += 1
    assert checked >= 1 and engine.stats.fed_tokens >= sum(len(c["prompt"]) for c in ref)


def test_default_prefill_chunk_follows_the_windows():
    from glint.runtime.config import WINDOWED_PREFILL_CHUNK, EngineConfig

    config = EngineConfig(max_step_tokens=4096)
    assert config.for_model((0, 0)).max_prefill_chunk == 4096  # no ring: whole prompts per step as before
    assert config.for_model((0, 128)).max_prefill_chunk == WINDOWED_PREFILL_CHUNK
    assert EngineConfig(max_step_tokens=64).for_model((0, 128)).max_prefill_chunk == 64
    assert EngineConfig(max_prefill_chunk=1024).for_model((0, 128)).max_prefill_chunk == 1024
    # where the ring is capped by the capacity anyway, a smaller chunk would only slow prefill
    assert config.for_model((0, 128), capacity=128 + WINDOWED_PREFILL_CHUNK - 1).max_prefill_chunk == 4096
    assert config.for_model((0, 128), capacity=128 + WINDOWED_PREFILL_CHUNK).max_prefill_chunk == \
        WINDOWED_PREFILL_CHUNK
    with pytest.raises(ValueError, match=r"max_prefill_chunk must be an int in \[min_prefill_chunk 16, "
                                         r"max_step_tokens 4096\], got 8"):
        EngineConfig(max_prefill_chunk=8)


def test_stories260k_200_greedy_tokens():
    ref = json.loads((STORIES / "reference.json").read_text())["cases"][0]
    engine = Engine.from_pretrained(str(STORIES), dtype="float32", **SMALL)
    out = engine.generate([ref["prompt"]], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == ref["greedy"][:200]


def mixed_requests(rng, vocab, count=16):
    prompts = [rng.integers(0, vocab, int(rng.integers(1, 50))).tolist() for _ in range(count)]
    params = []
    for i in range(count):
        if i % 3 == 0:
            params.append(SamplingParams(max_tokens=int(rng.integers(1, 24)), temperature=0.0, ignore_eos=True))
        else:
            params.append(SamplingParams(max_tokens=int(rng.integers(1, 24)), temperature=0.9, top_k=int(i % 2) * 20,
                                         top_p=0.9, seed=1000 + i, ignore_eos=True))
    return prompts, params


def test_batched_equals_solo_equals_with_other_traffic():
    engine = tiny_engine()
    rng = np.random.default_rng(11)
    prompts, params = mixed_requests(rng, engine.model.vocab_size)
    together = [o.token_ids for o in engine.generate(prompts, params)]
    solo = [engine.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params)]
    assert together == solo
    assert [len(t) for t in together] == [p.max_tokens for p in params]
    noise_prompts, noise_params = mixed_requests(np.random.default_rng(99), engine.model.vocab_size, 10)
    order = rng.permutation(26)
    all_prompts = [(prompts + noise_prompts)[i] for i in order]
    all_params = [(params + noise_params)[i] for i in order]
    mixed = engine.generate(all_prompts, all_params)
    back = {int(i): o.token_ids for i, o in zip(order, mixed)}
    assert [back[i] for i in range(16)] == together
    assert engine.generate(prompts, params)[1].token_ids == together[1]  # seeded: reproducible


def test_min_p_alone_draws_what_it_draws_beside_a_ranked_request():
    """min_p alone is applied by the forward's own draw (no sort); beside a top-k request the step's rows are
    redrawn by the `sample` program, which sorts: the same tokens either way."""
    engine = tiny_engine()
    min_p = SamplingParams(max_tokens=16, temperature=1.5, min_p=0.5, seed=7, ignore_eos=True)
    ranked = SamplingParams(max_tokens=16, temperature=0.9, top_k=5, seed=8, ignore_eos=True)
    sampled = []
    run_sample = engine.runner.sample
    engine.runner.sample = lambda *args: sampled.append(1) or run_sample(*args)
    alone = engine.generate([[3, 4, 5]], min_p)[0].token_ids
    assert not sampled  # no `sample` program: the forward drew them
    beside = engine.generate([[3, 4, 5], [6, 7]], [min_p, ranked])[0].token_ids
    assert sampled
    assert alone == beside
    plain = SamplingParams(max_tokens=16, temperature=1.5, seed=7, ignore_eos=True)
    assert engine.generate([[3, 4, 5]], plain)[0].token_ids != alone  # and min_p did cut what it drew


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-top-k"])
def test_penalties_through_the_engine_match_full_forwards(sampled):
    """Requests with the three penalties through the engine's pipelined paged steps (each step's history ends in
    the token the step before drew, still on the device; the prompt, a story's start, repeats tokens of its own)
    draw what full forwards draw with the penalties applied by an independent reference; batched beside other
    requests the same, and those others what they draw alone; without penalties the tokens differ."""
    case = json.loads((STORIES / "reference.json").read_text())["cases"][0]
    prompt, steps, width = case["prompt"] + case["greedy"][:12], 24, 64
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.3}
    drawing = {"temperature": 0.8, "top_k": 20, "seed": 5} if sampled else {"temperature": 0.0}
    params = SamplingParams(max_tokens=steps, ignore_eos=True, **drawing, **penalties)
    engine = Engine.from_pretrained(str(STORIES), dtype="float32", **SMALL)
    got = engine.generate([prompt], params)[0].token_ids

    cfg, weights = load_checkpoint(STORIES, dtype="float32")
    graphdef = transformer.split(transformer.abstract_model(cfg))[0]
    logits_of = jax.jit(lambda tokens: transformer.full_sequence_logits(graphdef, weights, tokens))
    completion = []
    for _ in range(steps):
        tokens = np.zeros(width, np.int32)  # causal: the padding after the sequence changes none of its logits
        tokens[:len(prompt) + len(completion)] = prompt + completion
        logits = np.asarray(logits_of(tokens))[len(prompt) + len(completion) - 1]
        penalized = penalized_reference(logits, prompt, completion, *penalties.values())
        position = len(prompt) + len(completion)  # a sampled token's randomness: (seed, position)
        inputs = SamplerInputs.from_params([params], [position], rows=1)
        completion.append(int(sample(jnp.asarray(penalized[None], jnp.float32), inputs)[0]) if sampled
                          else int(np.argmax(penalized)))
    assert got == completion

    others = [([1, 5, 9], SamplingParams(max_tokens=30, temperature=0.8, seed=3)),
              (list(range(2, 30)), SamplingParams(max_tokens=10, temperature=0.0))]
    alone = [engine.generate([p], sp)[0].token_ids for p, sp in others]
    beside = engine.generate([others[0][0], prompt, others[1][0]], [others[0][1], params, others[1][1]])
    assert [o.token_ids for o in beside] == [alone[0], got, alone[1]]
    plain = SamplingParams(max_tokens=steps, ignore_eos=True, **drawing)
    assert engine.generate([prompt], plain)[0].token_ids != got


def test_logit_bias_and_min_tokens_through_the_engine_match_full_forwards():
    """Greedy requests with a logit bias, with min_tokens before a stop token, with min_tokens keeping off an EOS
    that a +100 bias makes the likeliest token (a ban outranks a bias; the request then stops on it), and with
    allowed_token_ids draw what full forwards draw with the same rules applied by hand; batched together they
    draw the same."""
    case = json.loads((STORIES / "reference.json").read_text())["cases"][0]
    prompt, width = case["prompt"] + case["greedy"][:12], 64
    engine = Engine.from_pretrained(str(STORIES), dtype="float32", **SMALL)
    eos = engine.model.eos_token_ids[0]
    plain = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    stop = plain[2]  # plain greedy would stop on its third token
    requests = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias={plain[0]: -100.0, plain[-1]: 3.0}),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,), min_tokens=4),
        SamplingParams(max_tokens=12, temperature=0.0, logit_bias={eos: 100.0}, min_tokens=3),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, allowed_token_ids=plain[1::2]),
    ]

    cfg, weights = load_checkpoint(STORIES, dtype="float32")
    graphdef = transformer.split(transformer.abstract_model(cfg))[0]
    logits_of = jax.jit(lambda tokens: transformer.full_sequence_logits(graphdef, weights, tokens))

    def reference(params):
        completion, stops = [], set(params.stop_token_ids) | (set() if params.ignore_eos else {eos})
        while len(completion) < params.max_tokens:
            tokens = np.zeros(width, np.int32)
            tokens[:len(prompt) + len(completion)] = prompt + completion
            logits = np.asarray(logits_of(tokens))[len(prompt) + len(completion) - 1].astype(np.float64)
            if params.allowed_token_ids is not None:
                logits[np.setdiff1d(np.arange(len(logits)), params.allowed_token_ids)] = -np.inf
            for token, bias in params.logit_bias:
                logits[token] += bias
            if len(completion) < params.min_tokens:
                logits[list(stops)] = -np.inf
            completion.append(int(np.argmax(logits)))
            if completion[-1] in stops:
                break
        return completion

    want = [reference(p) for p in requests]
    assert want[0] != plain and plain[0] not in want[0]
    assert len(want[1]) >= 4 and stop not in want[1][:4] and want[1][:3] != plain[:3]
    assert len(want[2]) == 4 and want[2][-1] == eos and eos not in want[2][:3]
    assert set(want[3]) <= set(plain[1::2]) and want[3] != plain[:8]
    alone = [engine.generate([prompt], p)[0] for p in requests]
    assert [o.token_ids for o in alone] == want
    assert alone[2].finish_reason == "stop"
    together = engine.generate([prompt] * len(requests), requests)
    assert [o.token_ids for o in together] == want

    # min_tokens alone: the penalize program runs while a ban holds (two tokens, one step after them in flight at
    # most), then no longer
    calls, penalize = [], engine.runner.penalize
    engine.runner.penalize = lambda *args: calls.append(1) or penalize(*args)
    held = SamplingParams(max_tokens=10, temperature=0.0, min_tokens=2, stop_token_ids=(stop,), ignore_eos=True)
    assert len(engine.generate([prompt], held)[0].token_ids) >= 3 and 2 <= len(calls) <= 3


def test_page_pressure_preempts_and_recovers():
    roomy = tiny_engine(capacity=64)
    tight = tiny_engine(capacity=64, num_pages=12)  # 11 usable pages of 8 rows: far fewer than 10 requests need
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, int(rng.integers(10, 30))).tolist() for _ in range(10)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    got = [o.token_ids for o in tight.generate(prompts, params)]
    assert tight.stats.preemptions > 0
    assert got == expected
    for g in range(tight.cache.num_groups):
        assert tight.control.pages_in_use(g) == 0
        assert tight.control.num_free_pages(g) == tight.cache.num_pages - 1
    assert tight.control.active_seqs() == []


BAD_INPUTS = [
    ([], SamplingParams(max_tokens=4), "prompt is empty"),
    ([1, 2, 256], SamplingParams(max_tokens=4), "token id 256 is outside the vocabulary"),
    ([-1], SamplingParams(max_tokens=4), "token id -1"),
    ([1] * 250, SamplingParams(max_tokens=10), "exceeds the context capacity 256"),
    ([1, 2], "greedy", "must be a SamplingParams"),
    ("hello", SamplingParams(max_tokens=4), "needs a tokenizer"),
    ([1, 2], SamplingParams(max_tokens=4, logit_bias={256: 1.0}), r"logit_bias token id 256 is outside the vocab"),
    ([1, 2], SamplingParams(max_tokens=4, allowed_token_ids=[3, 300]), r"allowed_token_ids token id 300 is outside"),
    ([1, 2], SamplingParams(max_tokens=4, stop_token_ids=(2**40,), min_tokens=2),  # an int32 on the device
     r"stop_token_ids token id 1099511627776 is outside the vocabulary \[0, 256\)"),
]


def test_bad_input_is_refused_and_engine_keeps_serving():
    engine = tiny_engine()
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    expected = engine.generate([[5, 6, 7]], greedy)[0].token_ids
    for prompt, params, message in BAD_INPUTS:
        good = engine.add_request([5, 6, 7], greedy)
        engine.step()
        with pytest.raises(ValueError, match=message):
            engine.add_request(prompt, params)
        with pytest.raises(ValueError, match=message):  # a bad prompt in a batch queues nothing
            engine.generate([[1, 2, 3], prompt], [greedy, params])
        while engine.has_unfinished():
            engine.step()
        assert engine.output(good).token_ids == expected
    assert engine.generate([[5, 6, 7]], greedy)[0].token_ids == expected


def test_bad_sampling_values_raise():
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(max_tokens=0), dict(top_k=-2), dict(n=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_n_samples_share_the_prompt_and_match_single_greedy():
    engine = tiny_engine()
    prompt = list(range(3, 40))
    single = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    engine.set_prefix_cache(False)  # the completions can then share the prompt only as clones of its sequence
    fed, copies = engine.stats.fed_tokens, engine.stats.page_copies
    group = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=3))[0]
    assert [c.token_ids for c in group.outputs] == [single.token_ids] * 3
    # The prompt is fed once; each completion feeds its tokens but the last (its first is drawn from the prompt).
    assert engine.stats.fed_tokens - fed == len(prompt) + 3 * (12 - 1)
    assert engine.stats.page_copies > copies  # the prompt's shared last page, copied when a completion writes it
    engine.set_prefix_cache(True)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=3, ignore_eos=True)
    a = [c.token_ids for c in engine.generate([prompt], seeded)[0].outputs]
    b = [c.token_ids for c in engine.generate([prompt], seeded)[0].outputs]
    assert a == b and len({tuple(t) for t in a}) > 1
    assert all(engine.control.pages_in_use(g) == 0 for g in range(engine.cache.num_groups))


def test_streaming_abort_and_stop_tokens():
    engine = tiny_engine()
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    reference = engine.generate([[4, 5, 6]], greedy)[0].token_ids
    stop_at = reference[5]
    keep = engine.add_request([4, 5, 6], SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(stop_at,),
                                                        ignore_eos=True))
    gone = engine.add_request([7, 8, 9], greedy)
    streamed = []
    for _ in range(3):
        streamed += engine.step().get(keep, [])
    engine.abort(gone)
    while engine.has_unfinished():
        streamed += engine.step().get(keep, [])
    out = engine.output(keep)
    assert out.finish_reason == "stop" and out.token_ids == streamed
    assert out.token_ids == reference[: reference.index(stop_at) + 1]
    assert engine.output(gone).finish_reason == "abort"


def test_eos_stops_unless_ignored():
    engine = tiny_engine()
    eos = engine.model.eos_token_ids[0]
    ref = engine.generate([[3, 4]], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0].token_ids
    engine.model = engine.model.replace(eos_token_ids=(ref[3],))
    out = engine.generate([[3, 4]], SamplingParams(max_tokens=40, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[: ref.index(ref[3]) + 1]
    assert eos == 2


def test_wide_step_output_does_not_scale_with_width_times_vocab():
    """Compiled memory analysis: logits exist only for max_sample_rows rows, whatever the width."""
    cfg = preset("tiny", dtype="bfloat16").replace(vocab_size=32000)
    params = transformer.split(transformer.abstract_model(cfg))[1]
    from glint.export.checkpoint import flatten
    from glint.runtime.config import EngineConfig
    from glint.runtime.engine import cache_config_for
    from glint.runtime.programs import forward_name
    from glint.runtime.step import live_programs

    config = EngineConfig(max_seqs=64, page_size=16, max_step_tokens=4096, num_pages=64, capacity=1024)
    cache = cache_config_for(cfg, config)
    programs = live_programs(cfg, flatten(params), cache, "reference", (64, 4096), config.max_seqs,
                             config.max_sample_rows)
    narrow, wide = (programs.lower(forward_name(w)).compile().memory_analysis() for w in (64, 4096))
    full_logits = 4096 * cfg.vocab_size * 4
    assert wide.output_size_in_bytes == narrow.output_size_in_bytes  # tokens[R], logits[R, V], the aliased KV
    assert wide.temp_size_in_bytes < full_logits / 4
    print(f"width 4096: output {wide.output_size_in_bytes:,} B, temp {wide.temp_size_in_bytes:,} B; "
          f"full logits would be {full_logits:,} B")


def test_fewer_sample_rows_than_sequences_gives_the_same_tokens():
    rng = np.random.default_rng(8)
    prompts, params = mixed_requests(rng, 256, count=7)
    wide = [o.token_ids for o in tiny_engine().generate(prompts, params)]
    narrow_engine = tiny_engine(max_sample_rows=2)
    assert narrow_engine.config.max_sample_rows == 2 and tiny_engine().config.max_sample_rows == 8
    assert [o.token_ids for o in narrow_engine.generate(prompts, params)] == wide


def test_logprobs_are_the_models_log_softmax():
    engine = tiny_engine()
    prompt = [7, 8, 9, 10]
    out = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True))[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 4
    from glint.export.checkpoint import unflatten

    nested = unflatten(engine.params, transformer.split(transformer.abstract_model(engine.model))[1])
    logits = transformer.full_sequence_logits(engine.graphdef, nested, prompt + out.token_ids)
    expected = np.asarray(jax.nn.log_softmax(logits, -1))
    for i, (token, lps) in enumerate(zip(out.token_ids, completion.logprobs)):
        row = expected[len(prompt) - 1 + i]
        top3 = np.argsort(-row)[:3]
        assert set(lps) == set(top3.tolist()) | {token}
        for t, v in lps.items():
            assert abs(v - row[t]) < 1e-4
    assert engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))[0].outputs[0].logprobs is None


def test_streaming_n_samples_reports_every_token_and_no_placeholders():
    engine = tiny_engine()
    rid = engine.add_request(list(range(5, 25)), SamplingParams(max_tokens=5, temperature=1.0, seed=7, n=3,
                                                                ignore_eos=True))
    streamed: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for r, toks in engine.step().items():
            streamed.setdefault(r, []).extend(toks)
        assert all(t >= 0 for c in engine.output(rid).outputs for t in c.token_ids)
    out = engine.output(rid)
    assert len(out.outputs) == 3
    assert sorted(streamed.values()) == sorted(c.token_ids for c in out.outputs)


def test_unschedulable_configurations_are_refused_up_front():
    engine = tiny_engine(max_sample_rows=2)
    with pytest.raises(ValueError, match="n=3 exceeds max_sample_rows 2"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, n=3))
    from glint.runtime.config import EngineConfig

    with pytest.raises(ValueError, match="min_prefill_chunk 16 exceeds max_step_tokens 8"):
        EngineConfig(max_step_tokens=8, forward_sizes=(1, 2, 4, 8))
    with pytest.raises(ValueError, match=r"forward_sizes \(1, 32\) exceed max_step_tokens 16"):
        EngineConfig(max_step_tokens=16, forward_sizes=(1, 32))  # given ones are kept as given


def test_default_forward_sizes_stop_at_max_step_tokens():
    from glint.runtime.config import DEFAULT_FORWARD_SIZES, EngineConfig

    assert EngineConfig().forward_sizes == DEFAULT_FORWARD_SIZES
    small = EngineConfig(max_step_tokens=16)
    assert small.forward_sizes == tuple(w for w in DEFAULT_FORWARD_SIZES if w <= 16)
    assert small.buckets[-1] == 16 and all(w <= 16 for w in small.buckets)
    assert EngineConfig(max_step_tokens=100).buckets[-1] == 100  # the widest step holds max_step_tokens


def test_pallas_kernels_give_the_reference_tokens():
    """The engine's Pallas path (ring write + varlen attention; interpreted on CPU) == the jnp reference path,
    with a prompt long enough to wrap the sliding-window layer's ring."""
    small = dict(max_seqs=4, page_size=8, max_step_tokens=32, forward_sizes=(1, 2, 4, 8, 16), num_pages=40,
                 capacity=64, min_prefill_chunk=4)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 50, 9)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    reference = tiny_engine(**small, attention="reference")
    pallas = tiny_engine(**small, attention=PALLAS)
    assert pallas.cache.group_ring_rows(1) < 56  # the 50-token prompt wraps the ring
    want = [o.token_ids for o in reference.generate(prompts, greedy)]
    assert [o.token_ids for o in pallas.generate(prompts, greedy)] == want


def test_a_step_uploads_its_host_inputs_as_one_array():
    """A step's host inputs travel as one int32 array (programs.StepLayout): unpacked inside a jit, every input
    comes back bit for bit (float temperatures and top-p, uint32 seeds, each layer group's page-table changes,
    padded with entries past the tables), and every forward program of an engine takes (params, pools, page
    tables, that array, the previous step's tokens)."""
    from glint.runtime.programs import DeviceMeta, StepLayout, apply_table_changes, forward_name
    from glint.runtime.sampling import SamplerInputs

    rng = np.random.default_rng(3)
    layout = StepLayout(width=6, segments=4, rows=5, groups=2, changes=3, max_seqs=9)
    ints = lambda *shape: rng.integers(-2**31, 2**31 - 1, shape, dtype=np.int64).astype(np.int32)  # noqa: E731
    changes = (ints(3, 3), ints(1, 3))
    meta = DeviceMeta(ints(6), (ints(6), ints(6)), ints(4, 4), table_changes=changes)
    sampler = SamplerInputs(rng.standard_normal(5).astype(np.float32), ints(5),
                            np.array([np.nan, -0.0, 1.0, 1e-38, np.inf], np.float32),
                            rng.random(5).astype(np.float32),
                            rng.integers(0, 2**32, 5, dtype=np.uint64).astype(np.uint32), ints(5))
    tokens, token_src, rows = ints(6), ints(6), ints(5)
    host = layout.pack(tokens, token_src, meta, rows, sampler)
    assert host.dtype == np.int32 and host.shape == (layout.size,)
    starts = [start for _, start, _, _, _ in layout.spans]
    assert all(4 * start % 256 == 0 for start in starts)  # Mosaic GPU kernels take 256-byte aligned inputs
    parts = jax.device_get(jax.jit(layout.unpack)(host))
    tables = (np.zeros((9, 4), np.int32), np.zeros((9, 5), np.int32))
    back = layout.meta(parts, tables)
    pads = np.array([[9, 0, 0]] * 2, np.int32)  # sequence max_seqs: past the tables
    for got, want in [(parts["tokens"], tokens), (parts["token_src"], token_src), (parts["rows"], rows),
                      (back.positions, meta.positions), (back.seq_info, meta.seq_info),
                      *zip(back.slots, meta.slots), (back.page_tables[1], tables[1]),
                      *zip(layout.table_changes(parts), (changes[0], np.concatenate([changes[1], pads]))),
                      *zip(layout.sampler(parts), (sampler.temperature, sampler.top_k, sampler.top_p, sampler.min_p,
                                                   sampler.seed, sampler.position))]:
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))  # bit for bit, NaN and -0.0 included
    assert not parts["draft_rows"].any()  # not given: zeros
    # applied on the device: the entries set, the pads dropped
    given = np.array([[2, 1, 7], [8, 4, 3]], np.int32)
    meta = DeviceMeta(meta.positions, meta.slots, meta.seq_info, table_changes=(given[:1], given[1:]))
    parts = jax.jit(layout.unpack)(layout.pack(tokens, token_src, meta, rows, sampler))
    got = jax.device_get(apply_table_changes(tables, layout.table_changes(parts)))
    want = [t.copy() for t in tables]
    want[0][2, 1], want[1][8, 4] = 7, 3
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    with pytest.raises(ValueError, match=r"step input seq_info: shape \(3, 4\), the width-6 layout holds \(4, 4\)"):
        layout.pack(tokens, token_src, DeviceMeta(meta.positions, meta.slots, meta.seq_info[:3],
                                                  table_changes=changes), rows, sampler)
    with pytest.raises(ValueError, match="4 page-table changes; the width-6 upload holds 3"):
        layout.pack(tokens, token_src, DeviceMeta(meta.positions, meta.slots, meta.seq_info,
                                                  table_changes=(ints(4, 3), changes[1])), rows, sampler)

    engine = tiny_engine()
    for width in engine.config.buckets:
        args = engine.runner.programs.programs[forward_name(width)].args
        expected = StepLayout.of(width, engine.cache, engine.config.max_seqs, engine.config.max_sample_rows).size
        assert len(args) == 5 and args[3].shape == (expected,) and args[3].dtype == np.int32
        assert [t.shape for t in args[2]] == [(engine.config.max_seqs, engine.cache.group_pages_per_seq(g))
                                              for g in range(engine.cache.num_groups)]
        assert engine.runner.layout(width).size == expected  # the runner packs with the program's own layout
    # metadata built for another width is refused by name before anything reaches the device
    wide, narrow = engine.config.buckets[-1], engine.config.buckets[0]
    groups = engine.cache.num_groups
    meta = DeviceMeta(np.zeros(narrow, np.int32), (np.zeros(narrow, np.int32),) * groups,
                      np.zeros((min(narrow, engine.config.max_seqs), 4), np.int32),
                      table_changes=(np.zeros((0, 3), np.int32),) * groups)
    rows = np.zeros(engine.config.max_sample_rows, np.int32)
    with pytest.raises(ValueError, match=rf"step input tokens: shape \({narrow},\), the width-{wide} layout"):
        engine.runner.forward(wide, engine.params, engine.kv, np.zeros(narrow, np.int32), np.zeros(narrow, np.int32),
                              rows, meta, rows, SamplerInputs.from_params([], [], rows=len(rows)))


def test_the_exported_signature_lists_the_packed_inputs_in_layout_order():
    """An artifact's metadata tells callers without glint how to build the host array: the same parts, in the
    order StepLayout packs them."""
    from glint.export.exporter import SIGNATURES
    from glint.runtime.programs import SPAN_ALIGN, StepLayout

    text = SIGNATURES["forward_W"]["inputs"][3]
    names = [n if not n.startswith("table_changes_") else "table_changes"
             for n, _, _ in StepLayout(1, 1, 1, groups=1, changes=1, max_seqs=1).parts]
    found = [text.index(f"{n} ") for n in names]
    assert found == sorted(found), names
    assert f"a multiple of {SPAN_ALIGN} elements ({4 * SPAN_ALIGN} bytes" in text  # the alignment StepLayout packs with


def test_page_table_entries_go_to_the_device_in_chunks():
    """More entries than a `tables` call takes, a different number per layer group: the device's tables end up
    as NumPy sets them, pads dropped; a step's metadata past its upload is cut to the upload, the rest sent."""
    from glint.runtime.programs import TABLE_ROWS, DeviceMeta

    engine = tiny_engine(max_seqs=64, capacity=512)
    runner, cache, max_seqs = engine.runner, engine.cache, engine.config.max_seqs
    assert cache.num_groups == 2 and max_seqs * cache.group_pages_per_seq(0) > 2 * TABLE_ROWS + 5
    rng = np.random.default_rng(0)
    want = [np.asarray(t).copy() for t in runner.tables]
    changes = []
    for g, n in enumerate((2 * TABLE_ROWS + 5, 3)):
        pages = cache.group_pages_per_seq(g)
        keys = rng.choice(max_seqs * pages, n, replace=False)  # each (seq, index) once
        seqs, index = np.divmod(keys, pages)
        c = np.stack([seqs, index, rng.integers(1, cache.num_pages, n)], axis=1).astype(np.int32)
        want[g][seqs, index] = c[:, 2]
        changes.append(c)
    runner.update_tables(changes)
    assert all(np.array_equal(np.asarray(t), w) for t, w in zip(runner.tables, want))
    width = engine.config.buckets[0]
    keep = runner.layout(width).changes
    more = [np.array([[s, 0, 7] for s in range(min(max_seqs, keep + 2))], np.int32), np.zeros((0, 3), np.int32)]
    meta, earlier = runner.split_changes(width, DeviceMeta(np.zeros(width, np.int32), (), np.zeros((1, 4), np.int32),
                                                           table_changes=tuple(more)))
    runner.update_tables(earlier)
    assert [len(c) for c in meta.table_changes] == [min(keep, len(more[0])), 0]
    sent = len(more[0]) - len(meta.table_changes[0])
    assert (np.asarray(runner.tables[0])[more[0][:sent, 0], 0] == 7).all()  # what did not fit went ahead
