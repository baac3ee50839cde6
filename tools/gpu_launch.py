"""What the host spends launching a step: the engine's decode loop at one width, on the GPU, in one process.

1. the pipelined loop (`pipelined_decode_ms`, median of 3) and its host time per step by phase; "launch" is the
   forward program's call returning, i.e. what XLA does on the host to enqueue the step (on the engine's launch
   thread, beside the other phases, unless --sync-launch);
2. the forward called directly on one captured step, 24 times with two calls in flight ("overlapped", as the
   loop runs) and 24 times each after the last finished ("waited"), the previous tokens a new buffer each call
   as in the loop: the launch time of each way. XLA re-records its command buffer (a CUDA graph) when a buffer
   the graph uses moved; if only the overlapped calls pay for that, what moves is what two steps in flight do
   not share (XLA's temporaries, most likely);
3. with --trace DIR: a jax.profiler trace of 8 loop steps with command buffers kept on while profiling
   (XLA otherwise runs op by op under the profiler), its host events summed per step by name: e.g.
   `command_buffer::update` (the re-recording) and `cuGraphLaunch`.

    python3 tools/gpu_launch.py --quantize fp8 --kv-cache-dtype fp8 --trace $OUT/launch_fp8
    python3 tools/gpu_launch.py                      # bf16, batch 256 at 576 keys
The timed width is the batch (forward_sizes); prompts prefill in a second program, 64 wider.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from glint.runtime.bench import decoding, pipelined_decode_ms
from glint.runtime.commands import launch_arg
from glint.runtime.engine import Engine


def direct_launches(engine: Engine, batch: int, context: int, calls: int = 24) -> dict:
    """Median ms for the forward's call to return, overlapped and waited (two rounds each, alternating)."""
    captured = {}
    run_forward = engine.runner.run_forward

    def capture(*args):
        captured["args"] = args
        return run_forward(*args)

    engine.runner.run_forward = capture  # the last step before decoding starts is the one called again
    try:
        with decoding(engine, batch, context, 0, seed=3, started=3):
            kv = engine.kv  # every launched step's programs have run (the launch thread is idle)
            del engine.runner.run_forward  # the class's method again
            width, weights, _, host, prev = captured["args"]
            jax.block_until_ready(kv.parts())
            times = collections.defaultdict(list)
            try:
                for way in ("overlapped", "waited") * 2:
                    print(f"-- {way} round", file=sys.stderr, flush=True)  # marks XLA's logs (TF_CPP_VMODULE)
                    pending = []
                    for i in range(calls):
                        moved = jnp.copy(prev)  # the previous tokens: a buffer of their own each step, as in the loop
                        t = time.perf_counter()
                        out, _, kv = run_forward(width, weights, kv, host, moved)
                        if i >= 4:  # the first calls of a round follow the other way's
                            times[way].append(time.perf_counter() - t)
                        pending.append(out)
                        if way == "waited" or len(pending) > 2:  # overlapped: two steps in flight at most, as the loop
                            pending.pop(0).block_until_ready()
                    jax.block_until_ready(pending)
            finally:
                engine.kv = kv  # the last call's pools: the engine's own were donated
    finally:
        vars(engine.runner).pop("run_forward", None)
    return {way: 1e3 * float(np.median(t)) for way, t in times.items()}


def host_events(engine: Engine, batch: int, context: int, trace_dir: str, steps: int = 8, top: int = 20) -> list:
    """(ms per step, calls per step, name) of the host events in a trace of `steps` loop steps, most first; the
    GPU's events summed as one row."""
    with decoding(engine, batch, context, steps, seed=2, started=3):
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0  # Python frames would swamp the host threads' own events
        jax.profiler.start_trace(trace_dir, profiler_options=options)
        for _ in range(steps):
            engine.step()
        jax.profiler.stop_trace()
    path = max(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "/device:GPU" in e["args"]["name"]}
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X":
            name = "GPU kernels and copies" if e.get("pid") in gpu else e["name"][:80]
            total[name] += e.get("dur", 0)
            count[name] += 1
    return [(us / steps / 1e3, count[name] / steps, name) for name, us in total.most_common(top)]


def loop_engine(model: str, batch: int, context: int, **config) -> Engine:
    """An engine whose decode loop runs at width `batch` over `context` keys; prompts prefill in a second program,
    64 wider than the batch: room for a prompt chunk beside the decode rows."""
    capacity = context + 256
    return Engine.from_pretrained(model, max_seqs=batch, max_step_tokens=batch + 64, forward_sizes=(batch,),
                                  capacity=capacity, num_pages=batch * -(-capacity // 16) + 16,
                                  allow_long_context=True, **config)


def median_loop(engine: Engine, batch: int, context: int, repeats: int = 3, steps: int = 32, params=None):
    """The median of `repeats` runs of `pipelined_decode_ms` (its requests drawn with `params`, default greedy):
    (ms per step, host ms per step), and every run's ms."""
    runs = sorted((pipelined_decode_ms(engine, batch, context, steps, params=params) for _ in range(repeats)),
                  key=lambda r: r[0])
    return (*runs[len(runs) // 2], [r[0] for r in runs])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="llama3-8b")
    p.add_argument("--quantize", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=576)
    p.add_argument("--trace", help="also trace 8 loop steps here and sum their host events")
    launch_arg(p)
    args = p.parse_args()
    if args.trace:  # before the backend starts: XLA reads its flags once
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_enable_command_buffers_during_profiling=true").strip()
    b = args.batch
    t0 = time.perf_counter()
    engine = loop_engine(args.model, b, args.context, quantize=args.quantize, kv_cache_dtype=args.kv_cache_dtype,
                         async_launch=args.async_launch)
    engine.warmup()
    print(f"engine + warmup {time.perf_counter() - t0:.0f} s", flush=True)
    ms, host, _ = median_loop(engine, b, args.context)
    label = (f"{args.model} {args.quantize or 'bf16'} KV {args.kv_cache_dtype}, batch {b} at {args.context} keys, "
             f"{'async' if args.async_launch else 'sync'} launch")
    print(f"loop: {ms:.2f} ms/step; host per step " + ", ".join(f"{k} {v:.2f}" for k, v in host.items()), flush=True)
    launches = direct_launches(engine, b, args.context)
    print("forward launch ms: " + ", ".join(f"{k} {v:.2f}" for k, v in launches.items()), flush=True)
    if args.trace:
        for ms_step, calls, name in host_events(engine, b, args.context, args.trace):
            print(f"{ms_step:8.3f} ms {calls:7.1f}x  {name}")
    print(json.dumps({"case": label, "loop_ms": ms, "host_ms": host, "launch_ms": launches}))


if __name__ == "__main__":
    main()
