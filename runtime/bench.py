"""`glint bench`: per-bucket step times, decode throughput per batch and context, and an end-to-end run.

Every number is a median over repeats after warm-up. Roofline percentages divide the bytes a step must
move (weights + the KV it reads) by the copy bandwidth this harness measures at start.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.progress import track
from rich.table import Table

from glint.runtime import weights
from glint.runtime.commands import fill_defaults
from glint.runtime.engine import Engine
from glint.runtime.params import SamplingParams
from glint.runtime.sampling import SamplerInputs
from glint.runtime.spec import DEFAULT_SPECULATIVE_TOKENS, DFlashDrafter, host_drafter
from glint.runtime.programs import DeviceMeta, forward_name, num_segments


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_bandwidth(num_bytes: int) -> dict[str, float]:
    """Device memory bandwidth in bytes/s: a plain copy and a scaled copy (bytes read + written), and a
    read-only sum. The roofline uses the best of them."""
    x = jnp.ones(num_bytes // 2, jnp.bfloat16)
    kernels = {"copy": (jax.jit(jnp.copy), 2), "scale": (jax.jit(lambda a: a * 3), 2),
               "sum": (jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), 1)}
    rates = {}
    for name, (fn, passes) in kernels.items():
        jax.block_until_ready(fn(x))
        rates[name] = passes * x.nbytes / _median_time(lambda: fn(x), 10)
    return rates


def measure_matmul(n: int, dtype) -> float:
    """Matmul rate in FLOP/s on random data."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    mm = jax.jit(jnp.dot)
    jax.block_until_ready(mm(a, b))
    return 2 * n**3 / _median_time(lambda: mm(a, b), 10)


@dataclasses.dataclass
class StepTiming:
    width: int
    batch: int
    context: int
    device_ms: float
    host_ms: float
    tokens_per_s: float
    roofline_pct: float
    engine_ms: float | None = None  # decode rows: per step of the engine's own pipelined loop (engine.step())
    engine_host_ms: dict | None = None  # and the loop's host time per step: busy, waiting, busy by phase


class StepBench:
    """Times the engine's jitted step on synthetic batches (KV contents are irrelevant to speed)."""

    def __init__(self, engine: Engine, bandwidth: float):
        self.engine, self.bandwidth = engine, bandwidth
        self.weight_bytes = weights.decode_weight_bytes(engine.params, engine.model.tie_embeddings)

    def kv_bytes(self, batch: int, context: int) -> int:
        cache, total = self.engine.cache, 0
        for layer in range(cache.num_layers):
            window = cache.windows[layer]
            keys = min(context, window) if window else context
            total += 2 * batch * keys * cache.kv_heads[layer] * cache.head_row_bytes(layer)
        return total

    def time_step(self, batch: int, context: int, q_len: int, repeats: int, timer=_median_time) -> StepTiming:
        """`batch` sequences with `context` cached positions each feed `q_len` tokens; `timer(run, repeats)` gives
        the step's seconds (a profiler may wrap the runs)."""
        eng, control = self.engine, self.engine.control
        eng.wait_launched()  # a step still launching owns the runner's tables and the KV state
        seqs = [control.seq_new() for _ in range(batch)]
        if None in seqs:
            raise ValueError(f"batch {batch} exceeds max_seqs {eng.config.max_seqs}")
        try:
            for seq in seqs:  # fill the host bookkeeping as if the context had been prefilled
                done = 0
                while done < context:
                    n = min(context - done, eng.cache.max_seq_write)
                    if not control.declare_step([seq] * n):
                        raise ValueError(f"the KV pool cannot hold batch {batch} x context {context}")
                    control.commit_step()
                    done += n
            # the context's pages to the device's tables now, so the timed step carries only its own changes
            eng.runner.update_tables(control.take_table_changes())
            width = eng.config.bucket_for(batch * q_len)
            t0 = time.perf_counter()
            if not control.declare_step([s for s in seqs for _ in range(q_len)]):
                raise ValueError(f"the KV pool cannot hold batch {batch} x context {context + q_len}")
            meta = control.prepare_step(width=width, num_segments=num_segments(width, eng.config.max_seqs))
            rows = [int(i) * q_len + q_len - 1 for i in range(min(batch, eng.config.max_sample_rows))]
            greedy = [SamplingParams(temperature=0.0)] * len(rows)
            sampler = SamplerInputs.from_params(greedy, [context] * len(rows), rows=eng.config.max_sample_rows)
            zeros = np.zeros(width, np.int32)
            padded_rows = np.zeros(eng.config.max_sample_rows, np.int32)
            padded_rows[:len(rows)] = rows
            args = (zeros, zeros - 1, np.zeros(eng.config.max_sample_rows, np.int32), DeviceMeta.from_host(meta),
                    padded_rows, sampler)
            host = time.perf_counter() - t0

            def run():
                out, _, eng.kv = eng.runner.forward(width, eng.params, eng.kv, *args)
                return out

            jax.block_until_ready(run())
            # the device's tables now hold the step's pages: the timed runs carry no changes (a decode step's few)
            empty = tuple(np.zeros((0, 3), np.int32) for _ in meta.table_changes)
            args = (*args[:3], dataclasses.replace(args[3], table_changes=empty), *args[4:])
            device = timer(run, repeats)
        finally:
            if control.has_pending_step:  # so a failing step raises its own error, not seq_rm's about a pending step
                control.abort_step()
            for seq in seqs:
                control.seq_rm(seq)
        # over N devices (tensor parallel) each reads its 1/N: the roofline is their summed bandwidth
        ideal = (self.weight_bytes + self.kv_bytes(batch, context)) / (self.bandwidth * eng.config.tensor_parallel)
        return StepTiming(width, batch, context, 1e3 * device, 1e3 * host, batch * q_len / device,
                          100 * ideal / device)


