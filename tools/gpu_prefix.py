"""Prefix cache on == off through the GPU kernels: every HF fixture and stories260K in float32 (expected token
for token), and stories260K (trained weights) in bfloat16 (reported). Two rounds of prompts sharing prefixes
of several shapes, greedy and seeded, in a pool small enough to preempt and evict.

  python tools/gpu_prefix.py FIXTURES_DIR STORIES_DIR
"""
import pathlib
import sys

from glint.runtime.bench import shared_prefix_prompts
from glint.runtime.engine import Engine
from glint.runtime.params import SamplingParams

PAGE = 16
GEOMETRY = dict(max_seqs=8, page_size=PAGE, forward_sizes=(1, 8), max_step_tokens=64, capacity=256,
                min_prefill_chunk=4)


def run(folder: str, dtype: str, cache: bool) -> tuple[list, object]:
    pages = GEOMETRY["capacity"] // PAGE + 12  # room for about three of the sequences: preemption, eviction
    engine = Engine.from_pretrained(folder, dtype=dtype, prefix_cache=cache, num_pages=pages, **GEOMETRY)
    ps = shared_prefix_prompts(engine.model.vocab_size, PAGE, 0)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_tokens=24, temperature=0.9, top_k=40, top_p=0.95, seed=i, ignore_eos=True)
              for i in range(len(ps))]
    outs = [[o.token_ids for o in engine.generate(ps, params)] for _ in range(2)]
    return outs, engine.stats


def main(fixtures: str, stories: str) -> None:
    cases = [(str(p), "float32") for p in sorted(pathlib.Path(fixtures).iterdir()) if (p / "config.json").exists()]
    cases += [(stories, "float32"), (stories, "bfloat16")]
    rows = []
    for folder, dtype in cases:
        (off, _), (on, stats) = run(folder, dtype, False), run(folder, dtype, True)
        same = sum(a == b for ra, rb in zip(off, on) for a, b in zip(ra, rb))
        rows.append((pathlib.Path(folder).name, dtype, f"{same}/{sum(len(r) for r in off)}", stats.prefix_hit_tokens,
                     stats.preemptions, stats.prefix_evictions))
        print(rows[-1], flush=True)
    print("check | dtype | same tokens on/off | hit tokens | preemptions | evictions")
    for row in rows:
        print(" | ".join(str(x) for x in row))


if __name__ == "__main__":
    main(*sys.argv[1:3])
