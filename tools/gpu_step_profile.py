"""Where one engine step's device time goes at any width (e.g. the end-to-end mix's width-4096 prefill step, where
fp8 ran only 1.35x bf16 in docs/perf.md), on the GPU, in one process:

1. the step alone, as `glint bench`'s step table times it (`StepBench.time_step`: `batch` sequences with `context`
   cached positions each feed `q_len` tokens), median of REPEATS runs;
2. a jax.profiler trace of STEPS more runs of the same step, its GPU kernels summed per run by name (top 25) and by
   kind (matmuls, attention, everything else), with one run's kernels in launch order (one_step_kernels.txt).

    PROFILE_QUANTIZE=fp8 python3 tools/gpu_step_profile.py OUT/fp8 --batch 8 --q-len 512   # width 4096
    python3 tools/gpu_step_profile.py OUT/bf16 --batch 8 --q-len 512

Prints one JSON line last. Runs on a CPU too (no GPU kernels in the trace then, so the tables are empty).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import jax
from glint.runtime import bench
from glint.runtime.engine import Engine

sys.path.insert(0, os.path.dirname(__file__))
from gpu_decode_profile import kernel_table

KINDS = (("matmul", ("gemm", "cublas", "nvjet", "cutlass", "matmul", "sm90_xmma", "dot")),
         ("attention", ("attention",)))


def kind(name: str) -> str:
    lowered = name.lower()
    return next((k for k, marks in KINDS if any(m in lowered for m in marks)), "other")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--model", default=os.environ.get("PROFILE_MODEL", "llama3-8b"))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=0)
    p.add_argument("--q-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args(argv)
    quantize = os.environ.get("PROFILE_QUANTIZE")
    os.makedirs(args.out, exist_ok=True)
    width = args.batch * args.q_len
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(args.model, dtype="bfloat16", max_seqs=args.batch, max_step_tokens=width,
                                    capacity=args.context + args.q_len + 16, allow_long_context=True,
                                    **({"quantize": quantize} if quantize else {}))
    step_bench = bench.StepBench(engine, bandwidth=4.3e12)
    alone = step_bench.time_step(args.batch, args.context, args.q_len, args.repeats)
    print(f"engine + step compiled and timed {time.perf_counter() - t0:.1f} s: width {alone.width}, "
          f"{alone.device_ms:.2f} ms alone", flush=True)

    trace_dir = os.path.join(args.out, "trace")

    def traced(run, repeats):  # the same step again, `repeats` times under the profiler
        with jax.profiler.trace(trace_dir):
            t = time.perf_counter()
            for _ in range(repeats):
                jax.block_until_ready(run())
        return (time.perf_counter() - t) / repeats

    step_bench.time_step(args.batch, args.context, args.q_len, args.steps, timer=traced)
    table = kernel_table(trace_dir, args.steps, os.path.join(args.out, "one_step_kernels.txt"), top=1 << 30)
    by_kind = collections.Counter()
    for name, us, _ in table.get("top_us_per_step", []):
        by_kind[kind(name)] += us
    table["top_us_per_step"] = table.get("top_us_per_step", [])[:25]
    result = dict(model=args.model, quantize=quantize, width=alone.width, batch=args.batch, context=args.context,
                  q_len=args.q_len, step_ms_alone=alone.device_ms,
                  us_per_step_by_kind={k: round(v, 1) for k, v in by_kind.items()}, **table)
    for key, value in result.items():
        if key != "top_us_per_step":
            print(f"{key}: {value}")
    for row in result.get("top_us_per_step", []):
        print("  ", row)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
