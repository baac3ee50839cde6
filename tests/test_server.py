"""`glint serve` as a real process on loopback, driven by the official openai client and httpx: the same tokens and
text as Engine.generate, streaming that adds up, stop strings, concurrency, disconnects, and 4xx for bad input."""
import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx
import jinja2
import openai
import pytest
from conftest import HF_FIXTURES, SHARED, fail_launch

from glint.runtime.engine import Engine
from glint.runtime.params import MAX_STOP, MAX_STOP_CHARS, SamplingParams

CHAT = SHARED / "fixtures" / "chat" / "llama"
KEY = "sk-test-glint"
CONFIG = dict(max_seqs=16, page_size=8, max_step_tokens=64, num_pages=512, capacity=256)
FLAGS = ["--max-seqs", "16", "--page-size", "8", "--max-step-tokens", "64", "--num-pages", "512", "--capacity", "256"]
PROMPTS = ["héllo wörld ✓", "the cat sat on a mat", "日本語 テキスト", "once upon a time"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "glint.runtime.cli", "serve", str(CHAT), "--port", str(port),
                             "--api-key", KEY, "--dtype", "float32", *FLAGS],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 240
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"glint serve did not come up: {proc.stdout.read()[-3000:]}")
        time.sleep(0.5)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(str(CHAT), dtype="float32", **CONFIG)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def generate(engine, prompt, **params):
    return engine.generate([prompt], SamplingParams(**params))[0]


GREEDY = dict(max_tokens=16, temperature=0.0, ignore_eos=True)
SEEDED = dict(max_tokens=16, temperature=0.8, top_k=20, top_p=0.9, seed=7, ignore_eos=True)


def openai_args(params: dict) -> dict:
    extra = {"ignore_eos": params["ignore_eos"],
             **{k: params[k] for k in ("top_k", "min_p", "repetition_penalty") if k in params}}
    extra |= {k: params[k] for k in ("min_tokens", "allowed_token_ids") if k in params}
    openai = {k: params[k] for k in ("presence_penalty", "frequency_penalty") if k in params}
    if "logit_bias" in params:  # OpenAI's keys: token ids as strings
        openai["logit_bias"] = {str(token): bias for token, bias in params["logit_bias"].items()}
    return dict(max_tokens=params["max_tokens"], temperature=params["temperature"], top_p=params.get("top_p", 1.0),
                seed=params.get("seed"), extra_body=extra, **openai)


