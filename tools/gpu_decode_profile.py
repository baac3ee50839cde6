"""Where batch-1 decode's time goes (issue #13 item 4), on the GPU, in one process:

1. the engine's pipelined decode loop (ms per engine.step(), batch 1, context CONTEXT), median of 3 runs;
2. a jax.profiler trace of 16 engine steps, its GPU kernels summed per step by name (top 15), and the device's
   busy time per step against the wall time per step (the gaps are launch and host time; the trace itself
   slows the loop), and one step's kernels in launch order (one_step_kernels.txt) with the optimized HLO of
   the width-1 program (forward_1.hlo.txt) beside it.

Run it once per XLA_FLAGS setting to compare (each its own process), e.g.
    python3 tools/gpu_decode_profile.py OUT/prof_default
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python3 tools/gpu_decode_profile.py OUT/prof_cublas
and once per kernel tuning value through tools/with_tuning.py, e.g.
    TUNING=MAX_SPLITS=16 python3 tools/with_tuning.py tools/gpu_decode_profile.py OUT/prof_16_splits
Prints one JSON line last.
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import sys
import time

import jax
import numpy as np

from glint.pallas_kernels import tuning
from glint.runtime import weights
from glint.runtime.bench import pipelined_decode_ms
from glint.runtime.engine import Engine
from glint.runtime.params import SamplingParams

MODEL = os.environ.get("PROFILE_MODEL", "llama3-8b")
CONTEXT = int(os.environ.get("PROFILE_CONTEXT", "512"))
QUANTIZE = os.environ.get("PROFILE_QUANTIZE")  # a weight format (model/quant.py), e.g. fp8


def kernel_table(trace_dir: str, steps: int, sequence_path: str | None = None, top: int = 15) -> dict:
    paths = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not paths:
        return {"error": f"no trace under {trace_dir}"}
    with gzip.open(paths[0]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pids = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {p for p, n in pids.items() if "/device:GPU" in n}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu and e.get("dur")]
    if sequence_path:  # one step's kernels in launch order (the middle step), to read a layer's sequence off
        kernels.sort(key=lambda e: e["ts"])
        per_step = len(kernels) // steps
        with open(sequence_path, "w") as f:
            for e in kernels[per_step * (steps // 2):per_step * (steps // 2 + 1)]:
                f.write(f"{e['dur']:8.2f} {e['name']}\n")
    per_name = collections.Counter()
    count = collections.Counter()
    for e in kernels:
        per_name[e["name"]] += e["dur"]
        count[e["name"]] += 1
    busy_us = sum(per_name.values())
    span_us = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) if kernels else 0
    rows = [(n[:90], round(t / steps, 1), count[n] // steps) for n, t in per_name.most_common(top)]
    return dict(gpu_busy_us_per_step=round(busy_us / steps, 1), gpu_span_us_per_step=round(span_us / steps, 1),
                kernels_per_step=len(kernels) // steps, top_us_per_step=rows, processes=sorted(set(pids.values())))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "out/profile"
    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(MODEL, dtype="bfloat16", max_seqs=1, max_step_tokens=64, capacity=CONTEXT + 256,
                                    allow_long_context=True, **({"quantize": QUANTIZE} if QUANTIZE else {}))
    engine.warmup(progress=False)
    print(f"engine + warmup {time.perf_counter() - t0:.1f} s", flush=True)
    weight_bytes = weights.decode_weight_bytes(engine.params, engine.model.tie_embeddings)
    loop = sorted(pipelined_decode_ms(engine, 1, CONTEXT, steps=64)[0] for _ in range(3))[1]
    steps = 16
    rng = np.random.default_rng(1)
    rid = engine.add_request(rng.integers(0, engine.model.vocab_size, CONTEXT).tolist(),
                             SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
    while len(engine.output(rid, text=False).token_ids) < 4:
        engine.step()
    trace_dir = os.path.join(out, "trace")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        t1 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        jax.block_until_ready(engine.kv)
        traced_ms = 1e3 * (time.perf_counter() - t1) / steps
    tokens = engine.output(rid, text=False).token_ids  # greedy: the same under every XLA_FLAGS, or a numerics change
    engine.abort(rid)
    table = kernel_table(trace_dir, steps, os.path.join(out, "one_step_kernels.txt"))
    with open(os.path.join(out, "forward_1.hlo.txt"), "w") as f:  # the optimized program the loop runs
        f.write(engine.runner.programs["forward_1"].as_text())
    result = dict(xla_flags=os.environ.get("XLA_FLAGS", ""), model=MODEL, context=CONTEXT, quantize=QUANTIZE,
                  max_splits=tuning.MAX_SPLITS, min_blocks_per_split=tuning.MIN_BLOCKS_PER_SPLIT,
                  weight_GB=weight_bytes / 1e9, engine_ms_per_step=loop,
                  engine_TBps=weight_bytes / loop / 1e9, pct_of_4p3=100 * weight_bytes / loop / 1e9 / 4.3,
                  traced_ms_per_step=traced_ms, tokens=tokens, **table)
    for k, v in result.items():
        if k not in ("top_us_per_step", "tokens"):
            print(f"{k}: {v}")
    print("tokens:", " ".join(map(str, tokens)))
    for row in result.get("top_us_per_step", []):
        print("  ", row)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
