"""Speculative decoding on CPU: lossless against transformers and against plain runs, caches after rejection,
the acceptance rule's distribution, bad input."""
import json
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import STORIES
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from glint.export.checkpoint import unflatten
from glint.model import dflash, transformer
from glint.model.attention import DenseMeta, dense_attention
from glint.model.presets import preset
from glint.runtime.config import EngineConfig
from glint.runtime.engine import Engine
from glint.runtime.params import SamplingParams
from glint.runtime.sampling import SamplerInputs, sample
from glint.runtime.spec import NgramDrafter, OracleDrafter, committed

SMALL = dict(max_seqs=8, page_size=8, max_step_tokens=64, forward_sizes=(1, 4, 16, 32), num_pages=160,
             capacity=256, min_prefill_chunk=2)
K = 3


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def perturbed(tokens: list[int], vocab: int, every: int, salt: int) -> list[int]:
    """The continuation with every `every`-th token replaced by another id: the oracle then proposes wrong
    tokens at known places."""
    out = list(tokens)
    for i in range(salt % every, len(out), every):
        out[i] = (out[i] + 1 + zlib.crc32(bytes([i, salt])) % (vocab - 1)) % vocab
    return out


def expected_acceptance(reference: list[int], proposals: list[int], k: int) -> list[int]:
    """Greedy acceptance of the oracle's proposals against the true greedy tokens, step by step: a block
    from g known tokens proposes proposals[g:g + k'] and commits the agreeing prefix + 1 token."""
    lengths, g, n = [], 1, len(reference)  # the first token comes from the prefill, not a block
    while g < n:
        kk = min(k, n - g - 1)
        draft = proposals[g:g + kk]
        if not draft:
            g += 1
            continue
        a = next((i for i, t in enumerate(draft) if t != reference[g + i]), len(draft))
        lengths.append(a + 1)
        g += a + 1
    return lengths


def test_oracle_with_wrong_tokens_keeps_transformers_tokens(hf_fixture):
    """Batched speculative decoding where the oracle is wrong at known places gives transformers' greedy
    tokens, with acceptance lengths as greedy acceptance defines them; small prefill chunks keep the
    sliding-window rings at window + chunk - 1 rows, so rewinds happen right at the ring floor."""
    cases = json.loads((hf_fixture / "reference.json").read_text())["cases"]
    vocab = json.loads((hf_fixture / "config.json").read_text())["vocab_size"]
    n = len(cases[0]["greedy"])
    engine = Engine.from_pretrained(str(hf_fixture), dtype="float32", draft="oracle", num_speculative_tokens=K,
                                    **dict(SMALL, max_prefill_chunk=K + 1))
    proposals = []
    for i, case in enumerate(cases):
        proposals.append(perturbed(case["greedy"], vocab, every=3 + i % 3, salt=i))
        engine.drafter.record(case["prompt"], proposals[-1])
    outs = engine.generate([c["prompt"] for c in cases], greedy(n))
    checked = 0
    for case, out, prop in zip(cases, outs, proposals):
        if case["greedy_min_gap"] < 1e-3:
            continue
        assert out.token_ids == case["greedy"]
        assert out.acceptance_lengths == expected_acceptance(case["greedy"], prop, K)
        checked += 1
    assert checked >= 1
    lengths = [a for o in outs for a in o.acceptance_lengths]
    assert 1 in lengths and max(lengths) == K + 1  # rejected and fully accepted blocks both happened
    assert engine.stats.mean_acceptance_length == pytest.approx(np.mean(lengths))
    assert all(engine.control.pages_in_use(g) == 0 for g in range(engine.cache.num_groups))


