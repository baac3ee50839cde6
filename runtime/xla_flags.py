"""XLA settings glint's programs run best with, added to XLA_FLAGS before JAX starts a backend.

`--xla_gpu_command_buffer_update_mode=SKIP_TEMP`: XLA runs a program as a CUDA graph and, on every call, re-records
the graph's commands whose buffers moved since the last call. A step's temporaries (one allocation that nearly every
kernel of the step touches) move between calls, so every step re-recorded nearly all of its graph on the host:
1.6-2.4 ms for bf16 llama3-8b at batch 256, 5.8 ms for fp8 weights (twice the kernels), which made fp8 decode
host-bound. SKIP_TEMP backs the temporaries with the VMM allocator at one virtual address per program, so only the
commands that touch the step's inputs and outputs are re-recorded (docs/perf.md, "The host's launch of a step").

A value the user gave in XLA_FLAGS wins; GLINT_XLA_DEFAULTS=0 leaves XLA_FLAGS as it is. XLA reads XLA_FLAGS once,
when the first backend starts: `apply` runs when `glint.runtime` is imported and is a no-op (with a warning) after.
"""
from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

DEFAULTS = {"xla_gpu_command_buffer_update_mode": "SKIP_TEMP"}


def merged(flags: str, defaults: dict[str, str] = DEFAULTS) -> str:
    """`flags` (XLA_FLAGS' syntax) with each default whose flag it does not already set."""
    given = {f.split("=", 1)[0].lstrip("-") for f in flags.split()}
    extra = [f"--{name}={value}" for name, value in defaults.items() if name not in given]
    return " ".join([flags.strip(), *extra]).strip()


def apply(environ=os.environ) -> None:
    """Add DEFAULTS to XLA_FLAGS in `environ`, unless GLINT_XLA_DEFAULTS=0."""
    if environ.get("GLINT_XLA_DEFAULTS", "1") == "0":
        return
    flags = merged(environ.get("XLA_FLAGS", ""))
    if flags == environ.get("XLA_FLAGS", ""):
        return
    bridge = sys.modules.get("jax._src.xla_bridge")  # loaded only once jax is: glint.runtime does not import it
    if bridge is not None and getattr(bridge, "backends_are_initialized", lambda: False)():
        log.warning("JAX's backends started before glint.runtime was imported: XLA_FLAGS is read once, so glint's "
                    "defaults (%s) do not apply to this process", flags)
        return
    environ["XLA_FLAGS"] = flags
