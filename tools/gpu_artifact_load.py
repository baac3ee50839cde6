"""Where does an artifact's load time go? Exports llama3-8b (random bf16 weights, a small geometry so the export
compiles quickly) once, then loads it in fresh processes: the weights alone, the whole artifact (as
load_artifact does) after the GPU client started and allocated its pool, the same with the client starting
inside the load (as in a server's process: "-cold"), and the cold-start bench's child (load, warm-up, first
token). Each way twice, interleaved.

  python tools/gpu_artifact_load.py [PRESET] [--folder /tmp/glint-artifact] [--bench-geometry]
"""
import argparse
import json
import os
import subprocess
import sys
import time

LOAD = """
import sys, time, json, pathlib
t0 = time.time()
import jax
folder, way = pathlib.Path(sys.argv[1]), sys.argv[2]
from glint.runtime import artifact, weights
cold = way.endswith("-cold")  # as a server's process: the client starts (and allocates its pool) inside the load
way = way.removesuffix("-cold")
t_client = time.time()
if not cold:
    jax.devices()
    t_client = time.time() - t_client
    t_put = time.time()
    jax.block_until_ready(jax.device_put(0.0))  # the GPU client is up before the clock starts
    t_put = time.time() - t_put
t1 = time.time()
if way in ("weights", "executables", "serial"):
    import concurrent.futures
    meta = artifact.read_metadata(folder)
    like = artifact.load_program(folder, "forward_1", meta["programs"]["forward_1"]).args[0]
    parts = {}
    if way != "executables":
        t = time.time()
        weights.read_params(folder / "params", like)
        parts["params"] = time.time() - t
    if way != "weights":
        import jax.experimental.mosaic.gpu  # noqa: F401
        t = time.time()
        with concurrent.futures.ThreadPoolExecutor(len(meta["programs"])) as pool:
            list(pool.map(lambda name: artifact.load_compiled(folder, meta, name), meta["programs"]))
        parts["executables"] = time.time() - t
else:
    parts = artifact.load_artifact(folder, compiled=way == "artifact").seconds
if not cold:
    parts |= dict(client_start=t_client, first_put=t_put)
print(json.dumps(dict(way=way + "-cold" * cold, import_s=round(t1 - t0, 2), load_s=round(time.time() - t1, 2),
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
    geometry = (dict(max_seqs=256, max_step_tokens=4096, capacity=512 + 256 + 4096, allow_long_context=True)
                if args.bench_geometry else
                dict(max_seqs=8, max_step_tokens=256, forward_sizes=(1, 8), capacity=1024, num_pages=512))
    t0 = time.time()  # in a child, as the cold-start bench does: this process never holds the GPU
    subprocess.run([sys.executable, "-m", "glint.runtime.coldstart", "--export", args.preset, args.folder,
                    json.dumps(geometry)], check=True, capture_output=True)
    os.sync()
    print(f"exported in {time.time() - t0:.1f} s", flush=True)
    rows = []
    for way in ("weights", "artifact", "artifact-cold", "coldstart") * 2:
        if way == "coldstart":  # the cold-start bench's own child on this artifact: load, warm up, first token
            t0 = time.time()
            proc = subprocess.run([sys.executable, "-m", "glint.runtime.coldstart", args.folder,
                                   json.dumps({"compile_cache": True})], capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("coldstart: ")]
            if lines:
                t = json.loads(lines[-1].removeprefix("coldstart: "))
                print(dict(way=way, first_token_s=round(t["first_token"] - t0, 2),
                           import_s=round(t["imported"] - t0, 2), load_s=round(t["loaded"] - t["imported"], 2),
                           parts={k: round(v, 2) for k, v in (t["load_parts"] or {}).items()}), flush=True)
            else:
                print(dict(way=way, error=proc.stderr[-600:]), flush=True)
            continue
        proc = subprocess.run([sys.executable, "-c", LOAD, args.folder, way], capture_output=True, text=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else
                    {"way": way, "error": proc.stderr[-600:]})
        print(rows[-1], flush=True)


if __name__ == "__main__":
    main()