def lookup_by_definition(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup spelled out: for n = max_n .. min_n, the latest start j < len - n whose n tokens are the
    last n, and the k tokens after them; the first n that has one wins."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        tail = tokens[-n:]
        for j in range(len(tokens) - n - 1, -1, -1):
            if tokens[j:j + n] == tail:
                return tokens[j + n:j + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.integers(1, 5), st.integers(1, 3), st.integers(0, 2))
def test_ngram_proposals_are_prompt_lookup(tokens, k, min_n, extra):
    """The drafter's proposals equal prompt lookup by its definition, from a fresh list and from the arrays it
    keeps per owner as a sequence grows token by token; an owner whose tokens are not a continuation of its last
    call's is read afresh, and its array goes with it."""
    max_n = min_n + extra
    drafter = NgramDrafter(k, min_n, max_n)
    assert drafter.propose(tokens, 0, k) == lookup_by_definition(tokens, k, min_n, max_n)

    class Owner:
        pass

    owner = Owner()
    for end in range(len(tokens) + 1):
        assert drafter.propose(tokens[:end], 0, k, owner=owner) == lookup_by_definition(tokens[:end], k, min_n, max_n)
    other = [t ^ 1 for t in tokens]  # every token different: not a continuation
    assert drafter.propose(other, 0, k, owner=owner) == lookup_by_definition(other, k, min_n, max_n)
    shorter = tokens[:len(tokens) // 2]  # fewer tokens than the last call's
    assert drafter.propose(shorter, 0, k, owner=owner) == lookup_by_definition(shorter, k, min_n, max_n)
    del owner
    assert len(drafter._arrays) == 0


def test_ngram_on_stories_is_lossless_and_accepts():
    """Prompt lookup on a real model's repetitive greedy text: the same 200 tokens as llama2.c, and the
    repeats are accepted (more than one token per block on average)."""
    case = json.loads((STORIES / "reference.json").read_text())["cases"][0]
    engine = Engine.from_pretrained(str(STORIES), draft="ngram", num_speculative_tokens=4,
                                    **dict(SMALL, capacity=512, num_pages=200))
    out = engine.generate([case["prompt"]], greedy(len(case["greedy"])))[0]
    assert out.token_ids == case["greedy"]
    assert engine.stats.mean_acceptance_length > 1.2
    assert sum(out.acceptance_lengths) <= len(case["greedy"]) - 1


def _tiny():
    cfg = preset("tiny", dtype="float32")
    graphdef, params = transformer.split(transformer.init_model(cfg, 3))
    return cfg, graphdef, params


def test_batched_with_preemption_equals_plain_runs():
    """Many prompts, greedy and seeded (top-k, top-p), through a pool too small for all of them (preemption,
    recompute) with drafters that are right and wrong: every output equals its plain run."""
    cfg, graphdef, params = _tiny()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, int(rng.integers(3, 30))).tolist() for _ in range(10)]
    settings = [greedy(24) if i % 2 else SamplingParams(max_tokens=24, temperature=0.7, top_k=(0, 5)[i % 4 == 0],
                                                       top_p=0.9, seed=i, ignore_eos=True) for i in range(10)]
    plain = Engine(cfg, graphdef, params, EngineConfig(**SMALL))
    refs = [o.token_ids for o in plain.generate(prompts, settings)]
    for drafter in (NgramDrafter(K), OracleDrafter(K)):
        if isinstance(drafter, OracleDrafter):
            for i, (p, r) in enumerate(zip(prompts, refs)):
                drafter.record(p, perturbed(r, cfg.vocab_size, every=4, salt=i))
        engine = Engine(cfg, graphdef, params, EngineConfig(**dict(SMALL, num_pages=16, capacity=96),
                                                            num_speculative_tokens=K), drafter=drafter)
        outs = engine.generate(prompts, settings)
        assert [o.token_ids for o in outs] == refs  # greedy and seeded: the very tokens of the plain run
        assert engine.stats.preemptions > 0 and engine.stats.spec_steps > 0


