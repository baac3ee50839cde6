"""The same requests in process and over HTTP, one engine: what the server costs, and where the engine thread goes.

One engine: first `engine.generate` of --requests prompts of --prompt-len random ids -> exactly --gen-len tokens
(greedy, ignore_eos), --repeats times; then the server (`create_app` under uvicorn, on a thread of this process)
loaded with the same mix by `glint bench MODEL --server` in a second process, --repeats times. Prints output
tokens/s of each, their ratio, and per engine step the engine thread's time in `step()` and in handing tokens to
the event loop (`_deliver`):

    python3 tools/serve_load.py tiny --dtype float32 --requests 256 --prompt-len 32 --gen-len 64   # a CPU
    python3 tools/serve_load.py llama3-8b --requests 256 --prompt-len 512 --gen-len 128           # the H200
"""
from __future__ import annotations

import argparse
import collections
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="tiny")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--capacity", type=int, default=1024)
    p.add_argument("--max-step-tokens", type=int, default=None)
    p.add_argument("--quantize", default=None)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()

    import uvicorn

    from glint.runtime.engine import Engine
    from glint.runtime.metrics import ServerMetrics
    from glint.runtime.params import SamplingParams
    from glint.runtime.server import create_app
    from glint.runtime.worker import EngineWorker

    # the prefix cache off: the load generator draws its prompts as the first in-process round does (seed 0)
    config = dict(max_seqs=args.requests, capacity=args.capacity, quantize=args.quantize, prefix_cache=False)
    if args.max_step_tokens:
        config["max_step_tokens"] = args.max_step_tokens
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, **config)
    engine.warmup()
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
    local = []
    for _ in range(args.repeats):
        prompts = [rng.integers(0, engine.model.vocab_size, args.prompt_len).tolist() for _ in range(args.requests)]
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        local.append(args.requests * args.gen_len / (time.perf_counter() - t0))
        print(f"in process: {local[-1]:,.0f} tok/s", flush=True)

    metrics = ServerMetrics()
    worker = EngineWorker(engine, metrics)
    spent = collections.Counter()

    def timed(name, fn):
        def call(*a):
            t0 = time.perf_counter()
            try:
                return fn(*a)
            finally:
                spent[name] += time.perf_counter() - t0
                spent[name + "s"] += 1
        return call

    engine.step, worker._deliver = timed("step", engine.step), timed("deliver", worker._deliver)
    worker.start()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(worker, args.model, metrics=metrics), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise SystemExit("the server did not start")
        time.sleep(0.1)
    http = []
    for _ in range(args.repeats):
        spent.clear()
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            run = subprocess.run([sys.executable, "-m", "glint.runtime.cli", "bench", args.model, "--server",
                                  f"http://127.0.0.1:{port}", "--requests", str(args.requests), "--prompt-len",
                                  str(args.prompt_len), "--gen-len", str(args.gen_len), "--json", out.name],
                                 capture_output=True, text=True, check=False)
            if run.returncode:
                raise SystemExit(f"the load generator failed:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
            with open(out.name) as f:
                result = json.load(f)
        http.append(result["output_tokens_per_s"])
        steps = max(spent["steps"], 1)
        print(f"over HTTP: {http[-1]:,.0f} tok/s, {result['completed']}/{args.requests} requests, ITL p50 "
              f"{1e3 * result['itl_s']['p50']:.1f} ms; {spent['steps']} steps, step() {1e3 * spent['step'] / steps:.2f}"
              f" ms, deliver {1e3 * spent['deliver'] / steps:.2f} ms a step", flush=True)
    server.should_exit = True
    worker.stop()
    print(f"{args.model}, {args.requests} x {args.prompt_len} -> {args.gen_len}: in process "
          f"{np.median(local):,.0f} tok/s, over HTTP {np.median(http):,.0f} tok/s = "
          f"{np.median(http) / np.median(local):.2f}x (medians of {args.repeats})")


if __name__ == "__main__":
    main()
