"""TextStream: whole characters from byte-level tokens, stop strings matched across token boundaries."""
import random

import pytest
from conftest import SHARED
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from glint.runtime.textstream import TextStream

TOKENIZER = Tokenizer.from_file(str(SHARED / "fixtures" / "chat" / "llama" / "tokenizer.json"))
TEXTS = ["héllo wörld ✓ café naïve", "日本語 テキスト 中文 한국어", "emoji 🙂 🚀 and the park", "über größe"]


def pieces(stream: TextStream, ids, rng) -> list[str]:
    out, i = [], 0
    while i < len(ids):  # tokens arrive in uneven batches, as steps deliver them
        k = rng.randint(1, 3)
        out.append(stream.push(ids[i:i + k]))
        i += k
    return out + [stream.finish()]


def test_pieces_are_whole_characters_and_add_up():
    rng = random.Random(0)
    for text in TEXTS:
        ids = TOKENIZER.encode(text, add_special_tokens=False).ids
        got = pieces(TextStream(TOKENIZER), ids, rng)
        assert "".join(got) == TOKENIZER.decode(ids)
        assert all("\ufffd" not in p for p in got)  # no half of a multi-byte character, ever


@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_strings_across_tokens_are_cut_with_what_follows(include_stop):
    """Cut before the stop string, or after it with include_stop (vLLM's include_stop_str_in_output)."""
    rng = random.Random(1)
    for text in TEXTS:
        ids = TOKENIZER.encode(text, add_special_tokens=False).ids
        full = TOKENIZER.decode(ids)
        for start in range(1, len(full) - 2, 3):
            stop = full[start:start + 3]
            stream = TextStream(TOKENIZER, [stop, "zzz-not-there"], include_stop=include_stop)
            got = "".join(pieces(stream, ids, rng))
            assert got == full[:full.find(stop) + len(stop) * include_stop] and stream.stopped, (text, stop)
            # The tokens counted stop at the one that completed the stop string.
            assert TOKENIZER.decode(ids[:stream.num_tokens]).find(stop) >= 0
            assert TOKENIZER.decode(ids[:stream.num_tokens - 1]).find(stop) < 0


def test_text_held_for_a_possible_stop_is_released():
    ids = TOKENIZER.encode("the cat sat", add_special_tokens=False).ids
    stream = TextStream(TOKENIZER, ["sat on the mat"])  # "sat" begins the stop string but it never completes
    text = "".join(stream.push([t]) for t in ids)
    assert not text.endswith("sat") and text + stream.finish() == TOKENIZER.decode(ids) and not stream.stopped


def test_min_tokens_matches_stop_strings_that_end_after_its_tokens():
    """SamplingParams.min_tokens, as vLLM's: a stop string that ends in the text of the first min_tokens tokens does
    not stop the stream; the first one that ends in the text of a later token does (it may begin before), cut as
    before."""
    rng = random.Random(2)
    ids = TOKENIZER.encode("the cat sat on the mat and the cat ran to the cat flap", add_special_tokens=False).ids
    full = TOKENIZER.decode(ids)
    starts = [i for i in range(len(full)) if full.startswith("cat", i)]
    assert len(starts) == 3
    for min_tokens in range(len(ids) + 1):
        stream = TextStream(TOKENIZER, ["cat"], min_tokens=min_tokens)
        got = "".join(pieces(stream, ids, rng))
        # the text of the first min_tokens tokens, as the tokenizer's streaming decoder gives it out (a piece may
        # come a token late: "at" of " c", "at" arrives with the token after it)
        decoder = DecodeStream(skip_special_tokens=True)
        protected = sum(len(decoder.step(TOKENIZER, t) or "") for t in ids[:min_tokens])
        hit = next((i for i in starts if i + len("cat") > protected), None)
        assert got == (full if hit is None else full[:hit]), min_tokens
        assert stream.stopped == (hit is not None) and (hit is None or stream.num_tokens > min_tokens), min_tokens


def test_special_tokens_show_when_asked():
    """skip_special_tokens=False shows the tokenizer's special tokens (here <|user|>, a special token of the
    fixture's tokenizer), as a whole decode with it does; by default they are left out."""
    rng = random.Random(3)
    user = TOKENIZER.token_to_id("<|user|>")
    ids = [user] + TOKENIZER.encode("the cat", add_special_tokens=False).ids
    shown = "".join(pieces(TextStream(TOKENIZER, skip_special_tokens=False), ids, rng))
    assert shown == TOKENIZER.decode(ids, skip_special_tokens=False) and shown.startswith("<|user|>")
    hidden = "".join(pieces(TextStream(TOKENIZER), ids, rng))
    assert hidden == TOKENIZER.decode(ids) and "<|user|>" not in hidden and hidden.endswith("cat")