def _kv_at(engine: Engine, seq: int, positions: np.ndarray):
    """Every layer's K and V rows of `seq` at logical `positions`, read through its page table."""
    out = []
    for layer in range(engine.cache.num_layers):
        group = engine.cache.layer_group[layer]
        ring = engine.cache.group_ring_rows(group)
        rows = positions % ring if ring else positions
        pages = engine.control.page_table(group)[seq][rows // engine.cache.page_size]
        for pool in (engine.kv.k[layer], engine.kv.v[layer]):
            out.append(np.asarray(pool)[pages, rows % engine.cache.page_size])
    return out


def test_cache_after_rejections_equals_plain_cache():
    """After blocks whose tails were rejected and rewound, the KV rows at every position the sequence holds
    (the last ring_rows positions in ring layers) equal a plain run's."""
    cfg, graphdef, params = _tiny()
    prompt = list(range(5, 25))
    plain = Engine(cfg, graphdef, params, EngineConfig(**SMALL))
    ref = plain.generate([prompt], greedy(40))[0].token_ids
    drafter = OracleDrafter(K, {tuple(prompt): perturbed(ref, cfg.vocab_size, every=3, salt=1)})
    engines = [Engine(cfg, graphdef, params, EngineConfig(**SMALL)),
               Engine(cfg, graphdef, params, EngineConfig(**SMALL, num_speculative_tokens=K), drafter=drafter)]
    rids = [e.add_request(prompt, greedy(60)) for e in engines]
    for e, rid in zip(engines, rids):
        while len(e.output(rid).token_ids) < 36:
            e.step()
    spec = engines[1]
    assert 1 in spec.output(rids[1]).acceptance_lengths  # blocks were rejected
    reqs = [e._requests[rid] for e, rid in zip(engines, rids)]
    held = min(r.num_cached for r in reqs)
    rings = [spec.cache.group_ring_rows(g) for g in range(spec.cache.num_groups) if spec.cache.group_ring_rows(g)]
    positions = np.arange(max(0, held - min(rings, default=held)), held)
    for a, b in zip(_kv_at(engines[0], reqs[0].seq, positions), _kv_at(spec, reqs[1].seq, positions)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_verification_is_the_rejection_rule_for_a_deterministic_draft():
    """Rows verify by the plain draw (many seeds of one row): a proposal d is accepted with probability p(d)
    and a rejected row's token follows the residual, p without d renormalised (chi-square), with and without
    top-k; so the committed tokens follow softmax(logits / T) whatever is proposed."""
    rows, vocab = 20000, 7
    logits = jnp.asarray(np.random.default_rng(1).normal(size=vocab) * 1.5, jnp.float32)
    for top_k, proposal in ((0, 2), (4, 0), (0, int(np.argmax(logits)))):
        temperature = 0.8
        z = np.asarray(logits, np.float64) / temperature
        if top_k:
            z[np.argsort(-z)[top_k:]] = -np.inf
        p = np.exp(z - z.max())
        p /= p.sum()
        sampler = SamplerInputs(jnp.full(rows, temperature, jnp.float32), jnp.full(rows, top_k, jnp.int32),
                                jnp.ones(rows, jnp.float32), jnp.zeros(rows, jnp.float32),
                                jnp.arange(rows, dtype=jnp.uint32), jnp.full(rows, 7, jnp.int32))
        drawn = np.asarray(jax.jit(sample, static_argnames="is_filtered")(
            jnp.tile(logits, (rows, 1)), sampler, is_filtered=top_k > 0))
        blocks = [committed(np.array([t, 5]), np.array([proposal, -1]), 0, 2) for t in drawn]
        accepted = np.array([len(b) == 2 for b in blocks])
        assert abs(accepted.mean() - p[proposal]) < 4 * np.sqrt(p[proposal] * (1 - p[proposal]) / rows) + 1e-9
        rejected = np.array([b[0] for b in blocks if len(b) == 1])
        residual = np.where(np.arange(vocab) == proposal, 0.0, p)
        residual /= residual.sum()
        kept = residual > 0
        counts = np.bincount(rejected, minlength=vocab)
        assert counts[~kept].sum() == 0
        if kept.any() and len(rejected):
            assert stats.chisquare(counts[kept], residual[kept] * len(rejected)).pvalue > 1e-3


def test_sampling_with_speculation_keeps_the_joint_distribution():
    """Seeded sampling through the engine: the first two tokens of many requests, the second verified from
    an oracle proposal, follow the model's joint distribution (computed by the dense full-sequence path)."""
    cfg, graphdef, params = _tiny()
    prompt, top_k, temperature, n = [4, 9, 17, 30], 3, 1.0, 1200
    full = lambda toks: np.asarray(transformer.full_sequence_logits(graphdef, params, toks)[-1], np.float64)  # noqa: E731

    def dist(logits):
        z = logits / temperature
        z[np.argsort(-z, kind="stable")[top_k:]] = -np.inf
        p = np.exp(z - z.max())
        return p / p.sum()

    p1 = dist(full(prompt))
    first = int(np.argmax(p1))
    drafter = OracleDrafter(K, {tuple(prompt): [first, int(np.argmax(full(prompt + [first]))), 0]})
    engine = Engine(cfg, graphdef, params, EngineConfig(**dict(SMALL, max_seqs=32, num_pages=200),
                                                        num_speculative_tokens=K), drafter=drafter)
    params_list = [SamplingParams(max_tokens=3, temperature=temperature, top_k=top_k, seed=s, ignore_eos=True)
                   for s in range(n)]
    outs = engine.generate([prompt] * n, params_list)
    assert engine.stats.spec_steps > 0
    pairs = {}
    for o in outs:
        key = tuple(o.token_ids[:2])
        pairs[key] = pairs.get(key, 0) + 1
    expected = {}
    for t1 in np.flatnonzero(p1 > 0):
        p2 = dist(full(prompt + [int(t1)]))
        for t2 in np.flatnonzero(p2 > 0):
            expected[(int(t1), int(t2))] = p1[t1] * p2[t2] * n
    assert set(pairs) <= set(expected)
    cells = sorted(expected)
    observed = np.array([pairs.get(c, 0) for c in cells])
    assert stats.chisquare(observed, np.array([expected[c] for c in cells])).pvalue > 1e-3


def test_bad_draft_settings_are_clear_errors(tmp_path):
    cfg, graphdef, params = _tiny()
    with pytest.raises(ValueError, match="num_speculative_tokens 3 needs a drafter"):
        Engine(cfg, graphdef, params, EngineConfig(**SMALL, num_speculative_tokens=3))
    with pytest.raises(ValueError, match="num_speculative_tokens 80 makes blocks of 81 tokens"):
        EngineConfig(**SMALL, num_speculative_tokens=80)
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int >= 0, got -1"):
        EngineConfig(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="draft 'medusa' is not a drafter kind"):
        Engine.from_pretrained("tiny", draft="medusa")
    spec = Engine(cfg, graphdef, params, EngineConfig(**SMALL, num_speculative_tokens=3), drafter=NgramDrafter(3))
    for params in ({"repetition_penalty": 1.2}, {"logit_bias": {5: 1.0}}, {"min_tokens": 2},
                   {"allowed_token_ids": [5]}):
        with pytest.raises(ValueError, match=f"^{next(iter(params))}=.*: penalties, logit_bias, min_tokens and "
                                             "allowed_token_ids are not supported with speculative decoding"):
            spec.add_request([1, 2, 3], SamplingParams(**params))
    with pytest.raises(ValueError, match=r"^repetition_penalty=1.2, logit_bias=\(\(5, 1.0\),\), min_tokens=2: "):
        spec.add_request([1, 2, 3], SamplingParams(repetition_penalty=1.2, logit_bias={5: 1.0}, min_tokens=2))
    assert not spec.has_unfinished()  # nothing queued


DFLASH = STORIES.parents[1] / "fixtures" / "dflash"


def _fed_blocks(engine: Engine, block: int) -> list[list[int]]:
    """Wrap the engine's forward to record each verified block (a segment of `block` tokens, drafts filled in)."""
    blocks, run_forward = [], engine.runner.run_forward

    def recording(width, params, kv, host, prev):
        step = engine.runner.layout(width).unpack(np.asarray(host))
        tokens, token_src = np.asarray(step["tokens"]), np.asarray(step["token_src"])
        fed = np.where(token_src >= 0, np.asarray(prev)[np.maximum(token_src, 0)], tokens)
        for start, length, _, _ in np.asarray(step["seq_info"]):
            if length == block:
                blocks.append(fed[start:start + length].tolist())
        return run_forward(width, params, kv, host, prev)

    engine.runner.run_forward = recording
    return blocks


def test_dflash_engine_matches_the_authors_reference():
    """The DFlash draft through the engine (paged draft cache, drafting and verification inside the steps, on
    the reference attention): z-lab's tokens, acceptance lengths and verified blocks, batched and solo, and
    again through a pool small enough to preempt (the draft context is recomputed with the prompt)."""
    ref = json.loads((DFLASH / "reference.json").read_text())
    block, n = ref["block_size"], ref["max_new_tokens"]
    cases = ref["cases"]
    longest = max(len(c["prompt"]) for c in cases) + n + block
    settings = dict(SMALL, capacity=longest, num_pages=4 * -(-longest // SMALL["page_size"]) + 1)
    engine = Engine.from_pretrained(str(DFLASH / "target"), draft=str(DFLASH / "draft"), **settings)
    assert engine.config.num_speculative_tokens == block - 1
    blocks = _fed_blocks(engine, block)
    for case in cases:
        blocks.clear()
        out = engine.generate([case["prompt"]], greedy(n))[0]
        assert out.token_ids == case["output_ids"] == case["target_greedy"]
        # The reference loops while its next block would start inside the n tokens, so its last step
        # verifies a block after all n tokens exist; the engine stops there.
        steps = len(out.acceptance_lengths)
        assert out.acceptance_lengths == case["acceptance_lengths"][:steps]
        assert steps == len(case["acceptance_lengths"]) - 1 and 1 + sum(case["acceptance_lengths"][:-1]) >= n
        assert blocks == case["proposed_blocks"][:steps]
    outs = engine.generate([c["prompt"] for c in cases], greedy(n))
    assert [o.token_ids for o in outs] == [c["output_ids"] for c in cases]
    assert [o.acceptance_lengths for o in outs] == [c["acceptance_lengths"][:-1] for c in cases]
    small = Engine.from_pretrained(str(DFLASH / "target"), draft=str(DFLASH / "draft"),
                                   **dict(settings, num_pages=-(-longest // SMALL["page_size"]) + 3))
    outs = small.generate([c["prompt"] for c in cases], greedy(n))
    assert small.stats.preemptions > 0
    assert [o.token_ids for o in outs] == [c["output_ids"] for c in cases]


def test_dflash_bad_input_is_a_clear_error(tmp_path):
    ref = json.loads((DFLASH / "reference.json").read_text())
    llama = sorted((STORIES.parents[1] / "fixtures" / "hf").glob("llama*"))[0]
    with pytest.raises(ValueError, match="draft hidden_size|draft vocab_size|num_target_layers"):
        Engine.from_pretrained(str(llama), draft=str(DFLASH / "draft"), **SMALL)
    with pytest.raises(ValueError, match=f"makes blocks of {ref['block_size']} tokens"):
        Engine.from_pretrained(str(DFLASH / "target"), draft=str(DFLASH / "draft"),
                               **dict(SMALL, max_step_tokens=ref["block_size"] - 1, forward_sizes=(1,),
                                      min_prefill_chunk=1))
    with pytest.raises(ValueError, match=f"a DFlash draft of block_size {ref['block_size']} drafts"):
        Engine.from_pretrained(str(DFLASH / "target"), draft=str(DFLASH / "draft"),
                               num_speculative_tokens=ref["block_size"], **SMALL)


def test_dflash_draft_cache_after_rejections_holds_the_committed_context():
    """After DFlash blocks whose drafts were rejected and rewound, the draft's pools hold, at every position
    the sequence keeps, the context K/V of its committed tokens as the dense path computes them (the target's
    tapped layers over the whole sequence, fc, hidden_norm, each layer's k/v projection)."""
    case = json.loads((DFLASH / "reference.json").read_text())["cases"][0]
    engine = Engine.from_pretrained(str(DFLASH / "target"), draft=str(DFLASH / "draft"),
                                    **dict(SMALL, capacity=128, num_pages=40))
    rid = engine.add_request(case["prompt"], greedy(64))
    while len(engine.output(rid).token_ids) < 24:
        engine.step()
    assert 1 in engine.output(rid).acceptance_lengths  # drafts were rejected
    req, cfg = engine._requests[rid], engine.drafter.cfg
    tokens = (req.prompt + req.generated)[:req.num_cached]
    positions = jnp.arange(len(tokens), dtype=jnp.int32)
    graphdef, like = transformer.split(transformer.abstract_model(engine.model))
    target = unflatten(engine.params, like)  # the target's weights out of the engine's flat dict
    _, _, tapped = transformer.forward(graphdef, target, jnp.asarray(tokens, jnp.int32), positions, dense_attention,
                                       None, DenseMeta.single(len(tokens)), taps=cfg.target_layer_ids)
    features = dflash.context_features(engine.drafter.params, cfg, tapped)
    pools = _kv_at(engine, req.seq, np.arange(len(tokens)))
    n = engine.model.num_layers
    for i in range(cfg.num_layers):
        k, v = dflash.context_kv(engine.drafter.params, cfg, i, features, positions)
        np.testing.assert_allclose(pools[2 * (n + i)], np.asarray(k), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(pools[2 * (n + i) + 1], np.asarray(v), rtol=1e-5, atol=1e-5)


def _spec_engine():
    from test_robustness import TIGHT, HF_FIXTURES

    return Engine.from_pretrained(str(HF_FIXTURES / "llama"), dtype="float32", draft="ngram",
                                  num_speculative_tokens=K, **TIGHT)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_speculating_engine_survives_interrupts_and_exceptions(sampled):
    """Ctrl-C at random moments, then an exception injected at each stage of a step, on an engine that
    speculates (a pool tight enough to preempt): every run gives the uninterrupted run's tokens."""
    from test_robustness import outputs, requests, step_through_interrupts

    eng = _spec_engine()
    prompts, params = requests(sampled)

    def run():
        rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        while eng.has_unfinished():
            try:
                eng.step()
            except RuntimeError as e:
                assert "injected" in str(e) and not eng.control.has_pending_step
        out = outputs(eng, rids)
        for rid in rids:
            eng.release(rid)
        return out

    want = run()
    assert eng.stats.spec_steps > 0 and eng.stats.preemptions > 0
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    # A speculating engine waits for the step it just dispatched, a longer wait than a pipelined one: gaps
    # long enough that steps still finish between interrupts on a busy machine.
    caught = step_through_interrupts(eng, seed=3, gaps=(0.002, 0.03))
    assert caught >= 10 and outputs(eng, rids) == want
    for rid in rids:
        eng.release(rid)
    rng = np.random.default_rng(5)
    for stage in ("_dispatch", "_run", "_fetch", "_commit_block"):
        original = getattr(eng, stage)

        def flaky(*args, _original=original, _stage=stage, **kwargs):
            if rng.random() < 0.25:
                raise RuntimeError(f"injected into {_stage}")
            return _original(*args, **kwargs)

        setattr(eng, stage, flaky)
        assert run() == want, stage
        setattr(eng, stage, original)


def test_logprobs_and_stop_tokens_inside_blocks_match_plain_runs():
    """Logprobs of tokens committed from a block, and a stop token met in the middle of one (the rest of the
    block discarded), as in a plain run."""
    cfg, graphdef, params = _tiny()
    prompt = list(range(7, 19))
    plain = Engine(cfg, graphdef, params, EngineConfig(**SMALL))
    ref = plain.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2))[0]
    stop = ref.token_ids[9]
    cut = plain.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                  stop_token_ids=(stop,)))[0]
    engine = Engine(cfg, graphdef, params, EngineConfig(**SMALL, num_speculative_tokens=K),
                    drafter=OracleDrafter(K, {tuple(prompt): ref.token_ids}))
    out = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2))[0]
    assert out.token_ids == ref.token_ids and max(out.acceptance_lengths) == K + 1
    for got, want in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
        assert got.keys() == want.keys()
        np.testing.assert_allclose([got[t] for t in want], list(want.values()), rtol=1e-5, atol=1e-6)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                    stop_token_ids=(stop,), logprobs=2))
    held, streamed = [], []
    while not engine.is_finished(rid):
        held.append(engine.output(rid))
        streamed += engine.step().get(rid, [])
    stopped = engine.output(rid)
    assert stopped.token_ids == cut.token_ids == streamed and stopped.finish_reason == cut.finish_reason == "stop"
    assert any(len(h.token_ids) < len(cut.token_ids) for h in held)
    for h in held:  # an output taken before the block that stopped is not changed by it
        assert h.token_ids == cut.token_ids[:len(h.token_ids)]
    assert len(stopped.outputs[0].logprobs) == len(cut.token_ids)
    engine.release(rid)
    assert all(engine.control.pages_in_use(g) == 0 for g in range(engine.cache.num_groups))


