"""The engine: schedule -> run -> postprocess, over bucketed jitted steps and the paged KV state."""
from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np
from rich.progress import Progress

from glint.kvcache import BatchControl, CacheConfig, KVState, default_num_pages, pad_copies
from glint.model.config import ModelConfig
from glint.runtime.config import EngineConfig
from glint.runtime.loading import load_model
from glint.runtime.params import SamplingParams
from glint.runtime.request import Completion, Request, RequestOutput, Status
from glint.runtime.sampling import SamplerInputs, uses_filters
from glint.runtime.scheduler import Entry, Scheduler
from glint.runtime.step import DeviceMeta, make_copy_fn, make_step_fn, num_logprobs_bucket, pad_rows

DEFAULT_MAX_CAPACITY = 32768


def cache_config_for(model: ModelConfig, config: EngineConfig) -> CacheConfig:
    """The KV cache geometry for a model under an engine config (pool size from free memory by default)."""
    capacity = config.capacity or min(model.max_position_embeddings, DEFAULT_MAX_CAPACITY)
    fields = dict(page_size=config.page_size, max_seqs=config.max_seqs, max_write=config.buckets[-1],
                  capacity=capacity, windows=model.layer_windows, kv_heads=model.num_kv_heads,
                  head_dim=model.head_dim, dtype=model.dtype)
    num_pages = config.num_pages or default_num_pages(CacheConfig(num_pages=2, **fields), config.memory_fraction)
    return CacheConfig(num_pages=num_pages, **fields)


@dataclasses.dataclass
class EngineStats:
    steps_per_bucket: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    fed_tokens: int = 0  # tokens run through the model (prefill, recompute and decode)
    generated_tokens: int = 0
    preemptions: int = 0
    host_seconds: float = 0.0  # host busy: scheduling, metadata, dispatch, postprocessing
    wait_seconds: float = 0.0  # host blocked on the device's results


@dataclasses.dataclass
class Sampled:
    """A request that samples in a dispatched step: rows `row ..` of its output, placeholder at `index`."""

    req: Request
    row: int
    index: int
    num_children: int
    num_cached: int  # the request's cached positions when it sampled (the prompt, for n > 1 clones)


@dataclasses.dataclass
class InFlight:
    sampled: list[Sampled]
    next_tokens: jax.Array
    lp: object


