"""The command line and text prompts through an HF tokenizer."""
import json
import shutil

import pytest
from conftest import HF_FIXTURES
from tokenizers import Tokenizer, models, pre_tokenizers

from glint.export.checkpoint import convert
from glint.runtime.cli import build_parser, main
from glint.runtime.engine import Engine
from glint.runtime.params import SamplingParams

LLAMA = HF_FIXTURES / "llama"
VOCAB = json.loads((LLAMA / "config.json").read_text())["vocab_size"]
SMALL = ["--max-seqs", "4", "--page-size", "8", "--max-step-tokens", "64", "--num-pages", "64", "--capacity", "128"]


def reference_case():
    return json.loads((LLAMA / "reference.json").read_text())["cases"][0]


@pytest.mark.parametrize("command", ["convert", "info", "generate", "demo", "bench", "serve", "export"])
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([command, "--help"])
    assert exit_.value.code == 0 and "usage: glint " + command in capsys.readouterr().out


@pytest.mark.parametrize("launch", [[], ["--sync-launch"]], ids=["async-launch", "sync-launch"])
def test_generate_json_matches_reference(launch, capsys):
    from glint.runtime.commands import _engine_config

    case = reference_case()
    argv = ["generate", str(LLAMA), "--prompt-ids", " ".join(map(str, case["prompt"])), "--max-tokens", "12",
            "--temperature", "0", "--ignore-eos", "--json", "--dtype", "float32", *SMALL, *launch]
    assert _engine_config(build_parser().parse_args(argv)).get("async_launch", True) == (not launch)
    code = main(argv)
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["outputs"][0]["token_ids"] == case["greedy"][:12]
    assert out["outputs"][0]["finish_reason"] == "length"


def test_generate_streams_tokens(capsys):
    case = reference_case()
    assert main(["generate", str(LLAMA), "--prompt-ids", " ".join(map(str, case["prompt"])), "--max-tokens", "6",
                 "--temperature", "0", "--ignore-eos", "--dtype", "float32", *SMALL]) == 0
    printed = capsys.readouterr().out.split()
    assert [int(t) for t in printed[:6]] == case["greedy"][:6] and printed[6] == "[length]"


def test_generate_samples_with_the_engines_filters(capsys):
    """--top-k, --top-p, --min-p, the penalties, --logit-bias, --min-tokens and --seed reach the engine: the same
    tokens as Engine.generate with them."""
    case = reference_case()
    filters = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, seed=3, presence_penalty=0.4,
                   frequency_penalty=0.2, repetition_penalty=1.1)
    bias = {case["greedy"][0]: -100.0, case["greedy"][1]: 2.5}
    engine = Engine.from_pretrained(str(LLAMA), dtype="float32", max_seqs=4, page_size=8, max_step_tokens=64,
                                    num_pages=64, capacity=128)
    first = engine.generate([case["prompt"]], SamplingParams(max_tokens=1, ignore_eos=True, logit_bias=bias,
                                                             **filters))[0].token_ids[0]
    filters |= {"stop_token_ids": first, "min_tokens": 4}  # a stop on the first token, held off by min_tokens
    argv = ["generate", str(LLAMA), "--prompt-ids", " ".join(map(str, case["prompt"])), "--max-tokens", "10",
            "--ignore-eos", "--json", "--dtype", "float32", *SMALL,
            *(x for k, v in filters.items() for x in (f"--{k.replace('_', '-')}", str(v))),
            *(x for t, b in bias.items() for x in ("--logit-bias", f"{t}={b}"))]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["outputs"][0]["token_ids"]
    filters["stop_token_ids"] = (first,)
    params = SamplingParams(max_tokens=10, ignore_eos=True, logit_bias=bias, **filters)
    assert got == engine.generate([case["prompt"]], params)[0].token_ids and len(got) > 4 and first not in got[:4]
    params = SamplingParams(max_tokens=10, ignore_eos=True, **filters)
    assert got != engine.generate([case["prompt"]], params)[0].token_ids  # the biases changed it
    assert got != engine.generate([case["prompt"]], SamplingParams(max_tokens=10, ignore_eos=True, seed=3,
                                                                     temperature=0.9))[0].token_ids


