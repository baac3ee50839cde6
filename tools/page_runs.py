"""How many key blocks of the running sequences have their pages back to back in the pools, as the engine's own
allocator hands pages out: what `tuning.MOSAIC_COALESCE_PAGES` (one TMA copy per block where they do) could take.

Runs `--waves` waves of `--batch` greedy requests (random prompts of `--prompt-len`, `--gen-len` tokens each; the
second and later waves' requests 0-2 x 64 tokens longer, so that they retire apart) through an engine, and prints
after steps 40, 100 and 150 of each wave the whole blocks (`--block-kv` keys) of the running sequences whose pages
run back to back, against those whose pages do not. The first wave takes fresh pages; later ones take the pages
earlier waves freed.

    JAX_PLATFORMS=cpu python3 tools/page_runs.py tiny                 # 256 x (512 + 128), pages of 16
    JAX_PLATFORMS=cpu python3 tools/page_runs.py tiny --page-size 32 --block-kv 64
"""
from __future__ import annotations

import argparse

import numpy as np
from glint.runtime import Engine, SamplingParams

CENSUS_STEPS = (40, 100, 150)


def census(engine, page_size: int, block_kv: int) -> tuple[int, int]:
    """(blocks in runs, blocks not) over the running sequences' whole blocks of written keys."""
    control = engine.control
    table = control.page_table(0)
    per_block = block_kv // page_size
    counts = [0, 0]
    for seq in control.active_seqs():
        pages = table[seq, :control.pos(seq) // page_size]
        for b in range(len(pages) // per_block):
            counts[int((np.diff(pages[b * per_block:(b + 1) * per_block]) != 1).any())] += 1
    return counts[0], counts[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="tiny")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--block-kv", type=int, default=128)
    p.add_argument("--waves", type=int, default=2)
    args = p.parse_args()
    engine = Engine.from_pretrained(args.model, max_seqs=args.batch, page_size=args.page_size, max_step_tokens=4096)
    vocab = engine.model.vocab_size
    rng = np.random.default_rng(0)
    for wave in range(args.waves):
        for i in range(args.batch):
            extra = 64 * (i % 3) if wave else 0
            engine.add_request(rng.integers(1, vocab, args.prompt_len).tolist(),
                               SamplingParams(max_tokens=args.gen_len + extra, temperature=0.0, ignore_eos=True))
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
            if steps in CENSUS_STEPS:
                runs, broken = census(engine, args.page_size, args.block_kv)
                print(f"wave {wave}, step {steps}: {runs} blocks in runs, {broken} not "
                      f"({runs / max(runs + broken, 1):.0%})", flush=True)
        print(f"wave {wave}: {steps} steps", flush=True)


if __name__ == "__main__":
    main()
