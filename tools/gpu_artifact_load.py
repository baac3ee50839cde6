"""Where does an artifact's load time go? Exports llama3-8b (random bf16 weights, a small geometry so the export
compiles quickly) once, then loads it in fresh processes three ways: the weights alone, the artifact without its
executables, the whole artifact. Each way twice, interleaved.

  python tools/gpu_artifact_load.py [PRESET] [--folder /tmp/glint-artifact] [--bench-geometry]
"""
import argparse
import json
import subprocess
import sys
import time

LOAD = """
import sys, time, json, pathlib
t0 = time.time()
import jax
folder, way = pathlib.Path(sys.argv[1]), sys.argv[2]
from glint.runtime import artifact, weights
jax.block_until_ready(jax.device_put(0.0))  # the GPU client is up before the clock starts
t1 = time.time()
if way == "weights":
    meta = artifact.read_metadata(folder)
    like = artifact.load_program(folder, "forward_1", meta["programs"]["forward_1"]).args[0]
    weights.read_params(folder / "params", like)
    parts = {}
else:
    parts = artifact.load_artifact(folder, compiled=way == "artifact").seconds
print(json.dumps(dict(way=way, import_s=round(t1 - t0, 2), load_s=round(time.time() - t1, 2),
                      parts={k: round(v, 2) for k, v in parts.items()})))
"""


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("preset", nargs="?", default="llama3-8b")
    parser.add_argument("--folder", default="/tmp/glint-artifact")
    parser.add_argument("--bench-geometry", action="store_true",
                        help="export with the cold-start bench's geometry (max_seqs 256, 13 widths to 4096, KV pool "
                        "from free memory) instead of a small one")
    args = parser.parse_args()
    from glint.export import export_engine

    geometry = (dict(max_seqs=256, max_step_tokens=4096, capacity=512 + 256 + 4096, allow_long_context=True)
                if args.bench_geometry else
                dict(max_seqs=8, max_step_tokens=256, forward_sizes=(1, 8), capacity=1024, num_pages=512))
    t0 = time.time()
    export_engine(args.preset, args.folder, show_progress=False, **geometry)
    print(f"exported in {time.time() - t0:.1f} s", flush=True)
    rows = []
    for way in ("weights", "no-executables", "artifact") * 2:
        proc = subprocess.run([sys.executable, "-c", LOAD, args.folder, way], capture_output=True, text=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else
                    {"way": way, "error": proc.stderr[-600:]})
        print(rows[-1], flush=True)


if __name__ == "__main__":
    main()