@pytest.mark.parametrize("params", [GREEDY, SEEDED, dict(SEEDED, top_k=0, top_p=1.0, min_p=0.05),
                                    dict(GREEDY, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
                                    dict(SEEDED, logit_bias={7: 5.0, 8: -100.0}, min_tokens=3),
                                    dict(SEEDED, allowed_token_ids=list(range(40, 80)))],
                         ids=["greedy", "seeded", "min_p", "penalties", "logit-bias", "allowed-tokens"])
def test_completions_equal_engine_generate(client, engine, params):
    for prompt in PROMPTS[:2]:
        want = generate(engine, prompt, **params)
        got = client.completions.create(model="llama", prompt=prompt, **openai_args(params))
        choice = got.choices[0]
        assert choice.model_extra["token_ids"] == want.token_ids and choice.text == want.text
        assert choice.finish_reason == "length" and got.usage.completion_tokens == len(want.token_ids)
        assert set(want.token_ids) <= set(params.get("allowed_token_ids", want.token_ids))
        ids = client.completions.create(model="llama", prompt=engine.tokenizer.encode(prompt).ids,
                                        **openai_args(params))
        assert ids.choices[0].text == want.text  # the prompt as token ids


def test_streamed_pieces_add_up_to_the_text(client, engine):
    for prompt in PROMPTS:  # multi-byte characters that span byte-level tokens
        want = generate(engine, prompt, max_tokens=24, temperature=0.0, ignore_eos=True)
        chunks = list(client.completions.create(model="llama", prompt=prompt, stream=True,
                                                stream_options={"include_usage": True},
                                                **openai_args(dict(GREEDY, max_tokens=24))))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == want.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices
        assert sum(len(c.choices[0].model_extra["token_ids"]) for c in chunks if c.choices) == 24


def test_chat_renders_the_checkpoints_template(client, engine):
    config = json.loads((CHAT / "tokenizer_config.json").read_text())
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a café in the park?"}]
    rendered = jinja2.Template(config["chat_template"]).render(messages=messages, add_generation_prompt=True,
                                                               bos_token=config["bos_token"])
    prompt = engine.tokenizer.encode(rendered, add_special_tokens=False).ids
    want = generate(engine, prompt, max_tokens=20, temperature=0.0, ignore_eos=True)
    args = dict(model="llama", messages=messages, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    got = client.chat.completions.create(**args)
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(prompt)
    streamed = list(client.chat.completions.create(stream=True, **args))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == want.text


def test_stop_strings_cut_the_text_across_tokens(client, engine):
    want = generate(engine, PROMPTS[1], max_tokens=32, temperature=0.0, ignore_eos=True).text
    stop = next(want[i:i + 3] for i in range(4, len(want) - 3) if "\ufffd" not in want[i:i + 3])
    expected = want[:want.find(stop)]
    args = dict(model="llama", prompt=PROMPTS[1], stop=[stop, "never appears"], **openai_args(dict(GREEDY,
                                                                                                  max_tokens=32)))
    got = client.completions.create(**args).choices[0]
    assert got.text == expected and got.finish_reason == "stop"
    # the engine ends it at the token that completed the stop string, as the engine alone does
    alone = generate(engine, PROMPTS[1], max_tokens=32, temperature=0.0, ignore_eos=True, stop=(stop,))
    assert got.model_extra["token_ids"] == alone.token_ids and alone.text == expected
    assert len(alone.token_ids) < 32
    chunks = list(client.completions.create(stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert sum(len(c.choices[0].model_extra["token_ids"]) for c in chunks) == len(alone.token_ids)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_min_tokens_looks_for_stop_strings_past_its_tokens(client, engine):
    """A stop string in the text of the first min_tokens tokens does not end the completion (vLLM's min_tokens:
    one may end it from the token after them); the server's text and tokens are the engine's, whole and
    streamed."""
    plain = generate(engine, PROMPTS[1], max_tokens=32, temperature=0.0, ignore_eos=True)
    # the first tokens whose text shows a character to stop at, and that character
    k, stop = next((k, c) for k in range(1, 32) for c in engine.tokenizer.decode(plain.token_ids[:k])
                   if c.strip() and c != "\ufffd")
    first = engine.tokenizer.decode(plain.token_ids[:k])
    params = dict(GREEDY, max_tokens=32, min_tokens=k + 4)
    alone = generate(engine, PROMPTS[1], stop=(stop,), **params)
    assert len(generate(engine, PROMPTS[1], stop=(stop,), **GREEDY).token_ids) <= k  # without min_tokens: at once
    assert len(alone.token_ids) >= k + 4 and alone.token_ids == plain.token_ids[:len(alone.token_ids)]
    assert alone.text.startswith(first) and (alone.finish_reason == "length" or len(alone.token_ids) > k + 4)
    args = dict(model="llama", prompt=PROMPTS[1], stop=[stop], **openai_args(params))
    got = client.completions.create(**args).choices[0]
    assert got.text == alone.text and got.model_extra["token_ids"] == alone.token_ids
    assert got.finish_reason == alone.finish_reason
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **args)) == alone.text


def test_stop_string_kept_and_special_tokens_shown_when_asked(client, engine):
    """include_stop_str_in_output and skip_special_tokens=false (vLLM's): the server's text is the engine's with
    the same params, whole and streamed; the stop string then ends the text."""
    plain = generate(engine, PROMPTS[1], max_tokens=32, temperature=0.0, ignore_eos=True).text
    stop = next(plain[i:i + 3] for i in range(4, len(plain) - 3) if "\ufffd" not in plain[i:i + 3])
    for extra in ({"include_stop_str_in_output": True}, {"skip_special_tokens": False},
                  {"include_stop_str_in_output": True, "skip_special_tokens": False}):
        want = generate(engine, PROMPTS[1], stop=(stop,), **GREEDY | {"max_tokens": 32}, **extra)
        args = dict(model="llama", prompt=PROMPTS[1], stop=[stop], **openai_args(dict(GREEDY, max_tokens=32)))
        args["extra_body"] |= extra
        got = client.completions.create(**args).choices[0]
        assert got.text == want.text and got.model_extra["token_ids"] == want.token_ids, extra
        assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **args)) == want.text
        kept = extra.get("include_stop_str_in_output", False)
        assert want.text == (plain[:plain.find(stop) + len(stop)] if kept else plain[:plain.find(stop)]), extra


