"""`glint serve`: the OpenAI HTTP API (completions, chat completions, models) over one engine.

FastAPI + uvicorn. The engine runs on its own thread (`EngineWorker`); each HTTP request becomes a job whose
tokens arrive on an asyncio queue, are turned into text by a `TextStream` per completion (whole characters, cut
before a stop string: the engine ends a completion at one) and sent whole or as server-sent events in OpenAI's
chunk format.
Errors are OpenAI-style bodies: {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from glint.runtime.chat import chat_messages, render_chat
from glint.runtime.metrics import ServerMetrics
from glint.runtime.params import MAX_LOGPROBS, SamplingParams
from glint.runtime.textstream import TextStream
from glint.runtime.worker import EngineWorker, Job, Update

MAX_BODY_BYTES = 4 * 2**20
MAX_PROMPTS = 256  # prompts in one completions request
# Request fields of OpenAI's API (and vLLM's) that glint does not implement, with the values that mean "off":
# any other value is refused with a 400, not silently ignored.
UNSUPPORTED = {
    "best_of": (1,), "suffix": ("",),
    "use_beam_search": (False,), "prompt_logprobs": (), "tools": ([],), "tool_choice": ("none", "auto"),
    "functions": ([],), "function_call": ("none", "auto"), "response_format": ({"type": "text"},),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (), "structured_outputs": (),
    "bad_words": ([],),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
    return JSONResponse(ApiError(status, message, kind, param).body(), status)


class Api:
    """The request handlers; one per server, over one worker."""

    def __init__(self, worker: EngineWorker, model_name: str, chat: dict | None, metrics: ServerMetrics):
        self.worker, self.model_name, self.chat, self.metrics = worker, model_name, chat, metrics
        # What the handlers need of the engine, read once: only the worker thread touches the engine after this.
        engine = worker.engine
        self.tokenizer, self.vocab_size, self.capacity = engine.tokenizer, engine.model.vocab_size, engine.capacity
        self.speculative = engine.drafter is not None

    # ---- parsing ----

    def check_model(self, body: dict) -> None:
        name = body.get("model")
        if name is not None and name != self.model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {self.model_name!r}",
                           kind="not_found_error", param="model")

    def prompt_ids(self, prompt) -> list[list[int]]:
        """One list of token ids per prompt: a string, a list of ids, or a list of either."""
        def one(p) -> list[int]:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
                return self.tokenizer.encode(p).ids
            if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                vocab = self.vocab_size
                bad = [t for t in p if not 0 <= t < vocab]
                if bad:
                    raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")
                return p
            raise ApiError(400, "prompt must be a string, a list of token ids, or a list of those", param="prompt")

        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) > MAX_PROMPTS:
                raise ApiError(400, f"{len(prompt)} prompts in one request; at most {MAX_PROMPTS}", param="prompt")
            return [one(p) for p in prompt]
        return [one(prompt)]

    def sampling(self, body: dict, default_max_tokens: int, logprobs: int) -> SamplingParams:
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ApiError(400, "stop must be a string or a list of strings", param="stop")
        stop = [s for s in stop if s]  # an empty string stops nothing: dropped, not refused
        if body.get("echo"):
            raise ApiError(400, "echo is not supported", param="echo")
        for name, neutral in UNSUPPORTED.items():  # refused rather than ignored: they would change the output
            value = body.get(name)
            if value is not None and value not in neutral and not (name == "best_of" and value == body.get("n", 1)):
                allowed = "".join(f"{json.dumps(v)} or " for v in neutral)
                raise ApiError(400, f"{name}={json.dumps(value)[:80]} is not supported by this server (only "
                                    f"{allowed}leaving it out)", param=name)
        def get(name, default):
            value = body.get(name)
            return default if value is None else value

        logit_bias = get("logit_bias", {})
        if not isinstance(logit_bias, dict):
            raise ApiError(400, f"logit_bias must map token ids to biases, got {json.dumps(logit_bias)[:80]}",
                           param="logit_bias")
        try:  # OpenAI's keys are token ids as strings
            logit_bias = [(int(token), bias) for token, bias in logit_bias.items()]
        except ValueError:
            keys = json.dumps(list(body["logit_bias"]))[:80]
            raise ApiError(400, f"logit_bias keys must be token ids, got {keys}", param="logit_bias") from None

        try:
            params = SamplingParams(
                max_tokens=get("max_tokens", get("max_completion_tokens", default_max_tokens)),
                temperature=get("temperature", 1.0), top_p=get("top_p", 1.0), top_k=get("top_k", 0),
                min_p=get("min_p", 0.0), presence_penalty=get("presence_penalty", 0.0),
                frequency_penalty=get("frequency_penalty", 0.0), repetition_penalty=get("repetition_penalty", 1.0),
                logit_bias=logit_bias, min_tokens=get("min_tokens", 0),
                allowed_token_ids=body.get("allowed_token_ids"),
                n=get("n", 1), seed=body.get("seed"), stop_token_ids=get("stop_token_ids", ()),
                ignore_eos=get("ignore_eos", False), logprobs=logprobs, stop=tuple(stop),
                include_stop_str_in_output=get("include_stop_str_in_output", False),
                skip_special_tokens=get("skip_special_tokens", True))
        except (ValueError, TypeError) as e:  # SamplingParams' messages begin with the field's name
            name = str(e).split(" ", 1)[0].rstrip(":")
            raise ApiError(400, str(e), param=name if name in body else None) from None
        if error := params.vocab_error(self.vocab_size):  # the engine refuses them too; this names the field
            raise ApiError(400, error[1], param=error[0])
        if self.speculative and params.adjusts_logits:  # the engine refuses them too; this names the field
            name = params.logit_adjustments[0]
            raise ApiError(400, f"{name}={json.dumps(body[name])[:80]} is not supported with speculative decoding "
                                "(leave it out)", param=name)
        return params

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer is not None else str(token)

    # ---- running ----

    async def run(self, prompts: list[list[int]], params: SamplingParams) -> Run:
        """Submit every prompt; raise ApiError if the engine refuses one (the others are cancelled)."""
        loop, updates = asyncio.get_running_loop(), asyncio.Queue()
        jobs = [self.worker.submit(Job(p, params, loop, updates, i)) for i, p in enumerate(prompts)]
        early, accepted = [], 0
        while accepted < len(jobs):
            i, update = await updates.get()
            if update.error is not None:
                for job in jobs:
                    self.worker.cancel(job)
                self.metrics.requests.labels("refused").inc()
                raise ApiError(503 if not self.worker.is_alive else 400, update.error,
                               kind="server_error" if not self.worker.is_alive else "invalid_request_error")
            if update.accepted:
                accepted += 1
            else:
                early.append((i, update))  # tokens of a job accepted before the others
        self.metrics.requests.labels("accepted").inc()
        return Run(self.worker, jobs, updates, early)


class Run:
    """The jobs of one HTTP request and their shared queue of (job index, update)."""

    def __init__(self, worker: EngineWorker, jobs: list[Job], updates: asyncio.Queue, early: list):
        self.worker, self.jobs, self.updates, self.early = worker, jobs, updates, early
        self.remaining = len(jobs)
        self._watcher: asyncio.Task | None = None
        self._closed = False

    async def events(self, request: Request) -> AsyncIterator[tuple[int, Update]]:
        """(job index, update) as they come, until every job is done; ClientGone when the client leaves (a
        watcher reads the connection's disconnect). Callers `close()` the run when they stop early."""
        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.updates.put_nowait((None, None))

        self._watcher = asyncio.create_task(watch())
        try:
            while self.remaining:
                queued, self.early = self.early or [await self.updates.get()], []
                while not self.updates.empty():
                    queued.append(self.updates.get_nowait())
                if any(update is None for _, update in queued):
                    raise ClientGone(499, "the client closed the connection")
                for i, update in merged(queued):
                    if update.error is not None:
                        raise ApiError(500, update.error, kind="server_error")
                    self.remaining -= update.done
                    yield i, update
        finally:
            self.close()

    def close(self) -> None:
        """Stop watching and cancel every job still running (the client left, or the engine failed)."""
        if self._closed:
            return
        self._closed = True
        if self._watcher is not None:
            self._watcher.cancel()
        if self.remaining:
            for job in self.jobs:  # finished jobs are released already: cancelling them does nothing
                self.worker.cancel(job, client_gone=True)


def merged(queued: list[tuple[int, Update]]) -> list[tuple[int, Update]]:
    """The updates waiting for one job as one, jobs in the order they first came: a stream that fell behind the
    engine sends one chunk a job for all the steps it missed, not one a step (as vLLM merges a request's outputs
    that its consumer has not taken yet)."""
    out: dict[int, Update] = {}
    for i, update in queued:
        if i not in out or update.error is not None:  # an error is raised: what came before it no longer matters
            out[i] = update
        elif out[i].error is None:  # nor what comes after it
            out[i] = out[i].merge(update)
    return list(out.items())


class ClientGone(ApiError):
    pass


class Choice:
    """One completion's text, tokens and finish reason as it streams."""

    def __init__(self, index: int, stream: TextStream | None):
        self.index, self.stream = index, stream
        self.text, self.token_ids, self.logprobs, self.finish_reason = "", [], [], None
        self.num_sent = 0  # tokens already sent in stream chunks

    def add(self, tokens: list[int], logprobs: list[dict[int, float]], reason: str | None) -> str:
        """The new text (whole characters, cut before a stop string) for these tokens; `reason` is the engine's
        finish reason when the completion has ended (the engine ends it at a stop string's last token)."""
        if self.finish_reason is not None:
            return ""
        self.token_ids += tokens
        self.logprobs += logprobs
        piece = ""
        if self.stream is not None:
            piece = self.stream.push(tokens) + (self.stream.finish() if reason is not None else "")
        if reason is not None:
            self.finish_reason = "length" if reason == "length" else "stop"
        self.text += piece
        return piece

    def unsent(self) -> tuple[list[int], list[dict[int, float]]]:
        tokens, lps = self.token_ids[self.num_sent:], self.logprobs[self.num_sent:]
        self.num_sent = len(self.token_ids)
        return tokens, lps


def make_choices(api: Api, jobs: list[Job]) -> list[list[Choice]]:
    return [[Choice(j * job.params.n + i,
                    TextStream.for_params(api.tokenizer, job.params) if api.tokenizer is not None else None)
             for i in range(job.params.n)] for j, job in enumerate(jobs)]


def apply(choices: list[Choice], update: Update) -> list[tuple[Choice, str]]:
    """Feed one update to a job's choices; (choice, new text) for each that gained tokens or finished."""
    moved = []
    for i, choice in enumerate(choices):
        tokens = update.tokens[i] if i < len(update.tokens) else []
        lps = update.logprobs[i] if i < len(update.logprobs) else []
        reason = update.finish_reasons[i] if update.finish_reasons is not None else None
        was_done = choice.finish_reason is not None
        piece = choice.add(tokens, lps, reason)
        if not was_done and (tokens or choice.finish_reason is not None):
            moved.append((choice, piece))
    return moved


def _top(lp: dict[int, float], token: int, k: int) -> list[tuple[int, float]]:
    """The k most likely alternatives, and the sampled token if it is not among them (as OpenAI reports)."""
    ranked = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
    if k and token not in dict(ranked):
        ranked.append((token, lp[token]))
    return ranked


def completion_logprobs(api: Api, tokens: list[int], lps: list[dict[int, float]], top: int):
    """OpenAI completions-style logprobs (`top` alternatives per token) for these tokens."""
    if not lps:
        return None
    decode = api.token_text
    return {"tokens": [decode(t) for t in tokens], "token_ids": tokens,
            "token_logprobs": [lp.get(t) for t, lp in zip(tokens, lps)],
            "top_logprobs": [_by_text(decode, _top(lp, t, top)) for t, lp in zip(tokens, lps)]}


def _by_text(decode, ranked: list[tuple[int, float]]) -> dict[str, float]:
    """{token text: logprob}; where two tokens print alike, the likelier keeps the key."""
    out: dict[str, float] = {}
    for token, value in ranked:
        out.setdefault(decode(token), value)
    return out


def chat_logprobs(api: Api, tokens: list[int], lps: list[dict[int, float]], top: int):
    if not lps:
        return None
    decode = api.token_text
    return {"content": [{"token": decode(t), "logprob": lp.get(t), "bytes": list(decode(t).encode()),
                         "top_logprobs": [{"token": decode(k), "logprob": v, "bytes": list(decode(k).encode())}
                                          for k, v in _top(lp, t, top)]} for t, lp in zip(tokens, lps)]}


def usage(prompts: list[list[int]], choices: list[list[Choice]]) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for job in choices for c in job)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def read_json(request: Request, max_bytes: int) -> dict:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > max_bytes:
        raise ApiError(413, f"request body of {size} bytes exceeds the limit of {max_bytes} bytes")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise ApiError(413, f"request body exceeds the limit of {max_bytes} bytes")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return data


