"""What each sampling feature costs a decode step: the engine's pipelined loop at one width, per way of drawing.

One engine (tools/gpu_launch.py's `loop_engine`: llama3-8b, random weights, batch 256 at 576 keys by default),
warmed up once (every program compiled), then `pipelined_decode_ms` (median of 3 runs) with every request
drawing the same way:
- greedy: the forward's own argmax, nothing after it;
- seeded: temperature 0.8, drawn in the forward (Gumbel-max), nothing after it;
- min_p: the same with min_p 0.05, still in the forward;
- top-k/top-p: top_k 50, top_p 0.9: the `sample` program's sort of each row after the forward;
- penalties: presence, frequency and repetition penalties on greedy rows: the `penalize` program (each row's
  prompt and completion uploaded as its history);
- bias+min_tokens: a logit bias of 16 tokens and min_tokens over the whole loop (EOS banned every step) on greedy
  rows: the `penalize` program with no history;
- penalties+top-k: penalties and top-k/top-p together: `penalize`, then `sample`.
Each way's ms per step against greedy's from the same process.

`--filters` times instead the `sample` program alone on random logits [batch, vocab] (llama3's vocabulary by
default), top_k 50 / top_p 0.9 on every row, under each of tuning.SAMPLING_FILTER's ways to cut the ranking
("sort", "keys") next to the draw without filters: chained (dependent calls in one jit) and separate (one
waited call each), and how often each draws the sort's tokens.

    python3 tools/gpu_sampling_cost.py                       # llama3-8b bf16, batch 256 at 576 keys
    JAX_PLATFORMS=cpu python3 tools/gpu_sampling_cost.py tiny --batch 8 --context 64   # a CPU dry run
    python3 tools/gpu_sampling_cost.py --filters --batch 256 --vocab 128256   # the sampler alone, per way
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpu_launch import loop_engine, median_loop  # noqa: E402

from glint.runtime.params import SamplingParams  # noqa: E402

PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
FILTERS = dict(temperature=0.8, top_k=50, top_p=0.9)


def ways(vocab: int, room: int) -> dict[str, SamplingParams | None]:
    bias = {t: (-1.0) ** t * 3.0 for t in range(3, vocab, max(1, vocab // 16))[:16]}
    return {
        "greedy": None,
        "seeded": SamplingParams(temperature=0.8),
        "min_p": SamplingParams(temperature=0.8, min_p=0.05),
        "top-k/top-p": SamplingParams(**FILTERS),
        "penalties": SamplingParams(temperature=0.0, **PENALTIES),
        "bias+min_tokens": SamplingParams(temperature=0.0, logit_bias=bias, max_tokens=room, min_tokens=room),
        "penalties+top-k": SamplingParams(**FILTERS, **PENALTIES),
    }


def time_filters(batch: int, vocab: int) -> list[dict]:
    """The `sample` program alone, per way of cutting the ranking, ms chained and separate."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from glint.pallas_kernels import tuning
    from glint.runtime.sampling import SamplerInputs, sample
    from gpu_kernels import bench, bench_separate

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(batch, vocab)) * 3, jnp.bfloat16).astype(jnp.float32)  # bf16's ties
    inputs = SamplerInputs.from_params([SamplingParams(**FILTERS, seed=i) for i in range(batch)], range(batch),
                                       rows=batch)
    rows, tokens = [], {}
    for way, filtered in (("no filter", False), ("sort", True), ("keys", True)):
        tuning.SAMPLING_FILTER = "sort" if way == "no filter" else way
        fn = functools.partial(lambda x, f, i: sample(x, i, is_filtered=f), f=filtered, i=inputs)
        tokens[way] = np.asarray(jax.jit(fn)(logits))
        chained, separate = bench(fn, (logits,)) * 1e3, bench_separate(fn, (logits,)) * 1e3
        rows.append({"way": way, "chained_ms": chained, "separate_ms": separate})
        print(f"{way:10s} chained {chained:7.3f} ms, separate {separate:7.3f} ms", flush=True)
    print(f"keys draws the sort's tokens in {float((tokens['keys'] == tokens['sort']).mean()):.1%} of {batch} rows")
    print("| way | chained ms | separate ms |\n| --- | --- | --- |")
    for r in rows:
        print(f"| {r['way']} | {r['chained_ms']:.3f} | {r['separate_ms']:.3f} |")
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="llama3-8b")
    p.add_argument("--quantize", default=None)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=576)
    p.add_argument("--ways", default="", help="comma-separated ways to time (default all)")
    p.add_argument("--filters", action="store_true", help="time the sample program alone, per way")
    p.add_argument("--vocab", type=int, default=128256, help="--filters: the vocabulary")
    args = p.parse_args()
    if args.filters:
        print(json.dumps({"batch": args.batch, "vocab": args.vocab, "rows": time_filters(args.batch, args.vocab)}))
        return
    t0 = time.perf_counter()
    engine = loop_engine(args.model, args.batch, args.context, quantize=args.quantize)
    engine.warmup()
    print(f"engine + warmup {time.perf_counter() - t0:.0f} s", flush=True)
    chosen = [w for w in args.ways.split(",") if w]
    rows, base = [], None
    for name, params in ways(engine.model.vocab_size, engine.capacity - args.context).items():
        if chosen and name not in chosen and name != "greedy":
            continue
        ms, host, runs = median_loop(engine, args.batch, args.context, params=params)
        base = base or ms
        rows.append(dict(way=name, loop_ms=ms, runs=runs, host_busy_ms=host["busy"], launch_ms=host["launch"]))
        print(f"{name:16s} {ms:7.2f} ms/step ({ms / base:.2f}x greedy; runs "
              f"{', '.join(f'{r:.2f}' for r in runs)}); host busy {host['busy']:.2f}, launch {host['launch']:.2f}",
              flush=True)
    print(f"| way | ms per step | x greedy | host busy ms |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['way']} | {r['loop_ms']:.2f} | {r['loop_ms'] / base:.2f} | {r['host_busy_ms']:.2f} |")
    print(json.dumps({"model": args.model, "quantize": args.quantize, "batch": args.batch, "context": args.context,
                      "rows": rows}))


if __name__ == "__main__":
    main()
