"""Does XLA run a decode-sized while loop inside one CUDA graph, or iteration by iteration from the host?

A multi-step decode program (K decode steps in one call) only amortizes the host's launch if the loop's body is
recorded once and replayed on the device. This times, for K = 1, 4 and 16 iterations of a body of LAYERS small
GEMVs (bf16, 4096 x 4096, one row, as a batch-1 decode layer's), the host time until the call returns and the
wall time until its result is ready, each call fed a new input buffer like the engine's steps (XLA likely drops
a one-trip loop, so K = 1 is the body alone):
    python3 tools/gpu_while_probe.py
    XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL python3 tools/gpu_while_probe.py
Prints one line per K and a JSON line last.
"""
from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

LAYERS = int(os.environ.get("PROBE_LAYERS", "32"))
DIM = 4096


def program(steps: int):
    @jax.jit
    def run(x, w):
        def body(_, h):
            for i in range(LAYERS):
                h = jnp.tanh(h @ w[i]).astype(jnp.bfloat16) + h
            return h

        return jax.lax.fori_loop(0, steps, body, x)

    return run


def main():
    key = jax.random.PRNGKey(0)
    w = (jax.random.normal(key, (LAYERS, DIM, DIM), jnp.float32) / DIM**0.5).astype(jnp.bfloat16)
    rows = []
    for steps in (1, 4, 16):
        run = program(steps)
        xs = [jnp.asarray(np.random.default_rng(i).standard_normal((1, DIM)), jnp.bfloat16) for i in range(40)]
        run(xs[0], w).block_until_ready()
        launch, wall = [], []
        for x in xs[1:]:
            t0 = time.perf_counter()
            y = run(x, w)
            t1 = time.perf_counter()
            y.block_until_ready()
            t2 = time.perf_counter()
            launch.append(t1 - t0)
            wall.append(t2 - t0)
        row = dict(steps=steps, launch_ms=1e3 * float(np.median(launch)), wall_ms=1e3 * float(np.median(wall)))
        row["wall_ms_per_step"] = row["wall_ms"] / steps
        rows.append(row)
        print(f"K={steps:2d}: launch {row['launch_ms']:.3f} ms, wall {row['wall_ms']:.3f} ms, "
              f"{row['wall_ms_per_step']:.3f} ms per iteration")
    print(json.dumps(dict(xla_flags=os.environ.get("XLA_FLAGS", ""), layers=LAYERS, rows=rows)))


if __name__ == "__main__":
    main()
