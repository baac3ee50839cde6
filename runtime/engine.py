"""The engine: schedule -> run -> postprocess, over bucketed jitted steps and the paged KV state."""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import pathlib
import time
from collections.abc import Sequence

import jax
import numpy as np
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from glint.kvcache import BatchControl, CacheConfig, KVState, default_num_pages, prefix
from glint.runtime import compile_cache, interrupts, spec
from glint.runtime.config import EngineConfig
from glint.runtime.launcher import Launcher
from glint.runtime.params import SamplingParams
from glint.runtime.programs import (RUNTIME_PROGRAMS, DeviceMeta, ProgramSet, Runner, draft_name, forward_name,
                                    num_segments, penalize_name, penalize_names)
from glint.runtime.request import Completion, Request, RequestOutput, Status
from glint.runtime.sampling import BIAS_WIDTH, PenaltyInputs, SamplerInputs, logit_entries, uses_filters
from glint.runtime.scheduler import Entry, Scheduler

DEFAULT_MAX_CAPACITY = 32768


def resolved_capacity(model, config: EngineConfig) -> int:
    """Positions a sequence may hold: the config's, else the model's context capped at DEFAULT_MAX_CAPACITY."""
    return config.capacity or min(model.max_position_embeddings, DEFAULT_MAX_CAPACITY)


