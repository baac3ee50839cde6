"""How fast do an artifact's weights reach the device? Each way restores the same weights, saved by orbax
uncompressed with OCDBT (params/, what `glint export` wrote before) and without (params-raw/, what it writes
now), in a fresh process; read-only and npy are ceilings (tensorstore reads alone; memory-mapped .npy files
copied to the device).

  python tools/gpu_weights_probe.py [PRESET] [--ways a,b,...]    (default llama3-8b, random bf16 weights)

A way ending in @cold first empties the page cache (sync; drop_caches), so it reads from the disk.
"""
import argparse
import json
import os
import subprocess
import sys
import time

RESTORE = """
import sys, time, json, concurrent.futures
t0 = time.time()
import jax, numpy as np
folder, way = sys.argv[1], sys.argv[2]
meta = json.load(open(folder + '/shapes.json'))
dev = jax.devices()[0]
like = {k: jax.ShapeDtypeStruct(tuple(s), d) for k, (s, d) in meta.items()}
jax.block_until_ready(jax.device_put(np.zeros(4), dev))  # the GPU client is up before the clock starts
t1 = time.time()
if way == "orbax":  # what glint did before runtime/weights.py: orbax straight onto the device
    import orbax.checkpoint as ocp
    sharding = jax.sharding.SingleDeviceSharding(dev)
    with ocp.StandardCheckpointer() as ckpt:
        out = ckpt.restore(folder + '/params', {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
                                                for k, v in like.items()})
elif way.startswith("glint"):  # glint:THREADS (OCDBT, as glint export wrote before) or glint-raw:THREADS
    from glint.runtime.weights import read_params
    params = folder + ('/params-raw' if way.startswith('glint-raw') else '/params')
    out = read_params(params, like, dev, num_threads=int(way.split(':')[1]))
elif way == "read-only":  # tensorstore reads into host memory, no device copy
    import tensorstore as ts
    from glint.runtime.weights import _spec, stored_names, ts_context
    _, m = stored_names(__import__('pathlib').Path(folder + '/params'))
    ctx = ts_context(16)
    stores = [ts.open(_spec(folder + '/params', k, m), open=True, context=ctx) for k in like]
    reads = [s.result().read() for s in stores]
    out = {k: np.asarray(r.result()) for k, r in zip(like, reads)}
elif way.startswith("npy"):  # npy:THREADS: page-cached .npy files, memory-mapped, copied to the device
    def put(k):
        return k, jax.device_put(np.load(f"{folder}/npy/{k}.npy", mmap_mode="r").view(like[k].dtype), dev)
    with concurrent.futures.ThreadPoolExecutor(int(way.split(':')[1])) as pool:
        out = dict(pool.map(put, like))
jax.block_until_ready(out)
gb = sum(x.nbytes for x in out.values()) / 1e9
print(json.dumps(dict(way=way, import_s=round(t1 - t0, 2), restore_s=round(time.time() - t1, 2), gb=round(gb, 2),
                      gb_per_s=round(gb / (time.time() - t1), 2))))
"""

WAYS = "orbax,glint:16,glint-raw:16,read-only,orbax@cold,glint:16@cold,glint-raw:16@cold"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("preset", nargs="?", default="llama3-8b")
    parser.add_argument("--ways", default=WAYS)
    parser.add_argument("--folder", default="/tmp/weights-probe")
    args = parser.parse_args()
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from glint.export.checkpoint import flatten
    from glint.model import transformer
    from glint.model.presets import preset
    from glint.runtime.loading import random_params

    cfg = preset(args.preset)
    params = flatten(random_params(transformer.split(transformer.abstract_model(cfg))[1]))
    jax.block_until_ready(params)
    folder = args.folder
    t0 = time.time()
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False)) as ckpt:  # as glint export saves
        ckpt.save(folder + "/params", args=ocp.args.PyTreeSave(params))
    print(f"saved in {time.time() - t0:.1f} s", flush=True)
    t0 = time.time()
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False, use_ocdbt=False)) as ckpt:  # as now
        ckpt.save(folder + "/params-raw", args=ocp.args.PyTreeSave(params))
    print(f"saved without OCDBT in {time.time() - t0:.1f} s", flush=True)
    json.dump({k: (list(v.shape), str(v.dtype)) for k, v in params.items()}, open(folder + "/shapes.json", "w"))
    if any(w.startswith("npy") for w in args.ways.split(",")):
        os.makedirs(folder + "/npy", exist_ok=True)
        for k, v in params.items():
            np.save(f"{folder}/npy/{k}.npy", np.asarray(v))
    del params
    t0 = time.time()
    os.sync()  # no page still being written back while the ways read
    print(f"sync {time.time() - t0:.1f} s", flush=True)
    rows = []
    for way in args.ways.split(","):
        cold = way.endswith("@cold")
        if cold:  # from the disk: the page cache emptied first (root on the GPU machine)
            way = way.removesuffix("@cold")
            try:
                os.sync()
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("3\n")
            except OSError as e:
                print(f"drop_caches refused ({e}); {way} reads from the page cache", flush=True)
        proc = subprocess.run([sys.executable, "-c", RESTORE, folder, way], capture_output=True, text=True)
        row = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else \
            {"way": way, "error": proc.stderr[-600:]}
        row["way"] += " (disk)" if cold else ""
        rows.append(row)
        print(row, flush=True)
    print("way | restore s | GB | GB/s")
    for r in rows:
        print(f"{r['way']} | {r.get('restore_s')} | {r.get('gb')} | {r.get('gb_per_s')}")


if __name__ == "__main__":
    main()