@contextlib.contextmanager
def decoding(engine: Engine, batch: int, context: int, steps: int, seed: int = 0, started: int = 2,
             params: SamplingParams | None = None):
    """`batch` requests of `context` random tokens, greedy or drawn with `params` (their max_tokens, ignore_eos
    and seed are the loop's own), all decoding (each has `started` generated tokens or more) and none finishing
    within the next `steps` steps (of one token each: no speculative engine); their ids. Aborted and released
    after.

    A step decodes every running request, so one admitted early has generated more by the time the last prompt
    is in (256 prompts of 576 tokens at 4096 a step: 36 steps apart). With the prefix cache on, each prompt is
    first run for one token: the timed requests then find all but its last page cached (a sliding-window
    model: at most its ring's pages) and start a few steps apart. Without it they start as far apart as the
    prefill's steps. The step must have room for a prompt chunk beside `batch` decode rows (max_step_tokens
    >= batch + min_prefill_chunk), or the last prompts wait until the first requests finish: a clear error."""
    room = engine.capacity - context
    if room < started + steps + 1:  # + 1: the step in flight
        raise ValueError(f"capacity {engine.capacity}: requests of {context} tokens cannot decode {started} + "
                         f"{steps} more steps")
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, engine.model.vocab_size, context).tolist() for _ in range(batch)]
    if engine.prefix_cache_enabled:
        engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    drawn = dataclasses.replace(params or SamplingParams(temperature=0.0), max_tokens=room, ignore_eos=True)
    rids = [engine.add_request(prompt, dataclasses.replace(drawn, seed=i) if not drawn.is_greedy else drawn)
            for i, prompt in enumerate(prompts)]
    try:
        while min(generated := [len(engine.output(rid, text=False).token_ids) for rid in rids]) < started:
            if max(generated) == room:
                raise ValueError(f"a request finished before every one of the {batch} had started (a step of "
                                 f"{engine.config.max_step_tokens} tokens, {batch} requests of {context}): "
                                 f"give the step room for a prompt chunk beside the decode rows")
            engine.step()
        if max(generated) + steps + 1 > room:
            raise ValueError(f"capacity {engine.capacity}: {batch} requests of {context} tokens, the first "
                             f"{max(generated)} tokens ahead of the last, cannot all decode {steps} more steps")
        yield rids
    finally:
        for rid in rids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        for rid in rids:
            engine.release(rid)


def pipelined_decode_ms(engine: Engine, batch: int, context: int, steps: int = 32, seed: int = 0,
                        params: SamplingParams | None = None) -> tuple[float, dict]:
    """Milliseconds per engine.step() while `batch` requests with `context` tokens each decode (greedy, or drawn
    with `params`: `decoding`): the loop users get (step n+1 dispatched before step n is read, host bookkeeping
    included), after prefill and two steps; and the loop's host time per step (`host_ms`)."""
    kept = engine.stats  # the timed steps count on fresh stats; the engine's own come back after
    try:
        with decoding(engine, batch, context, steps, seed, params=params):
            engine.stats = type(kept)()
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            ms = 1e3 * (time.perf_counter() - t0) / steps
            return ms, host_ms(engine, steps)
    finally:
        engine.stats = kept