def cache_config_for(model, config: EngineConfig, draft=None) -> CacheConfig:
    """The KV cache geometry for a model under an engine config (pool size from free memory by default); a
    DFlash `draft`'s layers follow the model's (full attention, sharing its sequences' page tables)."""
    if config.capacity and config.capacity > model.max_position_embeddings and not config.allow_long_context:
        raise ValueError(f"capacity {config.capacity} exceeds the model's context (max_position_embeddings "
                         f"{model.max_position_embeddings}); pass allow_long_context=True (--allow-long-context) "
                         "to serve beyond it anyway")
    capacity = resolved_capacity(model, config)
    chunk = config.for_model(model.layer_windows, capacity).max_prefill_chunk
    # Over N devices the pools hold max(kv heads, N) heads (model/tp.py replicates KV heads N exceeds), 1/N per
    # device: the free memory of one device sizes its share.
    n = config.tensor_parallel
    kv = max(model.num_kv_heads, n)
    layers = [(w, kv, model.head_dim) for w in model.layer_windows]
    if draft is not None:
        layers += [(0, draft.num_kv_heads, draft.head_dim)] * draft.num_layers
    windows, kv_heads, head_dim = (tuple(column) for column in zip(*layers))
    fields = dict(page_size=config.page_size, max_seqs=config.max_seqs, max_write=config.buckets[-1],
                  max_seq_write=chunk, capacity=capacity, windows=windows, head_dim=head_dim,
                  dtype=config.kv_dtype(model.dtype))
    num_pages = config.num_pages or default_num_pages(
        CacheConfig(num_pages=2, kv_heads=tuple(h // n for h in kv_heads), **fields), config.memory_fraction)
    return CacheConfig(num_pages=num_pages, kv_heads=kv_heads, **fields)


@dataclasses.dataclass
class EngineStats:
    steps_per_bucket: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    fed_tokens: int = 0  # tokens run through the model (prefill, recompute and decode)
    generated_tokens: int = 0
    preemptions: int = 0
    page_copies: int = 0  # copy-on-write page copies (n > 1 clones writing into a shared page)
    host_seconds: float = 0.0  # host busy: scheduling, metadata, dispatch, postprocessing
    # of it, by phase: "schedule" (the scheduler and page bookkeeping), "dispatch" (packing and launching the
    # step's programs), "postprocess" (committing, accepting and delivering a step's tokens)
    host_phase_seconds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    # the forward's call until it returns (XLA enqueueing the step's device work): on the launch thread beside the
    # phases above (EngineConfig.async_launch), else inside "dispatch"
    launch_seconds: float = 0.0
    wait_seconds: float = 0.0  # host blocked on the device's results
    # per step width: the step() calls that read a step of that width, whole (the loop's period: dispatching the
    # next step, waiting for this one, applying its tokens), so seconds / steps is the width's time in the loop
    seconds_per_bucket: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    wait_seconds_per_bucket: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # of it
    spec_steps: int = 0  # speculative blocks verified
    spec_tokens: int = 0  # tokens they committed (accepted drafts + the target's own)
    prefix_lookup_tokens: int = 0  # tokens of admitted requests (prompts, and recomputed ones after preemption)
    prefix_hit_tokens: int = 0  # of them, mapped from the prefix cache instead of computed
    prefix_cached_pages: int = 0  # pages in the prefix cache now (all layer groups)
    prefix_evictions: int = 0  # cached pages reused for new data

    @property
    def prefix_hit_rate(self) -> float:
        """Share of admitted tokens the prefix cache held; 0 before the first admission."""
        return self.prefix_hit_tokens / self.prefix_lookup_tokens if self.prefix_lookup_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per speculative block (accepted draft tokens + 1); 0 before the first."""
        return self.spec_tokens / self.spec_steps if self.spec_steps else 0.0


@dataclasses.dataclass(slots=True)
class Sampled:
    """A request that samples in a dispatched step: rows `row ..` of its output, placeholder at `index`."""

    req: Request
    row: int
    index: int
    num_children: int
    num_cached: int  # the request's cached positions when it sampled (the prompt, for n > 1 clones)
    is_applied: bool = False  # its tokens were recorded (a resumed postprocess skips it)
    num_spawned: int = 0  # n > 1 children already spawned from it (a resumed postprocess spawns the rest)
    block: int = 0  # a speculative block of this many rows (0: one token drawn)


@dataclasses.dataclass
class InFlight:
    width: int
    sampled: list[Sampled]
    # (next tokens, logprobs or None, the device drafter's tokens or None, for proposals DRAFTED_ON_DEVICE), once
    # the step's programs are launched
    launched: concurrent.futures.Future
    proposed: np.ndarray | None = None  # a speculative step: the draft token each row verifies (-1: none)


class EngineFailed(RuntimeError):
    """A step failed on the device (or in its launch), after the host had committed it and the steps after it:
    the KV state the engine holds is not known, so it takes no more steps. Build a new engine."""


def _failed_step(error: BaseException, width: int | None = None) -> EngineFailed:
    step = "a step" if width is None else f"a step of width {width}"
    return EngineFailed(f"{step} failed on the device ({type(error).__name__}: {error}); the engine's KV state is "
                        "lost: build a new engine")


class Engine:
    """Continuous-batching generation over one set of weights.

    Build with `Engine.from_pretrained(path_or_preset, ...)` (a checkpoint, a preset or an exported
    artifact folder) or `Engine.from_export(folder)`; use `generate` for batches, or `add_request` +
    `step` for streaming. `warmup()` compiles every program up front; serving then never compiles.
    """

    def __init__(self, model, graphdef, params, config: EngineConfig | None = None, tokenizer=None,
                 warmup: bool = False, drafter=None):
        """A live engine over a model config, its graph definition and (nested or flat) parameters; `drafter`
        (`glint.runtime.spec`) proposes `config.num_speculative_tokens` tokens per decoding step."""
        from glint.export.checkpoint import flatten
        from glint.runtime.step import live_programs

        config = config or EngineConfig()
        config = config.for_model(model.layer_windows, resolved_capacity(model, config))
        compile_cache.configure(config.compile_cache)
        impl = config.attention
        if impl == "auto":
            impl = "pallas" if jax.default_backend() == "gpu" else "reference"
        draft = drafter.cfg if isinstance(drafter, spec.DFlashDrafter) else None
        cache = cache_config_for(model, config, draft)
        flat = flatten(params)  # programs take {"dotted.name": array}; a flat dict stays as it is
        n = config.tensor_parallel
        if n > 1:  # split over n devices (kept where the loader already placed it so)
            from glint.model import tp
            from glint.runtime.loading import local_like

            tp.check(model, n)
            flat = tp.shard_params(model, n, flat, local_like(model, n))
        if draft is not None:
            from glint.model.dflash import check_fits, flatten_params

            check_fits(draft, model)
            flat |= flatten_params(drafter.params)
        programs = live_programs(model, flat, cache, impl, config.buckets, config.max_seqs, config.max_sample_rows,
                                 draft=draft, tensor_parallel=n)
        self.graphdef = graphdef
        self._start(model, config, cache, impl, programs, flat, tokenizer, drafter)
        if warmup:
            self.warmup()

    def _start(self, model, config: EngineConfig, cache: CacheConfig, attention: str, programs: ProgramSet,
               params: dict, tokenizer, drafter=None) -> None:
        if jax.process_count() > 1 and config.seed is None:  # every process runs this loop and must draw alike
            raise ValueError(f"this engine runs in {jax.process_count()} processes (jax.distributed): give it seed= "
                             "(--seed) so that every process draws the same seeds for requests that give none")
        if (drafter is None) != (config.num_speculative_tokens == 0):
            raise ValueError(f"num_speculative_tokens {config.num_speculative_tokens} needs a drafter (draft=...)"
                             if drafter is None else "a drafter needs num_speculative_tokens >= 1")
        self.model, self.config, self.cache, self.tokenizer = model, config, cache, tokenizer
        self.attention, self.programs, self.params = attention, programs, params
        self.capacity = cache.capacity
        for g in range(cache.num_groups):
            if cache.group_pages_per_seq(g) > cache.num_pages - 1:
                raise ValueError(f"num_pages {cache.num_pages} cannot hold one sequence of capacity "
                                 f"{self.capacity} (needs {cache.group_pages_per_seq(g) + 1} pages)")
        self.control = BatchControl(cache)
        self._evictions_seen = 0
        self.drafter = drafter
        self._drafts_on_device = isinstance(drafter, spec.DFlashDrafter)
        self.scheduler = Scheduler(config, self.control, propose=None if drafter is None else self._propose)
        self.set_prefix_cache(config.prefix_cache)
        self.runner = Runner(programs, cache, config.max_seqs, config.max_sample_rows)
        # a speculative step is read before the next is dispatched: nothing would overlap its launch
        self._launcher = Launcher(config.async_launch and drafter is None)
        self._failed: EngineFailed | None = None
        self._kv = self.runner.kv_init()  # the launch thread's while steps are launching: read through `kv`
        self._requests: dict[int, Request] = {}
        self._children: dict[int, list[Request]] = {}
        self._next_rid = 0
        self._inflight: InFlight | None = None  # dispatched, its tokens not yet read
        self._unread: InFlight | None = None  # the step before it, while it is being read
        self._undelivered: dict[int, list[int]] = {}  # tokens recorded but not yet returned by step()
        self._rng = np.random.default_rng(config.seed)
        self.stats = EngineStats()

    @classmethod
    def from_pretrained(cls, path: str, dtype: str | None = None, warmup: bool = False, weights_seed: int = 0,
                        draft: str | None = None, quantize: str | None = None, quantize_head: bool = False,
                        quant_group: int | None = None, **engine_config) -> Engine:
        """An engine for an HF folder, an orbax folder, an exported artifact or a preset name (random weights).

        `dtype` defaults to the checkpoint's own (`torch_dtype` in config.json; bfloat16 for presets; an
        artifact keeps the dtype it was exported with). `weights_seed` seeds a preset's random weights.
        `draft` turns on speculative decoding: a DFlash draft folder (z-lab layout; block_size - 1 draft
        tokens per step), "ngram" (prompt lookup) or "oracle" (replays continuations given to
        `engine.drafter.record`), `num_speculative_tokens` draft tokens per step (default
        spec.DEFAULT_SPECULATIVE_TOKENS). `quantize` ("int8", "int4", "fp8"; model/quant.py) quantizes an HF
        folder's or a preset's linears as they load (`quant_group`: int4's input rows per scale, default 128),
        `quantize_head` its LM head as int8 (a converted checkpoint keeps its own format). Keyword
        arguments are EngineConfig fields (max_seqs, page_size,
        max_step_tokens, seed, ...).
        """
        from glint.runtime.artifact import is_artifact

        if is_artifact(path):
            if quantize is not None or quantize_head or quant_group is not None:
                raise ValueError(f"{path} is an exported artifact: it serves the weight format it was exported "
                                 f"with; quantize={quantize!r} applies when converting or exporting")
            return cls.from_export(path, dtype=dtype, warmup=warmup, draft=draft, **engine_config)
        from glint.runtime.loading import load_model

        is_dflash = draft is not None and pathlib.Path(draft).is_dir()
        if is_dflash:
            from glint.model import dflash

            block = dflash.DraftConfig.from_hf(draft).block_size
            k = engine_config.setdefault("num_speculative_tokens", block - 1)
            if k != block - 1:
                raise ValueError(f"num_speculative_tokens {k}: a DFlash draft of block_size {block} drafts "
                                 f"{block - 1} tokens per step")
        elif draft is not None:
            drafter = spec.host_drafter(draft, engine_config.get("num_speculative_tokens"))
            engine_config["num_speculative_tokens"] = drafter.num_speculative_tokens
        else:
            drafter = None
        config = EngineConfig(**engine_config)
        compile_cache.configure(config.compile_cache)  # before loading: random weights compile too
        cfg, graphdef, params, tokenizer = load_model(path, dtype=dtype, seed=weights_seed, quantize=quantize,
                                                      quantize_head=quantize_head, quant_group=quant_group,
                                                      tensor_parallel=config.tensor_parallel)
        if is_dflash:
            drafter = spec.DFlashDrafter(*dflash.load_draft(draft, cfg, dtype=cfg.dtype))
        return cls(cfg, graphdef, params, config, tokenizer=tokenizer, warmup=warmup, drafter=drafter)

    @classmethod
    def from_export(cls, folder: str, dtype: str | None = None, warmup: bool = False, compiled: bool = True,
                    draft: str | None = None, **engine_config) -> Engine:
        """An engine over the programs and weights of a `glint export` folder (no model code imported).

        Keyword arguments are EngineConfig fields; geometry fields must equal the exported ones.
        `compiled=False` ignores stored executables and compiles the StableHLO (cached as usual). `draft`:
        "ngram" or "oracle" (host drafters need no program of their own; blocks use the exported
        max_sample_rows, so export with room for them); a DFlash draft needs a live engine.
        """
        from glint.runtime.artifact import load_artifact

        drafter = None
        if draft is not None:
            if draft not in spec.DRAFT_KINDS:
                raise ValueError(f"draft={draft!r}: an exported artifact speculates with a host drafter "
                                 f"{spec.DRAFT_KINDS}; a DFlash draft needs a live engine (a checkpoint or a preset)")
            drafter = spec.host_drafter(draft, engine_config.get("num_speculative_tokens"))
            engine_config["num_speculative_tokens"] = drafter.num_speculative_tokens
        compile_cache.configure(engine_config.get("compile_cache", True))
        engine = cls.__new__(cls)
        art = load_artifact(folder, dtype=dtype, compiled=compiled, **engine_config)
        engine.graphdef = None
        engine._start(art.model, art.config, art.cache, art.attention, art.programs, art.params, art.tokenizer,
                      drafter)
        engine.load_seconds = art.seconds
        if warmup:
            engine.warmup()
        return engine

    def set_prefix_cache(self, enabled: bool) -> None:
        """Turn prefix caching on or off for requests added from now on (what is cached stays, evictable)."""
        # Keys chain from what else the K/V depend on; a DFlash draft's layers are pools of the same cache.
        cache = self.cache
        self._salt = prefix.salt(self.model, cache.windows, cache.kv_heads, cache.head_dim, cache.dtype,
                                 getattr(self.drafter, "cfg", None)) if enabled else None
        for req in self.scheduler.running if enabled else ():  # pages they filled while it was off, keys known
            self.control.cache_pages(req.seq, req.page_keys)

    def wait_launched(self) -> None:
        """Wait until every dispatched step's programs have been launched: the runner and the KV state are then
        the caller's to use (between steps; not from inside a launched program). Raises `EngineFailed` once a
        launched step has failed, read by `step()` or not."""
        self._launcher.drain()
        if self._failed is None and self._launcher.error is not None:
            self._failed = _failed_step(self._launcher.error)
        if self._failed is not None:
            raise self._failed

    @property
    def async_launch(self) -> bool:
        """Whether steps launch from the launch thread (`EngineConfig.async_launch`; speculative engines launch
        in `step()`, which reads each step before dispatching the next)."""
        return self._launcher.threaded

    @property
    def kv(self) -> KVState:
        """The KV pools (and scales) once every dispatched step's programs have been launched."""
        self.wait_launched()
        return self._kv

    @kv.setter
    def kv(self, kv: KVState) -> None:
        self.wait_launched()
        self._kv = kv

    @property
    def prefix_cache_enabled(self) -> bool:
        """Whether requests added now share prompt pages through the prefix cache (set_prefix_cache)."""
        return self._salt is not None

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
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {list(params.stop)} need a tokenizer, and this checkpoint has none "
                             "(use stop_token_ids)")
        if params.adjusts_logits and self.drafter is not None:
            set_fields = ", ".join(f"{name}={getattr(params, name)}" for name in params.logit_adjustments)
            raise ValueError(f"{set_fields}: penalties, logit_bias, min_tokens and allowed_token_ids are not "
                             "supported with speculative decoding (leave them out)")
        if error := params.vocab_error(self.model.vocab_size):
            raise ValueError(error[1])
        bans = self._stops(params) if params.min_tokens else ()
        entries = logit_entries(params, bans)
        if len(entries) > BIAS_WIDTH:
            raise ValueError(f"logit_bias ({len(params.logit_bias)} tokens), allowed_token_ids "
                             f"({len(params.allowed_token_ids or ())}) and min_tokens' stop tokens ({len(bans)}) name "
                             f"{len(entries)} tokens; at most {BIAS_WIDTH} a request")
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**32))
        req = Request(self._new_rid(), tokens, params, seed, num_children=params.n - 1)
        self._extend_keys(req, len(tokens))
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
        """Whether `step()` has more to do or to return: requests to run, tokens in flight or not yet returned."""
        in_flight = [s for step in (self._unread, self._inflight) if step is not None for s in step.sampled]
        return (self.scheduler.has_work() or bool(self._undelivered)
                or any(s.req.status is not Status.FINISHED for s in in_flight))

    def output(self, rid: int, text: bool = True) -> RequestOutput:
        """Everything request `rid` has generated so far (its n completions), with finish reasons (and their
        text when the checkpoint has a tokenizer and `text`)."""
        outs = []
        for r in self._completions(rid):
            tokens = r.known_tokens
            shown = r.stop_state[2] if r.params.stop else self._decode(tokens, r.params.skip_special_tokens)
            outs.append(Completion(list(tokens), r.finish_reason, shown if text else None,
                                   r.logprobs if r.params.logprobs else None,
                                   list(r.acceptance_lengths) if self.drafter is not None else None))
        return RequestOutput(rid, self._requests[rid].prompt, outs)

    def is_finished(self, rid: int) -> bool:
        """Whether request `rid` and all its n completions are done (then `release` may forget it)."""
        self._request(rid)
        return self._is_done(rid)

    def logprobs_since(self, rid: int, starts: Sequence[int]) -> list[list[dict[int, float]]]:
        """Per completion of `rid`, the logprobs of its tokens from `starts[i]` to what `new_tokens` handed out."""
        completions = self._completions(rid)
        out = []
        for i, start in enumerate(starts):
            r = completions[i] if i < len(completions) else None  # an n > 1 completion not yet begun
            out.append(r.logprobs[start:r.num_read] if r is not None and r.params.logprobs else [])
        return out

    def new_tokens(self, rid: int) -> list[list[int]]:
        """Tokens each completion of request `rid` gained since the last call: a list of n lists, completion i
        at index i (an n > 1 completion not yet begun gets []).

        Each request has its own cursor, so streaming does not depend on who calls `step()`: one loop may
        drive the engine (or `generate()` other prompts) while callers stream their own requests.
        """
        completions = self._completions(rid)
        out = []
        for r in completions:
            known = r.num_known
            out.append(r.generated[r.num_read:known])
            r.num_read = known
        return out + [[] for _ in range(completions[0].params.n - len(completions))]

    def finish_reasons(self, rid: int) -> list[str | None]:
        """Per completion of request `rid` (n of them), why it ended, or None while it runs. An n > 1 request
        that ended before it sampled (aborted) never spawns its siblings: they end for its reason."""
        completions = self._completions(rid)
        reasons = [r.finish_reason for r in completions]
        unspawned = reasons[0] if self._is_done(rid) else None
        return reasons + [unspawned] * (completions[0].params.n - len(completions))

    def _request(self, rid: int) -> Request:
        if rid not in self._children:  # parents only
            raise ValueError(f"unknown request id {rid!r} (never added, a child of an n > 1 request, or released)")
        return self._requests[rid]

    def _completions(self, rid: int) -> list[Request]:
        """Request `rid` and its n > 1 siblings spawned so far, completion i at index i."""
        return [self._request(rid), *self._children[rid]]

    def release(self, rid: int) -> None:
        """Forget a finished request's bookkeeping."""
        if rid in self._requests and not self._is_done(rid):
            raise ValueError(f"request {rid} is not finished; abort it first")
        for child in self._children.pop(rid, []):
            self._requests.pop(child.rid, None)
            self._undelivered.pop(child.rid, None)
        self._requests.pop(rid, None)
        self._undelivered.pop(rid, None)

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (token lists or strings); one SamplingParams for all or one each.

        If it fails (bad input, an exception, Ctrl-C), the requests it added are aborted and released:
        the engine is left as it was, serving whatever else it had.
        """
        if isinstance(prompts, np.ndarray) and prompts.ndim == 2:  # a batch of equal-length prompts, one per row
            prompts = list(prompts)
        if isinstance(prompts, (str, np.ndarray)) or not isinstance(prompts, Sequence):
            raise ValueError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
        if prompts and all(isinstance(p, (int, np.integer)) and not isinstance(p, bool) for p in prompts):
            raise ValueError(f"prompts is a flat list of token ids; generate takes a list of prompts: "
                             f"wrap one prompt as [{list(prompts)[:4]}...]")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if isinstance(params, (dict, str)) or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"params must be a SamplingParams or a list of them, got {type(params).__name__}")
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        rids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                try:
                    rids.append(self.add_request(prompt, p))
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from None
            pending = set(rids)
            with Progress(disable=not progress, transient=True) as bar:
                task = bar.add_task("generating", total=len(rids))
                while pending:
                    self.step()
                    done = {rid for rid in pending if self._is_done(rid)}
                    pending -= done
                    bar.advance(task, len(done))
            outs = [self.output(rid) for rid in rids]
        except BaseException:
            with interrupts.deferred():
                for rid in rids:
                    self.abort(rid)
                    self.release(rid)
            raise
        for rid in rids:
            self.release(rid)
        return outs

    # ---- the step ----

    def step(self) -> dict[int, list[int]]:
        """Dispatch the next step, then finish the previous one; returns the tokens each request gained.

        The host schedules step n+1 while the device runs step n: a token sampled in step n feeds step
        n+1 on the device, and stands on the host as a placeholder until step n's results are read.

        A KeyboardInterrupt or an exception anywhere in a step leaves the engine consistent, and calling
        `step()` again carries on: no token is lost or drawn twice. Only the wait for the device can be
        interrupted; the bookkeeping around it holds Ctrl-C until it is done. Tokens a call could not
        return are returned by the next one.
        """
        if self._failed is not None:
            raise self._failed
        if self._unread is not None:  # a step whose results an interrupted call did not get to read
            self._read(self._unread, since=time.perf_counter())
        t0 = time.perf_counter()
        with interrupts.deferred():
            try:
                t_schedule = time.perf_counter()
                entries = self._schedule()
                t_dispatch = time.perf_counter()
                dispatched = self._dispatch(entries) if entries else None
                phases = self.stats.host_phase_seconds
                phases["schedule"] += t_dispatch - t_schedule
                phases["dispatch"] += time.perf_counter() - t_dispatch
            except BaseException:  # whatever failed before the commit, the declared step is undone
                if self.control.has_pending_step:
                    self.control.abort_step()  # its page-table changes stay logged: the next step sends them
                raise
            if self.drafter is None:
                self._unread, self._inflight = self._inflight, dispatched
            else:  # a block's length depends on what the last one accepted: read each step before the next
                self._unread, self._inflight = dispatched, None
        if self._unread is None and dispatched is None and self.scheduler.has_work():
            raise RuntimeError("no request can be scheduled: the KV pool is too small for the waiting requests")
        self.stats.host_seconds += time.perf_counter() - t0
        if self._unread is not None:
            self._read(self._unread, since=t0)
        with interrupts.deferred() as held:
            new, self._undelivered = self._undelivered, {}
            held.on_interrupt(lambda: self._undeliver(new))
        return new

    def _read(self, step: InFlight, since: float) -> None:
        """Wait for a dispatched step's tokens (interruptible), then apply them (not interruptible); the time
        from `since` (the step() call's start: dispatching the next step included) counts to the step's width."""
        t0 = time.perf_counter()
        next_tokens, lp, proposed = self._fetch(step)
        t1 = time.perf_counter()
        with interrupts.deferred():
            self._postprocess(step, next_tokens, lp, proposed)
            self._unread = None
        t2 = time.perf_counter()
        self.stats.wait_seconds += t1 - t0
        self.stats.wait_seconds_per_bucket[step.width] += t1 - t0
        self.stats.host_seconds += t2 - t1
        self.stats.host_phase_seconds["postprocess"] += t2 - t1
        self.stats.seconds_per_bucket[step.width] += t2 - since

    def _fetch(self, step: InFlight):
        """The step's tokens, logprobs and (speculative) proposals, the device drafter's filled in. A step that
        failed on the device fails the engine (`EngineFailed`): it and the step after it are committed."""
        try:
            next_tokens, lp, drafted = jax.device_get(step.launched.result())
        except Exception as e:
            self._failed = _failed_step(e, step.width)
            raise self._failed from e
        proposed = step.proposed
        if drafted is not None:
            proposed = np.where(proposed == spec.DRAFTED_ON_DEVICE, drafted, proposed)
        return next_tokens, lp, proposed

    def _undeliver(self, new: dict[int, list[int]]) -> None:
        """Put back tokens a call took but could not return (it is raising an interrupt instead)."""
        for rid, tokens in self._undelivered.items():
            new.setdefault(rid, []).extend(tokens)
        self._undelivered = new

    def _schedule(self) -> list[Entry]:
        entries = self.scheduler.schedule()
        stats, control = self.stats, self.control
        while entries and not self.control.declare_step(np.repeat([e.req.seq for e in entries],
                                                                  [e.count for e in entries])):
            if any(e.draft for e in entries):  # pages run out: drop the drafts before preempting anyone
                for e in entries:
                    if e.draft:
                        e.count, e.samples, e.draft = 1, 1, []
                continue
            if self.scheduler.preempt(entries) is None:
                break
            self.stats.preemptions += 1
        if entries and not self.control.has_pending_step:
            raise RuntimeError("a single sequence does not fit in the KV pool")
        for req in self.scheduler.admitted:
            if req.seq is not None:  # not preempted again before it ran
                stats.prefix_lookup_tokens += len(req.prompt) + len(req.generated)
                stats.prefix_hit_tokens += req.num_cached
        stats.prefix_evictions += control.evictions - self._evictions_seen
        self._evictions_seen = control.evictions
        stats.prefix_cached_pages = sum(control.num_cached_pages(g) for g in range(self.cache.num_groups))
        return entries

    def _propose(self, req: Request, room: int) -> list[int]:
        """A decoding request's draft tokens: at most `room`, none past its max_tokens or the capacity; none for
        the first token (a prompt's last chunk draws it, however the prompt was chunked)."""
        if not req.generated:
            return []
        k = min(self.config.num_speculative_tokens, room, self.capacity - req.num_cached - 1)
        if self._drafts_on_device:  # a whole block, drafted in the step (past max_tokens is cut when committed)
            return self.drafter.propose((), 0, k)
        k = min(k, req.params.max_tokens - len(req.generated) - 1)
        return self.drafter.propose(req.prompt + req.generated, len(req.prompt), k, owner=req) if k > 0 else []

    def _dispatch(self, entries: list[Entry]) -> InFlight:
        width = self.config.bucket_for(sum(e.count for e in entries))
        meta = self.control.prepare_step(width=width, num_segments=num_segments(width, self.config.max_seqs))
        tokens, token_src, rows, samples, proposed, draft_rows, penalties = self._pack(entries, width)
        launched = self._run(width, meta, tokens, token_src, rows, samples, draft_rows, penalties)
        self.control.commit_step()
        self.stats.steps_per_bucket[width] += 1
        sampled, row = [], 0
        page_size = self.cache.page_size
        for e in entries:
            # the pages this step fills enter the prefix cache (a step within one page fills none; keys known
            # since the last one went in when they were made, `_record`)
            if self._salt is not None and (e.req.num_cached + e.count) // page_size > e.req.num_cached // page_size:
                self.control.cache_pages(e.req.seq, e.req.page_keys)
            e.req.num_cached += e.count
            self.stats.fed_tokens += e.count
            if e.samples:
                children = 0 if e.draft else e.samples - 1
                sampled.append(Sampled(e.req, row, len(e.req.generated), children, e.req.num_cached,
                                       block=e.count if e.draft else 0))
                e.req.generated.append(-(row + 1))  # placeholder: row `row` of this step's output
                e.req.num_children = 0
                row += e.samples
        return InFlight(width, sampled, launched, proposed)

    def _run(self, width: int, meta, tokens, token_src, rows, samples, draft_rows,
             penalties: PenaltyInputs | None) -> concurrent.futures.Future:
        """Pack the step's host inputs, then launch its programs (`Launcher`): page copies, the page-table
        changes its upload cannot hold, drafting, the forward, penalties (every row drawn again from the penalized
        logits), and top-k/top-p or logprobs when asked (logprobs of the raw logits, as vLLM's). -> a
        future of (tokens, logprobs, the device drafter's tokens or None). Whatever can fail on the host (packing,
        compiling a program) fails here, before the step is committed."""
        runner, rows_out, prev_step = self.runner, self.config.max_sample_rows, self._inflight
        copies = meta.copies if any(len(c) for c in meta.copies) else None
        device_meta, earlier = runner.split_changes(width, DeviceMeta.from_host(meta))
        params, seeds, positions = samples
        sampler = SamplerInputs.from_params(params, positions, rows=rows_out, seeds=seeds)
        params = list({id(p): p for p in params}.values())  # a block's rows share their request's
        filters, logprobs = uses_filters(params), any(p.logprobs for p in params)
        padded_rows = np.zeros(rows_out, np.int32)
        padded_rows[:len(rows)] = rows
        host = runner.pack(width, tokens, token_src, device_meta, padded_rows, sampler)
        # the device drafter's inputs: the step packed with its draft rows (the draft tokens its token_src reads)
        draft_host = None if draft_rows is None else runner.pack(width, tokens, token_src, device_meta, draft_rows,
                                                                 draft_rows=draft_rows)
        used = [forward_name(width)] + ["copy"] * (copies is not None) + ["tables"] * (earlier is not None) + \
            [draft_name(width)] * (draft_host is not None) + \
            ([] if penalties is None else [penalize_name(penalties.history.shape[1])]) + \
            ["sample"] * filters + ["logprobs"] * logprobs
        for name in used:
            self.programs[name]  # compiled here if it is not yet (an error undoes the step)
        stats = self.stats  # the window the step was dispatched in, whenever it launches
        if copies is not None:
            stats.page_copies += sum(len(c) for c in copies)

        def launch():
            # a step reads the tokens its predecessor drew: launched before it, on this thread
            prev = prev_step.launched.result()[0] if prev_step else np.zeros(rows_out, np.int32)
            if copies is not None:
                self._kv = runner.copy(self._kv, copies)
            if earlier is not None:
                runner.update_tables(earlier)
            drafted = None
            if draft_host is not None:
                drafted, self._kv = runner.run_draft(width, self.params, self._kv, draft_host)
                prev = drafted
            t0 = time.perf_counter()
            next_tokens, raw, self._kv = runner.run_forward(width, self.params, self._kv, host, prev)
            stats.launch_seconds += time.perf_counter() - t0
            logits = raw
            if penalties is not None:
                logits, next_tokens = runner.penalize(raw, penalties, prev, sampler)
            if filters:
                next_tokens = runner.sample(logits, sampler)
            return next_tokens, runner.logprobs(raw, next_tokens) if logprobs else None, drafted

        return self._launcher.submit(launch)

    def _pack(self, entries: list[Entry], width: int):
        """Token ids (from the host, or `token_src` rows of the previous step's output), the sampled rows and
        their (params, seed, position) lists, the draft token each row verifies (None: no speculative block), the
        step row whose draft the device drafter puts in each output row (None: no device drafts), and the sampled
        rows' `PenaltyInputs` (None: no request adjusts its logits)."""
        chunks, rows, start = [], [], 0
        # each penalized row's prompt and completion so far (a token still on the device as its placeholder: a row
        # of the previous step's output, which the penalize program reads), and the tokens each row may not draw
        # yet (min_tokens); speculative engines take none of these
        bans = [self._banned(e.req) if e.samples else () for e in entries]
        histories = [] if any(self._adjusts(e.req, ban) for e, ban in zip(entries, bans) if e.samples) else None
        banned = []
        params, seeds, positions = samples = [], [], []
        rows_out = self.config.max_sample_rows
        proposed = np.full(rows_out, -1, np.int32) if any(e.draft for e in entries) else None
        draft_rows = np.zeros(rows_out, np.int32) if self._drafts_on_device and proposed is not None else None
        for e, ban in zip(entries, bans):
            position = len(e.req.prompt) + len(e.req.generated)  # of the token its (first) row draws
            if e.draft:  # the last known token, then the draft; row i draws position + i and verifies draft[i]
                r0, draft = len(rows), list(e.draft)
                if draft_rows is not None:
                    for j, t in enumerate(draft):
                        if t == spec.DRAFTED_ON_DEVICE:  # output row r0 + j drafts block token j + 1 (step row)
                            draft[j], draft_rows[r0 + j] = -(r0 + j) - 1, start + j + 1
                chunks.append(e.req.token_slice(e.req.num_cached, 1) + draft)
                proposed[r0:r0 + len(draft)] = e.draft
                rows.extend(range(start, start + e.count))
                params += [e.req.params] * e.count
                seeds += [e.req.seed] * e.count
                positions.extend(range(position, position + e.count))
                start += e.count
                continue
            chunks.append(e.req.token_slice(e.req.num_cached, e.count))
            start += e.count
            if histories is not None and e.samples:  # a row without penalties passes unchanged: none to upload
                p = e.req.params
                histories += [(e.req.prompt_array, e.req.generated) if p.has_penalties else ((), ())] * e.samples
                banned += [ban] * e.samples
            rows += [start - 1] * e.samples
            params += [e.req.params] * e.samples
            seeds += [e.req.seed] if e.samples == 1 else [self._child_seed(e.req, i) for i in range(e.samples)]
            positions += [position] * e.samples
        ids = np.zeros(width, np.int32)
        ids[:start] = [t for chunk in chunks for t in chunk]
        tokens, token_src = np.maximum(ids, 0), np.where(ids < 0, -ids - 1, -1).astype(np.int32)
        token_src[start:] = -1
        penalties = None if histories is None else PenaltyInputs.from_rows(histories, params, rows_out,
                                                                           self.cache.capacity, banned)
        return tokens, token_src, rows, samples, proposed, draft_rows, penalties

    def _postprocess(self, step: InFlight, next_tokens: np.ndarray, lp, proposed) -> None:
        """Apply a step's tokens (into `_undelivered`); resumable: a request already applied is skipped."""
        new = self._undelivered
        drawn_rows = next_tokens.tolist()  # one conversion, not one per request
        for s in step.sampled:
            if s.is_applied or s.req.status is Status.FINISHED:
                continue  # applied by an earlier, interrupted call; or finished or aborted while this step ran
            if s.block:
                self._commit_block(s, next_tokens, lp, proposed, new)
                s.is_applied = True
                continue
            drawn = drawn_rows[s.row:s.row + 1 + s.num_children]
            k = s.req.params.logprobs
            lps = [self._row_logprobs(lp, s.row + i, k, t) if k else None for i, t in enumerate(drawn)]
            for i, token in enumerate(drawn[1:]):
                if i < s.num_spawned:
                    continue  # spawned by an earlier, interrupted call
                self._spawn_child(s, i + 1, token, lps[i + 1], new)
                s.num_spawned += 1
            s.req.generated[s.index] = drawn[0]
            self._accept(s.req, drawn[:1], s.index + 1, lps[:1], new)
            s.is_applied = True

    def _commit_block(self, s: Sampled, next_tokens, lp, proposed, new: dict[int, list[int]]) -> None:
        """Record what a speculative block committed and rewind the cache over the rejected rest."""
        req, k = s.req, s.req.params.logprobs
        tokens = spec.committed(next_tokens, proposed, s.row, s.block)
        kept = s.num_cached - s.block + len(tokens)  # the block's tokens before the last committed one
        if not self.control.rewind(req.seq, kept):  # first: a failure leaves the step to be read again, whole
            raise RuntimeError(f"sequence {req.seq} cannot rewind to {kept}: a ring layer lost the window (the "
                               "cache geometry must hold window + max_seq_write - 1 rows)")
        req.num_cached = kept
        req.acceptance_lengths.append(len(tokens))
        self.stats.spec_steps += 1
        self.stats.spec_tokens += len(tokens)
        n, reason = self._num_kept(req, tokens, s.index + 1)
        tokens = tokens[:n]  # none past a stop
        req.generated[s.index:] = tokens  # over the placeholder
        lps = [self._row_logprobs(lp, s.row + i, k, t) if k else None for i, t in enumerate(tokens)]
        self._record(req, tokens, s.index + 1, lps, new, reason)

    def _spawn_child(self, s: Sampled, i: int, token: int, lp, new: dict[int, list[int]]) -> None:
        """Completion i of an n > 1 request: a clone of the prompt's pages, with its own first token."""
        parent = s.req
        child = Request(self._new_rid(), parent.prompt, parent.params, self._child_seed(parent, i),
                        generated=parent.generated[:s.index] + [token],
                        page_keys=parent.page_keys[:(len(parent.prompt) + s.index) // self.cache.page_size])
        self._requests[child.rid] = child
        self._children[parent.rid].append(child)
        seq = self.control.seq_clone(parent.seq, s.num_cached) if parent.status is Status.RUNNING else None
        if seq is None:
            self.scheduler.add(child)  # recomputed from scratch when ids or pages free up
        else:
            child.seq, child.num_cached, child.status = seq, s.num_cached, Status.RUNNING
            self.scheduler.running.append(child)
        self._accept(child, [token], s.index + 1, [lp], new)

    def _num_kept(self, req: Request, tokens: list[int], num_generated: int) -> tuple[int, str | None]:
        """How many of `tokens` (the first is the request's `num_generated`-th) the request keeps, up to the first
        the stop rules end it at, and the finish reason then (None: it goes on)."""
        params, n, reason = req.params, len(tokens), None
        stops = self._stops(params)
        for i, token in enumerate(tokens):
            if token in stops and num_generated + i > params.min_tokens:  # (min_tokens bans them before)
                n, reason = i + 1, "stop"
                break
        num_allowed = max(params.max_tokens - num_generated + 1, 1)  # tokens up to max_tokens
        if num_allowed < n or (num_allowed == n and reason is None):
            n, reason = num_allowed, "length"
        if params.stop:
            stream = self._stop_stream(req, num_generated)
            for i, token in enumerate(tokens[:n]):
                if not stream.stopped and num_generated + i > stream.num_tokens:  # not pushed by an earlier call
                    self._push(req, stream, [token])
            stopped_at = stream.num_tokens - num_generated + 1
            if stream.stopped and 0 < stopped_at <= n:
                n, reason = stopped_at, "stop"
        return n, reason

    def _stops(self, params: SamplingParams) -> tuple[int, ...]:
        """The tokens that end a request: its stop_token_ids, and the model's EOS unless ignore_eos."""
        return params.stop_token_ids if params.ignore_eos else (*params.stop_token_ids, *self.model.eos_token_ids)

    def _banned(self, req: Request) -> tuple[int, ...]:
        """The tokens `req` may not draw next: its stop tokens (those in the vocabulary) while its completion is
        shorter than min_tokens (each token in flight counted), none after."""
        if len(req.generated) >= req.params.min_tokens:
            return ()
        return tuple(t for t in self._stops(req.params) if t < self.model.vocab_size)

    @staticmethod
    def _adjusts(req: Request, banned: tuple[int, ...]) -> bool:
        """Whether `req`'s next token is drawn from adjusted logits (the `penalize` program): a penalty, a logit
        bias, allowed tokens, or a ban (min_tokens: `banned`, its `_banned`) it still has."""
        return any(name != "min_tokens" for name in req.params.logit_adjustments) or bool(banned)

    def _stop_stream(self, req: Request, num_generated: int):
        """`req`'s TextStream, given every token before its `num_generated`-th (a clone's from its parent). An
        interrupt inside a push leaves the stream ahead of the tokens `stop_state` counts: it is built again."""
        from glint.runtime.textstream import TextStream

        stream, pushed, _ = req.stop_state
        if stream is None or stream.num_tokens != pushed:
            stream = TextStream.for_params(self.tokenizer, req.params)
            text = stream.push(req.generated[:pushed])
            req.stop_state = (stream, stream.num_tokens, text)
        for token in req.generated[stream.num_tokens:num_generated - 1]:
            self._push(req, stream, [token])
        return stream

    @staticmethod
    def _push(req: Request, stream, tokens: list[int]) -> None:
        piece = stream.push(tokens)
        req.stop_state = (stream, stream.num_tokens, req.stop_state[2] + piece)  # one assignment

    def _accept(self, req: Request, tokens: list[int], num_generated: int, lps: list,
                new: dict[int, list[int]]) -> None:
        """Record sampled tokens (the first is the request's `num_generated`-th; `lps` their logprobs or Nones)
        up to the first the stop rules end the request at (`_num_kept`), and finish it there."""
        n, reason = self._num_kept(req, tokens, num_generated)
        self._record(req, tokens[:n], num_generated, lps[:n], new, reason)

    def _record(self, req: Request, tokens: list[int], num_generated: int, lps: list, new: dict[int, list[int]],
                reason: str | None) -> None:
        """Record tokens the stop rules keep (`_num_kept`), then finish the request for `reason` if any."""
        if req.params.logprobs:
            req.logprobs += lps
        if self._extend_keys(req, len(req.prompt) + num_generated + len(tokens) - 1) and req.status is Status.RUNNING:
            self.control.cache_pages(req.seq, req.page_keys)
        self.stats.generated_tokens += len(tokens)
        new.setdefault(req.rid, []).extend(tokens)
        if reason is not None:
            self._finish(req, reason)

    def _extend_keys(self, req: Request, num_known: int) -> bool:
        """Prefix cache keys for the full pages of `req`'s first `num_known` tokens; whether any were added."""
        size = self.cache.page_size
        start = len(req.page_keys)
        if self._salt is None or (start + 1) * size > num_known:
            return False
        prev = req.page_keys[-1] if start else self._salt
        req.page_keys += prefix.page_keys(req.token_slice(start * size, num_known - start * size), size, prev)
        return True

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.num_children = 0  # an n > 1 request finished before it sampled spawns nothing
        req.generated = [t for t in req.generated if t >= 0]  # drop a token still in flight
        stream, pushed, text = req.stop_state
        if stream is not None:  # the text held back for a stop string that did not come
            rest, stopped = stream.rest()
            req.stop_state = (None, pushed, text + rest)
            if stopped and reason == "length":  # the whole decode shows a stop string the stream did not
                req.finish_reason = "stop"
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
        chosen, top, top_ids = lp
        out = {int(t): float(v) for t, v in zip(top_ids[row][:k], top[row][:k])}
        out[token] = float(chosen[row])
        return out

    def _encode(self, prompt) -> list[int]:
        """Token ids of a prompt: a string (needs a tokenizer), a list or tuple of ints, or a 1-D integer array."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer, and this checkpoint has none (pass token ids)")
            tokens = self.tokenizer.encode(prompt).ids
        elif isinstance(prompt, range):
            tokens = list(prompt)
        elif hasattr(prompt, "__array__") and not isinstance(prompt, (list, tuple)):  # NumPy, jax arrays
            prompt = np.asarray(prompt)
            if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
                raise ValueError(f"a prompt array must hold integer token ids in one dimension, got shape "
                                 f"{prompt.shape} of {prompt.dtype}")
            tokens = prompt.tolist()
        elif isinstance(prompt, (list, tuple)):
            for i, t in enumerate(prompt):
                if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                    raise ValueError(f"token {i} of the prompt is {t!r} ({type(t).__name__}); token ids are ints")
            tokens = [int(t) for t in prompt]
        else:
            raise ValueError(f"a prompt is a list of int token ids, a 1-D integer array or a string; got "
                             f"{type(prompt).__name__}")
        if not tokens:
            raise ValueError("prompt is empty")
        bad = [t for t in tokens if not 0 <= t < self.model.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.model.vocab_size})")
        return tokens

    def _decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(tokens,
                                                                          skip_special_tokens=skip_special_tokens)

    def program_names(self) -> list[str]:
        """Every program this engine may run: decode widths first (a server needs them first), then the rest."""
        drafts = [draft_name(w) for w in self.config.buckets] if self._drafts_on_device else []
        penalize = penalize_names(self.cache.capacity) if self.drafter is None else []  # spec: refused
        return [forward_name(w) for w in self.config.buckets] + list(RUNTIME_PROGRAMS) + penalize + drafts

    def warmup(self, progress: bool = True) -> dict[str, float]:
        """Compile every program (all step widths, top-k/top-p sampling, logprobs, page copies) in parallel
        threads, with the persistent compilation cache when it is on. Returns seconds per program."""
        names = self.program_names()
        columns = (TextColumn("compiling"), BarColumn(), TextColumn("{task.completed}/{task.total} {task.description}"),
                   TimeElapsedColumn())
        with Progress(*columns, disable=not progress, transient=True) as bar:
            task = bar.add_task("", total=len(names))
            return self.programs.compile_all(names, lambda name, _: bar.update(task, advance=1, description=name))
