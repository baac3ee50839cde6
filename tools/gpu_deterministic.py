"""GPU check of deterministic=True: batch invariance through the Pallas kernels, and its cost on llama3-8b.

  python tools/gpu_deterministic.py CHECKPOINT_DIR...
"""
import sys
import time

import numpy as np

from glint.runtime.engine import Engine
from glint.runtime.params import SamplingParams


def invariance(folder: str, deterministic: bool) -> int:
    """How many of 12 bf16 requests give other tokens batched than alone."""
    eng = Engine.from_pretrained(folder, dtype="bfloat16", deterministic=deterministic, max_seqs=12, page_size=16,
                                 max_step_tokens=256, num_pages=300, capacity=256)  # Pallas on a GPU
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, eng.model.vocab_size, int(n)).tolist() for n in rng.integers(2, 120, 12)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    batched = [o.token_ids for o in eng.generate(prompts, params)]
    solo = [eng.generate([p], params)[0].token_ids for p in prompts]
    return sum(a != b for a, b in zip(batched, solo))


def throughput(deterministic: bool) -> float:
    eng = Engine.from_pretrained("llama3-8b", deterministic=deterministic, max_seqs=64, max_step_tokens=1024,
                                 num_pages=8200, capacity=2048)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, eng.model.vocab_size, 256).tolist() for _ in range(64)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    eng.warmup(progress=False)
    eng.generate(prompts[:4], params)
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def main():
    for folder in sys.argv[1:]:
        print(f"{folder}: differ solo vs batched, default {invariance(folder, False)}/12, "
              f"deterministic {invariance(folder, True)}/12", flush=True)
    default = throughput(False)
    print(f"llama3-8b 64 x (256 + 64) greedy: default {default:.0f} tok/s", flush=True)
    det = throughput(True)
    print(f"llama3-8b deterministic {det:.0f} tok/s = {det / default:.2f}x default", flush=True)


if __name__ == "__main__":
    main()
