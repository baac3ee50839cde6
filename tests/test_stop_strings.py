"""Stop strings in the engine (`SamplingParams.stop`): the text ends before the first stop string, the tokens at
the one that completed it; checked against the tokenizer's own decode of the run without stop strings."""
from __future__ import annotations

import pytest
from conftest import HF_FIXTURES, SHARED, stop_piece

from glint.runtime.engine import Engine
from glint.runtime.params import SamplingParams

CHAT = SHARED / "fixtures" / "chat" / "llama"
CONFIG = dict(max_seqs=8, page_size=8, max_step_tokens=32, num_pages=256, capacity=128)
PROMPT = "once upon a time"


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(str(CHAT), dtype="float32", **CONFIG)


def cut(engine, tokens: list[int], stop: str) -> tuple[list[int], str] | None:
    """The tokens up to the first whose text contains `stop`, and the text before it (None: it never does)."""
    for k in range(1, len(tokens) + 1):
        text = engine.tokenizer.decode(tokens[:k])
        if stop in text:
            return tokens[:k], text[:text.find(stop)]
    return None


def stop_in(engine, tokens: list[int]) -> str:
    """A stop string in the decoded text (conftest.stop_piece)."""
    piece = stop_piece(engine.tokenizer.decode(tokens))
    if piece is None:
        pytest.skip("the generated text has no piece of whole characters to stop at")
    return piece


def test_the_text_ends_before_the_stop_string_and_the_tokens_at_the_one_that_completed_it(engine):
    params = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    full = engine.generate([PROMPT], SamplingParams(**params))[0]
    stop = stop_in(engine, full.token_ids)
    tokens, text = cut(engine, full.token_ids, stop)
    got = engine.generate([PROMPT], SamplingParams(**params, stop=("never there", stop)))[0]
    assert (got.token_ids, got.text, got.finish_reason) == (tokens, text, "stop")
    assert len(tokens) < len(full.token_ids)


def test_each_of_n_completions_stops_on_its_own(engine):
    params = dict(max_tokens=30, temperature=1.0, seed=7, n=3, ignore_eos=True)
    runs = engine.generate([PROMPT], SamplingParams(**params))[0].outputs
    stop = stop_in(engine, runs[1].token_ids)
    got = engine.generate([PROMPT], SamplingParams(**params, stop=stop))[0].outputs
    assert len(got) == 3
    for run, out in zip(runs, got):
        want = cut(engine, run.token_ids, stop)
        if want is None:
            assert (out.token_ids, out.finish_reason) == (run.token_ids, "length")
        else:
            assert (out.token_ids, out.text, out.finish_reason) == (*want, "stop")


def test_speculative_steps_stop_where_plain_ones_do():
    """Several tokens a step (n-gram drafts): the stop lands inside a block, at the same token."""
    params = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = Engine.from_pretrained(str(CHAT), dtype="float32", **CONFIG)
    full = plain.generate([PROMPT], SamplingParams(**params))[0]
    stop = stop_in(plain, full.token_ids)
    want = plain.generate([PROMPT], SamplingParams(**params, stop=stop))[0]
    spec = Engine.from_pretrained(str(CHAT), dtype="float32", draft="ngram", num_speculative_tokens=4, **CONFIG)
    got = spec.generate([PROMPT], SamplingParams(**params, stop=stop))[0]
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, "stop")


def test_streamed_text_never_shows_the_stop_string(engine):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    full = engine.generate([PROMPT], params)[0]
    stop = stop_in(engine, full.token_ids)
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=stop))
    shown = []
    while engine.has_unfinished():
        engine.step()
        shown.append(engine.output(rid).text)
    final = engine.output(rid).text
    assert all(final.startswith(s) and stop not in s for s in shown)
    assert final == cut(engine, full.token_ids, stop)[1]


def test_a_postprocess_applied_twice_pushes_its_tokens_once(engine):
    """A step's tokens may be applied again after an interrupt (`_postprocess` is resumable): the stop check
    must not see them twice."""
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=10, stop="zzz"))
    req = engine._requests[rid]
    req.generated = [5, 6, 7]
    first = engine._num_kept(req, [6, 7], 2)
    state = req.stop_state
    assert engine._num_kept(req, [6, 7], 2) == first and req.stop_state == state and state[1] == 3
    engine.abort(rid)


def test_an_interrupt_inside_a_push_loses_no_text(engine):
    """A second Ctrl-C lands after a push has moved the stream on but before its text was kept: the next call
    builds the stream again from the tokens, and the text is whole."""
    tokens = engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=12, stop="never there"))
    req = engine._requests[rid]
    req.generated = list(tokens)
    engine._num_kept(req, tokens[:5], 1)
    stream = req.stop_state[0]
    stream.push(tokens[5:6])  # the push of the 6th token, its text lost to the interrupt
    engine._num_kept(req, tokens[5:], 6)
    assert req.stop_state[1] == len(tokens)
    assert req.stop_state[2] + req.stop_state[0].finish() == engine.tokenizer.decode(tokens)
    engine.abort(rid)


def test_stop_strings_need_a_tokenizer_and_valid_strings():
    bare = Engine.from_pretrained(str(HF_FIXTURES / "llama"), dtype="float32", **CONFIG)
    with pytest.raises(ValueError, match="need a tokenizer"):
        bare.add_request([1, 2, 3], SamplingParams(stop="x"))
    assert not bare.has_unfinished()
    assert SamplingParams(stop="ab").stop == ("ab",)
    for bad in ("", ("a", ""), (1,), ("x",) * 17, "y" * 1001):
        with pytest.raises(ValueError, match="stop"):
            SamplingParams(stop=bad)