def test_two_hundred_concurrent_streams(server, engine):
    want = {p: generate(engine, p, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids for p in PROMPTS}

    async def one(http, prompt):
        body = dict(model="llama", prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True, stream=True)
        tokens, done = [], False
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    tokens += json.loads(line[6:])["choices"][0]["token_ids"]
        return prompt, tokens, done

    async def main():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, limits=limits,
                                     timeout=300) as http:
            return await asyncio.gather(*(one(http, PROMPTS[i % len(PROMPTS)]) for i in range(200)))

    results = asyncio.run(main())
    assert len(results) == 200 and all(done for _, _, done in results)
    assert all(tokens == want[prompt] for prompt, tokens, _ in results)


def metric(server, name: str) -> float:
    text = httpx.get(server + "/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_clients_that_disconnect_free_their_pages(server, client, engine):
    async def leave(http, i):
        body = dict(model="llama", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=200, temperature=0,
                    ignore_eos=True, stream=True)
        async with http.stream("POST", "/v1/completions", json=body) as response:
            lines = 0
            async for line in response.aiter_lines():
                lines += line.startswith("data: ")
                if lines == 2:
                    return True  # leaving the block closes the connection mid-stream
        return False

    async def main():
        async with httpx.AsyncClient(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=300,
                                     limits=httpx.Limits(max_connections=50, max_keepalive_connections=0)) as http:
            return await asyncio.gather(*(leave(http, i) for i in range(50)))

    assert all(asyncio.run(main()))
    deadline = time.time() + 60
    while metric(server, "glint_kv_pages_in_use") or metric(server, "glint_requests_running"):
        assert time.time() < deadline, "pages still in use after every client left"
        time.sleep(0.2)
    assert metric(server, "glint_aborted_requests_total") >= 50
    want = generate(engine, PROMPTS[0], **GREEDY)
    assert client.completions.create(model="llama", prompt=PROMPTS[0], **openai_args(GREEDY)).choices[0].text == \
        want.text


def test_non_streaming_clients_that_leave_are_aborted(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    before = metric(server, "glint_aborted_requests_total")
    generated = metric(server, "glint_generated_tokens_total")

    async def leave(http, i):
        body = dict(model="llama", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=230, temperature=0, ignore_eos=True)
        try:
            await http.post("/v1/completions", json=body, timeout=0.3)
        except httpx.TimeoutException:
            return True
        return False

    async def main():
        async with httpx.AsyncClient(base_url=server, headers=auth) as http:
            return await asyncio.gather(*(leave(http, i) for i in range(8)))

    left = sum(asyncio.run(main()))
    assert left >= 1, "every request finished before its client left: the test needs longer requests"
    deadline = time.time() + 60
    while metric(server, "glint_kv_pages_in_use") or metric(server, "glint_requests_running"):
        assert time.time() < deadline, "pages still in use after the clients left"
        time.sleep(0.2)
    assert metric(server, "glint_aborted_requests_total") - before >= left
    assert metric(server, "glint_generated_tokens_total") - generated < 8 * 230


def test_a_completion_that_hits_a_stop_string_stops_generating(server, client, engine):
    seeded = dict(max_tokens=40, temperature=1.0, seed=11, ignore_eos=True, n=2)
    first, second = (c.text for c in engine.generate([PROMPTS[3]], SamplingParams(**seeded))[0].outputs)
    stop = next((first[i:i + 3] for i in range(3, len(first) - 3)
                 if "\ufffd" not in first[i:i + 3] and first[i:i + 3] not in second), None)
    if stop is None:
        pytest.skip("no substring of the first completion is absent from the second")
    generated = metric(server, "glint_generated_tokens_total")
    got = client.completions.create(model="llama", prompt=PROMPTS[3], n=2, stop=stop, max_tokens=40, seed=11,
                                    temperature=1.0, extra_body={"ignore_eos": True})
    by_index = {c.index: c for c in got.choices}
    assert by_index[0].text == first[:first.find(stop)] and by_index[0].finish_reason == "stop"
    assert by_index[1].text == second and by_index[1].finish_reason == "length"
    assert metric(server, "glint_generated_tokens_total") - generated < 2 * 40  # the stopped one stopped
    # streamed, its "stop" comes with its last tokens, while its sibling still generates
    chunks = [c.choices[0] for c in client.completions.create(
        model="llama", prompt=PROMPTS[3], n=2, stop=stop, max_tokens=40, seed=11, temperature=1.0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices]
    ended = next(i for i, c in enumerate(chunks) if c.index == 0 and c.finish_reason is not None)
    assert chunks[ended].finish_reason == "stop" and chunks[ended].model_extra["token_ids"]
    assert any(c.index == 1 and c.model_extra["token_ids"] for c in chunks[ended + 1:])
    assert "".join(c.text for c in chunks if c.index == 0) == by_index[0].text


BAD = [  # (body or raw bytes, headers, status, part of the message)
    ({"prompt": "hi"}, {}, 401, "API key"),
    ({"prompt": "hi"}, {"Authorization": "Bearer wrong"}, 401, "API key"),
    (b"x" * (5 * 2**20), None, 413, "exceeds the limit"),
    (b"{not json", None, 400, "not valid JSON"),
    ([1, 2], None, 400, "JSON object"),
    ({"model": "gpt-4", "prompt": "hi"}, None, 404, "does not exist"),
    ({"prompt": "hi", "max_tokens": 10_000}, None, 400, "exceeds the context capacity 256"),
    ({"prompt": "hi", "n": 1000}, None, 400, "exceeds max_sample_rows 16"),
    ({"prompt": "hi", "temperature": -1}, None, 400, "temperature must be >= 0"),
    ({"prompt": "hi", "top_p": 2}, None, 400, "top_p must be in (0, 1]"),
    ({"prompt": "hi", "max_tokens": "ten"}, None, 400, "max_tokens must be an int"),
    ({"prompt": [1, 2, 99999]}, None, 400, "outside the vocabulary"),
    ({"prompt": {"a": 1}}, None, 400, "prompt must be"),
    ({}, None, 400, "prompt is required"),
    ({"prompt": "hi", "echo": True}, None, 400, "echo is not supported"),
    ({"prompt": "hi", "logprobs": 99}, None, 400, "logprobs must be an int"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, None, 400, 'logit_bias keys must be token ids, got ["x"]'),
    ({"prompt": "hi", "logit_bias": {"99999": 1}}, None, 400, "logit_bias token id 99999 is outside the vocabulary"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, None, 400, "logit_bias for token 5 must be in [-100, 100], got 101"),
    ({"prompt": "hi", "logit_bias": [5]}, None, 400, "logit_bias must map token ids to biases"),
    ({"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, None, 400, "min_tokens must be <= max_tokens (4), got 9"),
    ({"prompt": "hi", "allowed_token_ids": [1, 99999]}, None, 400, "allowed_token_ids token id 99999 is outside"),
    ({"prompt": "hi", "allowed_token_ids": []}, None, 400, "allowed_token_ids must be a non-empty list"),
    ({"prompt": "hi", "presence_penalty": 2.5}, None, 400, "presence_penalty must be in [-2, 2], got 2.5"),
    ({"prompt": "hi", "repetition_penalty": 0}, None, 400, "repetition_penalty must be > 0 (1 = off), got 0"),
    ({"prompt": "hi", "best_of": 3}, None, 400, "best_of=3 is not supported"),
    ({"prompt": "hi", "response_format": {"type": "json_object"}}, None, 400, "response_format="),
    ({"prompt": "hi", "prompt_logprobs": 0}, None, 400, "prompt_logprobs=0 is not supported by this server (only leaving"),
    ({"prompt": "hi", "stop": 5}, None, 400, "stop must be a string or a list of strings"),
    ({"prompt": "hi", "min_p": 1.5}, None, 400, "min_p must be in [0, 1], got 1.5"),
    ({"prompt": "hi", "stop": ["x"] * (MAX_STOP + 1)}, None, 400, f"at most {MAX_STOP} strings"),
    ({"prompt": "hi", "stop": ["x" * (MAX_STOP_CHARS + 1)]}, None, 400, f"of at most {MAX_STOP_CHARS} characters"),
]
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": {},
           "min_tokens": 0, "best_of": 1, "response_format": {"type": "text"}, "stop": [""], "min_p": 0}  # "off"


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client, engine):
    want = generate(engine, PROMPTS[2], **GREEDY).text
    auth = {"Authorization": f"Bearer {KEY}"}
    for body, headers, status, message in BAD:
        headers = auth if headers is None else headers
        if isinstance(body, bytes):
            r = httpx.post(server + "/v1/completions", content=body, headers=headers, timeout=60)
        else:
            r = httpx.post(server + "/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == status, (body if not isinstance(body, bytes) else body[:20], r.text)
        error = r.json()["error"]
        assert message in error["message"] and error["type"], (message, error)
        got = client.completions.create(model="llama", prompt=PROMPTS[2], **openai_args(GREEDY))
        assert got.choices[0].text == want
    for body, param in [({"prompt": "hi", "temperature": -1}, "temperature"), ({"prompt": "hi", "stop": 5}, "stop"),
                        ({"prompt": "hi", "stop": ["x"] * (MAX_STOP + 1)}, "stop"),
                        ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
                        ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
                        ({"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
                        ({"prompt": "hi", "allowed_token_ids": [1, 99999]}, "allowed_token_ids"),
                        ({"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids")]:
        assert httpx.post(server + "/v1/completions", json=body, headers=auth).json()["error"]["param"] == param
    r = httpx.post(server + "/v1/chat/completions", json={"messages": "hi"}, headers=auth)
    assert r.status_code == 400 and "messages must be" in r.json()["error"]["message"]
    args = openai_args(GREEDY)
    args |= args.pop("extra_body")
    r = httpx.post(server + "/v1/completions", json={"prompt": PROMPTS[2], **args, **NEUTRAL}, headers=auth, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["llama"]
    before = metric(server, "glint_generated_tokens_total")
    client.completions.create(model="llama", prompt=PROMPTS[0], **openai_args(GREEDY))
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    text = httpx.get(server + "/metrics").text
    for name in ("glint_requests_running", "glint_requests_waiting", "glint_generated_tokens_total",
                 "glint_kv_pages_in_use", "glint_step_seconds_bucket", "glint_preemptions_total",
                 "glint_prefix_cache_lookup_tokens_total", "glint_prefix_cache_evictions_total",
                 "glint_prefix_cache_pages"):
        assert name in text, name
    assert metric(server, "glint_generated_tokens_total") >= before + GREEDY["max_tokens"]
    # the same prompt ids again: all of its full pages but the one holding its last token come from the cache
    ids = list(range(3, 3 + 3 * CONFIG["page_size"] + 1))
    client.completions.create(model="llama", prompt=ids, **openai_args(GREEDY))
    hits = metric(server, "glint_prefix_cache_hit_tokens_total")
    client.completions.create(model="llama", prompt=ids, **openai_args(GREEDY))
    assert metric(server, "glint_prefix_cache_hit_tokens_total") == hits + 3 * CONFIG["page_size"]


def test_a_checkpoint_without_chat_template_or_tokenizer():
    """In process: a checkpoint with neither tokenizer nor chat template serves token ids, refuses chat."""
    from fastapi.testclient import TestClient

    from glint.runtime.server import create_app
    from glint.runtime.worker import EngineWorker

    engine = Engine.from_pretrained(str(HF_FIXTURES / "llama"), dtype="float32", **CONFIG)
    case = json.loads((HF_FIXTURES / "llama" / "reference.json").read_text())["cases"][0]
    worker = EngineWorker(engine).start()
    try:
        http = TestClient(create_app(worker, "llama"))
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "has no chat template" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"prompt": case["prompt"], "max_tokens": 8, "temperature": 0,
                                               "ignore_eos": True})
        assert http.get("/nowhere").json()["error"]["code"] == 404  # OpenAI-style bodies for any route

        step = engine.step

        def broken():  # the engine thread dies: requests in flight and after get a 503, not a hang
            raise KeyboardInterrupt

        engine.step = broken
        dead = http.post("/v1/completions", json={"prompt": case["prompt"], "max_tokens": 4})
        assert dead.status_code in (500, 503) and "engine" in dead.json()["error"]["message"]
        late = http.post("/v1/completions", json={"prompt": case["prompt"], "max_tokens": 4})
        assert late.status_code == 503 and "not running" in late.json()["error"]["message"]
        assert http.get("/health").status_code == 503
        engine.step = step
    finally:
        worker.stop()  # the engine is the test's again
    assert r.status_code == 200, r.text
    tokens = r.json()["choices"][0]["token_ids"]
    assert tokens == generate(engine, case["prompt"], max_tokens=8, temperature=0.0, ignore_eos=True).token_ids
    assert tokens == case["greedy"][:8] or case["greedy_min_gap"] < 1e-3


def test_a_step_that_fails_on_the_device_stops_the_engine_loop():
    """In process: a launched step fails (async launch: after the host committed it), so the engine takes no more
    steps; the request in flight gets an error, /health turns 503 and later requests 503, none hangs."""
    from fastapi.testclient import TestClient

    from glint.runtime.server import create_app
    from glint.runtime.worker import EngineWorker

    engine = Engine.from_pretrained(str(HF_FIXTURES / "llama"), dtype="float32", **CONFIG)
    fail_launch(engine, 3, "an illegal memory access")
    worker = EngineWorker(engine).start()
    try:
        http = TestClient(create_app(worker, "llama"))
        r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8, "ignore_eos": True})
        assert r.status_code in (500, 503) and "illegal memory access" in r.json()["error"]["message"], r.text
        assert "build a new engine" in worker.error
        assert http.get("/health").status_code == 503
        late = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4})
        assert late.status_code == 503 and "not running" in late.json()["error"]["message"]
    finally:
        worker.stop()


def test_load_generator_against_the_server(server, tmp_path):
    from glint.runtime.cli import main

    out = tmp_path / "load.json"
    assert main(["bench", "llama", "--server", server, "--api-key", KEY, "--requests", "24", "--concurrency", "8",
                 "--prompt-len", "20", "--gen-len", "6", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 24 and not result["errors"] and result["output_tokens"] == 24 * 6
    for name in ("ttft_s", "itl_s", "latency_s"):
        p = result[name]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"], (name, p)
    assert result["requests_per_s"] > 0


def test_logprobs_streamed_and_whole_agree_and_match_the_engine(client, engine):
    want = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                        logprobs=3))[0].outputs[0]
    args = dict(model="llama", prompt=PROMPTS[0], logprobs=3, **openai_args(dict(GREEDY, max_tokens=8)))
    whole = client.completions.create(**args).choices[0].logprobs
    assert whole.token_logprobs == pytest.approx([lp[t] for t, lp in zip(want.token_ids, want.logprobs)], abs=1e-5)
    # the top 3 and the sampled token if not among them (fewer where two tokens print alike: keys are text)
    assert all(1 <= len(top) <= 4 for top in whole.top_logprobs)
    assert [max(top.values()) for top in whole.top_logprobs] == pytest.approx([max(lp.values()) for lp in
                                                                               want.logprobs], abs=1e-5)
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **args)]
    assert [v for lp in streamed if lp for v in lp.token_logprobs] == pytest.approx(whole.token_logprobs, abs=1e-6)
    chat = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) in (2, 3) and c.logprob <= 0 for c in content)