def create_app(worker: EngineWorker, model_name: str, *, api_key: str | None = None, chat: dict | None = None,
               metrics: ServerMetrics | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app over a started `EngineWorker`."""
    from fastapi import Depends
    from starlette.exceptions import HTTPException

    metrics = metrics or worker.metrics or ServerMetrics()
    api = Api(worker, model_name, chat, metrics)
    app = FastAPI(title="glint", docs_url=None, redoc_url=None, openapi_url=None)

    async def require_key(request: Request) -> None:  # async: a plain def would run on a worker thread
        if api_key is not None and not hmac.compare_digest(request.headers.get("authorization", "").encode(),
                                                           f"Bearer {api_key}".encode()):
            raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                           kind="authentication_error")

    v1 = dict(dependencies=[Depends(require_key)])

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # unknown routes, wrong methods
        return error_response(e.status_code, str(e.detail), kind="not_found_error" if e.status_code == 404
                              else "invalid_request_error")

    @app.get("/health")
    async def health():
        if not worker.is_alive:
            return error_response(503, f"the engine is not running: {worker.error}", kind="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", **v1)
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "glint", "max_model_len": api.capacity,
                                            "vocab_size": api.vocab_size}]}

    @app.post("/v1/completions", **v1)
    async def completions(request: Request):
        body = await read_json(request, max_body_bytes)
        api.check_model(body)
        if "prompt" not in body:
            raise ApiError(400, "prompt is required", param="prompt")
        prompts = api.prompt_ids(body["prompt"])
        logprobs = body.get("logprobs")
        if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool)
                                     or not 0 <= logprobs <= MAX_LOGPROBS):
            raise ApiError(400, f"logprobs must be an int in [0, {MAX_LOGPROBS}], got {logprobs!r}", param="logprobs")
        # logprobs 0 still reports the sampled tokens' own logprobs
        params = api.sampling(body, 16, 0 if logprobs is None else max(1, logprobs))
        return await respond(request, body, prompts, params, chat_format=False, top=logprobs or 0)

    @app.post("/v1/chat/completions", **v1)
    async def chat_completions(request: Request):
        body = await read_json(request, max_body_bytes)
        api.check_model(body)
        if api.chat is None or api.tokenizer is None:
            raise ApiError(400, f"{model_name} has no chat template (chat_template in tokenizer_config.json or "
                           "chat_template.jinja): use /v1/completions", param="messages")
        try:
            text = render_chat(api.chat, chat_messages(body.get("messages")))
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        prompt = api.tokenizer.encode(text, add_special_tokens=False).ids
        top = body.get("top_logprobs") or 0
        if body.get("logprobs") and not (isinstance(top, int) and 0 <= top <= MAX_LOGPROBS):
            raise ApiError(400, f"top_logprobs must be an int in [0, {MAX_LOGPROBS}]", param="top_logprobs")
        logprobs = max(1, top) if body.get("logprobs") else 0
        params = api.sampling(body, max(1, api.capacity - len(prompt)), logprobs)
        return await respond(request, body, [prompt], params, chat_format=True, top=top)

    async def respond(request, body, prompts, params, chat_format: bool, top: int):
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise ApiError(400, "stream_options must be an object", param="stream_options")
        run = await api.run(prompts, params)
        choices = make_choices(api, run.jobs)
        rid = ("chatcmpl-" if chat_format else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        logs = chat_logprobs if chat_format else completion_logprobs

        if not body.get("stream"):
            try:
                async for j, update in run.events(request):
                    apply(choices[j], update)
            except ClientGone:
                return Response(status_code=499)
            finally:
                run.close()
            out = []
            for c in (c for job in choices for c in job):
                entry = {"index": c.index, "finish_reason": c.finish_reason,
                         "logprobs": logs(api, c.token_ids, c.logprobs, top), "token_ids": c.token_ids}
                entry.update({"message": {"role": "assistant", "content": c.text}} if chat_format else {"text": c.text})
                out.append(entry)
            return {"id": rid, "object": "chat.completion" if chat_format else "text_completion", "created": created,
                    "model": model_name, "choices": out, "usage": usage(prompts, choices)}
        kind = "chat.completion.chunk" if chat_format else "text_completion"

        def chunk(entries):
            return {"id": rid, "object": kind, "created": created, "model": model_name, "choices": entries}

        async def stream():
            try:
                if chat_format:
                    yield sse(chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None} for job in choices for c in job]))
                async for j, update in run.events(request):
                    moved = apply(choices[j], update)
                    entries = []
                    for c, piece in moved:
                        tokens, lps = c.unsent()
                        entry = {"index": c.index, "logprobs": logs(api, tokens, lps, top), "token_ids": tokens,
                                 "finish_reason": c.finish_reason}
                        entry.update({"delta": {"content": piece}} if chat_format else {"text": piece})
                        entries.append(entry)
                    if entries:
                        yield sse(chunk(entries))
                if options.get("include_usage"):
                    yield sse(chunk([]) | {"usage": usage(prompts, choices)})
                yield "data: [DONE]\n\n"
            except ClientGone:
                return
            except ApiError as e:
                yield sse(e.body())
            finally:  # also when the server closes this generator because the client left
                run.close()

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


def serve(engine, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          chat: dict | None = None, log_level: str = "warning") -> None:
    """Run the server until interrupted (the engine thread stops with it)."""
    import uvicorn

    metrics = ServerMetrics()
    worker = EngineWorker(engine, metrics).start()
    app = create_app(worker, model_name, api_key=api_key, chat=chat, metrics=metrics)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        worker.stop()