def host_ms(engine: Engine, steps: int) -> dict:
    """The host's milliseconds per step in the engine's stats: busy, waiting on the device, busy by phase, and
    the forward's launch (on the launch thread, or in the dispatch phase: `async_launch`)."""
    stats = engine.stats
    return dict(busy=1e3 * stats.host_seconds / steps, wait=1e3 * stats.wait_seconds / steps,
                **{k: 1e3 * v / steps for k, v in sorted(stats.host_phase_seconds.items())},
                launch=1e3 * stats.launch_seconds / steps, async_launch=engine.async_launch)


def end_to_end(engine: Engine, num_requests: int, prompt_len: int, gen_len: int, spread: float = 0.0,
               seed: int = 0) -> dict:
    """Greedy generation for `num_requests` random prompts; lengths uniform in [(1 - spread) x, (1 + spread) x]."""
    rng = np.random.default_rng(seed)
    vocab = engine.model.vocab_size

    def length(n: int) -> int:
        return max(1, int(rng.integers(int(n * (1 - spread)), int(n * (1 + spread)) + 1)))

    prompts = [rng.integers(0, vocab, length(prompt_len)).tolist() for _ in range(num_requests)]
    params = [SamplingParams(max_tokens=length(gen_len), temperature=0.0, ignore_eos=True) for _ in prompts]
    # warm up on other prompts of the same lengths: the timed ones must not find their pages in the prefix cache
    warm = [rng.integers(0, vocab, len(p)).tolist() for p in prompts[: min(4, num_requests)]]
    engine.generate(warm, params[: len(warm)])
    engine.stats = type(engine.stats)()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, progress=True)
    wall = time.perf_counter() - t0
    generated = sum(len(o.token_ids) for o in outs)
    s = engine.stats
    steps = sum(s.steps_per_bucket.values())

    def per_step(seconds) -> dict:  # ms per step of each width
        return {w: 1e3 * seconds[w] / n for w, n in sorted(s.steps_per_bucket.items())}

    return dict(requests=num_requests, prompt_len=prompt_len, gen_len=gen_len, length_spread=spread, wall_s=wall,
                output_tokens_per_s=generated / wall, steps=steps, host_ms_per_step=1e3 * s.host_seconds / steps,
                wait_ms_per_step=1e3 * s.wait_seconds / steps, host_ms=host_ms(engine, steps),
                preemptions=s.preemptions,
                steps_per_bucket=dict(sorted(s.steps_per_bucket.items())),
                ms_per_bucket=per_step(s.seconds_per_bucket), wait_ms_per_bucket=per_step(s.wait_seconds_per_bucket))


