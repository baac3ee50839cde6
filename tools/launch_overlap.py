"""The engine's decode loop with each step launched from the launch thread and in step() itself, same process.

For each arm (EngineConfig.async_launch True, then False) a fresh engine runs `pipelined_decode_ms` (batch B at
--context keys, 24 steps) --repeats times; prints each arm's median ms per step with its host phases, then the
ratio. --extra-launch-ms holds each forward's launch that much longer without the GIL (a sleep after the real
call), standing in for XLA's CUDA-graph update on a GPU, which the CPU client does not have:

    python3 tools/launch_overlap.py tiny --batch 256 --context 32                      # the CPU as it is
    python3 tools/launch_overlap.py tiny --batch 256 --context 32 --extra-launch-ms 15 # a 15 ms launch
    python3 tools/launch_overlap.py llama3-8b --quantize fp8 --batch 256 --context 576 # on the GPU
"""
from __future__ import annotations

import argparse
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_launch import loop_engine, median_loop  # noqa: E402

from glint.runtime.programs import Runner  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="tiny")
    p.add_argument("--quantize", default=None)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--extra-launch-ms", type=float, default=0.0)
    args = p.parse_args()
    if args.extra_launch_ms:
        real = Runner.run_forward

        def slow(self, *a, **k):
            out = real(self, *a, **k)
            time.sleep(args.extra_launch_ms / 1e3)  # releases the GIL, as XLA's launch does
            return out

        Runner.run_forward = slow
    b = args.batch
    rows = {}
    for async_launch in (True, False):
        engine = loop_engine(args.model, b, args.context, quantize=args.quantize, async_launch=async_launch)
        ms, host, runs = median_loop(engine, b, args.context, args.repeats, steps=24)
        name = "async launch" if async_launch else "sync launch"
        rows[name] = ms
        print(f"{name}: {ms:.2f} ms/step (runs {', '.join(f'{r:.2f}' for r in runs)}); host per step "
              + ", ".join(f"{k} {v:.2f}" for k, v in host.items() if k != "async_launch"), flush=True)
    print(f"{args.model} {args.quantize or ''} batch {b} x {args.context}, extra launch {args.extra_launch_ms} ms: "
          f"async / sync = {rows['async launch'] / rows['sync launch']:.2f}x the time per step (medians of "
          f"{args.repeats} runs)")


if __name__ == "__main__":
    main()