def test_a_delivery_wakes_each_event_loop_once_for_all_its_jobs():
    """The engine thread hands a step's updates to each event loop in one thread-safe call, in job order."""
    from glint.runtime.worker import Job, Update, push_all

    async def receive():
        loop, queues = asyncio.get_running_loop(), [asyncio.Queue(), asyncio.Queue()]
        calls = []
        real = loop.call_soon_threadsafe

        def counted(*args):
            calls.append(args)
            return real(*args)

        loop.call_soon_threadsafe = counted
        jobs = [Job([1], SamplingParams(), loop, queues[i % 2], index=i) for i in range(5)]
        push_all([(job, Update(tokens=[[job.index]])) for job in jobs])
        got = [[(await q.get()) for _ in range(n)] for q, n in zip(queues, (3, 2))]
        return len(calls), [[(i, u.tokens) for i, u in g] for g in got]

    wakeups, got = asyncio.run(receive())
    assert wakeups == 1
    assert got == [[(0, [[0]]), (2, [[2]]), (4, [[4]])], [(1, [[1]]), (3, [[3]])]]


def test_updates_a_stream_has_not_taken_yet_are_merged_per_job():
    """A stream behind the engine gets one update a job: its tokens and logprobs in order, its latest finish
    reasons, done if any part was."""
    from glint.runtime.server import merged
    from glint.runtime.worker import Update

    lp = [{t: -0.5 * t} for t in range(7)]
    queued = [(1, Update(tokens=[[1], [2]], logprobs=[[lp[1]], [lp[2]]])),
              (0, Update(tokens=[[5]], logprobs=[[lp[5]]])),
              (1, Update(tokens=[[3], []], logprobs=[[lp[3]], []], finish_reasons=[None, "stop"])),
              (1, Update(tokens=[[4], []], logprobs=[[lp[4]], []], finish_reasons=["length", "stop"], done=True))]
    (first, a), (second, b) = merged(queued)
    assert (first, second) == (1, 0)
    assert a.tokens == [[1, 3, 4], [2]] and a.logprobs == [[lp[1], lp[3], lp[4]], [lp[2]]]
    assert a.finish_reasons == ["length", "stop"] and a.done
    assert b.tokens == [[5]] and b.finish_reasons is None and not b.done
    assert merged(queued[:1])[0][1] is queued[0][1]
    failed = Update(error="the engine failed")
    assert merged([queued[1], (0, failed), queued[1]]) == [(0, failed)]


