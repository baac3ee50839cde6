"""GPU check of `glint export`: every fixture exported with the Pallas kernels serves the live engine's tokens,
from its stored executables and from its StableHLO, also in a process that cannot import the model code.

  python tools/gpu_export.py FIXTURES_DIR [STORIES_DIR] [--dtype bfloat16]
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

from glint.export import export_engine
from glint.runtime.engine import Engine
from glint.runtime.params import SamplingParams

SMALL = dict(max_seqs=8, page_size=16, max_step_tokens=256, forward_sizes=(1, 8, 64), num_pages=256, capacity=512,
             attention="pallas")

BLOCKED = """
import sys, json
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "glint.model" or name.startswith(("glint.model.", "glint.export", "glint.pallas_kernels")):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
from glint.runtime import Engine, SamplingParams
engine = Engine.from_export(sys.argv[1], compiled=sys.argv[2] == "1")
prompts, params = json.loads(sys.argv[3]), [SamplingParams(**p) for p in json.loads(sys.argv[4])]
print(json.dumps([[c.token_ids for c in o.outputs] for o in engine.generate(prompts, params)]))
"""


def workload(cases, vocab):
    rng = np.random.default_rng(0)
    prompts = [c["prompt"] for c in cases] + [rng.integers(0, vocab, n).tolist() for n in (150, 300)]
    params = []
    for i in range(len(prompts)):
        if i % 2:
            params.append(dict(max_tokens=24, temperature=0.8, top_k=50, top_p=0.9, seed=i, ignore_eos=True, n=2))
        else:
            params.append(dict(max_tokens=24, temperature=0.0, ignore_eos=True))
    return prompts, params


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("fixtures")
    parser.add_argument("more", nargs="*")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attention", default="pallas")
    args = parser.parse_args()
    dtype = args.dtype
    SMALL["attention"] = args.attention
    dirs = sorted(p for p in pathlib.Path(args.fixtures).iterdir() if (p / "config.json").exists())
    dirs += [pathlib.Path(a) for a in args.more]
    print("devices:", jax.devices(), "dtype:", dtype, flush=True)
    rows = []
    for d in dirs:
        cases = json.loads((d / "reference.json").read_text())["cases"]
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            meta = export_engine(str(d), pathlib.Path(tmp) / "a", dtype=dtype, show_progress=False, **SMALL)
            export_s = time.perf_counter() - t0
            live = Engine.from_pretrained(str(d), dtype=dtype, **SMALL)
            prompts, params = workload(cases, live.model.vocab_size)
            sp = [SamplingParams(**p) for p in params]
            want = [[c.token_ids for c in o.outputs] for o in live.generate(prompts, sp)]
            del live
            result = {}
            for compiled in (1, 0) if jax.default_backend() == "gpu" else (0,):  # stored executables, then the StableHLO compiled at load
                t0 = time.perf_counter()
                proc = subprocess.run([sys.executable, "-c", BLOCKED, str(pathlib.Path(tmp) / "a"), str(compiled),
                                       json.dumps(prompts), json.dumps(params)], capture_output=True, text=True,
                                      env=dict(os.environ, GLINT_CACHE_DIR=str(pathlib.Path(tmp) / "cache")))
                if proc.returncode:
                    print(proc.stderr[-3000:], flush=True)
                    result[compiled] = "ERROR"
                else:
                    got = json.loads(proc.stdout.strip().splitlines()[-1])
                    result[compiled] = f"{got == want} ({time.perf_counter() - t0:.1f}s)"
            kernels = sorted({c for p in meta["programs"].values() for c in p["custom_calls"]})
            rows.append((d.name, dtype, result.get(1, "n/a"), result[0], kernels, f"{export_s:.1f}"))
            print(rows[-1], flush=True)
    print("\nfixture | dtype | artifact (executables) == live | artifact (StableHLO) == live | kernels | export s")
    for r in rows:
        print(" | ".join(map(str, r)))
    return 0 if all(r[2].startswith(("True", "n/a")) and r[3].startswith("True") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
