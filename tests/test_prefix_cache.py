"""Automatic prefix caching end to end on CPU: outputs with the cache on equal outputs with it off (greedy and
seeded, ring layers, preemption, n > 1, speculative rewinds, aborts); the cache's own bookkeeping is checked
by the state machine in test_kvcache_control."""
import numpy as np
import pytest
from conftest import HF_FIXTURES

from glint.model import transformer
from glint.model.presets import preset
from glint.runtime import spec
from glint.runtime.bench import shared_prefix_prompts
from glint.runtime.config import EngineConfig
from glint.runtime.engine import Engine
from glint.runtime.params import SamplingParams

PAGE = 8
BASE = dict(max_seqs=8, page_size=PAGE, max_step_tokens=64, forward_sizes=(1, 4, 16), capacity=128,
            min_prefill_chunk=4)


def shared_prompts(vocab: int, seed: int) -> list[list[int]]:
    return shared_prefix_prompts(vocab, PAGE, seed)


def params_for(prompts, max_tokens):
    """Greedy for the even prompts, seeded top-k/top-p sampling for the odd ones."""
    return [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True) if i % 2 == 0 else
            SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=40, top_p=0.95, seed=100 + i, ignore_eos=True)
            for i in range(len(prompts))]


def run_twice(engine, prompts, params):
    """Two rounds of the same requests: the second finds what the first left in the cache."""
    return [[o.token_ids for o in engine.generate(prompts, params)] for _ in range(2)]


def test_prefix_cache_on_equals_off_with_ring_layers_and_preemption(hf_fixture):
    """Shared prefixes of every shape, greedy and seeded, over every HF fixture (gemma2/3 and mistral have
    sliding-window rings), in a pool so small that requests are preempted and cached pages evicted: the
    tokens of the same engine with the cache off."""
    probe = Engine.from_pretrained(str(hf_fixture), dtype="float32", num_pages=200, **BASE).cache
    num_pages = max(probe.group_pages_per_seq(g) for g in range(probe.num_groups)) + 12
    engine = Engine.from_pretrained(str(hf_fixture), dtype="float32", prefix_cache=False, num_pages=num_pages,
                                    **BASE)
    prompts = shared_prompts(engine.model.vocab_size, seed=0)
    params = params_for(prompts, max_tokens=12)
    want = run_twice(engine, prompts, params)
    off = engine.stats
    assert off.prefix_hit_tokens == 0 and off.prefix_cached_pages == 0 and off.preemptions > 0
    engine.stats = type(off)()
    engine.set_prefix_cache(True)
    assert run_twice(engine, prompts, params) == want
    stats = engine.stats
    assert stats.prefix_hit_tokens >= 4 * PAGE, "the shared prefixes were not found"
    assert stats.preemptions > 0 and stats.prefix_evictions > 0
    assert stats.fed_tokens < off.fed_tokens
    assert all(engine.control.pages_in_use(g) == 0 for g in range(engine.cache.num_groups))


def tiny(draft: str | None = None, **overrides) -> Engine:
    cfg = preset("tiny", dtype="float32")
    graphdef, params = transformer.split(transformer.init_model(cfg, 0))
    drafter = None
    if draft is not None:
        drafter = spec.host_drafter(draft, 3)
        overrides["num_speculative_tokens"] = drafter.num_speculative_tokens
    # room for blocks of 4 rows in every engine, so that all of them run the same programs (compiled once)
    config = EngineConfig(**{**BASE, "num_pages": 160, "max_sample_rows": 4 * BASE["max_seqs"], **overrides})
    return Engine(cfg, graphdef, params, config, drafter=drafter)


