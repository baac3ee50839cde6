"""GPU check of the engine: HF fixture parity through the Pallas kernels, float32 and bfloat16.

  python tools/gpu_engine.py FIXTURES_DIR [STORIES_DIR]
"""
import json
import pathlib
import sys
import time

import jax

from glint.runtime.engine import Engine
from glint.runtime.params import SamplingParams

SMALL = dict(max_seqs=8, page_size=16, max_step_tokens=256, num_pages=256, capacity=512)


def main():
    fixtures = pathlib.Path(sys.argv[1])
    dirs = sorted(p for p in fixtures.iterdir() if (p / "config.json").exists())
    if len(sys.argv) > 2:
        dirs.append(pathlib.Path(sys.argv[2]))
    print("devices:", jax.devices())
    rows = []
    for d in dirs:
        ref = json.loads((d / "reference.json").read_text())["cases"]
        for attention in ("pallas", "reference"):
            t0 = time.perf_counter()
            engine = Engine.from_pretrained(str(d), dtype="float32", attention=attention, **SMALL)
            n = max(len(c["greedy"]) for c in ref)
            outs = engine.generate([c["prompt"] for c in ref], SamplingParams(max_tokens=n, temperature=0.0,
                                                                               ignore_eos=True))
            ok = [o.token_ids == c["greedy"] for o, c in zip(outs, ref) if c.get("greedy_min_gap", 1.0) >= 1e-3]
            match = [sum(a == b for a, b in zip(o.token_ids, c["greedy"])) for o, c in zip(outs, ref)]
            rows.append((d.name, attention, all(ok), match, time.perf_counter() - t0))
            print(rows[-1], flush=True)
    print("\nfixture | attention | greedy == transformers | matching tokens per prompt | s")
    for r in rows:
        print(" | ".join(str(x) if not isinstance(x, float) else f"{x:.1f}" for x in r))
    return 0 if all(r[2] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