def workload_ceiling(engine: Engine, bench: StepBench, e2e: dict, flops: float) -> float:
    """Output tokens/s if prefill ran at the matmul rate and decode at the copy bandwidth (mean lengths), of
    every device together (tensor parallel)."""
    n, p, g = e2e["requests"], e2e["prompt_len"], e2e["gen_len"]
    devices = engine.config.tensor_parallel
    prefill_s = 2 * engine.model.num_params * n * p / (flops * devices)
    batch = min(n, engine.config.max_seqs)
    decode_steps = g * -(-n // batch)
    decode_s = decode_steps * (bench.weight_bytes + bench.kv_bytes(batch, p + g // 2)) / (bench.bandwidth * devices)
    return n * g / (prefill_s + decode_s)


def engine_settings(args) -> dict:
    """The engine the bench builds (also the one each cold-start process builds)."""
    batches = [int(b) for b in args.batch.split(",")]
    return dict(max_seqs=max(batches), page_size=args.page_size, max_step_tokens=args.max_step_tokens,
                capacity=args.prompt_len + args.gen_len + args.max_step_tokens, attention=args.attention,
                compile_cache=args.compile_cache, **({"quantize": args.quantize} if args.quantize else {}),
                **({"quantize_head": True} if args.quantize_head else {}), kv_cache_dtype=args.kv_cache_dtype,
                tensor_parallel=args.tensor_parallel, async_launch=args.async_launch,
                **({"forward_sizes": args.forward_sizes} if args.forward_sizes else {}),
                **{k: getattr(args, k) for k in ("num_pages", "memory_fraction") if getattr(args, k, None) is not None},
                allow_long_context=True)  # a speed test: the synthetic context may pass the model's


def run_cold_start(args) -> dict:
    """Process start -> first token, three ways, each in a fresh process; this process never touches the device."""
    from glint.runtime.coldstart import cold_start

    rows = cold_start(args.model, args.dtype, engine_settings(args), workdir=args.workdir,
                      ways=tuple(args.ways.split(",")))
    result = dict(model=args.model, dtype=args.dtype, date=time.strftime("%Y-%m-%d"), cold_start=rows)
    t = Table(title=f"cold start: {args.model} (seconds from process start; x: how much sooner than the first way "
                    "of this call)")
    for col in ("way", "first token", "x", "import", "load", "warm-up", "compiles", "cache hits", "export"):
        t.add_column(col, justify="right")
    for r in rows:
        r["speedup_vs_first_way"] = rows[0]["first_token_s"] / r["first_token_s"]
        t.add_row(r["way"], f"{r['first_token_s']:.1f}", f"{r['speedup_vs_first_way']:.2f}x",
                  f"{r['python_to_import_s']:.1f}", f"{r['load_s']:.1f}", f"{r['warmup_s']:.1f}", str(r["compiles"]),
                  str(r["cache_hits"]), f"{r['export_s']:.1f}" if "export_s" in r else "")
    Console().print(t)
    same = len({tuple(r["token_ids"]) for r in rows}) == 1
    Console().print(f"first tokens {'agree' if same else 'DIFFER'}: {[r['token_ids'] for r in rows]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def speculative(args, console: Console, oracle_passes: int = 10) -> dict:
    """Plain greedy decoding against speculative decoding with `args.draft`, per batch size, on the same random
    prompts and one set of weights: output tokens/s of each, their ratio, the mean acceptance length and the
    milliseconds per speculative engine step. The speculative engine of batch b serves b sequences (its
    steps return b x (k + 1) rows of logits). The oracle replays the plain run's tokens, then the speculative
    engine's own from its previous pass, until 90% of each block is accepted or `oracle_passes` passes (the
    last is reported): low precision makes a verify step's argmax differ from a decode step's now and then,
    and every token after the first difference would be rejected. `dflash-random`: `dflash_random`'s draft.
    `args.quote` > 1: every prompt quotes itself that many times (`quoting_prompt`). The prefix cache is off in
    both engines: every pass prefills its prompts, as a first pass does (with it on, a repeated pass would find
    them cached and time decoding alone)."""
    from glint.runtime.config import EngineConfig

    if not 1 <= args.quote <= args.prompt_len:
        raise ValueError(f"--quote {args.quote}: a prompt of {args.prompt_len} tokens quotes a passage 1 to "
                         f"{args.prompt_len} times")
    batches = [int(b) for b in args.batch.split(",")]
    k = args.num_speculative_tokens
    if args.draft == "dflash-random":
        k = DFLASH_BLOCK - 1
    elif k is None:
        k = DEFAULT_SPECULATIVE_TOKENS
    capacity = args.prompt_len + args.gen_len + k + 1
    per_seq = -(-capacity // args.page_size)
    settings = dict(engine_settings(args), capacity=capacity, prefix_cache=False)
    plain = Engine.from_pretrained(args.model, dtype=args.dtype,
                                   **dict(settings, num_pages=max(batches) * per_seq + 16))
    plain.warmup(progress=False)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
    rows = []
    for b in batches:
        drafter = dflash_random(plain.model) if args.draft == "dflash-random" else host_drafter(args.draft, k)
        engine_fields = {k: v for k, v in settings.items() if k not in ("quantize", "quantize_head", "max_seqs")}
        fast = Engine(plain.model, plain.graphdef, plain.params,
                      EngineConfig(**engine_fields, max_seqs=b, num_pages=b * per_seq + 16, num_speculative_tokens=k),
                      drafter=drafter)
        t0 = time.perf_counter()
        fast.warmup(progress=False)
        compile_s = time.perf_counter() - t0
        prompts = [quoting_prompt(rng, plain.model.vocab_size, args.prompt_len, args.quote) for _ in range(b)]
        timed = {}
        passes = oracle_passes if args.draft == "oracle" else 1
        for name, engine in [("plain", plain)] + [("speculative", fast)] * passes:
            engine.generate(prompts[:1], dataclasses.replace(params, max_tokens=4))  # warm
            engine.stats = type(engine.stats)()
            t = time.perf_counter()
            outs = engine.generate(prompts, params)
            timed.setdefault(name, []).append((time.perf_counter() - t, outs, engine.stats))
            if args.draft == "oracle":
                for p, o in zip(prompts, outs):
                    drafter.record(p, o.token_ids)
            if name == "speculative" and engine.stats.mean_acceptance_length >= 0.9 * (k + 1):
                break
        (t_plain, ref, _), (t_spec, outs, st) = timed["plain"][0], timed["speculative"][-1]
        # decoding alone: the run less a run of the same prompts to their first token (the prefill, drafting nothing)
        first = {name: _time_to_first_tokens(engine, prompts, params) for name, engine in (("plain", plain),
                                                                                          ("speculative", fast))}
        decode_plain, decode_spec = t_plain - first["plain"], t_spec - first["speculative"]
        tokens = b * args.gen_len
        steps = sum(st.steps_per_bucket.values())
        rows.append(dict(batch=b, plain_tokens_per_s=tokens / t_plain, spec_tokens_per_s=tokens / t_spec,
                         speedup=t_plain / t_spec, prefill_s=first,
                         decode_speedup=decode_plain / decode_spec if args.gen_len > 1 and decode_spec > 0 else None,
                         mean_acceptance_length=st.mean_acceptance_length,
                         spec_steps=st.spec_steps, ms_per_step=1e3 * t_spec / steps, compile_s=compile_s,
                         fed_tokens=st.fed_tokens,
                         # a speculating engine reads each step before the next: host time adds to the step's
                         host_ms_per_step=1e3 * st.host_seconds / steps, wait_ms_per_step=1e3 * st.wait_seconds / steps,
                         host_ms_per_step_by_phase={k: 1e3 * v / steps
                                                    for k, v in sorted(st.host_phase_seconds.items())},
                         same_as_plain=sum(o.token_ids == r.token_ids for o, r in zip(outs, ref)),
                         acceptance_per_pass=[s.mean_acceptance_length for _, _, s in timed["speculative"]],
                         steps_per_bucket=dict(sorted(st.steps_per_bucket.items()))))
    t = Table(title=f"speculative decoding ({args.draft}, {k} draft tokens), {args.prompt_len} prompt + "
              f"{args.gen_len} generated, greedy: end to end, prefill included (decode: less the time to the "
              "first tokens)")
    for col in ("batch", "plain tok/s", "speculative tok/s", "speedup", "decode speedup", "mean acceptance",
                "ms/step", "host / wait ms", "same as plain"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["batch"]), f"{r['plain_tokens_per_s']:.0f}", f"{r['spec_tokens_per_s']:.0f}",
                  f"{r['speedup']:.2f}x", "-" if r["decode_speedup"] is None else f"{r['decode_speedup']:.2f}x",
                  "→".join(f"{a:.1f}" for a in r["acceptance_per_pass"]),
                  f"{r['ms_per_step']:.2f}", f"{r['host_ms_per_step']:.2f} / {r['wait_ms_per_step']:.2f}",
                  f"{r['same_as_plain']}/{r['batch']}")
    console.print(t)
    return dict(draft=args.draft, num_speculative_tokens=k, prompt_len=args.prompt_len, gen_len=args.gen_len,
                quote=args.quote, rows=rows)


def _time_to_first_tokens(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> float:
    """Seconds to run `prompts` to their first token (prefill), on fresh stats: the timed run's stay as they were."""
    engine.stats = type(engine.stats)()
    return _median_time(lambda: engine.generate(prompts, dataclasses.replace(params, max_tokens=1)), 1)


def quoting_prompt(rng, vocab: int, length: int, times: int = 1) -> list[int]:
    """`length` random tokens; with `times` > 1 a random passage of ceil(length / times) tokens written over and
    over, cut to `length` (`times` copies when `times` divides `length`): a prompt that quotes itself, what
    prompt lookup drafts from."""
    if times < 1:
        raise ValueError(f"a prompt quotes itself at least once, got quote={times}")
    passage = rng.integers(0, vocab, -(-length // times)).tolist()
    return (passage * times)[:length]


def shared_prefix_prompts(vocab: int, page_size: int, seed: int) -> list[list[int]]:
    """Prompts over one base prompt, sharing with it a prefix inside a page, of exactly a page, of several pages
    plus a few tokens, all of it (twice), all but its last token, four pages, and nothing: what the prefix
    cache's on == off checks run (tests/test_prefix_cache.py, tools/gpu_prefix.py)."""
    rng = np.random.default_rng(seed)

    def fresh(n):
        return rng.integers(0, vocab, n).tolist()

    base = fresh(5 * page_size + 3)
    return [base, base[:3] + fresh(20), base[:page_size] + fresh(11), base[:3 * page_size + 2] + fresh(6),
            list(base), base[:-1], base[:4 * page_size] + fresh(1), fresh(30)]


def prefix_workload(args, console: Console) -> dict:
    """The prefix cache on and off on one engine: `args.requests` greedy requests of a shared
    `args.shared_prefix`-token system prompt + `args.prompt_len` tokens of their own -> `args.gen_len`, then
    the same with nothing shared (prompts of the same lengths). Output tokens/s, time to first token and hits."""
    n, shared, own = args.requests, args.shared_prefix, args.prompt_len
    settings = dict(engine_settings(args), capacity=shared + own + args.gen_len)
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, **settings)
    engine.warmup(progress=False)
    rng = np.random.default_rng(0)
    vocab = engine.model.vocab_size
    system = rng.integers(0, vocab, shared).tolist()
    workloads = {"shared": [system + rng.integers(0, vocab, own).tolist() for _ in range(n)],
                 "unique": [rng.integers(0, vocab, shared + own).tolist() for _ in range(n)]}
    params = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
    rows, outputs = [], {}
    for name, prompts in workloads.items():
        for on in (False, True):
            engine.set_prefix_cache(on)
            warm = rng.integers(0, vocab, own).tolist()  # a pass through the loop that shares nothing with the run
            engine.generate([warm], dataclasses.replace(params, max_tokens=4))
            engine.stats = type(engine.stats)()
            t0 = time.perf_counter()
            rids = [engine.add_request(p, params) for p in prompts]
            first: dict[int, float] = {}
            while engine.has_unfinished():
                now = time.perf_counter() - t0
                for rid in engine.step():
                    first.setdefault(rid, now)
            wall = time.perf_counter() - t0
            outputs[name, on] = [engine.output(rid).token_ids for rid in rids]
            for rid in rids:
                engine.release(rid)
            ttft = np.percentile([first[r] for r in rids], [50, 90])
            s = engine.stats
            rows.append(dict(workload=name, prefix_cache=on, wall_s=wall, output_tokens_per_s=n * args.gen_len / wall,
                             ttft_p50_s=ttft[0], ttft_p90_s=ttft[1], hit_rate=s.prefix_hit_rate,
                             fed_tokens=s.fed_tokens, evictions=s.prefix_evictions, preemptions=s.preemptions))
    t = Table(title=f"prefix cache: {n} requests x ({shared} shared or not + {own} own prompt tokens -> "
              f"{args.gen_len}), greedy")
    for col in ("prompts", "cache", "tok/s", "x off", "TTFT p50/p90 s", "hits", "fed", "same"):
        t.add_column(col, justify="right")
    for r in rows:
        off = next(o for o in rows if o["workload"] == r["workload"] and not o["prefix_cache"])
        same = sum(a == b for a, b in zip(outputs[r["workload"], True], outputs[r["workload"], False]))
        r["speedup"], r["same_as_off"] = r["output_tokens_per_s"] / off["output_tokens_per_s"], same
        t.add_row(r["workload"], "on" if r["prefix_cache"] else "off", f"{r['output_tokens_per_s']:.0f}",
                  f"{r['speedup']:.2f}x", f"{r['ttft_p50_s']:.2f} / {r['ttft_p90_s']:.2f}", f"{r['hit_rate']:.2f}",
                  str(r["fed_tokens"]), f"{same}/{n}")
    console.print(t)
    return dict(requests=n, shared_prefix=shared, prompt_len=own, gen_len=args.gen_len, rows=rows)


DFLASH_BLOCK = 16  # z-lab's Qwen3-8B-DFlash-b16


def dflash_random(target):
    """A DFlash drafter of z-lab's Qwen3-8B-DFlash-b16 shape (5 layers, block 16, taps 1, 9, 17, 25, 33 of 36)
    with random weights: what a real draft costs per step (its acceptance is that of noise)."""
    from glint.model import dflash
    from glint.model.config import RopeConfig

    taps = tuple(min(max(t, 0), target.num_layers - 1) for t in dflash.default_target_layer_ids(target.num_layers, 5))
    cfg = dflash.DraftConfig(hidden_size=target.hidden_size, num_heads=target.num_heads,
                             num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                             intermediate_size=target.intermediate_size, norm_eps=1e-6, rope=RopeConfig(1e6),
                             num_layers=5, num_target_layers=target.num_layers, block_size=DFLASH_BLOCK,
                             mask_token_id=target.vocab_size - 1, target_layer_ids=taps, vocab_size=target.vocab_size)
    return DFlashDrafter(cfg, dflash.init_draft(cfg, target.dtype))


def run_bench(args) -> dict:
    if args.cold_start:  # this process must not touch the device: the GPU sizes unless told otherwise
        fill_defaults(args, on_gpu=True)
        return run_cold_start(args)
    console = Console()
    on_gpu = jax.default_backend() == "gpu"
    fill_defaults(args, on_gpu)
    if args.draft or args.shared_prefix:
        run = speculative(args, console) if args.draft else prefix_workload(args, console)
        result = dict(model=args.model, dtype=args.dtype, device=str(jax.devices()[0].device_kind),
                      jax=jax.__version__, date=time.strftime("%Y-%m-%d"),
                      **{"speculative" if args.draft else "prefix_cache": run})
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return result
    rates = measure_bandwidth((4 << 30) if on_gpu else (64 << 20))
    bandwidth = args.bandwidth_gbps * 1e9 if args.bandwidth_gbps else max(rates.values())
    flops = measure_matmul(8192 if on_gpu else 512, jnp.bfloat16 if on_gpu else jnp.float32)
    batches = [int(b) for b in args.batch.split(",")]
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, **engine_settings(args))
    result = dict(model=args.model, dtype=args.dtype, quantize=engine.model.quantize, kv_dtype=engine.cache.dtype,
                  device=str(jax.devices()[0].device_kind),
                  jax=jax.__version__, attention=engine.attention, bandwidth_GBps=bandwidth / 1e9,
                  measured_GBps={k: v / 1e9 for k, v in rates.items()},
                  matmul_TFLOPs=flops / 1e12, num_params=engine.model.num_params,
                  kv_pages=engine.cache.num_pages, date=time.strftime("%Y-%m-%d"))
    measured = ", ".join(f"{k} {v / 1e9:.0f}" for k, v in rates.items())
    quantized = engine.model.quantize != "none" or engine.model.quantize_head
    linears = f" (linears {engine.model.linears_label or engine.model.quantize})" if quantized else ""
    linears += f" (KV {engine.cache.dtype})" if engine.cache.dtype != engine.model.dtype else ""
    console.print(f"[bold]{args.model}[/] {args.dtype}{linears} on {result['device']}: roofline "
                  f"{bandwidth / 1e9:.0f} GB/s "
                  f"(measured GB/s: {measured}), "
                  f"matmul {flops / 1e12:.2f} TFLOP/s, {engine.cache.num_pages} KV pages")
    t0 = time.perf_counter()
    times = engine.warmup()  # programs compile in parallel: each time is its own lowering + compile
    result["warmup_s"] = time.perf_counter() - t0
    compile_s = {w: times.get(forward_name(w), 0.0) for w in engine.config.buckets}
    result["compile_s"] = compile_s
    bench = StepBench(engine, bandwidth)
    buckets = [bench.time_step(min(w, engine.config.max_seqs), args.prompt_len,  # one chunk per sequence at most
                               min(max(1, w // min(w, engine.config.max_seqs)), engine.config.max_prefill_chunk),
                               args.repeats)
               for w in track(engine.config.buckets, description="buckets", console=console)]
    result["buckets"] = [dataclasses.asdict(t) | {"compile_s": compile_s[t.width]} for t in buckets]
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else [args.prompt_len + args.gen_len // 2]
    decode = []
    for b in track(batches, description="decode", console=console):
        for c in contexts:
            alone = bench.time_step(b, c, 1, args.repeats)  # the step alone first, then the loop, as before
            engine_ms, engine_host_ms = pipelined_decode_ms(engine, b, c)
            decode.append(dataclasses.replace(alone, engine_ms=engine_ms, engine_host_ms=engine_host_ms))
    result["decode"] = [dataclasses.asdict(t) for t in decode]
    if args.requests:
        e2e = end_to_end(engine, args.requests, args.prompt_len, args.e2e_gen_len or args.gen_len, args.length_spread)
        e2e["ceiling_tokens_per_s"] = workload_ceiling(engine, bench, e2e, flops)
        e2e["fraction_of_ceiling"] = e2e["output_tokens_per_s"] / e2e["ceiling_tokens_per_s"]
        result["end_to_end"] = e2e
        if args.peer_json:
            result["peers"] = read_peers(args.peer_json, e2e)
    print_tables(console, result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def _host_line(ms: dict) -> str:
    inside = not ms["async_launch"]  # the launch is part of the dispatch phase
    phases = ", ".join(f"{k} {v:.2f}" + (f" (launch {ms['launch']:.2f})" if k == "dispatch" and inside else "")
                       for k, v in ms.items() if k not in ("busy", "wait", "launch", "async_launch"))
    beside = "" if inside else f"; the launch thread {ms['launch']:.2f} ms launching"
    return f"busy {ms['busy']:.2f} ms ({phases}), waiting on the device {ms['wait']:.2f} ms{beside}"


def read_peers(path: str, e2e: dict) -> list[dict]:
    """Peer results (JSON lines, e.g. from tools/hf_peer.py run on the same mix) with glint's ratio."""
    peers = []
    with open(path) as f:
        for line in f:
            if line.startswith("{"):
                peer = json.loads(line)
                if "output_tokens_per_s" in peer:
                    peer["glint_ratio"] = e2e["output_tokens_per_s"] / peer["output_tokens_per_s"]
                peers.append(peer)
    return peers


def print_tables(console: Console, result: dict) -> None:
    t = Table(title="step buckets (one step alone)")
    for col in ("width", "batch", "ctx", "device ms", "host ms", "tokens/s", "% roofline", "compile s"):
        t.add_column(col, justify="right")
    for r in result["buckets"]:
        t.add_row(str(r["width"]), str(r["batch"]), str(r["context"]), f"{r['device_ms']:.2f}", f"{r['host_ms']:.2f}",
                  f"{r['tokens_per_s']:.0f}", f"{r['roofline_pct']:.0f}", f"{r['compile_s']:.1f}")
    console.print(t)
    t = Table(title="decode (one token per sequence): one step alone, and per step of the engine's pipelined loop")
    for col in ("batch", "ctx", "device ms", "host ms", "tokens/s", "% roofline", "engine ms/step",
                "engine % roofline"):
        t.add_column(col, justify="right")
    for r in result["decode"]:
        engine_ms = r.get("engine_ms")
        t.add_row(str(r["batch"]), str(r["context"]), f"{r['device_ms']:.2f}", f"{r['host_ms']:.2f}",
                  f"{r['tokens_per_s']:.0f}", f"{r['roofline_pct']:.0f}",
                  f"{engine_ms:.2f}" if engine_ms else "",
                  f"{r['roofline_pct'] * r['device_ms'] / engine_ms:.0f}" if engine_ms else "")
    console.print(t)
    for r in result["decode"]:
        if r.get("engine_host_ms"):
            console.print(f"the loop at batch {r['batch']}, context {r['context']}, host per step: "
                          f"{_host_line(r['engine_host_ms'])}")
    if "end_to_end" in result:
        e = result["end_to_end"]
        console.print(f"end to end: {e['requests']} requests x ({e['prompt_len']} prompt + {e['gen_len']} generated): "
                      f"{e['output_tokens_per_s']:.0f} output tokens/s, {e['wall_s']:.1f}s, host "
                      f"{e['host_ms_per_step']:.2f} ms busy / {e['wait_ms_per_step']:.2f} ms waiting on the device per step, "
                      f"ceiling {e['ceiling_tokens_per_s']:.0f} tokens/s ({100 * e['fraction_of_ceiling']:.0f}%)")
        if "host_ms" in e:
            console.print(f"end to end, host per step: {_host_line(e['host_ms'])}")
        if "ms_per_bucket" in e:
            console.print("end to end, steps by width: " + ", ".join(
                f"{w}: {e['steps_per_bucket'][w]} x {ms:.2f} ms (waiting {e['wait_ms_per_bucket'][w]:.2f})"
                for w, ms in e["ms_per_bucket"].items()))
    for peer in result.get("peers", []):
        if "glint_ratio" in peer:
            console.print(f"peer {peer['peer']} ({peer['variant']}): {peer['output_tokens_per_s']:.0f} output tokens/s; "
                          f"glint / peer = {peer['glint_ratio']:.1f}x")
        else:
            console.print(f"peer {peer['peer']} ({peer.get('variant')}): {peer.get('error')}")