def test_prefix_hits_skip_prefill_and_count_in_stats():
    engine = tiny()
    vocab = engine.model.vocab_size
    prompts = shared_prompts(vocab, seed=1)
    params = params_for(prompts, max_tokens=4)
    first = engine.generate(prompts[:1], params[:1])
    fed = engine.stats.fed_tokens
    sent, update = [], engine.runner.update_tables  # page-table entries a step's upload had no room for
    engine.runner.update_tables = lambda changes: (sent.append(sum(len(c) for c in changes)), update(changes))
    again = engine.generate(prompts[:1], params[:1])  # all but the page holding the last token is cached
    assert again[0].token_ids == first[0].token_ids
    n = len(prompts[0])
    # the hit maps (n - 1) // PAGE pages at once: more than the step feeding the rest uploads, so they went ahead
    width = engine.config.bucket_for(n - (n - 1) // PAGE * PAGE)
    assert (n - 1) // PAGE > engine.runner.layout(width).changes and sum(sent) > 0, (n, width, sent)
    assert engine.stats.prefix_hit_tokens == (n - 1) // PAGE * PAGE
    assert engine.stats.fed_tokens - fed == n - (n - 1) // PAGE * PAGE + 3  # the uncached rest, then 3 decodes
    assert engine.stats.prefix_lookup_tokens == 2 * n
    assert engine.stats.prefix_hit_rate == engine.stats.prefix_hit_tokens / (2 * n)
    assert engine.stats.prefix_cached_pages > 0


def test_a_preempted_request_finds_its_own_pages_again():
    """Prompts that share nothing, in a pool too small for all of them to decode: the only hits are the
    preempted requests' own pages (prompt and generated), found again when they are readmitted."""
    rng = np.random.default_rng(3)
    vocab = preset("tiny").vocab_size
    prompts = [rng.integers(0, vocab, 3 * PAGE + 3).tolist() for _ in range(4)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs = {}
    engine = tiny(num_pages=2 * (BASE["capacity"] // PAGE) + 1)  # room for 32 pages; each request ends holding 9
    for cache in (False, True):
        engine.set_prefix_cache(cache)
        engine.stats = type(engine.stats)()
        outs[cache] = [o.token_ids for o in engine.generate(prompts, params)]
        assert engine.stats.preemptions > 0
        assert (engine.stats.prefix_hit_tokens > 0) == cache
    assert outs[True] == outs[False]


def test_turned_on_again_it_caches_the_pages_filled_while_it_was_off():
    """A request keyed while the cache was on fills pages while it is off; turned on again, those pages are
    cached before the request's next step (which fills no page of its own) and a later request finds them (the
    llama fixture: no ring layer, whose overwritten first lap would not be found)."""
    engine = Engine.from_pretrained(str(HF_FIXTURES / "llama"), dtype="float32", num_pages=64,
                                    **BASE | {"max_prefill_chunk": 2 * PAGE})
    assert not any(engine.cache.windows)
    prompt = np.random.default_rng(5).integers(0, engine.model.vocab_size, 6 * PAGE + 4).tolist()
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    rid = engine.add_request(prompt, greedy)
    engine.step()  # the first chunk: 2 pages, cached
    engine.set_prefix_cache(False)
    while engine.output(rid, text=False).token_ids == []:
        engine.step()  # the rest of the prompt: 4 more full pages, none cached
    engine.set_prefix_cache(True)
    while engine.has_unfinished():
        engine.step()
    want = engine.output(rid).token_ids
    engine.release(rid)
    engine.stats = type(engine.stats)()
    assert engine.generate([prompt], greedy)[0].token_ids == want
    assert engine.stats.prefix_hit_tokens == 6 * PAGE


def test_prefix_cache_with_n_samples_aborts_and_speculative_rewinds():
    """n > 1 clones share mapped pages; an abort leaves its pages cached for the next request; an n-gram
    drafter's rejected tokens are rewound inside pages other sequences share: all as with the cache off."""
    vocab = preset("tiny").vocab_size
    rng = np.random.default_rng(2)
    motif = rng.integers(0, vocab, 6).tolist()
    base = (motif * 8)[:3 * PAGE + 5]  # repetitive: the n-gram drafter proposes, and is often wrong
    prompts = [base + rng.integers(0, vocab, 3).tolist() for _ in range(3)] + [base]
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
              SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)] * 2
    outs = {}
    for draft in (None, "ngram"):
        engine = tiny(draft)
        for cache in (False, True):
            engine.set_prefix_cache(cache)
            engine.stats = type(engine.stats)()
            rid = engine.add_request(base + [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
            engine.step()
            engine.step()
            engine.abort(rid)  # its prompt's pages stay cached
            engine.release(rid)
            got = [[c.token_ids for c in o.outputs] for o in engine.generate(prompts, params)]
            outs[cache, draft] = got
            if cache:
                assert engine.stats.prefix_hit_tokens >= len(prompts) * 3 * PAGE
            if draft:
                assert engine.stats.spec_steps > 0 and engine.stats.spec_tokens > engine.stats.spec_steps
            assert all(engine.control.pages_in_use(g) == 0 for g in range(engine.cache.num_groups))
    assert outs[True, None] == outs[False, None]
    assert outs[True, "ngram"] == outs[False, "ngram"] == outs[False, None]


def test_prefix_cache_config_is_checked():
    with pytest.raises(ValueError, match="prefix_cache must be a bool, got 'yes'"):
        EngineConfig(prefix_cache="yes")