class Engine:
    """Continuous-batching generation over one set of weights.

    Build with `Engine.from_pretrained(path_or_preset, ...)`; use `generate` for batches, or
    `add_request` + `step` for streaming.
    """

    def __init__(self, model: ModelConfig, graphdef, params, config: EngineConfig | None = None,
                 tokenizer=None, warmup: bool = False):
        self.model, self.config, self.tokenizer = model, config or EngineConfig(), tokenizer
        self.params, self.graphdef = params, graphdef
        self.cache = cache_config_for(model, self.config)
        self.capacity = self.cache.capacity
        for g in range(self.cache.num_groups):
            if self.cache.group_pages_per_seq(g) > self.cache.num_pages - 1:
                raise ValueError(f"num_pages {self.cache.num_pages} cannot hold one sequence of capacity "
                                 f"{self.capacity} (needs {self.cache.group_pages_per_seq(g) + 1} pages)")
        impl = self.config.attention
        if impl == "auto":
            impl = "pallas" if jax.default_backend() == "gpu" else "reference"
        self.attention = impl
        self.control = BatchControl(self.cache)
        self.kv = KVState.create(self.cache)
        self.scheduler = Scheduler(self.config, self.control)
        self._step_fn = make_step_fn(graphdef, self.cache, impl)
        self._copy_fn = make_copy_fn(self.cache)
        self._requests: dict[int, Request] = {}
        self._children: dict[int, list[Request]] = {}
        self._next_rid = 0
        self._inflight: InFlight | None = None
        self._rng = np.random.default_rng(self.config.seed)
        self.stats = EngineStats()
        if warmup:
            self.warmup()

    @classmethod
    def from_pretrained(cls, path: str, dtype: str = "bfloat16", warmup: bool = False, seed: int = 0,
                        **engine_config) -> Engine:
        """An engine for an HF folder, an orbax folder or a preset name (random weights).

        Keyword arguments are EngineConfig fields (max_seqs, page_size, max_step_tokens, ...).
        """
        cfg, graphdef, params, tokenizer = load_model(path, dtype=dtype, seed=seed)
        return cls(cfg, graphdef, params, EngineConfig(**engine_config), tokenizer=tokenizer, warmup=warmup)

    # ---- requests ----

    def add_request(self, prompt: Sequence[int] | str, params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. Raises ValueError (and queues nothing) for bad input."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        tokens = self._encode(prompt)
        if params.n > self.config.max_sample_rows:
            raise ValueError(f"n={params.n} exceeds max_sample_rows {self.config.max_sample_rows}")
        if len(tokens) + params.max_tokens > self.capacity:
            raise ValueError(f"prompt of {len(tokens)} tokens + max_tokens {params.max_tokens} exceeds the context "
                             f"capacity {self.capacity}")
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**32))
        req = Request(self._new_rid(), tokens, params, seed, num_children=params.n - 1)
        self._requests[req.rid] = req
        self._children[req.rid] = []
        self.scheduler.add(req)
        return req.rid

    def abort(self, rid: int) -> None:
        """Stop a request (and its n > 1 siblings) now; its pages are freed."""
        if rid not in self._requests:
            raise ValueError(f"unknown request id {rid}")
        for req in [self._requests[rid], *self._children.get(rid, [])]:
            if req.status is not Status.FINISHED:
                self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def output(self, rid: int) -> RequestOutput:
        req = self._requests[rid]
        reqs = [req, *self._children.get(rid, [])]
        outs = []
        for r in reqs:
            tokens = [t for t in r.generated if t >= 0]  # not a token still in flight
            outs.append(Completion(tokens, r.finish_reason, self._decode(tokens),
                                   r.logprobs if r.params.logprobs else None))
        return RequestOutput(rid, req.prompt, outs)

    def release(self, rid: int) -> None:
        """Forget a finished request's bookkeeping."""
        if rid in self._requests and not self._is_done(rid):
            raise ValueError(f"request {rid} is not finished; abort it first")
        for child in self._children.pop(rid, []):
            self._requests.pop(child.rid, None)
        self._requests.pop(rid, None)

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (token lists or strings); one SamplingParams for all or one each."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        rids = []
        try:
            for prompt, p in zip(prompts, params):
                rids.append(self.add_request(prompt, p))
        except ValueError:
            for rid in rids:
                self.abort(rid)
                self.release(rid)
            raise
        pending = set(rids)
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task("generating", total=len(rids))
            while pending:
                self.step()
                done = {rid for rid in pending if self._is_done(rid)}
                pending -= done
                bar.advance(task, len(done))
        outs = [self.output(rid) for rid in rids]
        for rid in rids:
            self.release(rid)
        return outs

    # ---- the step ----

    def step(self) -> dict[int, list[int]]:
        """Dispatch the next step, then finish the previous one; returns the tokens each request gained.

        The host schedules step n+1 while the device runs step n: a token sampled in step n feeds step
        n+1 on the device, and stands on the host as a placeholder until step n's results are read.
        """
        t0 = time.perf_counter()
        entries = self._schedule()
        dispatched = self._dispatch(entries) if entries else None
        previous, self._inflight = self._inflight, dispatched
        if previous is None and dispatched is None and self.scheduler.has_work():
            raise RuntimeError("no request can be scheduled: the KV pool is too small for the waiting requests")
        t1 = time.perf_counter()
        next_tokens, lp = (None, None) if previous is None else jax.device_get((previous.next_tokens, previous.lp))
        t2 = time.perf_counter()
        new = {} if previous is None else self._postprocess(previous, next_tokens, lp)
        self.stats.host_seconds += (t1 - t0) + (time.perf_counter() - t2)
        self.stats.wait_seconds += t2 - t1
        return new

    def _schedule(self) -> list[Entry]:
        entries = self.scheduler.schedule()
        while entries and not self.control.declare_step([e.req.seq for e in entries for _ in range(e.count)]):
            if self.scheduler.preempt(entries) is None:
                break
            self.stats.preemptions += 1
        if entries and not self.control.has_pending_step:
            raise RuntimeError("a single sequence does not fit in the KV pool")
        return entries

    def _dispatch(self, entries: list[Entry]) -> InFlight:
        width = self.config.bucket_for(sum(e.count for e in entries))
        meta = self.control.prepare_step(width=width, num_segments=min(width, self.config.max_seqs))
        tokens, token_src, rows, sample_reqs = self._pack(entries, width)
        prev = self._inflight.next_tokens if self._inflight else np.zeros(self.config.max_sample_rows, np.int32)
        try:
            if any(len(c) for c in meta.copies):
                self.kv = self._copy_fn(self.kv, pad_copies(meta.copies))
            params = [r.params for r, _ in sample_reqs]
            sampler = SamplerInputs.from_params(params, [len(r.prompt) + len(r.generated) for r, _ in sample_reqs],
                                                rows=self.config.max_sample_rows, seeds=[s for _, s in sample_reqs])
            num_lp = num_logprobs_bucket(max((p.logprobs for p in params), default=0))
            next_tokens, lp, self.kv = self._step_fn(
                self.params, self.kv, tokens, token_src, prev, DeviceMeta.from_host(meta),
                pad_rows(rows, self.config.max_sample_rows), sampler, is_filtered=uses_filters(params),
                num_logprobs=num_lp)
        except BaseException:
            self.control.abort_step()
            raise
        self.control.commit_step()
        self.stats.steps_per_bucket[width] += 1
        sampled, row = [], 0
        for e in entries:
            e.req.num_cached += e.count
            self.stats.fed_tokens += e.count
            if e.samples:
                sampled.append(Sampled(e.req, row, len(e.req.generated), e.samples - 1, e.req.num_cached))
                e.req.generated.append(-(row + 1))  # placeholder: row `row` of this step's output
                e.req.num_children = 0
                row += e.samples
        return InFlight(sampled, next_tokens, lp)

    def _pack(self, entries: list[Entry], width: int):
        """Token ids (from the host, or `token_src` rows of the previous step's output), sampled rows."""
        chunks, rows, sample_reqs, start = [], [], [], 0
        for e in entries:
            chunks.append(e.req.token_slice(e.req.num_cached, e.count))
            start += e.count
            for i in range(e.samples):
                rows.append(start - 1)
                sample_reqs.append((e.req, self._child_seed(e.req, i)))
        ids = np.zeros(width, np.int32)
        ids[:start] = [t for chunk in chunks for t in chunk]
        tokens, token_src = np.maximum(ids, 0), np.where(ids < 0, -ids - 1, -1).astype(np.int32)
        token_src[start:] = -1
        return tokens, token_src, rows, sample_reqs

    def _postprocess(self, step: InFlight, next_tokens: np.ndarray, lp) -> dict[int, list[int]]:
        new: dict[int, list[int]] = {}
        for s in step.sampled:
            if s.req.status is Status.FINISHED:
                continue  # finished or aborted while this step ran: its token is dropped
            drawn = next_tokens[s.row:s.row + 1 + s.num_children].tolist()
            k = s.req.params.logprobs
            lps = [self._row_logprobs(lp, s.row + i, k, t) if k else None for i, t in enumerate(drawn)]
            for i, token in enumerate(drawn[1:]):
                self._spawn_child(s, i + 1, token, lps[i + 1], new)
            s.req.generated[s.index] = drawn[0]
            self._accept(s.req, drawn[0], s.index + 1, lps[0], new)
        return new

    def _spawn_child(self, s: Sampled, i: int, token: int, lp, new: dict[int, list[int]]) -> None:
        """Completion i of an n > 1 request: a clone of the prompt's pages, with its own first token."""
        parent = s.req
        child = Request(self._new_rid(), parent.prompt, parent.params, self._child_seed(parent, i),
                        generated=parent.generated[:s.index] + [token])
        self._requests[child.rid] = child
        self._children[parent.rid].append(child)
        seq = self.control.seq_clone(parent.seq, s.num_cached) if parent.status is Status.RUNNING else None
        if seq is None:
            self.scheduler.add(child)  # recomputed from scratch when ids or pages free up
        else:
            child.seq, child.num_cached, child.status = seq, s.num_cached, Status.RUNNING
            self.scheduler.running.append(child)
        self._accept(child, token, s.index + 1, lp, new)

    def _accept(self, req: Request, token: int, num_generated: int, lp, new: dict[int, list[int]]) -> None:
        """Record a sampled token (the request's `num_generated`-th) and apply the stop rules."""
        if lp is not None:
            req.logprobs.append(lp)
        self.stats.generated_tokens += 1
        new.setdefault(req.rid, []).append(token)
        if token in req.params.stop_token_ids or (not req.params.ignore_eos and token in self.model.eos_token_ids):
            self._finish(req, "stop")
        elif num_generated >= req.params.max_tokens:
            self._finish(req, "length")

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.num_children = 0  # an n > 1 request finished before it sampled spawns nothing
        req.generated = [t for t in req.generated if t >= 0]  # drop a token still in flight
        self.scheduler.retire(req)

    # ---- helpers ----

    def _is_done(self, rid: int) -> bool:
        req = self._requests[rid]
        return req.status is Status.FINISHED and req.num_children == 0 and all(
            c.status is Status.FINISHED for c in self._children[rid])

    def _new_rid(self) -> int:
        self._next_rid += 1
        return self._next_rid - 1

    @staticmethod
    def _child_seed(req: Request, i: int) -> int:
        """Completion i of a request samples with its own seed, derived from the request's."""
        if i == 0:
            return req.seed
        return int(np.random.default_rng([req.seed, i]).integers(0, 2**32))

    @staticmethod
    def _row_logprobs(lp, row: int, k: int, token: int) -> dict[int, float]:
        """The `k` most likely tokens and the sampled one (token id -> logprob), as vLLM reports them."""
        out = {int(t): float(v) for t, v in zip(lp.top_ids[row][:k], lp.top[row][:k])}
        out[token] = float(lp.token[row])
        return out

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer, and this checkpoint has none (pass token ids)")
            tokens = self.tokenizer.encode(prompt).ids
        else:
            tokens = [int(t) for t in np.asarray(prompt).reshape(-1)] if len(prompt) else []
        if not tokens:
            raise ValueError("prompt is empty")
        bad = [t for t in tokens if not 0 <= t < self.model.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.model.vocab_size})")
        return tokens

    def _decode(self, tokens: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(tokens)

    def warmup(self, filtered: tuple[bool, ...] = (False, True)) -> dict[int, float]:
        """Compile every step bucket by running it on padding only (writes land in the scratch page).

        `filtered`: which sampler variants to compile (top-k/top-p off, on). Returns seconds per bucket.
        """
        times, rows = {}, self.config.max_sample_rows
        sampler = SamplerInputs.from_params([], [], rows=rows)
        for width in self.config.buckets:
            t0 = time.perf_counter()
            num_segments = min(width, self.config.max_seqs)
            zeros = np.zeros(width, np.int32)
            meta = DeviceMeta(zeros, (zeros,) * self.cache.num_groups, np.zeros((num_segments, 4), np.int32),
                              tuple(np.zeros((num_segments, self.cache.group_pages_per_seq(g)), np.int32)
                                    for g in range(self.cache.num_groups)))
            for is_filtered in filtered:
                out, _, self.kv = self._step_fn(self.params, self.kv, zeros, zeros - 1, np.zeros(rows, np.int32), meta,
                                                np.zeros(rows, np.int32), sampler, is_filtered=is_filtered, num_logprobs=0)
            jax.block_until_ready(out)
            times[width] = time.perf_counter() - t0
        return times