def test_bad_cli_input_is_a_clear_error(capsys):
    assert main(["generate", str(LLAMA), "--prompt-ids", f"1 2 {VOCAB}", "--max-tokens", "4", *SMALL]) == 2
    assert f"token id {VOCAB} is outside the vocabulary [0, {VOCAB})" in capsys.readouterr().err
    assert main(["generate", str(LLAMA), "--prompt-ids", "1 2", "--logit-bias", "5:3", *SMALL]) == 2
    assert "--logit-bias '5:3': expected TOKEN_ID=BIAS" in capsys.readouterr().err
    assert main(["generate", str(LLAMA), "--prompt-ids", "1 2", "--logit-bias", f"{VOCAB}=1", *SMALL]) == 2
    assert f"logit_bias token id {VOCAB} is outside the vocabulary [0, {VOCAB})" in capsys.readouterr().err
    assert main(["info", "no-such-model"]) == 2
    assert main(["generate", str(LLAMA), "--prompt-ids", "1", "--memory-fraction", "1.5", *SMALL]) == 2
    assert "memory_fraction must be in (0, 1], got 1.5" in capsys.readouterr().err


def test_text_prompts_through_the_tokenizer(tmp_path):
    """A checkpoint with tokenizer.json takes text and returns text; conversion carries the tokenizer along."""
    hf = tmp_path / "hf"
    shutil.copytree(LLAMA, hf)
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(hf / "tokenizer.json"))
    convert(hf, tmp_path / "orbax", dtype="float32", show_progress=False)
    case = reference_case()
    prompt = " ".join(f"w{t}" for t in case["prompt"])
    for folder in (hf, tmp_path / "orbax"):
        engine = Engine.from_pretrained(str(folder), dtype="float32", max_seqs=4, page_size=8, max_step_tokens=64,
                                        num_pages=64, capacity=128)
        out = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
        assert out.token_ids == case["greedy"][:8]
        assert out.text == " ".join(f"w{t}" for t in case["greedy"][:8])


def test_streamed_text_is_whole_characters(capsys):
    """Tokens are streamed as text through the tokenizer's streaming decoder: the pieces add up to the full
    decode even where one character spans several byte-level tokens."""
    from conftest import SHARED

    chat = SHARED / "fixtures" / "chat" / "llama"
    args = ["generate", str(chat), "--prompt", "héllo wörld ✓", "--max-tokens", "24", "--temperature", "0",
            "--ignore-eos", "--dtype", "float32", *SMALL]
    assert main([*args, "--json"]) == 0
    full = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["outputs"][0]["text"]
    assert main(args) == 0
    streamed = capsys.readouterr().out
    assert streamed == full + "\n[length]\n"


def test_generate_stops_at_a_stop_string(capsys):
    """--stop: the streamed text and the JSON's end before the first stop string, at the token that completed it."""
    from conftest import SHARED, stop_piece

    chat = SHARED / "fixtures" / "chat" / "llama"
    args = ["generate", str(chat), "--prompt", "once upon a time", "--max-tokens", "24", "--temperature", "0",
            "--ignore-eos", "--dtype", "float32", *SMALL]
    assert main([*args, "--json"]) == 0
    full = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["outputs"][0]
    text = full["text"]
    stop = stop_piece(text)
    if stop is None:
        pytest.skip("the generated text has no piece of whole characters to stop at")
    assert main([*args, "--stop", stop, "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["outputs"][0]
    assert got["text"] == text[:text.find(stop)] and got["finish_reason"] == "stop"
    assert got["token_ids"] == full["token_ids"][:len(got["token_ids"])] and len(got["token_ids"]) < 24
    assert main([*args, "--stop", stop]) == 0
    assert capsys.readouterr().out == got["text"] + "\n[stop]\n"
