"""How fast do the artifact's weights come back? orbax with and without zstd, each restored in a fresh process.

  python tools/gpu_weights_probe.py [PRESET]     (default llama3-8b, random bf16 weights)
"""
import json
import subprocess
import sys
import time

RESTORE = """
import sys, time, json
t0 = time.time()
import jax, numpy as np, orbax.checkpoint as ocp
meta = json.load(open(sys.argv[1] + '/shapes.json'))
dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
t1 = time.time()
if sys.argv[2] == "device":  # what glint does: orbax straight onto the device
    with ocp.StandardCheckpointer() as ckpt:
        out = ckpt.restore(sys.argv[1] + '/params', {k: jax.ShapeDtypeStruct(tuple(s), d, sharding=dev)
                                                     for k, (s, d) in meta.items()})
else:  # orbax into host arrays, then one device_put of the whole tree
    item = {k: np.empty(0) for k in meta}
    args = {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in meta}
    with ocp.PyTreeCheckpointer() as ckpt:
        host = ckpt.restore(sys.argv[1] + '/params', args=ocp.args.PyTreeRestore(item=item, restore_args=args))
    t_host = time.time() - t1
    out = jax.device_put(host, dev)
jax.block_until_ready(out)
print(json.dumps(dict(way=sys.argv[2], import_s=t1 - t0, restore_s=time.time() - t1,
                      gb=sum(x.nbytes for x in out.values()) / 1e9)))
"""


def main():
    import jax
    import orbax.checkpoint as ocp

    from glint.export.checkpoint import flatten
    from glint.model import transformer
    from glint.model.presets import preset
    from glint.runtime.loading import random_params

    cfg = preset(sys.argv[1] if len(sys.argv) > 1 else "llama3-8b")
    params = flatten(random_params(transformer.split(transformer.abstract_model(cfg))[1]))
    jax.block_until_ready(params)
    shapes = {k: (list(v.shape), str(v.dtype)) for k, v in params.items()}
    rows = []
    for name, compression in (("zstd (orbax default)", True), ("no compression", False)):
        folder = f"/tmp/weights-{int(compression)}"
        t0 = time.time()
        handler = ocp.PyTreeCheckpointHandler(use_compression=compression)
        with ocp.Checkpointer(handler) as ckpt:
            ckpt.save(folder + "/params", args=ocp.args.PyTreeSave(params))
        save_s = time.time() - t0
        json.dump(shapes, open(folder + "/shapes.json", "w"))
        du = subprocess.run(["du", "-sh", folder], capture_output=True, text=True).stdout.split()[0]
        for way in ("device", "host"):
            proc = subprocess.run([sys.executable, "-c", RESTORE, folder, way], capture_output=True, text=True)
            r = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {"error": proc.stderr[-800:]}
            rows.append((name, f"{save_s:.1f}", du, r))
            print(rows[-1], flush=True)
    for r in rows:
        print(" | ".join(map(str, r)))


if __name__ == "__main__":
    main()
