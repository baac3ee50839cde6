"""One process of a multi-process tensor-parallel run (tests/test_tp.py): PROCESS_ID NUM_PROCESSES DEVICES PORT
CHECKPOINT. Joins jax.distributed over localhost (CPU collectives over gloo), runs test_tp's workload over every
process's devices, prints its tokens as JSON on the last line."""
import os
import sys

pid, nproc, ndev, port, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
# The parent's XLA flags (conftest's compile settings, so both sides compile alike), with this process's devices.
flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={ndev}"])
os.environ["JAX_PLATFORMS"] = "cpu"
import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{port}", num_processes=nproc, process_id=pid)

import json  # noqa: E402

from test_tp import run  # noqa: E402

_, tokens = run(path, nproc * ndev, attention="reference", seed=0)
print(json.dumps(tokens))