def test_a_run_takes_every_queued_update_at_once():
    """Run.events drains its queue and yields the merged updates: three steps queued for one job, one event."""
    from glint.runtime.server import Run
    from glint.runtime.worker import Update

    class Connection:  # the client stays
        async def receive(self):
            await asyncio.Event().wait()

    async def events():
        updates = asyncio.Queue()
        for tokens, done in (([[1]], False), ([[2]], False), ([[3]], True)):
            updates.put_nowait((0, Update(tokens=tokens, finish_reasons=["length"] if done else None, done=done)))
        return [(i, u.tokens, u.done) async for i, u in Run(None, [None], updates, []).events(Connection())]

    assert asyncio.run(events()) == [(0, [[1, 2, 3]], True)]


def test_a_speculative_server_names_the_field_it_refuses():
    """Penalties, logit biases and min_tokens are refused by a speculative engine: a 400 whose param names the
    field, and the server keeps serving."""
    from fastapi.testclient import TestClient

    from glint.runtime.server import create_app
    from glint.runtime.worker import EngineWorker

    engine = Engine.from_pretrained(str(CHAT), dtype="float32", draft="ngram", num_speculative_tokens=3, **CONFIG)
    worker = EngineWorker(engine).start()
    try:
        http = TestClient(create_app(worker, "llama"))
        for field, value in [("presence_penalty", 0.5), ("repetition_penalty", 1.1), ("logit_bias", {"5": 1}),
                             ("min_tokens", 2), ("allowed_token_ids", [5, 6])]:
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, field: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
            assert "not supported with speculative decoding" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                                               "presence_penalty": 0, "logit_bias": {}, "min_tokens": 0})
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4
    finally:
        worker.stop()