def test_committed_stops_at_the_first_rejected_row_of_its_block():
    tokens, proposed = np.array([9, 4, 5, 6, 7, 8]), np.array([-1, 4, 5, 0, 7, -1])
    assert committed(tokens, proposed, 1, 4) == [4, 5, 6]  # rows 1 and 2 drew their proposals, row 3 did not
    assert committed(tokens, proposed, 4, 2) == [7, 8]  # every proposal accepted, then the last row's own token
    assert committed(tokens, proposed, 0, 1) == [9]


def test_oracle_record_replaces_a_continuation_a_request_already_looked_up():
    class Request:  # an owner, as the engine passes one
        pass

    drafter, owner = OracleDrafter(3), Request()
    drafter.record([1, 2], [5, 6, 7, 8])
    assert drafter.propose([1, 2, 5], 2, 3, owner=owner) == [6, 7, 8]
    drafter.record([1, 2], [5, 9, 9, 9])
    assert drafter.propose([1, 2, 5], 2, 3, owner=owner) == [9, 9, 9]
    assert drafter.propose([3, 5], 1, 3, owner=Request()) == []  # a prompt it was not given


def test_exported_artifact_speculates_with_a_host_drafter(tmp_path):
    """An artifact exported with rows for blocks, served with the oracle (wrong at known places): transformers'
    tokens and greedy acceptance, from the exported programs alone; a DFlash draft is refused there."""
    from test_export import SMALL as EXPORT

    from glint.export import export_engine

    fixture = sorted((STORIES.parents[1] / "fixtures" / "hf").glob("llama*"))[0]
    cases = json.loads((fixture / "reference.json").read_text())["cases"]
    vocab = json.loads((fixture / "config.json").read_text())["vocab_size"]
    rows = EXPORT["max_seqs"] * (1 + K)
    export_engine(str(fixture), tmp_path / "art", dtype="float32", show_progress=False, max_sample_rows=rows, **EXPORT)
    engine = Engine.from_pretrained(str(tmp_path / "art"), draft="oracle", num_speculative_tokens=K)
    assert engine.graphdef is None and engine.config.max_sample_rows == rows
    n = len(cases[0]["greedy"])
    proposals = [perturbed(c["greedy"], vocab, every=3, salt=i) for i, c in enumerate(cases)]
    for c, p in zip(cases, proposals):
        engine.drafter.record(c["prompt"], p)
    outs = engine.generate([c["prompt"] for c in cases], greedy(n))
    for case, out, prop in zip(cases, outs, proposals):
        if case["greedy_min_gap"] >= 1e-3:
            assert out.token_ids == case["greedy"]
            assert out.acceptance_lengths == expected_acceptance(case["greedy"], prop, K)
    with pytest.raises(ValueError, match="a DFlash draft needs a live engine"):
        Engine.from_pretrained(str(tmp_path / "art"), draft=str(DFLASH / "draft"))
